"""Election and sync: agree on the most tenured state and broadcast it to every rank."""

from __future__ import annotations

import logging
import math
import time
import uuid
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import attrs
import cloudpickle
import torch

from ._comm import Comm, fault_point, ranks_str
from ._decorator import StateConfig, as_timedelta, config_of, lineage, set_lineage
from ._errors import StateMismatchError, SyncError, TenureError
from ._transport import is_direct, receive_tensors, send_tensors
from ._tree import (
    Flat,
    StateNode,
    TensorMeta,
    apply_fields,
    carriers,
    compatible,
    digests_of,
    fill_aliases,
    flatten,
    receive_targets,
    schema_from,
    schema_of,
    tensor_index,
)

__all__ = [
    "SyncReport",
    "broadcast_state",
    "elect",
    "most_tenured_rank",
    "sync",
    "sync_method",
    "tenure",
]

log = logging.getLogger("elastic")


@attrs.frozen
class SyncReport:
    """What one `sync` did: who sent, at which tenure, to how many ranks, how many bytes, how long."""

    src: int
    tenure: Any
    world_size: int
    tensor_bytes: int
    object_bytes: int
    seconds: float


def tenure(state: Any) -> Any:
    """The tenure of `state` on this rank (local): `None` for a torn state."""
    config = config_of(state, "elastic.tenure()")
    if lineage(state).torn:
        return None
    return config.tenure(state)


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


def _has_nan(value: Any) -> bool:
    if isinstance(value, float):
        return math.isnan(value)
    if isinstance(value, tuple):
        return any(_has_nan(v) for v in value)
    try:
        return bool(value != value)
    except Exception:
        return False


def _local_record(state: Any, config: StateConfig, src: int | None, rank: int, with_schema: bool) -> Record:
    return _scan(state, config, src, with_schema)[0]


def _scan(state: Any, config: StateConfig, src: int | None, with_schema: bool) -> tuple[Record, Flat | None]:
    """This rank's election record and, with the schema, the flattened state it was computed from: one
    walk of the state serves the schema, the source's tensors and the receiver's targets."""
    line = lineage(state)
    try:
        value = None if line.torn else config.tenure(state)
    except Exception as exc:
        return Record(error=("tenure", f"tenure function raised {type(exc).__name__}: {exc}"), src=src), None
    schema = None
    flat = None
    if with_schema:
        try:
            flat = flatten(state, "sync")
            schema = digests_of(schema_from(flat))
        except Exception as exc:
            return Record(error=("prepare", f"{type(exc).__name__}: {exc}"), src=src), None
    try:
        cloudpickle.dumps(value)
    except Exception as exc:
        return Record(error=("tenure", f"tenure value {value!r} cannot be pickled: {exc}"), src=src), None
    return Record(tenure=value, torn=line.torn, token=line.token, schema=schema, src=src), flat


def _gather_records(comm: Comm, record: Record, phase: str) -> list[Record]:
    rows = comm.all_gather_bytes(cloudpickle.dumps(record), phase)
    return [cloudpickle.loads(r) for r in rows]


def _check_errors(records: Sequence[Record], op: str) -> None:
    for rank, rec in enumerate(records):
        if rec.error is None:
            continue
        kind, text = rec.error
        if kind == "tenure":
            msg = (
                f"{op}: on rank {rank} the {text}; fix the tenure callable so that it returns an "
                "orderable value or None"
            )
            raise TenureError(msg) from None
        msg = f"{op}: rank {rank} could not prepare its state: {text}"
        raise SyncError(msg, phase="prepare") from None


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


def _check_schemas(comm: Comm, records: Sequence[Record], state: Any, op: str) -> None:
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
        mine: Any = schema_of(state)
    except Exception as exc:  # still take part: the others are already in the all-gather
        mine = (f"<schema failed: {type(exc).__name__}: {exc}>", ())
    full = [cloudpickle.loads(r) for r in comm.all_gather_bytes(cloudpickle.dumps(mine), "schema")]
    raise StateMismatchError(_mismatch_message(full, op)) from None


def _describe(schema: Any) -> str:
    if schema[0] == "module":
        return f"module with {len(schema[1])} tensors"
    if schema[0] == "state":
        return f"nested state {schema[1][0]}"
    if schema[0] == "stateful":
        return f"stateful {schema[1]}"
    if schema[0] == "optimizer":
        groups = ", ".join(f"{n} params with {'/'.join(h)}" for n, h in schema[2])
        return f"{schema[1]} optimizer with {len(schema[2])} param group(s) [{groups}]"
    if schema[0] == "rng":
        return f"{schema[1]} generator"
    return str(schema[0])


