"""Checkpoints: collective `save` and `load`, the async save handle, and the `Stateful` protocol methods.

`save` elects the writer (the most tenured rank, lowest in ties; one per node with ``scope="node"``), which
writes the checkpoint through the root's storage (`_locate`: a local directory, written into a temporary
directory, fsynced and renamed into place; or an fsspec URL, data objects first and the manifest last); the
other ranks wait in one small all-gather that tells everyone the path or the writer's error.

`load` lets every rank look at the manifests it can see, all-gathers (memory tenure, checkpoints), and
either has one rank read, verify and apply the best checkpoint and then broadcasts it with the core sync,
or syncs the most tenured in-memory state. A reader that finds corruption tells the group, and the
election is run again among the remaining candidates.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal, overload

import attrs
import cloudpickle
import torch

from elastic._util.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    TenureError,
    UntrustedCheckpointError,
)
from elastic._util.timeouts import as_timedelta
from elastic.checkpoint import read as _r
from elastic.checkpoint import write as _w
from elastic.checkpoint.manifest import (
    InvalidCheckpoint,
    is_checkpoint_dir,
    scan,
    skipped,
    validate,
)
from elastic.checkpoint.storage.base import Storage
from elastic.checkpoint.storage.local import LOCAL
from elastic.checkpoint.storage.locate import locate
from elastic.replication.collective import Collective
from elastic.replication.sync import sync_in
from elastic.state.config import StateConfig, attached, config_of, saved_fields
from elastic.state.lineage import lineage
from elastic.state.nodes import STRUCTURED, Kind, kind_of
from elastic.state.tenure import Incomparable, as_saveable, check_saveable, current, elect, exceeds, greater

__all__ = [
    "LoadReport",
    "SaveHandle",
    "load",
    "load_method",
    "load_state_dict_method",
    "save",
    "save_method",
    "state_dict_method",
]

log = logging.getLogger("elastic")

Scope = Literal["global", "node", "rank"]


@attrs.frozen
class LoadReport:
    """What one `load` did.

    `source` is ``"checkpoint"`` when a checkpoint was read (by rank `src`, from `path`, written by a
    group of `saved_world_size` ranks) or ``"memory"`` when the most tenured in-memory state (rank `src`)
    won and was synced. `tenure` is the tenure every rank now holds; `world_size` is this group's size.
    """

    source: Literal["checkpoint", "memory"]
    src: int
    tenure: Any
    path: Path | str | None
    world_size: int
    saved_world_size: int | None = None


def _check_bool(value: Any, name: str, op: str) -> None:
    if not isinstance(value, bool):
        msg = f"{op}({name}=...) must be True or False, got {value!r}"
        raise TypeError(msg) from None


def _node_id() -> str:
    """torchrun's GROUP_RANK (one agent = one node) where set, else the hostname."""
    group_rank = os.environ.get("GROUP_RANK")
    return f"group-rank {group_rank}" if group_rank not in (None, "") else f"host {socket.gethostname()}"


# ---------------------------------------------------------------------------------------------------------
# save


@attrs.frozen
class _SaveRecord:
    tenure: Any = None
    node: str = ""
    error: str | None = None


def _save_record(state: Any, config: StateConfig, scope: str) -> _SaveRecord:
    node = _node_id() if scope == "node" else ""
    line = lineage(state)
    if line.torn:
        return _SaveRecord(tenure=None, node=node)
    try:
        value = current(state, config, line)
        cloudpickle.dumps(value)
    except Exception as exc:
        return _SaveRecord(node=node, error=f"{type(exc).__name__}: {exc}")
    return _SaveRecord(tenure=value, node=node)


def _save_failure(rank: int, error: str) -> TenureError:
    msg = f"save: on rank {rank} the tenure callable failed ({error}); fix it to return an orderable value"
    return TenureError(msg)


