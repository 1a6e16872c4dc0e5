"""`sync` of sharded states (FSDP2, DTensor, HSDP): complete versions and replica sets.

A sharded state at tenure t is *complete* when every shard position of its mesh has an untorn holder at
tenure t (`elastic.state.shards`). The election picks the most tenured complete version (`elect_version`).
One all-gather then carries what each rank brings (`_Ready`): the lowest rank holding the version sends
the state's non-DTensor leaves (plain tensors, counters, hyperparameters) in one cloudpickle payload, and
inside every replica set whose members do not all hold that version, its lowest member at that version
sends its transport's plan. That member then moves its pieces to the others over the set's process group
(the mesh's ``"replicate"`` dimension) by the sync's transport (by default through shared memory when the
set's ranks share a host, else by broadcasts), straight into the receivers' local tensors. Replica sets
that agree move nothing; when every rank holds the same version and lineage nothing moves at all (the fast
path). No complete version: every rank raises the same `SyncError` naming the shard positions nobody holds."""

from __future__ import annotations

import hashlib
import logging
import time
import uuid
from collections.abc import Sequence
from typing import Any

import attrs
import cloudpickle
import torch
import torch.distributed as dist

from elastic._util.errors import StateMismatchError, SyncError
from elastic._util.words import ranks_str
from elastic.replication.collective import Collective, raise_first
from elastic.replication.comm import Comm, fault_point
from elastic.replication.transport.default import default_transport
from elastic.replication.transport.protocol import Transport
from elastic.state.config import StateConfig
from elastic.state.lineage import lineage, set_lineage
from elastic.state.nodes import Which, path_str
from elastic.state.shards import (
    REPLICATE,
    Layout,
    Piece,
    apply_sharded,
    kept_modules,
    layout_of,
    mesh_of,
    pieces,
    plain_leaves,
    sharded_state_dict,
)
from elastic.state.tensors import TensorMeta
from elastic.state.tenure import current, elect, greater, order_key

__all__ = [
    "ShardRecord",
    "Version",
    "check_schemas",
    "elect_version",
    "group_layout",
    "shard_record",
    "sync_sharded",
]

log = logging.getLogger("elastic")


@attrs.frozen
class ShardRecord:
    """What each rank sends in the election all-gather of a sharded sync."""

    tenure: Any = None
    torn: bool = False
    token: str | None = None
    schema: Any = None
    position: tuple[int, ...] = ()
    #: per optimizer key path: whether this rank's optimizer has state
    stateful: tuple[tuple[Any, bool], ...] = ()
    nbytes: int = 0
    #: a digest of the sorted key paths of this rank's pieces with their local shapes and dtypes: when a
    #: receiver's equals its source's, both walk the same pieces in sorted order and no list of pieces
    #: (or their metadata) needs to be exchanged
    pieces: str = ""
    src: int | None = None
    error: tuple[str, str] | None = None


def group_layout(comm: Comm | None, mesh: Any, op: str) -> tuple[Layout, list[int]]:
    """The mesh's layout and the global rank of every group rank (`comm` None: a world of one);
    `ValueError` unless the mesh holds exactly the group's ranks."""
    layout = layout_of(mesh)
    ranks = [comm.global_rank(i) for i in range(comm.world_size)] if comm is not None else [0]
    if sorted(ranks) != sorted(layout.position):
        msg = (
            f"{op}: the state's device mesh holds ranks {sorted(layout.position)}, but the group has ranks "
            f"{sorted(ranks)}; call {op} on the group of the state's mesh (the default group when the mesh "
            "spans every rank)"
        )
        raise ValueError(msg)
    return layout, ranks


def _schema(state: Any, sd: dict[str, Any], own: Sequence[Piece], keys: Sequence[str], layout: Layout) -> Any:
    """What must agree before anything moves: the class, the mesh and every model piece's key, global
    shape, dtype and placements (optimizer states are allocated by receivers that lack them)."""
    rows = tuple(
        (key, tuple(p.tensor.shape), str(p.tensor.dtype), str(p.tensor.placements))
        for p, key in zip(own, keys)
        if not _in_optimizer_state(sd, p.path)
    )
    return (type(state).__qualname__, tuple(sd), layout.shape, layout.names, rows)


def _in_optimizer_state(sd: dict[str, Any], path: tuple[Any, ...]) -> bool:
    node: Any = sd
    for i, step in enumerate(path):
        if isinstance(node, dict) and set(node) >= {"state", "param_groups"} and step == "state" and i:
            return True
        node = node[step] if isinstance(node, dict) else None
    return False


