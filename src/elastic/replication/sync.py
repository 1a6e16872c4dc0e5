"""Election and sync: agree on the most tenured state and broadcast it to every rank."""

from __future__ import annotations

import contextlib
import gc
import logging
import pickle
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any

import attrs
import cloudpickle
import torch

from elastic._util.errors import StateMismatchError, SyncError, TenureError
from elastic._util.timeouts import as_timedelta
from elastic._util.words import ranks_str
from elastic.replication.collective import Collective, raise_first
from elastic.replication.comm import Comm, fault_point
from elastic.replication.layout import Layout, decode_metas, layout_of
from elastic.replication.sharded import sync_sharded
from elastic.replication.transport.default import default_transport
from elastic.replication.transport.protocol import Transport
from elastic.state.apply import apply_fields, fill_aliases, receive_targets
from elastic.state.config import StateConfig, attached, config_of
from elastic.state.lineage import Lineage, lineage, set_lineage
from elastic.state.nodes import NODE_TYPES, PLAIN, Kind, StateNode
from elastic.state.schema import compatible, scan_schema, schema_digests, strict_schema
from elastic.state.shards import is_sharded
from elastic.state.tensors import TensorMeta, carriers
from elastic.state.tenure import current, elect
from elastic.state.tree import Flat, flatten

__all__ = [
    "SyncReport",
    "broadcast_state",
    "most_tenured_rank",
    "sync",
    "sync_method",
    "tenure",
]

log = logging.getLogger("elastic")


@attrs.frozen
class SyncReport:
    """What one `elastic.sync` did: who sent, at which tenure, to how many ranks, how many bytes, how long.

    The same on every rank except `seconds`. A frozen attrs class.

    Attributes:
        src: the group rank whose state every rank now holds (the elected or given source).
        tenure: the tenure every rank now holds.
        world_size: the number of ranks in the group.
        tensor_bytes: tensor bytes the source sent (0 on the fast path: nothing had to move).
        object_bytes: bytes of the one cloudpickle payload of non-tensor values (0 on the fast path).
        seconds: this rank's wall time in the call.
    """

    src: int
    tenure: Any
    world_size: int
    tensor_bytes: int
    object_bytes: int
    seconds: float


def tenure(state: Any) -> Any:
    """The tenure of `state` on this rank, as the elections see it (local, no communication).

    Args:
        state: an instance of an ``@elastic_state`` class.

    Returns:
        The value of the class's tenure function, or None for a *torn* state (a receiver left
        half-written by a failed transfer, until its next successful `sync` or `load`).

    Raises:
        TypeError: `state` is not an instance of an ``@elastic_state`` class.
    """
    config = config_of(state, "elastic.tenure()")
    return current(state, config, lineage(state))


# -----------------------------------------------------------------------------------------------------------
# Election


@attrs.frozen
class Record:
    """What each rank contributes to the election all-gather."""

    tenure: Any = None
    torn: bool = False
    token: str | None = None
    schema: Any = None
    src: int | None = None
    error: tuple[str, str] | None = None  # (kind, message)


def _local_record(
    state: Any, config: StateConfig, line: Lineage, src: int | None, with_schema: bool
) -> Record:
    return _scan(state, config, line, src, with_schema)[0]


def _scan(
    state: Any, config: StateConfig, line: Lineage, src: int | None, with_schema: bool
) -> tuple[Record, dict[Any, Any]]:
    """This rank's election record and, with the schema, what it took from the modules (kept walks or
    state dicts, by path): a sync that moves the state flattens it with them (one look at each module per
    sync), one with nothing to move never flattens."""
    sds: dict[Any, Any] = {}
    try:
        value = current(state, config, line)
    except Exception as exc:
        return Record(error=("tenure", f"tenure function raised {type(exc).__name__}: {exc}"), src=src), sds
    schema = None
    if with_schema:
        try:
            schema = schema_digests(state, sds)
        except Exception as exc:
            return Record(error=("prepare", f"{type(exc).__name__}: {exc}"), src=src), sds
    try:
        cloudpickle.dumps(value)
    except Exception as exc:
        return Record(error=("tenure", f"tenure value {value!r} cannot be pickled: {exc}"), src=src), sds
    return Record(tenure=value, torn=line.torn, token=line.token, schema=schema, src=src), sds