def _conclude(
    outcomes: Sequence[_w.Outcome | None], mine: int, world: int, storage: Storage = LOCAL
) -> Path | str:
    failed = [o for o in outcomes if o is not None and o.error is not None]
    if failed:
        parts = []
        for o in failed:
            who = "" if world == 1 else f" on rank {o.rank} (the writer)"
            parts.append(f"writing the checkpoint under {o.root}{who} failed: {o.error}")
        msg = "save: " + "; ".join(parts) + ". No checkpoint was published by the failing writer"
        raise CheckpointError(msg) from None
    outcome = outcomes[mine]
    if outcome is None or outcome.path is None:  # cannot happen: every writer reports
        msg = f"save: rank {mine} (the writer) reported no result"
        raise CheckpointError(msg) from None
    return storage.result(outcome.path)


class SaveHandle:
    """What `save(..., blocking=False)` returns: the checkpoint is being written in a background thread.

    `wait()` is collective (every rank calls it): it returns the checkpoint's path on every rank once it
    is durable, or raises the writer's error as `CheckpointError` on every rank. `done()` says, locally,
    whether this rank's part is finished. The next `save` waits for this one first.
    """

    def __init__(
        self,
        group: Collective,
        mine: int,
        job: _w.Job | None,
        error: _w.Outcome | None,
        storage: Storage = LOCAL,
    ) -> None:
        self._group = group
        self._storage = storage
        self._mine = mine
        self._outcome: _w.Outcome | None = error
        self._lock = threading.Lock()
        self._result: Path | str | CheckpointError | None = None
        self._thread: threading.Thread | None = None
        if job is not None:
            self._thread = threading.Thread(target=self._work, args=(job,), name="elastic-save", daemon=False)
            self._thread.start()

    def _work(self, job: _w.Job) -> None:
        self._outcome = _w.run_job(job)
        if self._outcome.error is not None:
            log.error("save: background write failed: %s", self._outcome.error)

    def done(self) -> bool:
        """Whether this rank's part of the save has finished (local; does not raise)."""
        return self._thread is None or not self._thread.is_alive()

    def wait(self) -> Path | str:
        """The path once the checkpoint is durable, or the writer's error, on every rank (collective)."""
        global _inflight
        with self._lock:
            if self._result is None:
                if self._thread is not None:
                    self._thread.join()
                try:
                    outcomes = self._group.gather(self._outcome, "save-commit")
                    self._result = _conclude(outcomes, self._mine, self._group.world, self._storage)
                except CheckpointError as exc:
                    self._result = exc
                finally:
                    with _inflight_lock:
                        if _inflight is self:
                            _inflight = None
            if isinstance(self._result, CheckpointError):
                raise self._result
            return self._result

    def __repr__(self) -> str:
        state = "done" if self.done() else "writing"
        return f"<elastic.SaveHandle {state}>"


_inflight_lock = threading.Lock()
_inflight: SaveHandle | None = None


def _settle_inflight() -> None:
    """Finish the previous async save (collectively) before anything else is saved or staged."""
    with _inflight_lock:
        previous = _inflight
    if previous is not None:
        try:
            previous.wait()
        except CheckpointError as exc:
            msg = f"the previous save(blocking=False) failed: {exc}"
            raise CheckpointError(msg) from None


@overload
def save(
    state: Any,
    path: str | os.PathLike[str],
    *,
    group: Any = ...,
    keep: int | None = ...,
    blocking: Literal[True] = ...,
    scope: Scope = ...,
    timeout: timedelta | float | None = ...,
    storage_options: dict[str, Any] | None = ...,
) -> Path | str: ...


@overload
def save(
    state: Any,
    path: str | os.PathLike[str],
    *,
    group: Any = ...,
    keep: int | None = ...,
    blocking: Literal[False],
    scope: Scope = ...,
    timeout: timedelta | float | None = ...,
    storage_options: dict[str, Any] | None = ...,
) -> SaveHandle: ...


@overload
def save(
    state: Any,
    path: str | os.PathLike[str],
    *,
    group: Any = ...,
    keep: int | None = ...,
    blocking: bool = ...,
    scope: Scope = ...,
    timeout: timedelta | float | None = ...,
    storage_options: dict[str, Any] | None = ...,
) -> Path | str | SaveHandle: ...


