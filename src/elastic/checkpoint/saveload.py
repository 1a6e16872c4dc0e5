"""Checkpoints: collective `save` and `load`, the async save handle, and the `Stateful` protocol methods.

`save` elects the writer (the most tenured rank, lowest in ties; one per node with ``scope="node"``), which
writes the checkpoint through the root's storage (`locate`: a local directory, written into a temporary
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
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, overload

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
    DCP_LAYOUT,
    InvalidCheckpoint,
    is_checkpoint_dir,
    scan,
    skipped,
    validate,
)
from elastic.checkpoint.options import LoadOptions, SaveOptions, Scope
from elastic.checkpoint.storage.base import Storage
from elastic.replication.collective import Collective
from elastic.replication.sync import SyncReport, sync_in
from elastic.state.config import StateConfig, attached, config_of, saved_fields
from elastic.state.lineage import lineage
from elastic.state.nodes import STRUCTURED, Kind, kind_of
from elastic.state.shards import apply_sharded, is_sharded, sharded_state_dict
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

if TYPE_CHECKING:
    from elastic.checkpoint.dcp import ShardedWrite

log = logging.getLogger("elastic")


@attrs.frozen
class LoadReport:
    """What one `elastic.load` did, the same on every rank. A frozen attrs class.

    Attributes:
        source: ``"checkpoint"`` when a checkpoint was read, ``"memory"`` when the most tenured
            in-memory state won and was synced.
        src: the group rank that read the checkpoint, or whose in-memory state won.
        tenure: the tenure every rank now holds.
        path: the checkpoint read (a ``Path``; a URL string for fsspec URLs), or None when memory won.
        world_size: the size of this group.
        saved_world_size: the size of the group that wrote the checkpoint, or None when memory won.
    """

    source: Literal["checkpoint", "memory"]
    src: int
    tenure: Any
    path: Path | str | None
    world_size: int
    saved_world_size: int | None = None


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


def _commit(g: Collective, outcome: _w.Outcome | None, mine: int, storage: Storage) -> Path | str:
    """Every writer's `outcome` to every rank: the path of rank `mine`'s checkpoint, or the writers' errors
    raised on every rank (on a failing writer, from its own exception)."""
    outcomes = g.gather(None if outcome is None else outcome.shared(), "save-commit")
    failed = [o for o in outcomes if o is not None and o.error is not None]
    if failed:
        parts = []
        for o in failed:
            who = "" if g.world == 1 else f" on rank {o.rank} (the writer)"
            parts.append(f"writing the checkpoint under {o.root}{who} failed: {o.error}")
        msg = "save: " + "; ".join(parts) + ". No checkpoint was published by the failing writer"
        raise CheckpointError(msg) from (None if outcome is None else outcome.cause)
    reported = outcomes[mine]
    if reported is None or reported.path is None:  # cannot happen: every writer reports
        msg = f"save: rank {mine} (the writer) reported no result"
        raise CheckpointError(msg) from None
    return storage.result(reported.path)


class SaveHandle:
    """What ``save(..., blocking=False)`` returns: the checkpoint is being written in a background thread.

    Not built by users. The tensors were copied into a CPU staging area before `elastic.save` returned,
    so training may go on and change them. The next `elastic.save` waits for this one first (and raises
    its error if nobody called `wait`).
    """

    def __init__(
        self,
        group: Collective,
        mine: int,
        job: _w.Job | None,
        error: _w.Outcome | None,
        storage: Storage,
        sharded: ShardedWrite | None = None,
    ) -> None:
        self._sharded = sharded
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
        """Whether this rank's part of the save has finished (local; does not raise).

        Returns:
            True once this rank's background write (if any) has ended, successfully or not.
        """
        if self._sharded is not None:
            return self._sharded.done()
        return self._thread is None or not self._thread.is_alive()

    def wait(self) -> Path | str:
        """Wait until the checkpoint is durable (collective: every rank calls it).

        Returns:
            The checkpoint's path on every rank (a ``Path``; a URL string for fsspec URLs; with
            ``scope="node"``, the one this rank's node wrote). Calling it again returns the same.

        Raises:
            CheckpointError: the writer's error, on every rank.
        """
        global _inflight
        with self._lock:
            if self._result is None:
                if self._thread is not None:
                    self._thread.join()
                try:
                    if self._sharded is not None:
                        self._result = self._sharded.finish()
                    else:
                        self._result = _commit(self._group, self._outcome, self._mine, self._storage)
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
            raise CheckpointError(msg) from exc


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

    The most tenured rank (lowest in ties) writes; the others wait in one small all-gather that brings
    them the path or the writer's error. On a local disk the checkpoint is written into a hidden
    temporary directory inside `path`, every file fsynced, then renamed into place, so no reader ever
    sees it half-written; then only the `keep` most tenured checkpoints are kept (the new one is never
    deleted). Tensors and plain data are stored so that they load without unpickling
    (``torch.load(weights_only=True)``); only other values go to a cloudpickle file. Fields with
    ``save=False`` are not written.

    A sharded state (FSDP2, HSDP, DTensor fields) is written in the format of
    ``torch.distributed.checkpoint`` (DCP): the holder of each shard position writes that position's
    pieces, all in parallel, into one checkpoint published by the same rules (checksums, manifest last,
    atomic, retention); ``dcp.load(state.state_dict(), checkpoint_id=path)`` reads it too. `path` must be
    one place every rank sees (a shared filesystem or a URL); ``scope`` must be ``"global"``.

    `path` may be an fsspec URL (``s3://bucket/prefix``, ``gs://``, ``az://``, ``memory://``; needs the
    ``elastic-state[remote]`` extra): the data objects are uploaded first and the manifest last.

    Args:
        state: an instance of an ``@elastic_state`` class.
        path: the checkpoint root (a directory, or an fsspec URL); one sub-directory per checkpoint.
        group: the process group (None: the default group).
        keep: how many of the most tenured complete checkpoints to keep (None: all).
        blocking: False returns a `SaveHandle` right after copying the tensors to CPU (pinned memory for
            CUDA tensors) and writes in a background thread.
        scope: ``"global"``: one writer (a shared filesystem or bucket); ``"node"``: the most tenured
            rank of every node writes to its own `path` (node-local disks; a node is torchrun's
            ``GROUP_RANK``, else the host); ``"rank"``: every rank writes to its own `path`. A node or rank
            that lags behind is synced first.
        timeout: bound of every collective, including the wait for the writer (seconds or
            ``timedelta``).
        storage_options: passed to fsspec for URLs (credentials, endpoint, retries).

    Returns:
        On every rank once the checkpoint is durable: its path (a ``Path``; a URL string for fsspec
        URLs; with ``scope="node"``, the one this rank's node wrote). With ``blocking=False``, a
        `SaveHandle` whose collective ``wait()`` returns that path.

    Raises:
        CheckpointError: on every rank when the writer failed (a full disk, permissions, a path that is
            a file, a missing bucket, credentials, an unreachable endpoint), naming the writer and the
            fix; older checkpoints stay valid.
        TypeError: the tenure cannot be saved (it must be a number, string, None or a nested tuple of
            those), or `state` is not an ``@elastic_state`` instance.
        ValueError: a bad `keep` or `scope`.
        SyncError: a rank died, timed out or never called.
        ImportError: a URL without the ``remote`` extra installed.
    """
    config = config_of(state, "elastic.save()")
    options = SaveOptions.of(path, keep=keep, blocking=blocking, scope=scope, storage_options=storage_options)
    deadline = as_timedelta(timeout, "save")
    _settle_inflight()
    g = Collective.of(group, deadline, "save")
    if is_sharded(state, "save"):
        from elastic.checkpoint.dcp import save_sharded  # DCP's import costs ~0.1 s: only when needed

        write = save_sharded(state, config, g, options)
        if options.blocking:
            return write.finish()
        handle = SaveHandle(g, g.rank, None, None, options.storage, sharded=write)
        with _inflight_lock:
            _inflight = handle
        return handle
    records = g.gather_checked(_save_record(state, config, options.scope), "save-elect", _save_failure)
    tenures = [rec.tenure for rec in records]
    best = elect(tenures, "save")
    top = _saveable_top(tenures[best])
    mine, writers = _writers(state, config, g, options.scope, records, best)
    job, failure = _prepare_write(state, g, options, top, writers)
    if options.blocking:
        outcome = _w.run_job(job) if job is not None else failure
        return _commit(g, outcome, mine, options.storage)
    return _write_in_background(g, mine, job, failure, options.storage)


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
    state: Any, g: Collective, options: SaveOptions, top: Any, writers: set[int]
) -> tuple[_w.Job | None, _w.Outcome | None]:
    """A writer's job (tensors staged to CPU for an async save), or the outcome saying why it has none."""
    if g.rank not in writers:
        return None, None
    try:
        return _w.prepare(state, options, rank=g.rank, world=g.world, tenure=top), None
    except Exception as exc:
        return None, _w.Outcome(rank=g.rank, error=_w.explain(exc), root=str(options.root), cause=exc)


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


