"""Resharding in memory: a sharded state on a new mesh filled from the pieces ranks held on an old one.

When the workers of a sharded state change, the old mesh (and its process groups) is gone, but every
survivor still holds its old pieces. `hold` keeps them with where they sit in each tensor (the global offset
and shape DTensor's own placement rules give, `compute_local_shape_and_global_offset`). `reshard` then fills
a state built on the new mesh: one all-gather tells every rank what everybody holds; every rank plans the
same moves from it (each region of a new piece comes from one holder of the elected version, itself when it
can, else holders taken in turn); one `all_to_all_single` moves every byte that changes rank exactly once;
regions a rank holds itself are copied locally. Nothing touches a disk.

What a rank offers is a list of `Held`: its live pieces (the state of the generation that ended) and its
complete in-memory snapshots (`elastic.replication.snapshot`: its own pieces at an older tenure and a peer's
copy). A *version* is a tenure together with the generation whose mesh cut the pieces (`Held.layout`: pieces
of two meshes overlap and never combine). The elected version is the most tenured one whose held regions
cover every tensor entirely, live pieces before snapshots at the same tenure; none: the same `SyncError` on
every rank naming what nobody holds and the fixes. Non-DTensor leaves (step counters, hyperparameters,
plain fields) come from the lowest rank holding that version, in one payload.
"""

from __future__ import annotations

import logging
import math
import uuid
from collections.abc import Sequence
from typing import Any, NamedTuple

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

__all__ = ["Filled", "Held", "Move", "Offer", "Region", "elect_held", "hold", "plan", "plan_moves", "reshard"]

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
    """Pieces of a sharded state kept across the end of their mesh: by key path, the local tensor and its
    `Region`; the state's tenure and plain leaves; `layout`, the generation whose mesh cut them (pieces
    combine into a version only with pieces of the same tenure and layout); `snapshot`, None for a rank's
    live pieces, else what the snapshot is ("own", "copy of rank 2") for logs and messages."""

    tenure: Any
    regions: list[Region]
    tensors: list[torch.Tensor]
    plain: Any
    layout: int = 0
    snapshot: str | None = None

    def offer(self) -> Offer:
        return Offer(self.tenure, self.layout, tuple(self.regions), self.snapshot is not None)


@attrs.frozen
class Offer:
    """What a `Held` offers to the election, without its tensors: tenure, layout, regions, and whether it
    is a snapshot (live pieces win over snapshots of the same version)."""

    tenure: Any
    layout: int
    regions: tuple[Region, ...]
    snapshot: bool = False