def _mismatch_message(full: Sequence[Any], op: str) -> str:
    lines = [f"{op}: the ranks hold states of different schemas; nothing was moved."]
    classes: dict[str, list[int]] = {}
    for rank, (qualname, _) in enumerate(full):
        classes.setdefault(qualname, []).append(rank)
    if len(classes) > 1:
        lines.append("  class: " + "; ".join(f"{q} on {ranks_str(rs)}" for q, rs in classes.items()))
    names: list[str] = []
    for _, fields in full:
        names.extend(n for n, _ in fields if n not in names)
    for name in names:
        per_rank: list[Any] = [dict(fields).get(name) for _, fields in full]
        groups: dict[str, list[int]] = {}
        for rank, sch in enumerate(per_rank):
            groups.setdefault("missing" if sch is None else repr(sch), []).append(rank)
        if len(groups) <= 1:
            continue
        kinds = {sch[0] for sch in per_rank if sch is not None}
        if all(sch is not None for sch in per_rank) and len(kinds) == 1 and "module" in kinds:
            lines.append(f"  field {name!r}: " + _module_diff([sch[1] for sch in per_rank]))
            continue
        if all(sch is not None for sch in per_rank) and "none" in kinds and len(kinds) == 2:
            continue  # None on some ranks is compatible with a buildable kind
        desc = "; ".join(
            f"{'missing' if per_rank[rs[0]] is None else _describe(per_rank[rs[0]])} on {ranks_str(rs)}"
            for rs in groups.values()
        )
        lines.append(f"  field {name!r}: {desc}")
    lines.append(
        "Every rank must build the same state class with the same fields and module shapes; "
        "construct the model identically everywhere (sizes from the config, not from the rank)."
    )
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


def elect(tenures: Sequence[Any], op: str = "sync") -> int:
    """The rank of the maximum tenure (`None` least, ties to the lowest rank), or `TenureError`."""
    nan = [r for r, t in enumerate(tenures) if t is not None and _has_nan(t)]
    if nan:
        msg = (
            f"{op}: tenure is NaN on {ranks_str(nan)} ({tenures[nan[0]]!r}); NaN cannot be ordered. "
            "Return a number, string or tuple that grows as training advances (the step, for instance)"
        )
        raise TenureError(msg) from None
    best = 0
    for rank in range(1, len(tenures)):
        a, b = tenures[best], tenures[rank]
        if b is None:
            continue
        if a is None:
            best = rank
            continue
        if type(a) is not type(b) and not (_is_number(a) and _is_number(b)):
            raise _incomparable(op, best, a, rank, b)
        try:
            if b > a:
                best = rank
        except TypeError:
            raise _incomparable(op, best, a, rank, b) from None
    return best


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _incomparable(op: str, r1: int, a: Any, r2: int, b: Any) -> TenureError:
    msg = (
        f"{op}: tenures cannot be compared: rank {r1} has {a!r} ({type(a).__name__}) and rank {r2} has "
        f"{b!r} ({type(b).__name__}); the tenure callable must return values of one orderable type "
        "on every rank"
    )
    return TenureError(msg)


# -----------------------------------------------------------------------------------------------------------
# Sync


@attrs.frozen
class Payload:
    """What the source broadcasts as one cloudpickle object."""

    skeleton: StateNode | None
    metas: list[TensorMeta]
    direct: list[bool]
    token: str | None
    torn: bool
    tenure: Any
    error: str | None = None

    def __reduce__(self) -> tuple[Any, ...]:
        # Metadata as columns of plain values: pickles ~20x faster than one object per tensor.
        m = self.metas
        columns = (
            tuple(x.path for x in m),
            tuple(x.shape for x in m),
            tuple(x.dtype for x in m),
            tuple(x.device_type for x in m),
            tuple(x.stride for x in m),
            tuple(x.requires_grad for x in m),
            tuple(x.alias for x in m),
            tuple(x.offset for x in m),
        )
        return (
            _payload,
            (self.skeleton, columns, self.direct, self.token, self.torn, self.tenure, self.error),
        )