def save(
    state: Any,
    path: str | os.PathLike[str],
    *,
    group: Any = None,
    keep: int | None = 3,
    blocking: bool = True,
    scope: Scope = "global",
    timeout: timedelta | float | None = None,
    storage_options: dict[str, Any] | None = None,
) -> Path | str | SaveHandle:
    """Write a checkpoint of the most tenured state under the root `path` (collective).

    The most tenured rank (lowest in ties) writes; with ``scope="rank"`` every rank writes its own copy to
    its own `path` (one disk per worker); with ``scope="node"`` the most tenured rank of every
    node writes to its own `path` (node-local disks; a node is torchrun's ``GROUP_RANK``, else the host),
    after a sync if some node lags behind. The checkpoint is written into a temporary directory inside
    `path`, fsynced and renamed into place, so no reader ever sees it half-written; then only the `keep`
    most tenured checkpoints are kept (``keep=None`` keeps all; the new one is never deleted).

    Returns the checkpoint's directory on every rank once it is durable (with ``scope="node"``, the one
    this rank's node wrote). With ``blocking=False`` it returns a `SaveHandle` right after copying the
    tensors to CPU; ``handle.wait()`` (collective) returns the path or raises the writer's error.
    `timeout` (seconds or `timedelta`) bounds every collective, including the wait for the writer.
    A writer's failure raises `CheckpointError` on every rank. Fields with ``save=False`` are not written.

    `path` may be an fsspec URL (``s3://bucket/prefix``, ``gs://``, ``az://``, ``memory://``; needs the
    ``elastic-state[remote]`` extra), with `storage_options` passed to fsspec: the data objects are uploaded
    first and the manifest last, and the checkpoint's URL is returned as a string.
    """
    config = config_of(state, "elastic.save()")
    storage, root = locate(path, storage_options, "save")
    _check_save_options(keep, blocking, scope)
    deadline = as_timedelta(timeout, "save")
    _settle_inflight()
    g = Collective.of(group, deadline, "save")
    records = g.gather_checked(_save_record(state, config, scope), "save-elect", _save_failure)
    tenures = [rec.tenure for rec in records]
    best = elect(tenures, "save")
    top = _saveable_top(tenures[best])
    mine, writers = _writers(state, config, g, scope, records, best)
    job, failure = _prepare_write(state, g, storage, root, keep, top, writers, stage=not blocking)
    if blocking:
        outcome = _w.run_job(job) if job is not None else failure
        return _conclude(g.gather(outcome, "save-commit"), mine, g.world, storage)
    return _write_in_background(g, mine, job, failure, storage)


def _check_save_options(keep: Any, blocking: Any, scope: Any) -> None:
    if keep is not None and (not isinstance(keep, int) or isinstance(keep, bool) or keep < 1):
        msg = f"save(keep=...) must be a positive int (or None to keep every checkpoint), got {keep!r}"
        raise ValueError(msg) from None
    _check_bool(blocking, "blocking", "save")
    if scope not in ("global", "node", "rank"):
        msg = f"save(scope=...) must be 'global', 'node' or 'rank', got {scope!r}"
        raise ValueError(msg) from None


def _saveable_top(top: Any) -> Any:
    """The elected tenure, if there is a state to save and a manifest can hold its tenure."""
    if top is None:
        msg = (
            "save: no rank holds a state to save: every tenure is None (fresh states, or torn by a failed "
            "sync). Load or train first, or make the tenure callable return a value"
        )
        raise CheckpointError(msg) from None
    top = as_saveable(top)  # a numpy integer step saves as an int
    check_saveable(top)
    return top