def _record_failure(op: str) -> Callable[[int, tuple[str, str]], Exception]:
    """The error every rank raises for the first rank whose election record has one."""

    def fail(rank: int, error: tuple[str, str]) -> Exception:
        kind, text = error
        if kind == "tenure":
            msg = (
                f"{op}: on rank {rank} the {text}; fix the tenure callable so that it returns an "
                "orderable value or None"
            )
            return TenureError(msg)
        return SyncError(f"{op}: rank {rank} could not prepare its state: {text}", phase="prepare")

    return fail


def _elect_records(group: Collective, record: Record, op: str) -> list[Record]:
    """Every rank's election record, or the first error any rank saw (raised on every rank)."""
    return group.gather_checked(record, "elect", _record_failure(op))


def _check_src(records: Sequence[Record], world: int, op: str) -> int | None:
    given = {rec.src for rec in records}
    if len(given) > 1:
        by = {str(r): rec.src for r, rec in enumerate(records)}
        msg = f"{op}(src=...) must be the same on every rank, got {by}; pass one src everywhere or none"
        raise SyncError(msg, phase="elect") from None
    src = given.pop()
    if src is not None and not (isinstance(src, int) and 0 <= src < world):
        msg = f"{op}(src={src!r}) is not a rank of this group of {world}; pass 0 <= src < {world} or None"
        raise SyncError(msg, phase="elect") from None
    return src


def _check_schemas(group: Collective, records: Sequence[Record], state: Any, op: str) -> None:
    first = records[0].schema
    assert first is not None  # every record without an error carries a schema
    same = all(
        rec.schema[0] == first[0]
        and len(rec.schema[1]) == len(first[1])
        and all(compatible(a, b) for a, b in zip(rec.schema[1], first[1]))
        for rec in records
    )
    if same:
        return
    # Everyone saw the mismatch: gather the full schemas once more to say exactly what differs.
    try:
        mine: Any = scan_schema(state)[0]
    except Exception as exc:  # still take part: the others are already in the all-gather
        mine = (f"<schema failed: {type(exc).__name__}: {exc}>", ())
    full = group.gather(mine, "schema")
    raise StateMismatchError(_mismatch_message(full, op)) from None


def _describe(schema: Any) -> str:
    kind = schema[0]
    if kind == Kind.MODULE:
        return f"module with {len(schema[1])} tensors"
    if kind == Kind.STATE:
        return f"nested state {schema[1][0]}"
    if kind == Kind.STATEFUL:
        return f"stateful {schema[1]}"
    if kind == Kind.OPTIMIZER:
        groups = ", ".join(f"{n} params with {'/'.join(h)}" for n, h in schema[2])
        return f"{schema[1]} optimizer with {len(schema[2])} param group(s) [{groups}]"
    if kind == Kind.RNG:
        return f"{schema[1]} generator"
    return str(kind)


#: The fix for a structured field that differs only within its kind.
_FIXES: dict[str, str] = {
    Kind.MODULE: "construct the model identically everywhere (sizes from the config, not from the rank)",
    Kind.OPTIMIZER: "build the optimizer with the same class and param groups on every rank",
    Kind.STATEFUL: "build the scheduler, scaler, sampler or other state_dict() object of each field with the "
    "same class on every rank",
    Kind.STATE: "build each nested state of the same class, with the same structured fields, on every rank",
}
#: The fix for a field that holds a structured value on some ranks and another kind of value on others.
_KIND_FIX = (
    "build the field's module, optimizer, scheduler, sampler or nested state on every rank, not None or "
    "another kind of value there (a receiver loads state into its own object but cannot build one; plain "
    "values of any kind are adopted from the source)"
)


