"""Resharding in memory: a sharded state on a new mesh filled from the pieces ranks held on an old one.

When the workers of a sharded state change, the old mesh (and its process groups) is gone, but every
survivor still holds its old pieces. `hold` keeps them with where they sit in each tensor (the global offset
and shape DTensor's own placement rules give, `compute_local_shape_and_global_offset`). `reshard` then fills
a state built on the new mesh: one all-gather tells every rank what everybody holds; every rank plans the
same moves from it (each region of a new piece comes from one holder of the elected version, itself when it
can, else holders taken in turn); regions a rank holds itself are copied locally (not at all where its held
piece *is* its target). Every other byte changes rank exactly once: on one host with the pieces on the CPU
(and Yama letting siblings read each other), each receiver reads its regions straight from the holders'
memory into its new pieces (``process_vm_readv``, as the cross-memory transport does: the addresses ride
in the first all-gather; each rank enters the second, the plan's, once its reads are done, so it keeps the
holders' tensors until then and tells who could not read); the ranks that cannot receive by one
`all_to_all_single` of packed bytes. Nothing touches a disk.

What a rank offers is a list of `Held`: its live pieces (the state of the generation that ended) and its
complete in-memory snapshots (`elastic.replication.snapshot`: its own pieces at an older tenure and a peer's
copy). A *version* is a tenure together with the generation whose mesh cut the pieces (`Held.layout`: pieces
of two meshes overlap and never combine). The elected version is the most tenured one whose held regions
cover every tensor entirely, live pieces before snapshots at the same tenure; none: the same `SyncError` on
every rank naming what nobody holds and the fixes. Non-DTensor leaves (step counters, hyperparameters,
plain fields) come from the lowest rank holding that version, in the second all-gather (broadcast after it
when they pickle to more than `OBJECTS_INLINE` bytes).
"""

from __future__ import annotations

import itertools
import logging
import math
import uuid
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import attrs
import cloudpickle
import torch
import torch.distributed as dist

from elastic._util.errors import SyncError
from elastic.replication.collective import Collective, raise_first
from elastic.replication.comm import Comm, fault_point
from elastic.replication.sharded import OBJECTS_INLINE
from elastic.replication.transport.cma import (
    SourceRef,
    can_read,
    plain_cpu,
    read_refusal,
    read_regions,
    source_ref,
)
from elastic.state.lineage import lineage, set_lineage
from elastic.state.nodes import Path, path_str
from elastic.state.shards import (
    Piece,
    allocate_optimizer_state,
    apply_sharded,
    kept_modules,
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
    lo: list[int] = []
    extent: list[int] = []
    for x, m, y, n in zip(a[0], a[1], b[0], b[1]):
        low, high = max(x, y), min(x + m, y + n)
        if high <= low:
            return None
        lo.append(low)
        extent.append(high - low)
    return tuple(lo), tuple(extent)


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
    wanted: Sequence[Sequence[Region]] | Mapping[int, Sequence[Region]],
    offers: Sequence[Sequence[Offer]],
    holders: Sequence[Holder],
    dsts: Sequence[int] | None = None,
) -> list[Move]:
    """The moves that fill every rank's `wanted` regions (only the ranks `dsts`, when given: then `wanted`
    may hold theirs alone) from the `holders`' offers: each region from one holder, the destination
    itself when it holds it, else one of the holding ranks, in turn over destinations and tensors (a
    rank's first offer holding a region: its live pieces before its snapshots). The moves into one
    destination depend on nothing else, so every rank plans the same moves into it."""
    moves: list[Move] = []
    held_boxes: dict[Path, dict[Box, dict[int, int]]] = {}  # per tensor, the distinct boxes: rank -> offer
    for r, i in holders:
        for h in offers[r][i].regions:
            if _volume(h.shape):
                held_boxes.setdefault(h.path, {}).setdefault((h.offset, h.shape), {}).setdefault(r, i)
    for dst in range(len(wanted)) if dsts is None else dsts:
        for key, region in enumerate(wanted[dst]):
            if _volume(region.shape) == 0:
                continue
            target: Box = (region.offset, region.shape)
            for turn, (box, owners) in enumerate(held_boxes.get(region.path, {}).items(), dst + key):
                part = _intersect(target, box)
                if part is None:
                    continue
                if dst in owners:
                    src = dst
                else:
                    ranks = list(owners)
                    src = ranks[turn % len(ranks)]
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


