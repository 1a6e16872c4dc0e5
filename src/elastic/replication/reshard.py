"""Resharding in memory: a sharded state on a new mesh filled from the pieces ranks held on an old one.

When the workers of a sharded state change, the old mesh (and its process groups) is gone, but every
survivor still holds its old pieces. `hold` keeps them with where they sit in each tensor (the global offset
and shape DTensor's own placement rules give, `compute_local_shape_and_global_offset`). `reshard` then fills
a state built on the new mesh: one all-gather tells every rank what everybody holds; every rank plans the
same moves from it (each region of a new piece comes from one holder of the elected version, itself when it
can, else holders taken in turn); one `all_to_all_single` moves every byte that changes rank exactly once;
regions a rank holds itself are copied locally. Nothing touches a disk.

The elected version is the most tenured one whose held regions cover every tensor entirely; none: the same
`SyncError` on every rank naming the tensors and regions nobody holds. Non-DTensor leaves (step counters,
hyperparameters, plain fields) come from the lowest rank holding that version, in one payload.
"""

from __future__ import annotations

import logging
import math
import uuid
from collections.abc import Sequence
from typing import Any

import attrs
import cloudpickle
import torch
import torch.distributed as dist

from elastic._util.errors import SyncError
from elastic.replication.collective import Collective, raise_first
from elastic.replication.comm import fault_point
from elastic.state.lineage import lineage, set_lineage
from elastic.state.nodes import Path, path_str
from elastic.state.shards import (
    Piece,
    allocate_optimizer_state,
    apply_sharded,
    merge_plain,
    pieces,
    plain_leaves,
    sharded_state_dict,
)
from elastic.state.tenure import greater, order_key

__all__ = ["Held", "Move", "Region", "elect_held", "hold", "plan", "plan_moves", "reshard"]

log = logging.getLogger("elastic")

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offset, shape) in the global tensor


@attrs.frozen
class Region:
    """What a rank holds of one tensor: its key path, global shape, dtype, and the box of its piece."""

    path: Path
    global_shape: tuple[int, ...]
    dtype: str
    offset: tuple[int, ...]
    shape: tuple[int, ...]


@attrs.define
class Held:
    """A rank's pieces of a sharded state, kept across the end of their mesh: by key path, the local
    tensor and its `Region`; the state's tenure and plain leaves."""

    tenure: Any
    regions: list[Region]
    tensors: list[torch.Tensor]
    plain: Any


def hold(state: Any, tenure: Any) -> Held:
    """This rank's pieces of `state` (a sharded state whose mesh is about to go), and its plain leaves."""
    sd = sharded_state_dict(state)
    own = pieces(sd)
    regions = [region_of(p) for p in own]
    tensors = [p.local for p in own]
    line = lineage(state)
    return Held(
        tenure=None if line.torn else tenure, regions=regions, tensors=tensors, plain=plain_leaves(sd)
    )