def _optimizers(sd: dict[str, Any], path: tuple[Any, ...] = ()) -> list[tuple[tuple[Any, ...], bool]]:
    out: list[tuple[tuple[Any, ...], bool]] = []
    for k, v in sd.items():
        if isinstance(v, dict):
            if set(v) == {"state", "param_groups"}:
                out.append(((*path, k), bool(v["state"])))
            else:
                out.extend(_optimizers(v, (*path, k)))
    return out


def shard_record(
    state: Any, config: StateConfig, layout: Layout, me: int, which: Which = "sync"
) -> tuple[ShardRecord, dict[str, Any]]:
    """This rank's election record (global rank `me`), and the sharded state dict it was taken from."""
    record, sd, _ = _shard_record(state, config, layout, me, which)
    return record, sd


def _shard_record(
    state: Any, config: StateConfig, layout: Layout, me: int, which: Which
) -> tuple[ShardRecord, dict[str, Any], dict[str, Piece]]:
    """`shard_record`, and the pieces of the state dict by key."""
    line = lineage(state)
    try:
        tenure = current(state, config, line)
        sd = sharded_state_dict(state, which)
        own = pieces(sd)
        keys = [path_str(p.path) for p in own]
        _check_replicated_on_replicate(own, layout)
        record = ShardRecord(
            tenure=tenure,
            torn=line.torn,
            token=line.token,
            schema=_schema(state, sd, own, keys, layout),
            position=layout.position[me],
            stateful=tuple(_optimizers(sd)),
            nbytes=sum(p.local.numel() * p.local.element_size() for p in own),
            pieces=_paths_digest(own, keys),
        )
        cloudpickle.dumps(tenure)
    except Exception as exc:
        return ShardRecord(error=("prepare", f"{type(exc).__name__}: {exc}")), {}, {}
    return record, sd, dict(zip(keys, own))


def _check_replicated_on_replicate(own: Sequence[Piece], layout: Layout) -> None:
    """Every DTensor must be a copy along the "replicate" dimension (that is what makes replica sets)."""
    if REPLICATE not in layout.names:
        return
    dim = layout.names.index(REPLICATE)
    for p in own:
        placement = p.tensor.placements[dim]
        if not placement.is_replicate():
            msg = (
                f"{path_str(p.path)} is placed {placement} on the mesh's 'replicate' dimension; ranks that "
                "differ only there must hold copies (Replicate()), as HSDP places parameters. Name the "
                "dimension otherwise (mesh_dim_names) if it shards"
            )
            raise ValueError(msg)


def _paths_digest(own: Sequence[Piece], keys: Sequence[str]) -> str:
    text = "\n".join(sorted(f"{key} {tuple(p.local.shape)} {p.local.dtype}" for p, key in zip(own, keys)))
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def check_schemas(records: Sequence[ShardRecord], op: str) -> None:
    """Raise the same error on every rank when a rank failed to prepare or the schemas differ."""
    raise_first(
        records,
        lambda r, e: SyncError(f"{op}: rank {r} could not prepare its state: {e[1]}", phase="elect", op=op),
    )
    schemas = {repr(r.schema) for r in records}
    if len(schemas) > 1:
        by: dict[str, list[int]] = {}
        for rank, rec in enumerate(records):
            by.setdefault(repr(rec.schema), []).append(rank)
        msg = (
            f"{op}: the ranks hold different sharded states: "
            + " vs ".join(ranks_str(rs) for rs in by.values())
            + " (class, fields, mesh shape, or a parameter's global shape, dtype or placement differ); "
            "build the same model on the same mesh on every rank"
        )
        raise StateMismatchError(msg)


# ---------------------------------------------------------------------------------------------------------
# The election


@attrs.frozen
class Version:
    """The elected version: its tenure, the rank sending objects, and per shard position its source."""

    tenure: Any
    src: int
    sources: dict[tuple[int, ...], int]