def _load_record(state: Any, config: StateConfig, options: LoadOptions) -> _LoadRecord:
    root, storage = options.root, options.storage
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
            if c.manifest.get("layout") == DCP_LAYOUT:
                msg = (
                    f"load: {root} holds a sharded state (written in DCP's layout by a state with DTensors); "
                    "this state is replicated: build the model sharded (fully_shard on a device mesh) to "
                    "load it, or load a checkpoint of a replicated state"
                )
                return _LoadRecord(tenure=value, error=("mismatch", msg))
            seen: tuple[_Seen, ...] = (_Seen(c.tenure, c.created_ns, str(c.path), c.world_size),)
            return _LoadRecord(tenure=value, seen=seen, single=True)
        found = []
        for c in scan(root, storage=storage, op="load"):
            if c.manifest.get("layout") == DCP_LAYOUT:
                log.info("load: %s holds a sharded state, not a replicated one: skipped", c.path)
            else:
                found.append(c)
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
        if kind == "mismatch":
            return CheckpointMismatchError(f"{text}{where}")
        return CheckpointError(f"load: {text}{where}")

    return fail


class _Search:
    """Load's search for the checkpoint to read: the most tenured one left, while it beats memory."""

    def __init__(self, records: Sequence[_LoadRecord]) -> None:
        self.records = records
        self.memory = [rec.tenure for rec in records]
        self.mem_best = elect(self.memory, "load")
        self.corrupt = [c for rec in records for c in rec.corrupt]
        #: the exception behind the last corrupt checkpoint this rank read itself (see `_r.Status.cause`)
        self.cause: BaseException | None = None
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

    def skip(self, choice: tuple[int, int], verdict: _r.Status) -> None:
        """The checkpoint is corrupt: never choose it again (and report it if it was named alone)."""
        self.excluded.add(choice)
        if self.records[choice[0]].single:
            self.corrupt.append(verdict.message)
            if verdict.cause is not None:
                self.cause = verdict.cause


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

    Every rank reports its in-memory tenure and the checkpoints it sees under `path` (manifests only,
    cheap). If a checkpoint is strictly more tenured than every in-memory state, one rank that holds it
    (lowest in ties) reads it, verifies every checksum, applies it to its own state (tensors in place)
    and broadcasts it to the others with `elastic.sync`; otherwise the most tenured in-memory state is
    synced. A missing or empty `path` is no error: memory wins. A corrupt or incomplete checkpoint is
    skipped with a ``RuntimeWarning`` naming the file and the group elects again among the rest.
    ``local()`` fields are never touched; a ``sync=False`` field is restored on the reading rank only.
    ``on_sync`` runs afterwards on every rank. A checkpoint written by another world size loads too.

    A sharded state loads *resharded*: every rank reads the pieces its shards overlap, whatever mesh wrote
    the checkpoint, each piece verified before use and staged, so a corrupt piece is never loaded (the
    group falls back to the next checkpoint). The checkpoint must be seen by every rank; one written by
    plain ``dcp.save`` loads when `path` names it (it carries no tenure and no checksums).

    For an fsspec URL only prefixes with a complete, checksum-verified manifest count.

    Args:
        state: an instance of an ``@elastic_state`` class.
        path: a checkpoint root, or one checkpoint directory (a path, or an fsspec URL).
        group: the process group (None: the default group).
        trusted: allow unpickling values that are not tensors or plain data (only for checkpoints you
            trust: unpickling can run code).
        strict: False keeps current values for fields the checkpoint lacks and ignores (with a
            warning) fields the class no longer has.
        timeout: bound of every collective (seconds or ``timedelta``).
        storage_options: passed to fsspec for URLs.

    Returns:
        What was restored, from where, the same on every rank.

    Raises:
        UntrustedCheckpointError: the checkpoint holds pickled values and `trusted` is False; names the
            fields.
        CheckpointMismatchError: the checkpoint's fields (with `strict`) or module shapes differ from the
            state's; nothing was changed.
        CheckpointCorruptError: `path` names one checkpoint and it is damaged.
        CheckpointError: a checkpoint could not be read (a missing bucket, credentials, ...).
        StateMismatchError: the ranks' in-memory states have different schemas.
        TenureError: tenures cannot be compared.
        SyncError: a rank died, timed out or never called.

    Warns:
        RuntimeWarning: a skipped damaged or incomplete checkpoint, naming the file.
    """
    config = config_of(state, "elastic.load()")
    options = LoadOptions.of(path, trusted=trusted, strict=strict, storage_options=storage_options)
    g = Collective.of(group, as_timedelta(timeout, "load"), "load")
    with torch.inference_mode(False):  # tensors it allocates must be ordinary ones (see sync)
        return _load_in(state, config, options, g)


def _load_in(state: Any, config: StateConfig, options: LoadOptions, g: Collective) -> LoadReport:
    if is_sharded(state, "save"):
        return _load_sharded(state, config, options, g)
    records = g.gather_checked(_load_record(state, config, options), "load-scan", _scan_failure(g.world))
    search = _Search(records)
    while (choice := search.next()) is not None:
        reader = choice[0]
        verdict = _read_on_reader(state, g, options, search, choice)
        if verdict.torn:
            search.lost_memory(reader)
        if verdict.kind == "ok":
            return _share_checkpoint(state, config, g, options.storage, reader, search.seen(choice))
        if verdict.kind != "corrupt":
            raise _read_error(verdict, reader, g.world) from verdict.cause
        search.skip(choice, verdict)
        if g.rank != reader:
            log.warning("load: rank %d found %s", reader, verdict.message)
    if search.corrupt:
        found = "; ".join(search.corrupt)
        msg = (
            f"load: the checkpoint {options.root} is corrupt or incomplete: {found}. Load from its parent "
            "directory to fall back to the next checkpoint, or restore the files"
        )
        raise CheckpointCorruptError(msg) from search.cause
    report = sync_in(state, config, g, op="load")
    return LoadReport(source="memory", src=report.src, tenure=report.tenure, path=None, world_size=g.world)


def _load_sharded(state: Any, config: StateConfig, options: LoadOptions, g: Collective) -> LoadReport:
    """`load` of a sharded state: every rank reads its own pieces of the chosen checkpoint (resharded onto
    the state's mesh), or the most tenured complete version in memory is synced."""
    from elastic.checkpoint.dcp import load_sharded  # DCP's import costs ~0.1 s: only when needed

    started = time.perf_counter()
    source, src, tenure, path, saved = load_sharded(state, config, g, options)
    if config.on_sync is not None:
        report = SyncReport(
            src=src,
            tenure=tenure,
            world_size=g.world,
            tensor_bytes=0,
            object_bytes=0,
            seconds=time.perf_counter() - started,
        )
        config.on_sync(state, report)
    if source == "checkpoint":
        log.info(
            "load: every rank read its pieces of %s (tenure %r, written by %s ranks)", path, tenure, saved
        )
    return LoadReport(
        source="checkpoint" if source == "checkpoint" else "memory",
        src=src,
        tenure=tenure,
        path=path,
        world_size=g.world,
        saved_world_size=saved,
    )


def _read_on_reader(
    state: Any, g: Collective, options: LoadOptions, search: _Search, choice: tuple[int, int]
) -> _r.Status:
    """The reader reads, verifies and applies the checkpoint; every rank learns its verdict (the reader
    keeps its own, with the exception behind it as `cause`)."""
    reader = choice[0]
    status = None
    if g.rank == reader:
        path = options.storage.result(search.seen(choice).path)
        status = _r.read(state, path, options, stream=search.expendable(choice))
    verdict = g.gather(None if status is None else status.shared(), "load-read")[reader]
    assert verdict is not None  # the reader always reports
    return verdict if status is None else status


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
    if is_sharded(self, "save"):  # DCP's own view: modules and optimizers through torch's state_dict API
        return sharded_state_dict(self, "save")
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
    if is_sharded(self, "save"):
        apply_sharded(self, state_dict, "save")
        return
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