def region_of(piece: Piece) -> Region:
    """Where `piece` sits in its tensor, by DTensor's own placement rules (no communication)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    dt = piece.tensor
    mesh = dt.device_mesh
    # The rules depend on these alone: a model's many tensors of one shape cost one computation (~0.3 ms)
    key = (tuple(dt.shape), tuple(mesh.shape), mesh.get_coordinate(), tuple(dt.placements))
    box = _BOXES.get(key)
    if box is None:
        shape, offset = compute_local_shape_and_global_offset(dt.shape, mesh, dt.placements)
        box = _BOXES[key] = (tuple(shape), tuple(offset))
        if len(_BOXES) > 4096:
            _BOXES.clear()
    return Region(piece.path, tuple(dt.shape), str(dt.dtype), box[1], box[0])


#: `region_of`'s (local shape, global offset) by (global shape, mesh shape, coordinate, placements).
_BOXES: dict[Any, tuple[tuple[int, ...], tuple[int, ...]]] = {}


def _intersect(a: Box, b: Box) -> Box | None:
    lo = tuple(max(x, y) for x, y in zip(a[0], b[0]))
    hi = tuple(min(x + m, y + n) for x, m, y, n in zip(a[0], a[1], b[0], b[1]))
    if any(h <= low for low, h in zip(lo, hi)) and len(lo):
        return None
    return lo, tuple(h - low for low, h in zip(lo, hi))


def _volume(shape: Sequence[int]) -> int:
    return math.prod(shape)


@attrs.frozen
class Move:
    """One region of one tensor going from rank `src` to rank `dst` (the same rank: a local copy)."""

    key: int  # the index of the tensor in the new state's pieces
    src: int
    dst: int
    box: Box  # in the global tensor


def elect_held(held: Sequence[Sequence[Region] | None], tenures: Sequence[Any]) -> tuple[Any, list[int]]:
    """The most tenured version whose held regions cover every tensor it has, and its holders. Raises
    `SyncError` when none does."""
    keys: dict[Any, Any] = {}
    for t in tenures:
        if t is not None:
            keys.setdefault(order_key(t), t)
    best = None
    for k in sorted(keys):
        better = best is None or greater(keys[k], keys[best])
        if better and _covers(held, tenures, keys[k]) is None:
            best = k
    if best is None:
        missing = _covers(held, tenures, keys[max(keys)]) if keys else "no rank holds any piece"
        msg = (
            f"reshard: no version of the sharded state is held completely by the live ranks ({missing}); "
            "nothing was changed. Keep replicas (an HSDP mesh), snapshots, or a checkpoint (ckpt=)"
        )
        raise SyncError(msg, phase="plan", op="reshard")
    holders = [r for r, t in enumerate(tenures) if t is not None and order_key(t) == best]
    return keys[best], holders


def plan_moves(
    wanted: Sequence[Sequence[Region]], held: Sequence[Sequence[Region] | None], holders: Sequence[int]
) -> list[Move]:
    """The moves that fill every rank's `wanted` regions from the `holders`' regions: each region from
    one holder, the destination itself when it holds it, else the holders in turn."""
    moves: list[Move] = []
    turn = 0
    held_boxes: dict[Path, dict[Box, list[int]]] = {}  # per tensor, the distinct boxes held, with holders
    for r in holders:
        for h in held[r] or ():
            if _volume(h.shape):
                held_boxes.setdefault(h.path, {}).setdefault((h.offset, h.shape), []).append(r)
    for dst, regions in enumerate(wanted):
        for key, region in enumerate(regions):
            if _volume(region.shape) == 0:
                continue
            target: Box = (region.offset, region.shape)
            for box, owners in held_boxes.get(region.path, {}).items():
                part = _intersect(target, box)
                if part is None or _volume(part[1]) == 0:
                    continue
                src = dst if dst in owners else owners[turn % len(owners)]
                turn += 1
                moves.append(Move(key, src, dst, part))
    return moves


def plan(
    wanted: Sequence[Sequence[Region]], held: Sequence[Sequence[Region] | None], tenures: Sequence[Any]
) -> tuple[Any, list[Move], int]:
    """`elect_held`, then `plan_moves`: (tenure, moves, the lowest holder, who sends the objects)."""
    tenure, holders = elect_held(held, tenures)
    return tenure, plan_moves(wanted, held, holders), min(holders)


def _covers(held: Sequence[Sequence[Region] | None], tenures: Sequence[Any], t: Any) -> str | None:
    """None when the regions held at tenure `t` cover every tensor they belong to, else what is missing."""
    boxes: dict[Path, set[Box]] = {}
    shapes: dict[Path, tuple[int, ...]] = {}
    for regions, tenure in zip(held, tenures):
        if regions is None or tenure is None or order_key(tenure) != order_key(t):
            continue
        for h in regions:
            shapes[h.path] = h.global_shape
            if _volume(h.shape):
                boxes.setdefault(h.path, set()).add((h.offset, h.shape))
    lacking = []
    for path, shape in shapes.items():
        got = sum(_volume(b[1]) for b in boxes.get(path, set()))
        if got < _volume(shape):
            lacking.append(f"{path_str(path)} ({got}/{_volume(shape)} elements)")
    return None if not lacking else f"at tenure {t!r} nobody holds all of " + ", ".join(lacking[:5])


def _slices(box: Box, origin: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(o - b, o - b + n) for o, b, n in zip(box[0], origin, box[1]))


@attrs.frozen
class _Record:
    wanted: tuple[Region, ...]
    error: str | None = None


def reshard(new_state: Any, held: Held | None, group: Collective) -> tuple[Any, int, int]:
    """Fill `new_state` (built on the new mesh) from what the ranks of `group` hold (`held`; None for a
    newcomer), collectively. Returns (tenure, bytes this rank received from others, object sender)."""

    comm = group.comm
    first = group.gather(
        (tuple(held.regions) if held is not None else None, held.tenure if held is not None else None),
        "reshard-held",
    )
    tenure, holders = elect_held([r for r, _ in first], [t for _, t in first])
    sender = min(holders)
    error = None
    wanted: tuple[Region, ...] = ()
    targets: list[Any] = []
    sd: dict[str, Any] = {}
    try:
        entries = {h.path: (h.dtype, h.global_shape) for r in holders for h in first[r][0] or ()}
        with_state = _has_optimizer(entries) and not allocate_optimizer_state(new_state, entries)
        sd = sharded_state_dict(new_state, init_optimizers=with_state)
        targets = pieces(sd)
        wanted = tuple(region_of(p) for p in targets)
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    records = group.gather(_Record(wanted=wanted, error=error), "reshard-plan")
    raise_first(records, lambda r, e: SyncError(f"reshard: rank {r} could not prepare: {e}", phase="plan"))
    moves = plan_moves([r.wanted for r in records], [r for r, _ in first], holders)
    me = group.rank
    index = {reg.path: i for i, reg in enumerate(held.regions)} if held is not None else {}
    set_lineage(new_state, token=None, torn=True)  # until every region is in
    # Local copies, then one all-to-all of packed bytes for the rest.
    send: list[list[torch.Tensor]] = [[] for _ in range(group.world)]
    recv_plan: list[list[Move]] = [[] for _ in range(group.world)]
    with torch.no_grad():
        for m in moves:
            if m.src == me:
                assert held is not None
                i = index[records[m.dst].wanted[m.key].path]
                src_region = held.regions[i]
                part = held.tensors[i][_slices(m.box, src_region.offset)]
                if m.dst == me:
                    target = targets[m.key].local
                    target[_slices(m.box, wanted[m.key].offset)].copy_(part)
                else:
                    send[m.dst].append(part.reshape(-1).contiguous().view(torch.uint8))
            elif m.dst == me:
                recv_plan[m.src].append(m)
        received = 0
        if comm is not None and any(m.src != m.dst for m in moves):
            device = targets[0].local.device if targets else torch.device("cpu")
            send_sizes = [sum(t.numel() for t in ts) for ts in send]
            recv_sizes = [
                sum(_volume(m.box[1]) * _itemsize(wanted[m.key].dtype) for m in ms) for ms in recv_plan
            ]
            out = (
                torch.cat([t for ts in send for t in ts])
                if sum(send_sizes)
                else torch.empty(0, dtype=torch.uint8)
            )
            out = out.to(device)
            inp = torch.empty(sum(recv_sizes), dtype=torch.uint8, device=device)
            fault_point("reshard-pieces", me)  # local copies done, nothing received yet: half filled
            comm.wait(
                dist.all_to_all_single(inp, out, recv_sizes, send_sizes, group=comm.group, async_op=True),
                "reshard-pieces",
            )
            at = 0
            for ms in recv_plan:
                for m in ms:
                    target = targets[m.key].local
                    region = wanted[m.key]
                    n = _volume(m.box[1]) * target.element_size()
                    chunk = inp[at : at + n].view(target.dtype).view(m.box[1])
                    target[_slices(m.box, region.offset)].copy_(chunk)
                    at += n
            received = at
        # The sender's plain leaves.
        token = uuid.uuid4().hex
        data = cloudpickle.dumps((held.plain, token)) if me == sender and held is not None else None
        if comm is not None:
            plain, token = cloudpickle.loads(comm.broadcast_bytes(data, sender, "reshard-objects"))
        else:
            assert held is not None  # a world of one holds the elected version
            plain = held.plain
        apply_sharded(new_state, merge_plain(sd, plain))
    set_lineage(new_state, token=token, torn=False)
    return tenure, received, sender


def _itemsize(dtype: str) -> int:
    return torch.empty(0, dtype=getattr(torch, dtype.removeprefix("torch."))).element_size()


def _has_optimizer(paths: Any) -> bool:
    """Whether the paths of regions include optimizer states (receivers then allocate theirs)."""
    return any("state" in p for p in paths)