def elect_version(
    records: Sequence[ShardRecord], layout: Layout, ranks: Sequence[int], op: str, src: int | None = None
) -> Version:
    """The most tenured complete version (group ranks in the result); `src` (a group rank) forces its
    tenure. Raises the same `TenureError` / `SyncError` on every rank."""
    tenures = [None if r.torn else r.tenure for r in records]
    elect(tenures, op)  # the same TenureError everywhere for NaN or incomparable tenures
    wanted = layout.positions
    held: dict[Any, dict[tuple[int, ...], int]] = {}
    keys: dict[Any, Any] = {}
    for rank, (t, rec) in enumerate(zip(tenures, records)):
        if t is None:
            continue
        k = order_key(t)
        keys.setdefault(k, t)
        held.setdefault(k, {}).setdefault(rec.position, rank)
    complete = [k for k in held if len(held[k]) == len(wanted)]
    if src is not None:
        forced = order_key(tenures[src]) if tenures[src] is not None else None
        if forced not in complete:
            missing = sorted(set(wanted) - set(held.get(forced, {})))
            msg = (
                f"{op}(src={src}): rank {src}'s version (tenure {records[src].tenure!r}"
                f"{', torn' if records[src].torn else ''}) is not complete: no rank holds shard position(s) "
                f"{missing} at that tenure; leave src=None to elect the most tenured complete version"
            )
            raise SyncError(msg, phase="elect", op=op)
        best = forced
    elif not complete:
        top = max(held, default=None)
        if top is None:
            msg = f"{op}: every rank's state is torn or holds no state; there is no version to sync"
        else:
            missing = sorted(set(wanted) - set(held[top]))
            where = ", ".join(f"{pos} on rank(s) {ranks_str(_at(records, pos))}" for pos in missing)
            msg = (
                f"{op}: no complete version of the sharded state ({layout.describe()}): the most tenured "
                f"(tenure {keys[top]!r}) lacks shard position(s) {missing} (held at older tenures or lost: "
                f"{where}), and no older tenure is held at every position. Nothing was changed. Keep "
                "replicas (an HSDP mesh with a 'replicate' dimension), or load a checkpoint (elastic.load / "
                "run(ckpt=...))"
            )
        raise SyncError(msg, phase="elect", op=op)
    else:
        best = complete[0]
        for k in complete[1:]:
            if greater(keys[k], keys[best]):
                best = k
    sources = held[best]
    return Version(tenure=keys[best], src=min(sources.values()), sources=sources)


def _at(records: Sequence[ShardRecord], pos: tuple[int, ...]) -> list[int]:
    return [r for r, rec in enumerate(records) if rec.position == pos]


def _identical(records: Sequence[ShardRecord]) -> bool:
    tokens = {r.token for r in records}
    return (
        len(tokens) == 1
        and None not in tokens
        and not any(r.torn for r in records)
        and all(r.tenure == records[0].tenure for r in records)
    )


# ---------------------------------------------------------------------------------------------------------
# Moving pieces


#: The exchange after the election takes one all-gather when every rank's `_Ready` pickles to less than
#: this (the objects of a 42-parameter model and Adam, and the plan of its pieces, ~6 KB).
READY_BYTES = 16 * 1024
#: Objects larger than this do not ride in the all-gather (every rank would receive them from every rank):
#: the sender broadcasts them after it.
OBJECTS_INLINE = 8 * 1024


@attrs.frozen
class _Ready:
    """What each rank brings to the exchange after the election: the sender its objects (cloudpickled), a
    set source whose set receives its transport's plan, with its order of pieces and their metadata unless
    every receiver holds its source's pieces (`aligned`), and any rank whatever kept it from preparing."""

    objects: bytes | None = None
    #: whether the sender broadcasts its objects after the all-gather (more than `OBJECTS_INLINE` bytes)
    broadcast: bool = False
    plan: Any = None
    order: tuple[str, ...] | None = None
    metas: tuple[TensorMeta, ...] | None = None
    error: str | None = None


def _metas(chosen: Sequence[Piece]) -> list[TensorMeta]:
    """The transports' metadata of a rank's local pieces (each its own carrier)."""
    return [
        TensorMeta(p.path, tuple(t.shape), t.dtype, t.device.type, t.stride())
        for p in chosen
        for t in (p.local,)
    ]


def _targets(
    mine: dict[str, Piece], order: Sequence[str], metas: Sequence[TensorMeta]
) -> tuple[list[torch.Tensor], str | None]:
    """A receiver's local tensors for the source's pieces (`order`, `metas`), and why it cannot take them
    all: a piece it lacks or holds otherwise gets a scratch tensor, so the transfer stays in step."""
    out: list[torch.Tensor] = []
    wrong: list[str] = []
    for key, meta in zip(order, metas):
        piece = mine.get(key)
        local = piece.local if piece is not None else None
        if local is None or tuple(local.shape) != meta.shape or local.dtype != meta.dtype:
            wrong.append(key)
            local = torch.empty(meta.shape, dtype=meta.dtype, device=meta.device_type)
        out.append(local)
    if not wrong:
        return out, None
    return out, (
        f"this rank lacks (or holds with another local shape or dtype) the pieces {wrong[:3]} its replica "
        "set's source holds"
    )