def _payload(
    skeleton: Any, columns: Any, direct: Any, token: Any, torn: Any, tenure: Any, error: Any
) -> Payload:
    metas = [TensorMeta(*row) for row in zip(*columns)] if columns[0] else []
    return Payload(skeleton, metas, direct, token, torn, tenure, error)


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
    children: list[Any] = []
    if isinstance(node, StateNode):
        children = list(node.fields.values())
    elif hasattr(node, "children"):
        children = list(node.children)
    elif hasattr(node, "inner"):
        children = [node.inner]
    for child in children:
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
) -> SyncReport:
    """`sync` with the name of the calling operation for messages (used by `load` too)."""
    # Tensors allocated or cached here must be ordinary tensors, also when the caller is under
    # torch.inference_mode() (an inference tensor fails at the next optimizer.step()).
    with torch.inference_mode(False):
        return _run_sync(state, group, src, force, timeout, op, notify)


def _run_sync(
    state: Any,
    group: Any,
    src: int | None,
    force: bool,
    timeout: timedelta | float | None,
    op: str,
    notify: bool,
) -> SyncReport:
    config = config_of(state, f"elastic.{op}()")
    deadline = as_timedelta(timeout, op)
    started = time.perf_counter()
    comm = Comm.of(group, deadline, op)
    if comm is None:
        report = SyncReport(
            src=0, tenure=tenure(state), world_size=1, tensor_bytes=0, object_bytes=0, seconds=0.0
        )
        if notify and config.on_sync is not None:
            config.on_sync(state, report)
        return report

    world = comm.world_size
    mine, scanned = _scan(state, config, src, with_schema=True)
    records = _gather_records(comm, mine, "elect")
    _check_errors(records, op)
    given = _check_src(records, world, op)
    _check_schemas(comm, records, state, op)
    tenures = [rec.tenure for rec in records]
    elected = elect(tenures, op)
    tokens = {rec.token for rec in records}
    if (
        not force
        and len(tokens) == 1
        and None not in tokens
        and not any(rec.torn for rec in records)
        and all(t == tenures[0] for t in tenures)
    ):
        report = SyncReport(
            src=elected if given is None else given,
            tenure=tenures[elected],
            world_size=world,
            tensor_bytes=0,
            object_bytes=0,
            seconds=time.perf_counter() - started,
        )
        log.debug("%s: replicas already identical (tenure %r, lineage %s)", op, tenures[0], records[0].token)
        _finish(state, config, report, op, notify)
        return report
    source = elected if given is None else given
    report = _transfer(state, comm, source, records, op, started, scanned)
    _finish(state, config, report, op, notify)
    return report


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