def _mismatch_message(full: Sequence[Any], op: str) -> str:
    """What differs between the ranks' full schemas (`scan_schema`), and how to fix it. Plain fields never
    differ: receivers adopt the source's value whatever its kind (`strict_schema`)."""
    lines = [f"{op}: the ranks hold states of different schemas; nothing was moved."]
    fixes: list[str] = []
    classes: dict[str, list[int]] = {}
    for rank, (qualname, _) in enumerate(full):
        classes.setdefault(qualname, []).append(rank)
    if len(classes) > 1:
        lines.append("  class: " + "; ".join(f"{q} on {ranks_str(rs)}" for q, rs in classes.items()))
        fixes.append("build the same state class on every rank")
    names: list[str] = []
    for _, fields in full:
        names.extend(n for n, _ in fields if n not in names)
    for name in names:
        per_rank: list[Any] = [dict(fields).get(name) for _, fields in full]
        groups: dict[str, list[int]] = {}
        for rank, sch in enumerate(per_rank):
            groups.setdefault("missing" if sch is None else repr(strict_schema(sch)), []).append(rank)
        if len(groups) <= 1:
            continue
        if None in per_rank:
            fix = "define the same synced fields on every rank"
        else:  # plain fields group together: a structured kind differs, or its class or layout does
            kinds = {"plain" if sch[0] in PLAIN else sch[0] for sch in per_rank}
            fix = _FIXES[kinds.pop()] if len(kinds) == 1 else _KIND_FIX
        if fix not in fixes:
            fixes.append(fix)
        if all(sch is not None and sch[0] == Kind.MODULE for sch in per_rank):
            lines.append(f"  field {name!r}: " + _module_diff([sch[1] for sch in per_rank]))
            continue
        desc = "; ".join(
            f"{'missing' if per_rank[rs[0]] is None else _describe(per_rank[rs[0]])} on {ranks_str(rs)}"
            for rs in groups.values()
        )
        lines.append(f"  field {name!r}: {desc}")
    lines.append("Fix: " + ("; ".join(fixes) or "build the same state on every rank") + ".")
    return "\n".join(lines)


def _module_diff(layouts: Sequence[Sequence[tuple[str, tuple[int, ...], str]]]) -> str:
    keys: list[str] = []
    for layout in layouts:
        keys.extend(k for k, _, _ in layout if k not in keys)
    parts = []
    for key in keys:
        groups: dict[str, list[int]] = {}
        for rank, layout in enumerate(layouts):
            found = {k: (s, d) for k, s, d in layout}.get(key)
            text = "missing" if found is None else f"shape {tuple(found[0])} {found[1]}"
            groups.setdefault(text, []).append(rank)
        if len(groups) > 1:
            parts.append(f"{key}: " + ", ".join(f"{t} on {ranks_str(rs)}" for t, rs in groups.items()))
    return "; ".join(parts[:8]) + (f"; and {len(parts) - 8} more" if len(parts) > 8 else "")


# -----------------------------------------------------------------------------------------------------------
# Sync