def _writers(
    state: Any, config: StateConfig, g: Collective, scope: str, records: Sequence[_SaveRecord], best: int
) -> tuple[int, set[int]]:
    """The rank whose checkpoint this rank reports, and every writing rank.

    ``global``: the most tenured rank. ``node``/``rank``: the most tenured rank of each node (each rank),
    after a sync when some node is behind (then the lowest rank of each node writes)."""
    if scope == "global":
        return best, {best}
    tenures = [rec.tenure for rec in records]
    nodes = [rec.node for rec in records] if scope == "node" else [str(r) for r in range(g.world)]
    members: dict[str, list[int]] = {}
    for rank, node in enumerate(nodes):
        members.setdefault(node, []).append(rank)
    leaders = {node: rs[elect([tenures[r] for r in rs], "save")] for node, rs in members.items()}
    top = tenures[best]
    behind = [n for n, r in leaders.items() if exceeds(top, tenures[r], f"rank {best}", f"rank {r}", "save")]
    if behind:
        log.info("save: %s behind the most tenured state; syncing before the node-local save", behind)
        sync_in(state, config, g, op="save")
        leaders = {node: min(rs) for node, rs in members.items()}
    return leaders[nodes[g.rank]], set(leaders.values())


def _prepare_write(
    state: Any,
    g: Collective,
    storage: Storage,
    root: Any,
    keep: int | None,
    top: Any,
    writers: set[int],
    stage: bool,
) -> tuple[_w.Job | None, _w.Outcome | None]:
    """A writer's job (tensors staged to CPU when `stage`), or the outcome saying why it has none."""
    if g.rank not in writers:
        return None, None
    try:
        return _w.prepare(state, root, keep, g.rank, g.world, top, stage=stage, storage=storage), None
    except Exception as exc:
        return None, _w.Outcome(rank=g.rank, error=_w.explain(exc), root=str(root))


def _write_in_background(
    g: Collective, mine: int, job: _w.Job | None, failure: _w.Outcome | None, storage: Storage
) -> SaveHandle:
    global _inflight
    handle = SaveHandle(g, mine, job, failure, storage)
    with _inflight_lock:
        _inflight = handle
    return handle


@attached("save")
def save_method(
    self: Any,
    path: str | os.PathLike[str],
    *,
    group: Any = None,
    keep: int | None = 3,
    blocking: bool = True,
    scope: Scope = "global",
    timeout: timedelta | float | None = None,
    storage_options: dict[str, Any] | None = None,
) -> Path | str | SaveHandle:
    """Write a checkpoint of the most tenured state under `path` (collective); see `elastic.save`."""
    return save(
        self,
        path,
        group=group,
        keep=keep,
        blocking=blocking,
        scope=scope,
        timeout=timeout,
        storage_options=storage_options,
    )


# ---------------------------------------------------------------------------------------------------------
# load


@attrs.frozen
class _Seen:
    """A checkpoint as the other ranks learn of it (no manifest)."""

    tenure: Any
    created_ns: int
    path: str
    world_size: int


@attrs.frozen
class _LoadRecord:
    tenure: Any = None
    seen: tuple[_Seen, ...] = ()
    single: bool = False
    corrupt: tuple[str, ...] = ()
    error: tuple[str, str] | None = None


def _load_record(state: Any, config: StateConfig, root: Any, storage: Storage = LOCAL) -> _LoadRecord:
    try:
        value = current(state, config, lineage(state))
        cloudpickle.dumps(value)
    except Exception as exc:
        return _LoadRecord(error=("tenure", f"{type(exc).__name__}: {exc}"))
    try:
        if is_checkpoint_dir(root, storage):
            try:
                c = validate(root, storage)
            except InvalidCheckpoint as exc:
                skipped("load", str(exc))
                return _LoadRecord(tenure=value, single=True, corrupt=(str(exc),))
            seen: tuple[_Seen, ...] = (_Seen(c.tenure, c.created_ns, str(c.path), c.world_size),)
            return _LoadRecord(tenure=value, seen=seen, single=True)
        found = scan(root, op="load", storage=storage)
    except Exception as exc:
        text = storage.explain(exc) or f"{type(exc).__name__}: {exc}"
        return _LoadRecord(tenure=value, error=("scan", f"cannot list {root}: {text}"))
    return _LoadRecord(
        tenure=value, seen=tuple(_Seen(c.tenure, c.created_ns, str(c.path), c.world_size) for c in found)
    )