def _transfer(
    state: Any,
    comm: Comm,
    src: int,
    records: Sequence[Record],
    op: str,
    started: float,
    scanned: Flat | None = None,
) -> SyncReport:
    rank = comm.rank
    errors: list[str] = []

    def on_error(exc: BaseException) -> None:
        errors.append(f"{type(exc).__name__}: {exc}")

    # Objects: the skeleton, tensor metadata and the new lineage, in one cloudpickle payload.
    flat: Flat | None = None
    data: bytes | None = None
    built: Payload | None = None
    if rank == src:
        try:
            fault_point("flatten", rank)
            flat = scanned if scanned is not None else flatten(state, "sync")
            direct = [is_direct(t, comm.device) for t in flat.tensors]
            line = lineage(state)
            token = None if line.torn else uuid.uuid4().hex
            payload = Payload(flat.skeleton, flat.metas, direct, token, line.torn, records[src].tenure)
            try:
                data = cloudpickle.dumps(payload)
                built = payload
            except Exception:
                msg = (
                    f"rank {src} cannot pickle {_unpicklable_fields(flat.skeleton)}; make the value "
                    "picklable or mark the field elastic.local()"
                )
                data = cloudpickle.dumps(Payload(None, [], [], None, False, None, error=msg))
        except Exception as exc:
            msg = f"rank {src} could not flatten its state: {type(exc).__name__}: {exc}"
            data = cloudpickle.dumps(Payload(None, [], [], None, False, None, error=msg))
    index: dict[Any, torch.Tensor] | None = None
    index_error: BaseException | None = None
    if rank != src:  # walk our own tree while the source flattens and pickles
        try:
            index = scanned.index() if scanned is not None else tensor_index(state, "sync")
        except Exception as exc:
            index_error = exc
    raw = comm.broadcast_bytes(data, src, "objects")
    payload = built if built is not None else cloudpickle.loads(raw)
    if payload.error is not None:
        raise SyncError(f"{op} failed in phase 'objects': {payload.error}", phase="objects") from None
    moving = carriers(payload.metas)  # tensors sharing storage with another travel once
    tensor_bytes = sum(payload.metas[i].nbytes for i in moving)
    sent_metas = [payload.metas[i] for i in moving]
    sent_direct = [payload.direct[i] for i in moving]

    # Tensors: in place where the receiver has a matching tensor, allocated from the metadata otherwise.
    if rank == src:
        assert flat is not None
        send_tensors(comm, src, [flat.tensors[i] for i in moving], sent_direct, sent_metas, on_error)
    else:
        try:
            if index_error is not None:
                raise index_error
            targets, in_place = receive_targets(
                state, payload.metas, "sync", lambda m: _device_for(m, comm), index=index
            )
        except Exception as exc:
            on_error(exc)
            targets = [
                torch.empty(m.shape, dtype=m.dtype, device=_device_for(m, comm)) for m in payload.metas
            ]
            in_place = [False] * len(targets)
        set_lineage(state, token=None, torn=True)  # from the first byte written until commit
        receive_tensors(comm, src, [targets[i] for i in moving], sent_direct, sent_metas, on_error)
        if not errors:
            try:
                fault_point("apply", rank)
                assert payload.skeleton is not None
                with torch.no_grad(), torch.inference_mode(False):
                    fill_aliases(targets, payload.metas)
                    apply_fields(state, payload.skeleton, targets, in_place)
            except Exception as exc:
                on_error(exc)

    # Commit: every rank learns whether every other rank succeeded.
    status = cloudpickle.dumps(errors[0] if errors else None)
    outcomes = [cloudpickle.loads(r) for r in comm.all_gather_bytes(status, "commit")]
    failed = [(r, e) for r, e in enumerate(outcomes) if e is not None]
    if failed:
        r, e = failed[0]
        where = "source" if r == src else "receiver"
        msg = (
            f"{op} failed on rank {r} ({where}): {e}. The receivers are marked torn (tenure None) until "
            "their next successful sync or load; the source's state is unchanged"
        )
        raise SyncError(msg, phase="apply" if r != src else "send") from None
    set_lineage(state, token=payload.token, torn=payload.torn)
    return SyncReport(
        src=src,
        tenure=payload.tenure,
        world_size=comm.world_size,
        tensor_bytes=tensor_bytes,
        object_bytes=len(raw),
        seconds=time.perf_counter() - started,
    )


def _device_for(meta: TensorMeta, comm: Comm) -> torch.device:
    if meta.device_type == "cuda" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    if meta.device_type == comm.device.type:
        return comm.device
    return torch.device("cpu")


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

    Elects the rank with the greatest `tenure(state)` (ties to the lowest rank, `None` least) unless `src`
    is given, then broadcasts its synced fields: tensors in place by `torch.distributed.broadcast`,
    everything else in one cloudpickle payload. When every rank already holds the same lineage and tenure
    nothing moves (`tensor_bytes == 0`); `force=True` broadcasts anyway. `timeout` (a `timedelta` or
    seconds) bounds every collective. Raises `StateMismatchError`, `TenureError` or `SyncError` on every
    rank. Without a process group, or with one rank, it is a local no-op.
    """
    return run_sync(state, group=group, src=src, force=force, timeout=timeout)


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
    """Broadcast `state` from group rank `src` to every rank (collective), whatever the tenures."""
    return run_sync(state, group=group, src=src, force=True, timeout=timeout, op="broadcast_state")


def most_tenured_rank(state: Any, *, group: Any = None, timeout: timedelta | float | None = None) -> int:
    """The group rank holding the most tenured state (collective; lowest rank in ties). Moves no state."""
    config = config_of(state, "elastic.most_tenured_rank()")
    comm = Comm.of(group, as_timedelta(timeout, "most_tenured_rank"), "most_tenured_rank")
    if comm is None:
        return 0
    rec = _local_record(state, config, None, comm.rank, with_schema=False)
    records = _gather_records(comm, rec, "elect")
    _check_errors(records, "most_tenured_rank")
    return elect([r.tenure for r in records], "most_tenured_rank")