@attrs.frozen(kw_only=True)
class Payload:
    """What the source broadcasts as one cloudpickle object.

    The skeleton (the user's objects) travels as bytes inside it, decoded by `skeleton_here()`: a receiver
    that cannot unpickle it still reads the tensor metadata and plan, so it takes part in the transfer
    (into scratch tensors, its state untouched) and reports the failure at commit."""

    skeleton: StateNode | None
    metas: list[TensorMeta] | None  # decoded from `encoded` on first use on a receiver
    plan: Any  # the transport's plan for the carriers (BroadcastTransport: which go direct)
    token: str | None
    torn: bool
    tenure: Any
    error: str | None = None
    packed: bytes | None = None  # the pickled skeleton, on a receiver
    #: the digest of the source's metadata (`Layout.digest`): a receiver whose own is equal uses its own
    layout: str | None = None
    encoded: bytes | None = None  # the metadata as `encode_metas` gives them (kept with the layout)

    def __reduce__(self) -> tuple[Any, ...]:
        packed = self.packed if self.skeleton is None else _pickle_skeleton(self.skeleton)
        fields = (self.plan, self.token, self.torn, self.tenure, self.error, self.layout)
        return (_payload, (packed, self.encoded, *fields))

    def metas_here(self) -> list[TensorMeta]:
        """The source's metadata, decoded on first use on a receiver (one that holds the same needs none)."""
        if self.metas is None:
            object.__setattr__(self, "metas", decode_metas(self.encoded) if self.encoded else [])
        assert self.metas is not None
        return self.metas

    def skeleton_here(self) -> StateNode:
        """The skeleton, unpickled on first use on a receiver (where user classes may fail to load)."""
        if self.skeleton is not None:
            return self.skeleton
        assert self.packed is not None  # a payload without an error carries a skeleton
        skeleton = cloudpickle.loads(self.packed)
        object.__setattr__(self, "skeleton", skeleton)
        return skeleton