def _best_candidate(records: Sequence[_LoadRecord], excluded: set[tuple[int, int]]) -> tuple[int, int] | None:
    best: tuple[int, int] | None = None
    for rank, rec in enumerate(records):
        for i, seen in enumerate(rec.seen):
            if (rank, i) in excluded:
                continue
            if best is None:
                best = (rank, i)
                continue
            cur = records[best[0]].seen[best[1]]
            if exceeds(seen.tenure, cur.tenure, seen.path, cur.path, "load"):
                best = (rank, i)
    return best


def _scan_failure(world: int) -> Callable[[int, tuple[str, str]], CheckpointError | TenureError]:
    def fail(rank: int, error: tuple[str, str]) -> CheckpointError | TenureError:
        kind, text = error
        where = "" if world == 1 else f" on rank {rank}"
        if kind == "tenure":
            msg = (
                f"load: the tenure callable failed{where} ({text}); make it return an orderable value or None"
            )
            return TenureError(msg)
        return CheckpointError(f"load: {text}{where}")

    return fail


class _Search:
    """Load's search for the checkpoint to read: the most tenured one left, while it beats memory."""

    def __init__(self, records: Sequence[_LoadRecord]) -> None:
        self.records = records
        self.memory = [rec.tenure for rec in records]
        self.mem_best = elect(self.memory, "load")
        self.corrupt = [c for rec in records for c in rec.corrupt]
        self.excluded: set[tuple[int, int]] = set()

    def seen(self, choice: tuple[int, int]) -> _Seen:
        return self.records[choice[0]].seen[choice[1]]

    def next(self) -> tuple[int, int] | None:
        """(reader, index) of the best remaining checkpoint if it is strictly more tenured than every
        in-memory state, else `None` (then memory wins)."""
        choice = _best_candidate(self.records, self.excluded)
        if choice is None:
            return None
        seen, mem = self.seen(choice), self.mem_best
        if not exceeds(
            seen.tenure, self.memory[mem], f"checkpoint {seen.path}", f"rank {mem}'s state", "load"
        ):
            return None
        return choice

    def expendable(self, choice: tuple[int, int]) -> bool:
        return _expendable(self.records, self.memory, choice[0], choice, self.excluded)

    def lost_memory(self, reader: int) -> None:
        """The reader's own state is gone (torn): it can no longer win the election."""
        self.memory[reader] = None
        self.mem_best = elect(self.memory, "load")

    def skip(self, choice: tuple[int, int], message: str) -> None:
        """The checkpoint is corrupt: never choose it again (and report it if it was named alone)."""
        self.excluded.add(choice)
        if self.records[choice[0]].single:
            self.corrupt.append(message)


def load(
    state: Any,
    path: str | os.PathLike[str],
    *,
    group: Any = None,
    trusted: bool = False,
    strict: bool = True,
    timeout: timedelta | float | None = None,
    storage_options: dict[str, Any] | None = None,
) -> LoadReport:
    """Restore the most tenured state in the group, from memory or from a checkpoint in `path` (collective).

    Every rank reports its in-memory tenure and the checkpoints it sees under `path` (a root of
    checkpoints, or one checkpoint directory). If a checkpoint is strictly more tenured than every
    in-memory state, one rank that holds it (lowest in ties) reads it, verifies every checksum, applies it
    to its own state (tensors in place) and broadcasts it to the others; otherwise the most tenured
    in-memory state is synced. A missing or empty `path` is no error. A corrupt or incomplete checkpoint
    is skipped with a warning and the next best is used; `CheckpointCorruptError` is raised only when
    `path` names that one checkpoint and nothing else can replace it.

    Pickled objects (values that are not tensors or plain data) load only with ``trusted=True``
    (`UntrustedCheckpointError` otherwise). ``strict=False`` keeps current values for fields the
    checkpoint lacks and ignores (with a warning) fields the class no longer has. `local()` fields are
    never touched; a ``sync=False`` field is restored on the reading rank only. `on_sync` runs afterwards
    on every rank.

    `path` may be an fsspec URL (see `elastic.save`; `storage_options` go to fsspec): only prefixes with a
    complete, checksum-verified manifest count, and `LoadReport.path` is the checkpoint's URL.
    """
    config = config_of(state, "elastic.load()")
    storage, root = locate(path, storage_options, "load")
    _check_bool(trusted, "trusted", "load")
    _check_bool(strict, "strict", "load")
    g = Collective.of(group, as_timedelta(timeout, "load"), "load")
    with torch.inference_mode(False):  # tensors it allocates must be ordinary ones (see sync)
        return _load_in(state, config, storage, root, g, trusted, strict)