# ---------------------------------------------------------------------------------------------------------
# Reading the holders' memory


#: Where a tensor's bytes are, for a receiver reading them: its address and strides (in elements).
Where = tuple[int, tuple[int, ...]]


class Reach(NamedTuple):
    """Where receivers read a rank's offers in its memory: its `SourceRef`, and per offer, per tensor,
    `Where` it is (None: not a plain CPU tensor, it cannot be read by address)."""

    source: SourceRef
    tensors: tuple[tuple[Where | None, ...], ...]


def _where(t: torch.Tensor, region: Region) -> Where | None:
    """Where receivers read `t`, the piece `region`: None unless it is a plain CPU tensor of the region's
    shape (a read computes its addresses from that shape: anything else would read past the tensor)."""
    return (t.data_ptr(), tuple(t.stride())) if plain_cpu(t) and tuple(t.shape) == region.shape else None


def _reach(mine: Sequence[Held]) -> Reach:
    return Reach(source_ref(), tuple(tuple(map(_where, h.tensors, h.regions)) for h in mine))


def _dense_from(shape: Sequence[int], strides: Sequence[int]) -> int:
    """The first dimension from which the box `shape` is one run of memory under `strides` (every
    dimension from it inward follows the next in row-major order; a dimension of one index always does)."""
    step, first = 1, len(shape)
    for d in range(len(shape) - 1, -1, -1):
        if shape[d] != 1 and strides[d] != step:
            break
        step *= shape[d]
        first = d
    return first


def _runs(
    box: Box, itemsize: int, src: Where, src_origin: Sequence[int], dst: Where, dst_origin: Sequence[int]
) -> list[tuple[int, int, int]]:
    """The box `box` (global) of a tensor held at `src` (its piece's global offset `src_origin`) and
    wanted at `dst` (`dst_origin`) as runs of memory: (source address, target address, bytes), in
    row-major order, one per contiguous innermost extent common to both (a Shard(0) box of contiguous
    tensors: one run)."""
    offset, shape = box
    (s_at, s_strides), (d_at, d_strides) = src, dst
    first = max(_dense_from(shape, s_strides), _dense_from(shape, d_strides))
    length = math.prod(shape[first:]) * itemsize
    s_at += itemsize * sum((o - b) * st for o, b, st in zip(offset, src_origin, s_strides))
    d_at += itemsize * sum((o - b) * st for o, b, st in zip(offset, dst_origin, d_strides))
    if first == 0:
        return [(s_at, d_at, length)]
    out = []
    for index in itertools.product(*(range(n) for n in shape[:first])):
        out.append(
            (
                s_at + itemsize * sum(i * st for i, st in zip(index, s_strides)),
                d_at + itemsize * sum(i * st for i, st in zip(index, d_strides)),
                length,
            )
        )
    return out