def _pickle_skeleton(skeleton: StateNode) -> bytes:
    """The skeleton pickled by the C pickler where that is safe (5x faster than cloudpickle's per-object
    hook on a 2,000-tensor module), else by cloudpickle: for lambdas, closures and local classes (which
    the plain pickler refuses), for anything from `__main__` (a notebook's or spawn's `__main__` differs
    between processes) and when modules are registered to pickle by value."""
    if not cloudpickle.list_registry_pickle_by_value():
        try:
            data = pickle.dumps(skeleton, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:
            pass
        else:
            if b"__main__" not in data:
                return data
    return cloudpickle.dumps(skeleton)


def _payload(
    packed: Any, encoded: Any, plan: Any, token: Any, torn: Any, tenure: Any, error: Any, layout: Any
) -> Payload:
    return Payload(
        skeleton=None,
        metas=None,
        plan=plan,
        token=token,
        torn=torn,
        tenure=tenure,
        error=error,
        packed=packed,
        layout=layout,
        encoded=encoded,
    )


def _failed_payload(msg: str) -> bytes:
    payload = Payload(skeleton=None, metas=[], plan=[], token=None, torn=False, tenure=None, error=msg)
    return cloudpickle.dumps(payload)


def _unpicklable_fields(skeleton: StateNode) -> str:
    bad = []
    for name, node in skeleton.fields.items():
        try:
            cloudpickle.dumps(node)
        except Exception as exc:
            culprit = _find_unpicklable(node)
            what = (
                f" ({type(culprit).__module__}.{type(culprit).__qualname__})" if culprit is not None else ""
            )
            bad.append(f"field {name!r}{what}: {type(exc).__name__}: {exc}")
    return "; ".join(bad) or "the payload"


def _find_unpicklable(node: Any) -> Any:
    """The deepest node or leaf below `node` that cannot be pickled (`node` itself when none below is)."""
    branches = node.branches(()) if type(node) in NODE_TYPES else ()
    for _, child in branches:
        try:
            cloudpickle.dumps(child)
        except Exception:
            return _find_unpicklable(child)
    return node


def run_sync(
    state: Any,
    *,
    group: Any = None,
    src: int | None = None,
    force: bool = False,
    timeout: timedelta | float | None = None,
    op: str = "sync",
    notify: bool = True,
    transport: Transport | None = None,
) -> SyncReport:
    """`sync` with the name of the calling operation for messages."""
    config = config_of(state, f"elastic.{op}()")
    deadline = as_timedelta(timeout, op)
    started = time.perf_counter()
    collective = Collective.of(group, deadline, op)
    return sync_in(
        state,
        config,
        collective,
        src=src,
        force=force,
        op=op,
        notify=notify,
        started=started,
        transport=transport,
    )


def sync_in(
    state: Any,
    config: StateConfig,
    group: Collective,
    *,
    src: int | None = None,
    force: bool = False,
    op: str = "sync",
    notify: bool = True,
    started: float | None = None,
    transport: Transport | None = None,
) -> SyncReport:
    """The sync of `state` (whose configuration is `config`) in `group`: elect, then transfer or not.

    `save` and `load` call it with the group and configuration they already looked up. Tensors it
    allocates (or caches) are ordinary tensors, also when the caller is under `torch.inference_mode()`
    (an inference tensor fails at the next `optimizer.step()`)."""
    with torch.inference_mode(False), _no_cyclic_gc():
        return _sync_in(state, config, group, src, force, op, notify, started, transport)


@contextlib.contextmanager
def _no_cyclic_gc() -> Iterator[None]:
    """Python's cyclic collector paused for the call: a sync creates a few objects per tensor (skeleton,
    metadata, index), which in a large heap (torch's) triggers full collections costing ~20 ms of CPU per
    rank per 2,000-tensor sync. Nothing a sync creates needs cycle collection before it returns."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _sync_in(
    state: Any,
    config: StateConfig,
    group: Collective,
    src: int | None,
    force: bool,
    op: str,
    notify: bool,
    started: float | None,
    transport: Transport | None,
) -> SyncReport:
    started = time.perf_counter() if started is None else started
    line = lineage(state)
    if group.solo:
        report = SyncReport(
            src=0,
            tenure=current(state, config, line),
            world_size=1,
            tensor_bytes=0,
            object_bytes=0,
            seconds=0.0,
        )
        if notify and config.on_sync is not None:
            config.on_sync(state, report)
        return report
    if is_sharded(state):
        sender, tenure_, moved, object_bytes = sync_sharded(
            state, config, group, src=src, force=force, op=op, started=started, transport=transport
        )
        report = SyncReport(
            src=sender,
            tenure=tenure_,
            world_size=group.world,
            tensor_bytes=moved,
            object_bytes=object_bytes,
            seconds=time.perf_counter() - started,
        )
        _finish(state, config, report, op, notify)
        return report
    mine, sds = _scan(state, config, line, src, with_schema=True)
    records = _elect_records(group, mine, op)
    given = _check_src(records, group.world, op)
    _check_schemas(group, records, state, op)
    tenures = [rec.tenure for rec in records]
    elected = elect(tenures, op)
    source = elected if given is None else given
    if not force and _identical(records):
        report = SyncReport(
            src=source,
            tenure=tenures[elected],
            world_size=group.world,
            tensor_bytes=0,
            object_bytes=0,
            seconds=time.perf_counter() - started,
        )
        log.debug("%s: replicas already identical (tenure %r, lineage %s)", op, tenures[0], records[0].token)
    else:
        chosen = transport if transport is not None else default_transport()
        report = _transfer(state, group, source, records[source].tenure, line, chosen, op, started, sds)
    _finish(state, config, report, op, notify)
    return report


def _identical(records: Sequence[Record]) -> bool:
    """Whether every rank holds the same lineage and tenure (and none is torn): nothing to move."""
    tokens = {rec.token for rec in records}
    return (
        len(tokens) == 1
        and None not in tokens
        and not any(rec.torn for rec in records)
        and all(rec.tenure == records[0].tenure for rec in records)
    )


def _finish(state: Any, config: StateConfig, report: SyncReport, op: str, notify: bool) -> None:
    log.info(
        "%s: src=%d tenure=%r world_size=%d tensor_bytes=%d object_bytes=%d seconds=%.3f",
        op,
        report.src,
        report.tenure,
        report.world_size,
        report.tensor_bytes,
        report.object_bytes,
        report.seconds,
    )
    if notify and config.on_sync is not None:
        config.on_sync(state, report)


class _Failures:
    """This rank's local failures during a transfer; every rank learns of the first one at commit."""

    def __init__(self) -> None:
        self.messages: list[str] = []

    def add(self, exc: BaseException) -> None:
        self.messages.append(f"{type(exc).__name__}: {exc}")

    @property
    def first(self) -> str | None:
        return self.messages[0] if self.messages else None


def _transfer(
    state: Any,
    group: Collective,
    src: int,
    src_tenure: Any,
    line: Lineage,
    transport: Transport,
    op: str,
    started: float,
    sds: dict[Any, Any],
) -> SyncReport:
    """Objects, then tensors, then commit: every rank holds the source's state, or every rank raises.

    One walk of the state (with what the election took from the modules, `sds`) gives the source its
    tensors and a receiver its in-place targets; its layout (`elastic.replication.layout`) is kept between
    syncs. Tensors
    that share storage with another (tied weights, views) travel once, inside their carrier, and are
    rebuilt as views on the receivers."""
    comm = group.comm
    assert comm is not None  # a transfer needs a group
    failures = _Failures()
    own: tuple[Flat, Layout] | BaseException
    if comm.rank == src:
        own, data, built = _pack_objects(state, sds, comm, src, src_tenure, line, transport)
    else:
        data, built = None, None
        try:  # walk our own tree while the source walks and pickles
            flat = flatten(state, "sync", sds)
            own = (flat, layout_of(state, flat))
        except Exception as exc:
            own = exc
    payload, object_bytes = _exchange_objects(comm, src, data, built, op)
    if comm.rank == src:
        assert not isinstance(own, BaseException)  # a source that cannot walk sends its error instead
        flat, layout = own
        sent = [flat.tensors[i] for i in layout.moving]
        transport.send(comm, src, sent, layout.moving_metas, payload.plan, failures.add)
        moved = layout.moving_metas
    else:
        moved = _receive(state, comm, src, payload, own, transport, failures)
    _commit(group, src, failures, op)
    set_lineage(state, token=payload.token, torn=payload.torn)
    return SyncReport(
        src=src,
        tenure=payload.tenure,
        world_size=comm.world_size,
        tensor_bytes=sum(m.nbytes for m in moved),
        object_bytes=object_bytes,
        seconds=time.perf_counter() - started,
    )


def _pack_objects(
    state: Any,
    sds: dict[Any, Any],
    comm: Comm,
    src: int,
    src_tenure: Any,
    line: Lineage,
    transport: Transport,
) -> tuple[tuple[Flat, Layout] | BaseException, bytes, Payload | None]:
    """The source's walk and objects: the skeleton, tensor metadata (encoded once per layout), the
    transport's plan and the new lineage, in one cloudpickle payload (or one that carries the source's
    error)."""
    try:
        fault_point("flatten", comm.rank)
        flat = flatten(state, "sync", sds)
        layout = layout_of(state, flat)
        plan = transport.plan([flat.tensors[i] for i in layout.moving], comm)
        token = None if line.torn else uuid.uuid4().hex
        payload = Payload(
            skeleton=flat.skeleton,
            metas=layout.metas,
            plan=plan,
            token=token,
            torn=line.torn,
            tenure=src_tenure,
            layout=layout.digest,
            encoded=layout.encoded(),
        )
    except Exception as exc:
        msg = f"rank {src} could not flatten its state: {type(exc).__name__}: {exc}"
        return exc, _failed_payload(msg), None
    try:
        return (flat, layout), cloudpickle.dumps(payload), payload
    except Exception as exc:
        msg = (
            f"rank {src} cannot pickle {_unpicklable_fields(flat.skeleton)}; make the value "
            "picklable or mark the field elastic.local()"
        )
        return exc, _failed_payload(msg), None


def _exchange_objects(
    comm: Comm, src: int, data: bytes | None, built: Payload | None, op: str
) -> tuple[Payload, int]:
    """The source's payload on every rank (and its size), or the source's error raised on every rank."""
    raw = comm.broadcast_bytes(data, src, "objects")
    payload = built if built is not None else cloudpickle.loads(raw)
    if payload.error is not None:
        raise SyncError(f"{op} failed in phase 'objects': {payload.error}", phase="objects") from None
    return payload, len(raw)


def _receive(
    state: Any,
    comm: Comm,
    src: int,
    payload: Payload,
    own: tuple[Flat, Layout] | BaseException,
    transport: Transport,
    failures: _Failures,
) -> list[TensorMeta]:
    """A receiver's tensors: into its own tensors, in order, when its metadata equal the source's (the same
    layout digest), else in place where it has a matching tensor and allocated from the source's metadata
    otherwise; then the fields applied. Torn from the first byte written into its own state until commit.
    Returns the metadata of the tensors that moved.

    A receiver that cannot walk its state, decode the skeleton or place the tensors still takes part in
    every collective, receiving into scratch tensors (its state untouched, so not torn), and reports the
    failure at commit: every rank raises the same `SyncError` then, and the group's collectives stay in
    step."""
    alike = not isinstance(own, BaseException) and payload.layout == own[1].digest
    decoded: BaseException | None = None
    if alike:
        assert not isinstance(own, BaseException)
        metas, moving, moved = own[1].metas, own[1].moving, own[1].moving_metas
    else:
        try:
            metas = payload.metas_here()
        except Exception as exc:  # a path key that does not unpickle here: shapes and dtypes still do
            decoded, metas = exc, decode_metas(payload.encoded or b"", paths=False)
        moving = carriers(metas)
        moved = [metas[i] for i in moving]
    try:
        fault_point("decode", comm.rank)
        if isinstance(own, BaseException):
            raise own
        if decoded is not None:
            raise decoded
        flat = own[0]
        skeleton = payload.skeleton_here()
        if alike:
            targets, in_place = list(flat.originals), [True] * len(metas)
        else:
            targets, in_place = receive_targets(
                state, metas, "sync", lambda m: transport.device_for(m, comm), index=flat.index()
            )
    except Exception as exc:
        failures.add(exc)
        skeleton = None
        targets = [torch.empty(m.shape, dtype=m.dtype, device=transport.device_for(m, comm)) for m in metas]
        in_place = [False] * len(targets)
    if any(in_place[i] for i in moving):
        set_lineage(state, token=None, torn=True)
    transport.receive(comm, src, [targets[i] for i in moving], moved, payload.plan, failures.add)
    if failures.first is not None or skeleton is None:
        return moved
    set_lineage(state, token=None, torn=True)  # applying writes the state's fields
    try:
        fault_point("apply", comm.rank)
        with torch.no_grad():
            fill_aliases(targets, metas)
            apply_fields(state, skeleton, targets, in_place)
    except Exception as exc:
        failures.add(exc)
    return moved


def _commit(group: Collective, src: int, failures: _Failures, op: str) -> None:
    """Every rank learns whether every other rank succeeded; the first failure is raised everywhere."""

    def fail(rank: int, error: str) -> SyncError:
        where = "source" if rank == src else "receiver"
        msg = (
            f"{op} failed on rank {rank} ({where}): {error}. Receivers that were written are marked torn "
            "(tenure None) until their next successful sync or load; the source's state is unchanged"
        )
        return SyncError(msg, phase="apply" if rank != src else "send")

    raise_first(group.gather(failures.first, "commit"), fail, error_of=lambda e: e)


# -----------------------------------------------------------------------------------------------------------
# Public entry points


def sync(
    state: Any,
    *,
    group: Any = None,
    src: int | None = None,
    force: bool = False,
    timeout: timedelta | float | None = None,
) -> SyncReport:
    """Give every rank the most tenured state (collective: every rank of `group` calls it).

    One all-gather carries every rank's tenure, lineage token and schema digest; different schemas or
    incomparable tenures raise the same error on every rank before anything moves. The rank with the
    greatest tenure (ties to the lowest rank, None least) is elected unless `src` is given. When every
    rank reports the same tenure and lineage token (the replicas are already identical) nothing else
    moves (the fast path: ``tensor_bytes == 0``). Otherwise the source sends every non-tensor value in
    one cloudpickle payload, then the tensors without pickling: when every receiver runs on the source's
    host, each reads them straight from the source's memory (the default transport; through a
    shared-memory ring where reading another process is not permitted), else by gloo/NCCL broadcasts. A
    receiver tensor of the same shape, dtype and device is written in place (the optimizer's references
    to parameters stay valid); missing or differently shaped tensors are allocated from the source's
    metadata. Modules, optimizers and other stateful objects go through their state dicts. ``on_sync``
    runs on every rank afterwards.

    A sharded state (FSDP2, HSDP, DTensor fields; all on one device mesh spanning `group`) syncs by
    versions: the most tenured version held at every shard position wins; inside each replica set (the
    mesh's ``"replicate"`` dimension) whose members lag, its member holding that version sends its pieces
    into theirs by the same transports, in place; replica sets that agree move nothing. No complete
    version raises `SyncError` naming the missing positions, before anything moves.

    Without a process group, or with a world of one, it is a local no-op.

    Args:
        state: an instance of an ``@elastic_state`` class.
        group: the process group (None: the default group).
        src: the group rank to send from, overriding the election.
        force: send everything even when the replicas are already identical.
        timeout: bound of every collective of the call (seconds or ``timedelta``; None: the group's).

    Returns:
        What the sync did, the same on every rank except ``seconds``.

    Raises:
        StateMismatchError: the ranks hold different schemas (class, fields, kinds, module shapes).
        TenureError: a tenure raised, is NaN, or cannot be compared with the others.
        SyncError: a rank died, raised, timed out or never called, or a value cannot be sent (named with
            the field and the fix); receivers that may be half-written are marked torn, the source is
            unchanged.
        ElasticError: no process group, but ``WORLD_SIZE`` > 1 says this is one rank of several.
        TypeError: `state` is not an instance of an ``@elastic_state`` class.
    """
    return run_sync(state, group=group, src=src, force=force, timeout=timeout)


@attached("sync")
def sync_method(
    self: Any,
    *,
    group: Any = None,
    src: int | None = None,
    force: bool = False,
    timeout: timedelta | float | None = None,
) -> SyncReport:
    """Give every rank the most tenured state (collective); see `elastic.sync`."""
    return run_sync(self, group=group, src=src, force=force, timeout=timeout)


def broadcast_state(
    state: Any, src: int, *, group: Any = None, timeout: timedelta | float | None = None
) -> SyncReport:
    """Broadcast `state` from group rank `src` to every rank (collective), whatever the tenures.

    The same as ``sync(state, src=src, force=True)``: no election, every byte moves.

    Args:
        state: an instance of an ``@elastic_state`` class.
        src: the group rank to send from.
        group: the process group (None: the default group).
        timeout: bound of every collective (seconds or ``timedelta``).

    Returns:
        What the transfer did.

    Raises:
        StateMismatchError: the ranks hold different schemas.
        SyncError: a rank died, raised, timed out or never called.
        TypeError: `state` is not an instance of an ``@elastic_state`` class.
    """
    return run_sync(state, group=group, src=src, force=True, timeout=timeout, op="broadcast_state")


def most_tenured_rank(state: Any, *, group: Any = None, timeout: timedelta | float | None = None) -> int:
    """The group rank holding the most tenured state (collective). Moves no state.

    Args:
        state: an instance of an ``@elastic_state`` class.
        group: the process group (None: the default group).
        timeout: bound of the one all-gather (seconds or ``timedelta``).

    Returns:
        The rank whose tenure is greatest (lowest rank in ties; torn states count as None); 0 without a
        process group.

    Raises:
        TenureError: a tenure raised, is NaN, or cannot be compared.
        SyncError: a rank died, timed out or never called.
        TypeError: `state` is not an instance of an ``@elastic_state`` class.
    """
    op = "most_tenured_rank"
    config = config_of(state, f"elastic.{op}()")
    collective = Collective.of(group, as_timedelta(timeout, op), op)
    if collective.solo:
        return 0
    record = _local_record(state, config, lineage(state), None, with_schema=False)
    return elect([r.tenure for r in _elect_records(collective, record, op)], op)