def _load_in(
    state: Any, config: StateConfig, storage: Storage, root: Any, g: Collective, trusted: bool, strict: bool
) -> LoadReport:
    records = g.gather_checked(
        _load_record(state, config, root, storage), "load-scan", _scan_failure(g.world)
    )
    search = _Search(records)
    while (choice := search.next()) is not None:
        reader = choice[0]
        verdict = _read_on_reader(state, g, storage, search, choice, trusted, strict)
        if verdict.torn:
            search.lost_memory(reader)
        if verdict.kind == "ok":
            return _share_checkpoint(state, config, g, storage, reader, search.seen(choice))
        if verdict.kind != "corrupt":
            raise _read_error(verdict, reader, g.world)
        search.skip(choice, verdict.message)
        if g.rank != reader:
            log.warning("load: rank %d found %s", reader, verdict.message)
    if search.corrupt:
        msg = (
            f"load: the checkpoint {root} is corrupt or incomplete: {'; '.join(search.corrupt)}. Load from "
            "its parent directory to fall back to the next checkpoint, or restore the files"
        )
        raise CheckpointCorruptError(msg) from None
    report = sync_in(state, config, g, op="load")
    return LoadReport(source="memory", src=report.src, tenure=report.tenure, path=None, world_size=g.world)


def _read_on_reader(
    state: Any,
    g: Collective,
    storage: Storage,
    search: _Search,
    choice: tuple[int, int],
    trusted: bool,
    strict: bool,
) -> _r.Status:
    """The reader reads, verifies and applies the checkpoint; every rank learns its verdict."""
    reader = choice[0]
    status = None
    if g.rank == reader:
        path = storage.result(search.seen(choice).path)
        status = _r.read(state, path, trusted, strict, search.expendable(choice), storage)
    verdict = g.gather(status, "load-read")[reader]
    assert verdict is not None  # the reader always reports
    return verdict


def _share_checkpoint(
    state: Any, config: StateConfig, g: Collective, storage: Storage, reader: int, seen: _Seen
) -> LoadReport:
    """The reader holds the checkpoint: broadcast it to every rank, then run `on_sync`."""
    report = sync_in(state, config, g, src=reader, force=True, op="load", notify=False)
    if config.on_sync is not None:
        config.on_sync(state, report)
    log.info(
        "load: rank %d read %s (tenure %r, written by %d ranks)",
        reader,
        seen.path,
        report.tenure,
        seen.world_size,
    )
    return LoadReport(
        source="checkpoint",
        src=reader,
        tenure=report.tenure,
        path=storage.result(seen.path),
        world_size=g.world,
        saved_world_size=seen.world_size,
    )


def _read_error(verdict: _r.Status, reader: int, world: int) -> CheckpointError:
    where = "" if world == 1 else f" (read by rank {reader})"
    error: type[CheckpointError] = {
        "untrusted": UntrustedCheckpointError,
        "mismatch": CheckpointMismatchError,
    }.get(verdict.kind, CheckpointError)
    return error(f"load: {verdict.message}{where}")


@attached("load")
def load_method(
    self: Any,
    path: str | os.PathLike[str],
    *,
    group: Any = None,
    trusted: bool = False,
    strict: bool = True,
    timeout: timedelta | float | None = None,
    storage_options: dict[str, Any] | None = None,
) -> LoadReport:
    """Restore the most tenured state in the group from memory or `path` (collective); see `elastic.load`."""
    return load(
        self,
        path,
        group=group,
        trusted=trusted,
        strict=strict,
        timeout=timeout,
        storage_options=storage_options,
    )