def _merge_runs(pairs: Sequence[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """`pairs` (source address, target address, bytes) with each run that continues the one before it in
    both memories joined to it."""
    out: list[tuple[int, int, int]] = []
    for s, d, n in pairs:
        if out and out[-1][0] + out[-1][2] == s and out[-1][1] + out[-1][2] == d:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + n)
        else:
            out.append((s, d, n))
    return out


def _read_refusal(
    me: int,
    reaches: Sequence[Reach | None],
    offers: Sequence[Sequence[Offer]],
    holders: Sequence[Holder],
    targets: Sequence[Piece],
    wanted: Sequence[Region],
    comm: Comm,
    allowed: bool,
) -> str | None:
    """Why this rank cannot read what it may need from the holders' memory (None: it can): it was told
    not to (`allowed` false), the communication device is not the CPU, the platform or Yama forbids it,
    one of its targets or a holder's tensor is not a plain CPU tensor, or a holder's token does not read
    back (another host, another pid namespace, no permission)."""
    if not allowed:
        return "cross_memory=False"
    if comm.device.type != "cpu":
        return f"the communication device is {comm.device}"
    why = read_refusal()
    if why is not None:
        return why
    for p, region in zip(targets, wanted):
        if _where(p.local, region) is None and p.local.numel():
            return (
                f"its piece of {path_str(p.path)} is not a plain CPU tensor of the shape its mesh gives "
                f"({p.local.device}, {tuple(p.local.shape)} for {region.shape})"
            )
    checked: set[int] = set()
    for r, i in holders:
        if r == me:
            continue
        reach = reaches[r]
        if reach is None:
            return f"rank {r} published no addresses"
        for region, where in zip(offers[r][i].regions, reach.tensors[i]):
            if where is None and _volume(region.shape):
                return f"rank {r}'s piece of {path_str(region.path)} is not a plain CPU tensor"
        if r not in checked:
            checked.add(r)
            why = can_read(reach.source)
            if why is not None:
                return f"rank {r}: {why}"
    return None


def _read_moves(
    me: int,
    moves: Sequence[Move],
    reaches: Sequence[Reach | None],
    offers: Sequence[Sequence[Offer]],
    wanted: Sequence[Region],
    targets: Sequence[Piece],
) -> int:
    """Read every move into this rank from its holder's memory straight into the target pieces (one
    `read_regions` per holder); returns the bytes read."""
    by_src: dict[int, list[tuple[int, int, int]]] = {}
    index: dict[tuple[int, int], dict[Path, int]] = {}
    for m in moves:
        if m.dst != me or m.src == me:
            continue
        regions = offers[m.src][m.offer].regions
        at = index.get((m.src, m.offer))
        if at is None:
            at = index[(m.src, m.offer)] = {reg.path: k for k, reg in enumerate(regions)}
        region = wanted[m.key]
        k = at[region.path]
        reach = reaches[m.src]
        assert reach is not None  # `_read_refusal` saw to it
        where = reach.tensors[m.offer][k]
        assert where is not None
        if regions[k].dtype != region.dtype:
            msg = (
                f"rank {m.src} holds {path_str(region.path)} as {regions[k].dtype}, wanted as {region.dtype}"
            )
            raise ValueError(msg)
        local = targets[m.key].local
        dst = (local.data_ptr(), tuple(local.stride()))
        by_src.setdefault(m.src, []).extend(
            _runs(m.box, local.element_size(), where, regions[k].offset, dst, region.offset)
        )
    total = 0
    for src, pairs in by_src.items():
        joined = _merge_runs(pairs)
        reach = reaches[src]
        assert reach is not None
        read_regions(reach.source.pid, [(d, n) for _, d, n in joined], [(s, n) for s, _, n in joined])
        total += sum(n for _, _, n in joined)
    return total


@attrs.frozen
class _Record:
    """What each rank sends in the plan's all-gather, once it has copied and read what it could: the
    regions it wants, whatever kept it from preparing (`error`) or from filling them (`failure`), why it
    did not read from the holders' memory (`refusal`, None: it read every region it receives), and, from
    the sender, its plain leaves and the new lineage token (cloudpickled; None when they are broadcast
    after the gather)."""

    wanted: tuple[Region, ...]
    error: str | None = None
    failure: str | None = None
    refusal: str | None = None
    objects: bytes | None = None
    broadcast: bool = False


class Filled(NamedTuple):
    """What `reshard` filled the new state from."""

    tenure: Any
    #: bytes this rank received from others
    received: int
    #: the rank that sent the plain leaves
    sender: int
    #: whether the elected version came from snapshots only (no rank held it live)
    snapshot: bool


def reshard(
    new_state: Any, held: Held | Sequence[Held] | None, group: Collective, *, cross_memory: bool = True
) -> Filled:
    """Fill `new_state` (built on the new mesh) from what the ranks of `group` hold, collectively.

    After the all-gather of what every rank holds (and where, in its memory), each rank plans the moves
    into its own pieces (`plan_moves`: every rank would plan the same), copies the regions it holds itself
    (nothing at all where its held piece *is* the target: the same memory and box) and, where it can (one
    host, CPU pieces, Yama and the holders' tokens allow it, `cross_memory`), reads the others straight
    from the holders' memory into its pieces (`read_regions`: one copy, no buffer). The plan's all-gather
    then tells every rank who could not read (those receive by one `all_to_all_single` of packed bytes,
    the reason in a debug log) and keeps the holders' tensors until every read is done.

    Args:
        new_state: the sharded state built on the new mesh (its pieces are overwritten).
        held: this rank's live pieces and snapshots, live first (None or empty for a newcomer).
        group: the ranks of the new mesh.
        cross_memory: False: this rank does not read the holders' memory (it receives by the
            all-to-all).

    Returns:
        `Filled`: the elected tenure, the bytes this rank received, the sender of the plain leaves, and
        whether the version came from snapshots only.

    Raises:
        SyncError: the same on every rank when no version is held whole, a rank could not prepare, or a
            read failed; the new state is then left torn.
    """
    comm = group.comm
    me = group.rank
    mine = [h for h in ([held] if isinstance(held, Held) else held or ()) if h.tenure is not None]
    reach = _reach(mine) if comm is not None and mine else None
    rows: list[tuple[tuple[Offer, ...], Reach | None]] = group.gather(
        (tuple(h.offer() for h in mine), reach), "reshard-held", inline=RECORD_BYTES
    )
    offers = [o for o, _ in rows]
    reaches = [r for _, r in rows]
    tenure, holders = elect_held(offers)
    sender = min(r for r, _ in holders)
    from_snapshot = all(offers[r][i].snapshot for r, i in holders)
    targets: list[Piece] = []
    sd: dict[str, Any] = {}
    objects: bytes | None = None
    wanted: tuple[Region, ...] = ()
    refusal: str | None = "no other rank" if comm is None else None
    received = 0
    with torch.no_grad():
        try:
            entries = {h.path: (h.dtype, h.global_shape) for r, i in holders for h in offers[r][i].regions}
            with_state = _has_optimizer(entries) and not allocate_optimizer_state(new_state, entries)
            sd = sharded_state_dict(new_state, init_optimizers=with_state)
            targets = pieces(sd)
            wanted = tuple(region_of(p) for p in targets)
            if comm is not None:
                refusal = _read_refusal(me, reaches, offers, holders, targets, wanted, comm, cross_memory)
            if me == sender:  # its plain leaves (its first offer of the elected version) and the new token
                plain = mine[min(i for r, i in holders if r == me)].plain
                objects = cloudpickle.dumps((plain, uuid.uuid4().hex))
        except Exception as exc:
            record = _Record(wanted=(), error=f"{type(exc).__name__}: {exc}")
        else:
            inline = objects is not None and len(objects) <= OBJECTS_INLINE
            record = _Record(
                wanted,
                refusal=refusal,
                objects=objects if inline else None,
                broadcast=objects is not None and not inline,
            )
            try:  # what this rank fills alone: its local copies, then its reads
                moves = plan_moves({me: wanted}, offers, holders, dsts=(me,))
                _mark_torn(new_state, me, moves, mine, wanted, targets)  # until every region is in
                _copy_local(me, moves, mine, wanted, targets)
                if refusal is None:
                    fault_point("reshard-pieces", me)  # local copies done, nothing received yet
                    received = _read_moves(me, moves, reaches, offers, wanted, targets)
            except Exception as exc:
                record = attrs.evolve(record, failure=f"{type(exc).__name__}: {exc}")
        records = group.gather(record, "reshard-plan", inline=RECORD_BYTES)  # after every read
        raise_first(
            records, lambda r, e: SyncError(f"reshard: rank {r} could not prepare: {e}", phase="plan")
        )
        raise_first(records, _fill_failed, lambda rec: rec.failure)
        payload = records[sender].objects
        if records[sender].broadcast:
            payload = objects if comm is None else comm.broadcast_bytes(objects, sender, "reshard-objects")
        assert payload is not None  # the sender's record carries its objects, or it failed to prepare
        refused = [r for r, rec in enumerate(records) if rec.refusal is not None]
        if comm is not None and refused:
            log.debug(
                "reshard: rank(s) %s receive by an all-to-all instead of reading the holders' memory: "
                "rank %d: %s",
                refused,
                refused[0],
                records[refused[0]].refusal,
            )
            moves = plan_moves([r.wanted for r in records], offers, holders, dsts=refused)
            if any(m.src != m.dst for m in moves):
                received += _all_to_all(comm, me, moves, mine, records, targets)
        plain, token = cloudpickle.loads(payload)
        apply_sharded(new_state, kept_modules(new_state, sd, plain))
    set_lineage(new_state, token=token, torn=False)
    return Filled(tenure, received, sender, from_snapshot)


def _fill_failed(rank: int, error: str) -> SyncError:
    msg = (
        f"reshard: rank {rank} could not fill its new pieces from the holders' memory: {error}. The new "
        "state is left torn and the holders keep their pieces: reshard again (elastic.run does with the "
        "next generation), or pass cross_memory=False to take the all-to-all"
    )
    return SyncError(msg, phase="pieces", op="reshard")


#: The all-gathers take one round when every rank's record pickles to less than this (the regions of a
#: 21-layer model with Adam's moments, ~12 KB).
RECORD_BYTES = 32 * 1024


def _mark_torn(
    new_state: Any,
    me: int,
    moves: Sequence[Move],
    mine: Sequence[Held],
    wanted: Sequence[Region],
    targets: Sequence[Piece],
) -> None:
    """Mark `new_state` torn until every region is in, when anything is written into it: not when every
    move into this rank is from the held tensor that *is* its target (a state kept on the same mesh: its
    pieces, and so what it holds, stay intact if the fill fails)."""
    for m in moves:
        if m.dst != me:
            continue
        if m.src == me:
            h = mine[m.offer]
            k = next(j for j, reg in enumerate(h.regions) if reg.path == wanted[m.key].path)
            if _same_memory(h.tensors[k], h.regions[k], targets[m.key].local, wanted[m.key]):
                continue
        set_lineage(new_state, token=None, torn=True)
        return


def _copy_local(
    me: int, moves: Sequence[Move], mine: Sequence[Held], wanted: Sequence[Region], targets: Sequence[Piece]
) -> None:
    """The moves from this rank to itself, copied (none where the held tensor is the target: the same
    memory and box, as when a state's pieces are held as they are)."""
    index: dict[int, dict[Path, int]] = {}
    for m in moves:
        if m.src != me or m.dst != me:
            continue
        h = mine[m.offer]
        at = index.get(m.offer)
        if at is None:
            at = index[m.offer] = {reg.path: k for k, reg in enumerate(h.regions)}
        k = at[wanted[m.key].path]
        source, target = h.tensors[k], targets[m.key].local
        if _same_memory(source, h.regions[k], target, wanted[m.key]):
            continue
        target[_slices(m.box, wanted[m.key].offset)].copy_(source[_slices(m.box, h.regions[k].offset)])


def _same_memory(a: torch.Tensor, at: Region, b: torch.Tensor, bt: Region) -> bool:
    """Whether tensors `a` (the piece `at`) and `b` (`bt`) are one: the same memory, layout and box."""
    return (
        a.data_ptr() == b.data_ptr()
        and a.dtype == b.dtype
        and a.shape == b.shape
        and a.stride() == b.stride()
        and at.offset == bt.offset
    )


def _all_to_all(
    comm: Comm,
    me: int,
    moves: Sequence[Move],
    mine: Sequence[Held],
    records: Sequence[_Record],
    targets: Sequence[Piece],
) -> int:
    """The moves between ranks as one `all_to_all_single` of packed bytes; returns the bytes received."""
    wanted = records[me].wanted
    index = [{reg.path: k for k, reg in enumerate(h.regions)} for h in mine]
    device = targets[0].local.device if targets else torch.device("cpu")
    send: list[list[torch.Tensor]] = [[] for _ in range(comm.world_size)]
    recv_plan: list[list[Move]] = [[] for _ in range(comm.world_size)]
    for m in moves:
        if m.src == me and m.dst != me:
            h = mine[m.offer]
            k = index[m.offer][records[m.dst].wanted[m.key].path]
            part = h.tensors[k][_slices(m.box, h.regions[k].offset)]
            # a snapshot's part sits on the CPU: it travels on the pieces' device
            send[m.dst].append(part.reshape(-1).contiguous().view(torch.uint8).to(device))
        elif m.dst == me and m.src != me:
            recv_plan[m.src].append(m)
    send_sizes = [sum(t.numel() for t in ts) for ts in send]
    recv_sizes = [sum(_volume(m.box[1]) * _itemsize(wanted[m.key].dtype) for m in ms) for ms in recv_plan]
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
            n = _volume(m.box[1]) * target.element_size()
            chunk = inp[at : at + n].view(target.dtype).view(m.box[1])
            target[_slices(m.box, wanted[m.key].offset)].copy_(chunk)
            at += n
    return at


def _itemsize(dtype: str) -> int:
    return torch.empty(0, dtype=getattr(torch, dtype.removeprefix("torch."))).element_size()


def _has_optimizer(paths: Any) -> bool:
    """Whether the paths of regions include optimizer states (receivers then allocate theirs)."""
    return any("state" in p for p in paths)