def hold(state: Any, tenure: Any, layout: int = 0) -> Held:
    """This rank's pieces of `state` (a sharded state whose mesh is about to go), and its plain leaves;
    `layout` names the generation whose mesh the state was built on."""
    sd = sharded_state_dict(state)
    own = pieces(sd)
    regions = [region_of(p) for p in own]
    tensors = [p.local for p in own]
    line = lineage(state)
    return Held(
        tenure=None if line.torn else tenure,
        regions=regions,
        tensors=tensors,
        plain=plain_leaves(sd),
        layout=layout,
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
    """One region of one tensor going from rank `src` to rank `dst` (the same rank: a local copy), read
    from `src`'s offer number `offer` (its live pieces or one of its snapshots)."""

    key: int  # the index of the tensor in the new state's pieces
    src: int
    dst: int
    box: Box  # in the global tensor
    offer: int = 0


#: A holder of the elected version: (rank, index of the offer on that rank).
Holder = tuple[int, int]

#: A version: the order key of its tenure and its layout (the generation whose mesh cut the pieces).
VersionKey = tuple[Any, int]


def _key(offer: Offer) -> VersionKey:
    return order_key(offer.tenure), offer.layout


def _versions(offers: Sequence[Sequence[Offer]]) -> dict[VersionKey, Any]:
    versions: dict[VersionKey, Any] = {}
    for mine in offers:
        for o in mine:
            if o.tenure is not None:
                versions.setdefault(_key(o), o.tenure)
    return versions


def _live(offers: Sequence[Sequence[Offer]], key: VersionKey) -> bool:
    return any(not o.snapshot and o.tenure is not None and _key(o) == key for mine in offers for o in mine)


def _best(
    keys: Sequence[VersionKey], versions: dict[VersionKey, Any], offers: Sequence[Sequence[Offer]]
) -> Any:
    """The most tenured of `keys`; at one tenure, a version with live pieces, then the newest layout."""
    best = keys[0]
    for k in keys[1:]:
        t, b = versions[k], versions[best]
        if greater(t, b) or (not greater(b, t) and (_live(offers, k), k[1]) > (_live(offers, best), best[1])):
            best = k
    return best


def elect_held(offers: Sequence[Sequence[Offer]]) -> tuple[Any, list[Holder]]:
    """The most tenured version whose offered regions cover every tensor it has (live pieces before
    snapshots of the same tenure), and its holders as (rank, offer index), in order. `offers`: per rank,
    what it holds (live pieces first). Raises `SyncError` naming what is missing when none is whole."""
    versions = _versions(offers)
    whole = [k for k in versions if not _lacking(offers, k)]
    if not whole:
        msg = (
            f"reshard: no version of the sharded state is held whole by the {len(offers)} live rank(s): "
            f"{_what_lacks(offers, versions)}. Nothing was changed. Keep replicas (an HSDP mesh with a "
            "'replicate' dimension), snapshots (elastic.run(..., snapshot_every=k)), or a checkpoint "
            "(elastic.run(..., ckpt=...), saved with elastic.save)"
        )
        raise SyncError(msg, phase="plan", op="reshard")
    best = _best(whole, versions, offers)
    holders = [
        (r, i)
        for r, mine in enumerate(offers)
        for i, o in enumerate(mine)
        if o.tenure is not None and _key(o) == best
    ]
    return versions[best], holders


def plan_moves(
    wanted: Sequence[Sequence[Region]], offers: Sequence[Sequence[Offer]], holders: Sequence[Holder]
) -> list[Move]:
    """The moves that fill every rank's `wanted` regions from the `holders`' offers: each region from
    one holder, the destination itself when it holds it, else the holding ranks in turn (a rank's first
    offer holding a region: its live pieces before its snapshots)."""
    moves: list[Move] = []
    turn = 0
    held_boxes: dict[Path, dict[Box, dict[int, int]]] = {}  # per tensor, the distinct boxes: rank -> offer
    for r, i in holders:
        for h in offers[r][i].regions:
            if _volume(h.shape):
                held_boxes.setdefault(h.path, {}).setdefault((h.offset, h.shape), {}).setdefault(r, i)
    for dst, regions in enumerate(wanted):
        for key, region in enumerate(regions):
            if _volume(region.shape) == 0:
                continue
            target: Box = (region.offset, region.shape)
            for box, owners in held_boxes.get(region.path, {}).items():
                part = _intersect(target, box)
                if part is None or _volume(part[1]) == 0:
                    continue
                ranks = list(owners)
                src = dst if dst in owners else ranks[turn % len(ranks)]
                turn += 1
                moves.append(Move(key, src, dst, part, owners[src]))
    return moves


def plan(
    wanted: Sequence[Sequence[Region]], offers: Sequence[Sequence[Offer]]
) -> tuple[Any, list[Move], int]:
    """`elect_held`, then `plan_moves`: (tenure, moves, the lowest holder, who sends the objects)."""
    tenure, holders = elect_held(offers)
    return tenure, plan_moves(wanted, offers, holders), min(r for r, _ in holders)


def _subtract(box: Box, cut: Box) -> list[Box]:
    """`box` without `cut`, as disjoint boxes."""
    part = _intersect(box, cut)
    if part is None or _volume(part[1]) == 0:
        return [box]
    out: list[Box] = []
    lo, shape = list(box[0]), list(box[1])
    for d in range(len(lo)):
        p_lo, p_hi, hi = part[0][d], part[0][d] + part[1][d], lo[d] + shape[d]
        if lo[d] < p_lo:
            out.append((tuple(lo), (*shape[:d], p_lo - lo[d], *shape[d + 1 :])))
        if p_hi < hi:
            out.append(((*lo[:d], p_hi, *lo[d + 1 :]), (*shape[:d], hi - p_hi, *shape[d + 1 :])))
        lo[d], shape[d] = p_lo, p_hi - p_lo
    return out


def _box_str(path: Path, box: Box) -> str:
    return path_str(path) + "[" + ", ".join(f"{o}:{o + n}" for o, n in zip(*box)) + "]"


def _lacking(offers: Sequence[Sequence[Offer]], key: VersionKey) -> list[str]:
    """What no offer of version `key` holds, as slices of tensors (empty: the version is whole)."""
    boxes: dict[Path, set[Box]] = {}
    shapes: dict[Path, tuple[int, ...]] = {}
    for mine in offers:
        for o in mine:
            if o.tenure is None or _key(o) != key:
                continue
            for h in o.regions:
                shapes[h.path] = h.global_shape
                if _volume(h.shape):
                    boxes.setdefault(h.path, set()).add((h.offset, h.shape))
    lacking: list[str] = []
    for path, shape in shapes.items():
        held = boxes.get(path, set())
        if sum(_volume(b[1]) for b in held) >= _volume(shape):  # the boxes of one layout are disjoint
            continue
        missing: list[Box] = [((0,) * len(shape), shape)]
        for b in held:
            missing = [m for piece in missing for m in _subtract(piece, b)]
        lacking.extend(_box_str(path, m) for m in missing)
    return lacking


def _what_lacks(offers: Sequence[Sequence[Offer]], versions: dict[VersionKey, Any]) -> str:
    """The newest live version's and the newest snapshot's missing parts, in words."""
    parts = []
    for snapshot, name in ((False, "the live pieces"), (True, "the most tenured snapshot")):
        keys = [
            k
            for k in versions
            if any(
                o.snapshot == snapshot and o.tenure is not None and _key(o) == k for m in offers for o in m
            )
        ]
        if not keys:
            parts.append(f"no rank holds {'a snapshot' if snapshot else 'live pieces'}")
            continue
        k = _best(keys, versions, offers)
        lacking = _lacking(offers, k)
        more = f" and {len(lacking) - 5} more" if len(lacking) > 5 else ""
        parts.append(
            f"{name} at tenure {versions[k]!r} (generation {k[1]}'s mesh) lack {', '.join(lacking[:5])}{more}"
        )
    return "; ".join(parts)


def _slices(box: Box, origin: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(o - b, o - b + n) for o, b, n in zip(box[0], origin, box[1]))


@attrs.frozen
class _Record:
    wanted: tuple[Region, ...]
    error: str | None = None


class Filled(NamedTuple):
    """What `reshard` filled the new state from."""

    tenure: Any
    #: bytes this rank received from others
    received: int
    #: the rank that sent the plain leaves
    sender: int
    #: whether the elected version came from snapshots only (no rank held it live)
    snapshot: bool


def reshard(new_state: Any, held: Held | Sequence[Held] | None, group: Collective) -> Filled:
    """Fill `new_state` (built on the new mesh) from what the ranks of `group` hold (`held`: this rank's
    live pieces and snapshots, live first; None or empty for a newcomer), collectively."""

    comm = group.comm
    mine = [h for h in ([held] if isinstance(held, Held) else held or ()) if h.tenure is not None]
    offers: list[tuple[Offer, ...]] = group.gather(tuple(h.offer() for h in mine), "reshard-held")
    tenure, holders = elect_held(offers)
    sender = min(r for r, _ in holders)
    from_snapshot = all(offers[r][i].snapshot for r, i in holders)
    error = None
    wanted: tuple[Region, ...] = ()
    targets: list[Any] = []
    sd: dict[str, Any] = {}
    try:
        entries = {h.path: (h.dtype, h.global_shape) for r, i in holders for h in offers[r][i].regions}
        with_state = _has_optimizer(entries) and not allocate_optimizer_state(new_state, entries)
        sd = sharded_state_dict(new_state, init_optimizers=with_state)
        targets = pieces(sd)
        wanted = tuple(region_of(p) for p in targets)
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    records = group.gather(_Record(wanted=wanted, error=error), "reshard-plan")
    raise_first(records, lambda r, e: SyncError(f"reshard: rank {r} could not prepare: {e}", phase="plan"))
    moves = plan_moves([r.wanted for r in records], offers, holders)
    me = group.rank
    index = [{reg.path: k for k, reg in enumerate(h.regions)} for h in mine]
    # Local copies, then one all-to-all of packed bytes for the rest. A local part that already is the
    # target's memory (a state kept on the same mesh holds its own tensors) is not copied.
    device = targets[0].local.device if targets else torch.device("cpu")
    send: list[list[torch.Tensor]] = [[] for _ in range(group.world)]
    recv_plan: list[list[Move]] = [[] for _ in range(group.world)]
    local: list[tuple[torch.Tensor, torch.Tensor]] = []
    for m in moves:
        if m.src == me:
            h = mine[m.offer]
            k = index[m.offer][records[m.dst].wanted[m.key].path]
            part = h.tensors[k][_slices(m.box, h.regions[k].offset)]
            if m.dst == me:
                into = targets[m.key].local[_slices(m.box, wanted[m.key].offset)]
                if not _same_memory(into, part):
                    local.append((into, part))
            else:  # a snapshot's part sits on the CPU: it travels on the pieces' device
                send[m.dst].append(part.reshape(-1).contiguous().view(torch.uint8).to(device))
        elif m.dst == me:
            recv_plan[m.src].append(m)
    if local or any(recv_plan):
        set_lineage(new_state, token=None, torn=True)  # until every region is in
    with torch.no_grad():
        for into, part in local:
            into.copy_(part)
        received = 0
        if comm is not None and any(m.src != m.dst for m in moves):
            send_sizes = [sum(t.numel() for t in ts) for ts in send]
            recv_sizes = [
                sum(_volume(m.box[1]) * _itemsize(wanted[m.key].dtype) for m in ms) for ms in recv_plan
            ]
            out = (
                torch.cat([t for ts in send for t in ts])
                if sum(send_sizes)
                else torch.empty(0, dtype=torch.uint8, device=device)
            )
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
        # The sender's plain leaves (of its first offer of the elected version).
        token = uuid.uuid4().hex
        plain = mine[min(i for r, i in holders if r == me)].plain if me == sender else None
        if comm is not None:
            data = cloudpickle.dumps((plain, token)) if me == sender else None
            plain, token = cloudpickle.loads(comm.broadcast_bytes(data, sender, "reshard-objects"))
        apply_sharded(new_state, merge_plain(sd, plain))
    set_lineage(new_state, token=token, torn=False)
    return Filled(tenure, received, sender, from_snapshot)


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `a` and `b` are views of the same elements (copying one into the other changes nothing)."""
    return (
        a.device == b.device
        and a.dtype == b.dtype
        and a.data_ptr() == b.data_ptr()
        and a.shape == b.shape
        and a.stride() == b.stride()
    )


def _itemsize(dtype: str) -> int:
    return torch.empty(0, dtype=getattr(torch, dtype.removeprefix("torch."))).element_size()


def _has_optimizer(paths: Any) -> bool:
    """Whether the paths of regions include optimizer states (receivers then allocate theirs)."""
    return any("state" in p for p in paths)