# ---------------------------------------------------------------------------------------------------------
# Reading one checkpoint into this rank's state


def _expendable(
    records: Sequence[_LoadRecord],
    memory: Sequence[Any],
    reader: int,
    choice: tuple[int, int],
    excluded: set[tuple[int, int]],
) -> bool:
    """Whether the reader's in-memory state can be lost without losing tenure: it holds none, or another
    rank's memory or another remaining checkpoint is at least as tenured. Then the reader may verify the
    checkpoint while it copies it in (one pass), at the risk of being left torn if it turns out corrupt."""
    mine = memory[reader]
    if mine is None:
        return True
    others = [t for r, t in enumerate(memory) if r != reader]
    others += [
        seen.tenure
        for r, rec in enumerate(records)
        for i, seen in enumerate(rec.seen)
        if (r, i) != choice and (r, i) not in excluded
    ]
    try:
        return any(not greater(mine, t) for t in others if t is not None)
    except Incomparable:
        return False


# ---------------------------------------------------------------------------------------------------------
# torch's Stateful protocol (torch.distributed.checkpoint)

#: Key of the small record `state_dict()` adds so that `load_state_dict()` can tell when DCP had nowhere to
#: put an optimizer's state (DCP loads only into tensors the target state dict already has).
META_KEY = "_elastic"


@attached("state_dict")
def state_dict_method(self: Any) -> dict[str, Any]:
    """The saved fields as a state dict (torch's `Stateful` protocol, usable with DCP).

    Modules, optimizers, nested states and other stateful values appear as their own state dicts, tensors
    as themselves (DCP loads into them in place), everything else as it is.
    """
    config_of(self, "state_dict()")
    out: dict[str, Any] = {}
    with_state: dict[str, int] = {}
    for attribute in saved_fields(type(self)):
        value = getattr(self, attribute.name)
        kind = kind_of(value)
        if kind in STRUCTURED:
            out[attribute.name] = value.state_dict()
            if kind == Kind.OPTIMIZER:
                with_state[attribute.name] = len(value.state)
        else:
            out[attribute.name] = value
    out[META_KEY] = {"optimizer_state": with_state}
    return out


@attached("load_state_dict")
def load_state_dict_method(self: Any, state_dict: dict[str, Any]) -> None:
    """Restore the saved fields from `state_dict` (torch's `Stateful` protocol); tensors in place.

    Fields absent from `state_dict` keep their values. Raises `CheckpointMismatchError` when an optimizer
    had no state to receive the saved one (DCP fills only existing tensors).
    """
    config_of(self, "load_state_dict()")
    if not isinstance(state_dict, dict):
        msg = f"load_state_dict() expects a dict as returned by state_dict(), got {type(state_dict).__name__}"
        raise TypeError(msg) from None
    meta = state_dict.get(META_KEY)
    counts = meta.get("optimizer_state", {}) if isinstance(meta, dict) else {}
    for attribute in saved_fields(type(self)):
        name = attribute.name
        if name not in state_dict:
            continue
        new = state_dict[name]
        current = getattr(self, name)
        kind = kind_of(current)
        if (
            kind == Kind.OPTIMIZER
            and counts.get(name, 0)
            and not current.state
            and not (new or {}).get("state")
        ):
            msg = (
                f"load_state_dict(): optimizer field {name!r} has no state yet, so none of the saved state "
                f"({counts[name]} parameters) could be loaded into it (torch.distributed.checkpoint only "
                "fills tensors the target already has). Initialise the optimizer's state first, or use "
                "elastic.load"
            )
            raise CheckpointMismatchError(msg) from None
        if kind in STRUCTURED:
            current.load_state_dict(new)
        elif (
            kind == Kind.TENSOR
            and isinstance(new, torch.Tensor)
            and new.shape == current.shape
            and new.dtype == current.dtype
        ):
            if new is not current:
                with torch.no_grad():
                    current.copy_(new)
        else:
            object.__setattr__(self, name, new)