def _move_pieces(
    comm: Comm,
    rep: Comm,
    transport: Transport,
    src: int,
    tensors: list[torch.Tensor],
    metas: list[TensorMeta],
    plan: Any,
    receive: bool,
) -> list[str]:
    """The pieces of one replica set from its source (group rank `src` of the set's `rep`) by `transport`,
    in place on receivers. Returns the local failures (the transport went on with the others)."""
    fault_point("pieces", comm.rank)
    failures: list[str] = []

    def failed(exc: BaseException) -> None:
        failures.append(f"{type(exc).__name__}: {exc}")

    if receive:
        transport.receive(rep, src, tensors, metas, plan, failed)
    else:
        transport.send(rep, src, tensors, metas, plan, failed)
    return failures


def sync_sharded(
    state: Any,
    config: StateConfig,
    group: Collective,
    *,
    src: int | None,
    force: bool,
    op: str,
    started: float,
    transport: Transport | None = None,
) -> tuple[int, Any, int, int]:
    """The sharded sync of `state` in `group` (not solo): (src, tenure, tensor_bytes, object_bytes) for
    the caller's report, the same on every rank. `started` is when the call began (for the log); the
    pieces move by `transport` (None: `default_transport()`) inside each replica set."""
    comm = group.comm
    assert comm is not None  # the caller handles solo groups
    with torch.no_grad():
        mesh = mesh_of(state)
        layout, ranks = group_layout(comm, mesh, op)
        me = ranks[comm.rank]
        record, sd, by_key = _shard_record(state, config, layout, me, "sync")
        record = attrs.evolve(record, src=src)
        records = group.gather(record, "elect")
        check_schemas(records, op)
        given = {r.src for r in records}
        if len(given) > 1 or (src is not None and not 0 <= src < group.world):
            msg = (
                f"{op}: the ranks passed different or invalid src= values "
                f"({[r.src for r in records]}); pass the same group rank (0..{group.world - 1}) everywhere"
            )
            raise ValueError(msg)
        if not force and src is None and _identical(records):
            log.debug("%s: sharded replicas identical (tenure %r)", op, records[0].tenure)
            return 0, records[0].tenure, 0, 0
        version = elect_version(records, layout, ranks, op, src)
        sender = version.src if src is None else src
        if src is not None:  # the forced rank is its replica set's source, whatever the ranks' order
            version.sources[records[src].position] = src
        me_pos = layout.position[me]
        set_source = version.sources[me_pos]

        def lags(rank: int) -> bool:
            rec = records[rank]
            source = records[version.sources[rec.position]]
            return (
                force
                or rec.torn
                or rec.tenure != version.tenure
                or rec.token is None
                or rec.token != source.token
            )

        receiving_sets = {
            records[r].position
            for r in range(len(records))
            if r != version.sources[records[r].position] and lags(r)
        }
        receiver = comm.rank != set_source and lags(comm.rank)
        # Every rank but the sender takes the sender's objects unless it shares the sender's lineage.
        applies = comm.rank != sender and (
            receiver or record.token is None or record.token != records[sender].token
        )
        aligned = all(
            rec.pieces == records[version.sources[rec.position]].pieces
            for r, rec in enumerate(records)
            if r != version.sources[rec.position] and lags(r)
        )
        moving = me_pos in receiving_sets
        chosen = transport if transport is not None else default_transport()
        if applies:  # torn until the whole version is in (a failure below leaves it so)
            set_lineage(state, token=None, torn=True)
        failure: str | None = None
        object_bytes = 0
        token = None
        try:
            # 1. What each rank brings to the one exchange after the election (`_Ready`). A receiver
            #    allocates the optimizer state it lacks; a set source plans the transfer of its pieces in
            #    sorted order (optimizer states are ordered by when each parameter first stepped, which
            #    differs between ranks).
            ready = _Ready()
            mine: dict[str, Piece] = {}
            own: list[torch.Tensor] = []
            metas: list[TensorMeta] = []
            rep: Comm | None = None
            try:
                stateful = records[sender].stateful
                if receiver and any(
                    theirs and not have for (_, have), (_, theirs) in zip(record.stateful, stateful)
                ):
                    sd = sharded_state_dict(state, init_optimizers=True)
                    by_key = {path_str(p.path): p for p in pieces(sd)}
                mine = {k: p for k, p in by_key.items() if _needed(p, stateful)}
                if moving:
                    rep = Comm(mesh.get_group(REPLICATE), comm.timeout, op)
                if rep is not None and comm.rank == set_source:
                    order = sorted(mine)
                    own = [mine[k].local for k in order]
                    metas = _metas([mine[k] for k in order])
                    plan = chosen.plan(own, rep)
                    ready = (
                        _Ready(plan=plan)
                        if aligned
                        else _Ready(plan=plan, order=tuple(order), metas=tuple(metas))
                    )
            except Exception as exc:
                ready = _Ready(error=f"{type(exc).__name__}: {exc}")
            objects: bytes | None = None
            if comm.rank == sender:
                try:
                    objects = cloudpickle.dumps((plain_leaves(sd), uuid.uuid4().hex))
                except Exception as exc:
                    objects = cloudpickle.dumps(_Unsent(f"{type(exc).__name__}: {exc}"))
                inline = len(objects) <= OBJECTS_INLINE
                ready = attrs.evolve(ready, objects=objects if inline else None, broadcast=not inline)
            rows = group.gather(ready, "objects", inline=READY_BYTES)
            raise_first(
                rows,
                lambda r, e: RuntimeError(f"rank {r} could not prepare its pieces: {e}"),
                lambda x: x.error,
            )
            payload = rows[sender].objects
            if rows[sender].broadcast:
                payload = comm.broadcast_bytes(objects, sender, "objects")
            assert payload is not None  # the sender sends its objects or why it has none
            object_bytes = len(payload)
            sent = cloudpickle.loads(payload)
            if isinstance(sent, _Unsent):
                raise RuntimeError(f"the sender (rank {sender}) could not pack its objects: {sent.why}")
            plain, token = sent
            # 2. The pieces, inside each replica set that has a receiver (`elect_version` saw to it that
            #    such a set has a source, so the mesh has a "replicate" dimension).
            if rep is not None:
                theirs = rows[set_source]
                problem = None
                if receiver and theirs.order is None:  # aligned: the same pieces, walked in sorted order
                    order = sorted(mine)
                    own = [mine[k].local for k in order]
                    metas = _metas([mine[k] for k in order])
                elif receiver:
                    metas = list(theirs.metas or ())
                    own, problem = _targets(mine, theirs.order or (), metas)
                at = dist.get_group_rank(rep.group, ranks[set_source])
                failures = _move_pieces(comm, rep, chosen, at, own, metas, theirs.plan, receive=receiver)
                if problem is not None or failures:
                    raise RuntimeError(problem or failures[0])
            # 3. The sender's objects.
            if applies:
                apply_sharded(state, kept_modules(state, sd, plain))
        except SyncError as exc:
            failure = str(exc)
        except Exception as exc:
            failure = f"{type(exc).__name__}: {exc}"
        outcome = group.errors(failure, "commit")

        def fail(rank: int, error: str) -> SyncError:
            msg = (
                f"{op} of a sharded state failed on rank {rank}: {error}. Ranks that were receiving "
                "are marked torn (tenure None) until their next successful sync or load; the sources are "
                "unchanged"
            )
            return SyncError(msg, phase="pieces", op=op)

        raise_first(outcome, fail, error_of=lambda e: e)
        set_lineage(state, token=token, torn=False)
        moved = 0
        for r, rec in enumerate(records):
            if rec.position in receiving_sets and r != version.sources[rec.position] and lags(r):
                moved += rec.nbytes
        log.debug("%s: sharded sync moved %d bytes in %.3fs", op, moved, time.perf_counter() - started)
        return sender, version.tenure, moved, object_bytes


@attrs.frozen
class _Unsent:
    """What a sender that cannot pack its objects sends instead (every rank raises `why`)."""

    why: str


def _needed(piece: Piece, stateful: tuple[tuple[Any, bool], ...]) -> bool:
    """Whether a piece travels: optimizer state pieces only where the sender's optimizer has state."""
    return not any(piece.path[: len(path)] == path and not has for path, has in stateful)
