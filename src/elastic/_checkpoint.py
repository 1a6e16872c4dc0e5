"""Checkpoints: collective `save` and `load`, the async save handle, and the `Stateful` protocol methods.

`save` elects the writer (the most tenured rank, lowest in ties; one per node with ``scope="node"``), which
writes the checkpoint into a temporary directory inside the root, fsyncs it and renames it into place; the
other ranks wait in one small all-gather that tells everyone the path or the writer's error.

`load` lets every rank look at the manifests it can see, all-gathers (memory tenure, checkpoints), and
either has one rank read, verify and apply the best checkpoint and then broadcasts it with the core sync,
or syncs the most tenured in-memory state. A reader that finds corruption tells the group, and the
election is run again among the remaining candidates.
"""

from __future__ import annotations

import errno
import logging
import os
import platform
import shutil
import socket
import sys
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Literal

import attrs
import cloudpickle
import torch

from ._ckpt_format import (
    CONTENT,
    CONTENT_VERSION,
    HASH,
    MANIFEST,
    OBJECTS,
    FormatError,
    decode_skeleton,
    encode_skeleton,
    fsync_dir,
    hash_file,
    pickle_objects,
    slot_paths,
    write_bytes,
    write_content,
)
from ._comm import Comm, fault_point
from ._decorator import (
    StateConfig,
    as_timedelta,
    config_of,
    is_elastic_state,
    lineage,
    saved_fields,
    set_lineage,
)
from ._errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    TenureError,
    UntrustedCheckpointError,
)
from ._manifest import (
    InvalidCheckpoint,
    build_manifest,
    check_saveable_tenure,
    dir_name,
    is_checkpoint_dir,
    manifest_bytes,
    scan,
    skipped,
    tenure_to_json,
    validate,
)
from ._sync import elect, run_sync
from ._tree import (
    ContainerNode,
    StatefulNode,
    StateNode,
    TensorSlot,
    apply_fields,
    flatten,
    kind_of,
    path_str,
    tensor_index,
)

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

Scope = Literal["global", "node"]

#: Prefixes of the hidden working directories inside a root: checkpoints being written, being deleted.
TMP_PREFIX = ".tmp-"
DEL_PREFIX = ".del-"
#: A temporary directory of another host is considered abandoned once it is this old (clock skew margin).
FOREIGN_STALE_SECONDS = 600.0


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
    path: Path | None
    world_size: int
    saved_world_size: int | None = None


# ---------------------------------------------------------------------------------------------------------
# The group of one call


class _Group:
    """The collectives of one call, or their single-process stand-ins (no group, or a world of one)."""

    def __init__(self, group: Any, deadline: timedelta | None, op: str) -> None:
        self.comm = Comm.of(group, deadline, op)
        self.rank = self.comm.rank if self.comm is not None else 0
        self.world = self.comm.world_size if self.comm is not None else 1

    def gather(self, obj: Any, phase: str) -> list[Any]:
        """Every rank's `obj` in rank order (cloudpickled records of trusted peers)."""
        if self.comm is None:
            return [obj]
        return [cloudpickle.loads(r) for r in self.comm.all_gather_bytes(cloudpickle.dumps(obj), phase)]


def _as_path(path: Any, op: str) -> Path:
    try:
        return Path(os.fspath(path))
    except TypeError:
        what = f"{type(path).__name__} {path!r}"
        msg = f"{op}(path=...) must be a str or os.PathLike naming a directory, got {what}"
        raise TypeError(msg) from None


def _check_bool(value: Any, name: str, op: str) -> None:
    if not isinstance(value, bool):
        msg = f"{op}({name}=...) must be True or False, got {value!r}"
        raise TypeError(msg) from None


def _node_id() -> str:
    """torchrun's GROUP_RANK (one agent = one node) where set, else the hostname."""
    group_rank = os.environ.get("GROUP_RANK")
    return f"group-rank {group_rank}" if group_rank not in (None, "") else f"host {socket.gethostname()}"


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _gt(a: Any, b: Any, what_a: str, what_b: str, op: str) -> bool:
    """Whether tenure `a` is strictly greater than `b` (`None` least); `TenureError` if incomparable."""
    if a is None:
        return False
    if b is None:
        return True
    if type(a) is not type(b) and not (_is_number(a) and _is_number(b)):
        raise _incomparable(a, b, what_a, what_b, op)
    try:
        return bool(a > b)
    except TypeError:
        raise _incomparable(a, b, what_a, what_b, op) from None


def _incomparable(a: Any, b: Any, what_a: str, what_b: str, op: str) -> TenureError:
    msg = (
        f"{op}: the tenure {a!r} of {what_a} cannot be compared with the tenure {b!r} of {what_b}; "
        "tenures must be of one orderable type (remove checkpoints of another run from the directory, or "
        "make the tenure callable return the same type as before)"
    )
    return TenureError(msg)


# ---------------------------------------------------------------------------------------------------------
# save


@attrs.frozen
class _SaveRecord:
    tenure: Any = None
    node: str = ""
    error: str | None = None


def _save_record(state: Any, config: StateConfig, scope: str) -> _SaveRecord:
    node = _node_id() if scope == "node" else ""
    if lineage(state).torn:
        return _SaveRecord(tenure=None, node=node)
    try:
        value = config.tenure(state)
        cloudpickle.dumps(value)
    except Exception as exc:
        return _SaveRecord(node=node, error=f"{type(exc).__name__}: {exc}")
    return _SaveRecord(tenure=value, node=node)


@attrs.define
class _Job:
    """What the writer needs, prepared on the caller's thread (so a background write sees a snapshot)."""

    root: Path
    keep: int | None
    rank: int
    tenure: Any
    payload: dict[str, Any]
    objects: bytes | None
    info: dict[str, Any]
    crc32: bool


@attrs.frozen
class _Outcome:
    """A writer's result: the checkpoint's path, or the error text."""

    rank: int
    path: str | None = None
    error: str | None = None
    root: str = ""


def _versions() -> dict[str, str]:
    package = sys.modules.get("elastic")
    return {
        "python": platform.python_version(),
        "torch": str(torch.__version__),
        "cloudpickle": str(getattr(cloudpickle, "__version__", "unknown")),
        "elastic-state": str(getattr(package, "__version__", "unknown")),
    }


def _prepare(
    state: Any, root: Path, keep: int | None, rank: int, world: int, tenure: Any, stage: bool
) -> _Job:
    flat = flatten(state, "save")
    encoded = encode_skeleton(flat.skeleton)
    objects = pickle_objects(encoded) if encoded.objects else None
    tensors = _stage(flat.tensors) if stage else flat.tensors
    payload = {
        "format": CONTENT_VERSION,
        "skeleton": encoded.plain,
        "tensors": tensors,
        "devices": [t.device.type for t in flat.tensors],
    }
    cls = type(state)
    now = time.time_ns()
    info = {
        "class": f"{cls.__module__}.{cls.__qualname__}",
        "fields": [{"name": a.name, "kind": kind_of(getattr(state, a.name))} for a in saved_fields(cls)],
        "tenure": tenure_to_json(tenure),
        "tenure_repr": repr(tenure),
        "world_size": world,
        "writer_rank": rank,
        "created": datetime.fromtimestamp(now / 1e9, tz=timezone.utc).isoformat(timespec="milliseconds"),
        "created_ns": now,
        "versions": _versions(),
        "objects": encoded.object_summary(),
    }
    return _Job(
        root=root,
        keep=keep,
        rank=rank,
        tenure=tenure,
        payload=payload,
        objects=objects,
        info=info,
        crc32=stage,
    )


# One staging copy of the tensors for async saves, reused while shapes and dtypes stay the same.
_staging_lock = threading.Lock()
_staging: list[torch.Tensor] = []


def _stage(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """CPU copies of `tensors` for a background write, in reused buffers (pinned for CUDA sources)."""
    global _staging
    with _staging_lock:
        old = _staging
        out: list[torch.Tensor] = []
        cuda = False
        for i, t in enumerate(tensors):
            pin = t.device.type == "cuda" and torch.cuda.is_available()
            cuda = cuda or t.device.type == "cuda"
            buf = old[i] if i < len(old) else None
            if buf is None or buf.shape != t.shape or buf.dtype != t.dtype or buf.is_pinned() != pin:
                buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
            buf.copy_(t.detach(), non_blocking=pin)
            out.append(buf)
        if cuda and torch.cuda.is_available():
            torch.cuda.synchronize()
        _staging = out
        return out


_in_use_lock = threading.Lock()
_in_use: set[str] = set()  # temporary directories this process is writing right now


def _host() -> str:
    return socket.gethostname().replace("-", "_") or "host"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True
    return True


def _clean_stale(root: Path, started: float) -> None:
    """Remove temporary directories of writers that died, and directories left half-deleted."""
    try:
        entries = list(os.scandir(root))
    except OSError:
        return
    host, pid = _host(), os.getpid()
    for entry in entries:
        name = entry.name
        stale = False
        if name.startswith(DEL_PREFIX):
            stale = True
        elif name.startswith(TMP_PREFIX):
            parts = name[len(TMP_PREFIX) :].rsplit("-", 2)
            with _in_use_lock:
                busy = entry.path in _in_use
            if busy:
                continue
            if len(parts) == 3 and parts[0] == host and parts[1].isdigit():
                owner = int(parts[1])
                stale = owner == pid or not _pid_alive(owner)
            else:
                try:
                    stale = entry.stat(follow_symlinks=False).st_mtime < started - FOREIGN_STALE_SECONDS
                except OSError:
                    stale = False
        if stale:
            log.info("save: removing abandoned %s", entry.path)
            shutil.rmtree(entry.path, ignore_errors=True)


def _publish(tmp: Path, root: Path, base: str) -> Path:
    """Rename `tmp` to a free name `base`, `base.1`, ... in `root` (never over an existing checkpoint)."""
    n = 0
    while True:
        target = root / (base if n == 0 else f"{base}.{n}")
        if not os.path.lexists(target):
            try:
                os.rename(tmp, target)
                return target
            except OSError as exc:
                if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                    raise
        n += 1


def _remove(path: Path) -> None:
    """Delete a checkpoint: renamed out of sight at once (a crash never leaves a half-deleted checkpoint
    visible), then removed by a background thread (what it leaves is cleaned by the next save)."""
    doomed = path.parent / f"{DEL_PREFIX}{path.name}-{uuid.uuid4().hex[:8]}"
    try:
        os.rename(path, doomed)
    except OSError as exc:
        log.warning("save: could not remove old checkpoint %s: %s", path, exc)
        return
    threading.Thread(target=shutil.rmtree, args=(doomed, True), name="elastic-retention", daemon=True).start()


def _retain(root: Path, keep: int | None, written: Path) -> None:
    """Keep the `keep` most tenured complete checkpoints, and always `written`."""
    if keep is None:
        return
    complete = scan(root, warn=False, op="save")
    keepers = {c.path.name for c in complete[:keep]} | {written.name}
    for cand in complete:
        if cand.path.name not in keepers:
            log.info("save: retention (keep=%d) removes %s", keep, cand.path)
            _remove(cand.path)
    fsync_dir(root)


def _write(job: _Job) -> Path:
    """Write one checkpoint durably under `job.root`; returns its directory."""
    root, rank = job.root, job.rank
    if is_checkpoint_dir(root):
        msg = (
            f"{root} is itself a checkpoint (it holds {MANIFEST}); pass the directory that holds checkpoints"
        )
        raise ValueError(msg)
    started = time.time()
    root.mkdir(parents=True, exist_ok=True)
    _clean_stale(root, started)
    tmp = root / f"{TMP_PREFIX}{_host()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    os.mkdir(tmp)
    with _in_use_lock:
        _in_use.add(str(tmp))
    try:
        fault_point("write", rank)
        files = []
        if job.objects is not None:
            files.append(write_bytes(tmp / OBJECTS, job.objects))
        files.append(write_content(tmp / CONTENT, job.payload, crc32=job.crc32))
        fault_point("manifest", rank)
        manifest = build_manifest(job.info, files)
        write_bytes(tmp / MANIFEST, manifest_bytes(manifest))
        fsync_dir(tmp)
        fault_point("rename", rank)
        final = _publish(tmp, root, dir_name(job.tenure))
        fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        with _in_use_lock:
            _in_use.discard(str(tmp))
    log.info("save: rank %d wrote %s (tenure %r)", rank, final, job.tenure)
    try:
        fault_point("retain", rank)
        _retain(root, job.keep, final)
    except Exception as exc:  # the checkpoint is durable; failing to delete old ones is not fatal
        log.warning("save: retention under %s failed: %s: %s", root, type(exc).__name__, exc)
    return final


def _run(job: _Job) -> _Outcome:
    try:
        return _Outcome(rank=job.rank, path=str(_write(job)), root=str(job.root))
    except Exception as exc:
        return _Outcome(rank=job.rank, error=_explain(exc), root=str(job.root))


def _explain(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    code = getattr(exc, "errno", None)
    if code == errno.ENOSPC or code == getattr(errno, "EDQUOT", -1):
        return f"{text}. Free disk space, lower keep=, or save to another path"
    if code in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f"{text}. Make the directory writable by this process, or save to another path"
    if code in (errno.ENOTDIR, errno.EEXIST):
        return f"{text}. The path (or a parent) is a file; pass a directory"
    if isinstance(exc, TypeError):
        return str(exc)
    return f"{text}. Fix the cause and save again"


def _conclude(outcomes: Sequence[_Outcome | None], mine: int, world: int) -> Path:
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
    return Path(outcome.path)


class SaveHandle:
    """What `save(..., blocking=False)` returns: the checkpoint is being written in a background thread.

    `wait()` is collective (every rank calls it): it returns the checkpoint's path on every rank once it
    is durable, or raises the writer's error as `CheckpointError` on every rank. `done()` says, locally,
    whether this rank's part is finished. The next `save` waits for this one first.
    """

    def __init__(self, group: _Group, mine: int, job: _Job | None, error: _Outcome | None) -> None:
        self._group = group
        self._mine = mine
        self._outcome: _Outcome | None = error
        self._lock = threading.Lock()
        self._result: Path | CheckpointError | None = None
        self._thread: threading.Thread | None = None
        if job is not None:
            self._thread = threading.Thread(target=self._work, args=(job,), name="elastic-save", daemon=False)
            self._thread.start()

    def _work(self, job: _Job) -> None:
        self._outcome = _run(job)
        if self._outcome.error is not None:
            log.error("save: background write failed: %s", self._outcome.error)

    def done(self) -> bool:
        """Whether this rank's part of the save has finished (local; does not raise)."""
        return self._thread is None or not self._thread.is_alive()

    def wait(self) -> Path:
        """The path once the checkpoint is durable, or the writer's error, on every rank (collective)."""
        global _inflight
        with self._lock:
            if self._result is None:
                if self._thread is not None:
                    self._thread.join()
                try:
                    outcomes = self._group.gather(self._outcome, "save-commit")
                    self._result = _conclude(outcomes, self._mine, self._group.world)
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


def save(
    state: Any,
    path: str | os.PathLike[str],
    *,
    group: Any = None,
    keep: int | None = 3,
    blocking: bool = True,
    scope: Scope = "global",
    timeout: timedelta | float | None = None,
) -> Path | SaveHandle:
    """Write a checkpoint of the most tenured state under the root `path` (collective).

    The most tenured rank (lowest in ties) writes; with ``scope="node"`` the most tenured rank of every
    node writes to its own `path` (node-local disks; a node is torchrun's ``GROUP_RANK``, else the host),
    after a sync if some node lags behind. The checkpoint is written into a temporary directory inside
    `path`, fsynced and renamed into place, so no reader ever sees it half-written; then only the `keep`
    most tenured checkpoints are kept (``keep=None`` keeps all; the new one is never deleted).

    Returns the checkpoint's directory on every rank once it is durable (with ``scope="node"``, the one
    this rank's node wrote). With ``blocking=False`` it returns a `SaveHandle` right after copying the
    tensors to CPU; ``handle.wait()`` (collective) returns the path or raises the writer's error.
    `timeout` (seconds or `timedelta`) bounds every collective, including the wait for the writer.
    A writer's failure raises `CheckpointError` on every rank. Fields with ``save=False`` are not written.
    """
    config = config_of(state, "elastic.save()")
    root = _as_path(path, "save")
    if keep is not None and (not isinstance(keep, int) or isinstance(keep, bool) or keep < 1):
        msg = f"save(keep=...) must be a positive int (or None to keep every checkpoint), got {keep!r}"
        raise ValueError(msg) from None
    _check_bool(blocking, "blocking", "save")
    if scope not in ("global", "node"):
        msg = f"save(scope=...) must be 'global' or 'node', got {scope!r}"
        raise ValueError(msg) from None
    deadline = as_timedelta(timeout, "save")
    _settle_inflight()
    g = _Group(group, deadline, "save")
    records: list[_SaveRecord] = g.gather(_save_record(state, config, scope), "save-elect")
    for rank, rec in enumerate(records):
        if rec.error is not None:
            msg = (
                f"save: on rank {rank} the tenure callable failed ({rec.error}); "
                "fix it to return an orderable value"
            )
            raise TenureError(msg) from None
    tenures = [rec.tenure for rec in records]
    best = elect(tenures, "save")
    top = tenures[best]
    if top is None:
        msg = (
            "save: no rank holds a state to save: every tenure is None (fresh states, or torn by a failed "
            "sync). Load or train first, or make the tenure callable return a value"
        )
        raise CheckpointError(msg) from None
    check_saveable_tenure(top)
    if scope == "global":
        mine, writers = best, {best}
    else:
        nodes = [rec.node for rec in records]
        members: dict[str, list[int]] = {}
        for rank, node in enumerate(nodes):
            members.setdefault(node, []).append(rank)
        leaders = {node: rs[elect([tenures[r] for r in rs], "save")] for node, rs in members.items()}
        behind = [n for n, r in leaders.items() if _gt(top, tenures[r], f"rank {best}", f"rank {r}", "save")]
        if behind:
            log.info("save: %s behind the most tenured state; syncing before the node-local save", behind)
            run_sync(state, group=group, timeout=deadline, op="save")
            leaders = {node: min(rs) for node, rs in members.items()}
        mine, writers = leaders[nodes[g.rank]], set(leaders.values())

    job: _Job | None = None
    failure: _Outcome | None = None
    if g.rank in writers:
        try:
            job = _prepare(state, root, keep, g.rank, g.world, top, stage=not blocking)
        except Exception as exc:
            failure = _Outcome(rank=g.rank, error=_explain(exc), root=str(root))
    if blocking:
        outcome = _run(job) if job is not None else failure
        outcomes = g.gather(outcome, "save-commit")
        return _conclude(outcomes, mine, g.world)
    handle = SaveHandle(g, mine, job, failure)
    global _inflight
    with _inflight_lock:
        _inflight = handle
    return handle


def save_method(
    self: Any,
    path: str | os.PathLike[str],
    *,
    group: Any = None,
    keep: int | None = 3,
    blocking: bool = True,
    scope: Scope = "global",
    timeout: timedelta | float | None = None,
) -> Path | SaveHandle:
    """Write a checkpoint of the most tenured state under `path` (collective); see `elastic.save`."""
    return save(self, path, group=group, keep=keep, blocking=blocking, scope=scope, timeout=timeout)


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


def _load_record(state: Any, config: StateConfig, root: Path) -> _LoadRecord:
    try:
        value = None if lineage(state).torn else config.tenure(state)
        cloudpickle.dumps(value)
    except Exception as exc:
        return _LoadRecord(error=("tenure", f"{type(exc).__name__}: {exc}"))
    try:
        if is_checkpoint_dir(root):
            try:
                c = validate(root)
            except InvalidCheckpoint as exc:
                skipped("load", str(exc))
                return _LoadRecord(tenure=value, single=True, corrupt=(str(exc),))
            seen: tuple[_Seen, ...] = (_Seen(c.tenure, c.created_ns, str(c.path), c.world_size),)
            return _LoadRecord(tenure=value, seen=seen, single=True)
        found = scan(root, op="load")
    except Exception as exc:
        return _LoadRecord(tenure=value, error=("scan", f"cannot list {root}: {type(exc).__name__}: {exc}"))
    return _LoadRecord(
        tenure=value, seen=tuple(_Seen(c.tenure, c.created_ns, str(c.path), c.world_size) for c in found)
    )


@attrs.frozen
class _Status:
    """The reader's verdict: ``ok``, ``corrupt`` (skip it), or an error kind raised on every rank; and
    whether the reader's state was left torn (its tenure then counts as `None`)."""

    kind: Literal["ok", "corrupt", "untrusted", "mismatch", "error"]
    message: str = ""
    torn: bool = False


class _Refused(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


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
            if _gt(seen.tenure, cur.tenure, seen.path, cur.path, "load"):
                best = (rank, i)
    return best


def load(
    state: Any,
    path: str | os.PathLike[str],
    *,
    group: Any = None,
    trusted: bool = False,
    strict: bool = True,
    timeout: timedelta | float | None = None,
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
    """
    config = config_of(state, "elastic.load()")
    root = _as_path(path, "load")
    _check_bool(trusted, "trusted", "load")
    _check_bool(strict, "strict", "load")
    deadline = as_timedelta(timeout, "load")
    g = _Group(group, deadline, "load")
    records: list[_LoadRecord] = g.gather(_load_record(state, config, root), "load-scan")
    for rank, rec in enumerate(records):
        if rec.error is None:
            continue
        kind, text = rec.error
        where = "" if g.world == 1 else f" on rank {rank}"
        if kind == "tenure":
            msg = (
                f"load: the tenure callable failed{where} ({text}); make it return an orderable value or None"
            )
            raise TenureError(msg) from None
        raise CheckpointError(f"load: {text}{where}") from None
    memory = [rec.tenure for rec in records]
    mem_best = elect(memory, "load")
    corrupt = [c for rec in records for c in rec.corrupt]
    excluded: set[tuple[int, int]] = set()
    while True:
        choice = _best_candidate(records, excluded)
        if choice is None:
            break
        reader, index = choice
        seen = records[reader].seen[index]
        if not _gt(
            seen.tenure, memory[mem_best], f"checkpoint {seen.path}", f"rank {mem_best}'s state", "load"
        ):
            break
        status = None
        if g.rank == reader:
            stream = _expendable(records, memory, reader, choice, excluded)
            status = _read(state, Path(seen.path), trusted, strict, stream)
        statuses: list[_Status | None] = g.gather(status, "load-read")
        verdict = statuses[reader]
        assert verdict is not None
        if verdict.torn:  # the reader's own state is gone: it can no longer win the election
            memory[reader] = None
            mem_best = elect(memory, "load")
        if verdict.kind == "ok":
            report = run_sync(
                state, group=group, src=reader, force=True, timeout=deadline, op="load", notify=False
            )
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
                path=Path(seen.path),
                world_size=g.world,
                saved_world_size=seen.world_size,
            )
        if verdict.kind == "corrupt":
            excluded.add(choice)
            if records[reader].single:
                corrupt.append(verdict.message)
            if g.rank != reader:
                log.warning("load: rank %d found %s", reader, verdict.message)
            continue
        where = "" if g.world == 1 else f" (read by rank {reader})"
        error: type[CheckpointError] = {
            "untrusted": UntrustedCheckpointError,
            "mismatch": CheckpointMismatchError,
        }.get(verdict.kind, CheckpointError)
        raise error(f"load: {verdict.message}{where}") from None
    if corrupt:
        msg = (
            f"load: the checkpoint {root} is corrupt or incomplete: {'; '.join(corrupt)}. Load from its "
            "parent directory to fall back to the next checkpoint, or restore the files"
        )
        raise CheckpointCorruptError(msg) from None
    report = run_sync(state, group=group, timeout=deadline, op="load")
    return LoadReport(source="memory", src=report.src, tenure=report.tenure, path=None, world_size=g.world)


def load_method(
    self: Any,
    path: str | os.PathLike[str],
    *,
    group: Any = None,
    trusted: bool = False,
    strict: bool = True,
    timeout: timedelta | float | None = None,
) -> LoadReport:
    """Restore the most tenured state in the group from memory or `path` (collective); see `elastic.load`."""
    return load(self, path, group=group, trusted=trusted, strict=strict, timeout=timeout)


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
        return any(not _gt(mine, t, "memory", "another state", "load") for t in others if t is not None)
    except TenureError:
        return False


def _read(state: Any, directory: Path, trusted: bool, strict: bool, stream: bool) -> _Status:
    """Verify `directory` and apply it to `state`; never raises (the verdict goes to every rank)."""
    try:
        _read_into(state, directory, trusted, strict, stream)
        return _Status("ok")
    except InvalidCheckpoint as exc:
        skipped("load", str(exc))
        return _Status("corrupt", str(exc), torn=lineage(state).torn)
    except _Refused as exc:
        return _Status(exc.kind, str(exc), torn=lineage(state).torn)  # type: ignore[arg-type]
    except Exception as exc:
        text = f"reading {directory} failed: {type(exc).__name__}: {exc}"
        return _Status("error", text, torn=lineage(state).torn)


class _Verification:
    """Checksums of one file computed on a helper thread (`wait` raises `InvalidCheckpoint`)."""

    def __init__(self, directory: Path, manifest: dict[str, Any], name: str) -> None:
        self._error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, args=(directory, manifest, name), name="elastic-verify", daemon=True
        )
        self._thread.start()

    def _run(self, directory: Path, manifest: dict[str, Any], name: str) -> None:
        try:
            _verify(directory, manifest, name)
        except BaseException as exc:
            self._error = exc

    def wait(self) -> None:
        self._thread.join()
        if self._error is not None:
            raise self._error


def _verify(directory: Path, manifest: dict[str, Any], name: str) -> None:
    rec = manifest["files"][name]
    fpath = directory / name
    try:
        size, digests = hash_file(fpath, rec["chunk"])
    except OSError as exc:
        raise InvalidCheckpoint(f"{fpath}: cannot be read ({exc})") from None
    if size != rec["size"]:
        raise InvalidCheckpoint(
            f"{fpath}: is {size} bytes, the manifest says {rec['size']}: truncated or altered"
        )
    for k, (got, want) in enumerate(zip(digests, rec[HASH])):
        if got != want:
            a, b = k * rec["chunk"], min(size, (k + 1) * rec["chunk"])
            raise InvalidCheckpoint(
                f"{fpath}: {HASH} checksum mismatch in bytes {a}-{b}: the file is damaged"
            )


def _read_into(state: Any, directory: Path, trusted: bool, strict: bool, stream: bool = False) -> None:
    """Read, verify and apply one checkpoint. With `stream`, the content file is verified while it is
    parsed and copied in (the state is torn if it turns out corrupt); otherwise before."""
    manifest = validate(directory).manifest
    cls = type(state)
    saved_class = manifest.get("class")
    if saved_class != f"{cls.__module__}.{cls.__qualname__}":
        log.warning(
            "load: %s was saved from class %s, loading into %s.%s",
            directory,
            saved_class,
            cls.__module__,
            cls.__qualname__,
        )
    live = [a.name for a in saved_fields(cls)]
    saved = [f["name"] for f in manifest["fields"]]
    _check_fields(directory, live, saved, strict, "")
    applied = [n for n in saved if n in live]
    needed = [o for o in manifest["objects"] if o.get("field") in applied]
    if needed and not trusted:
        names = sorted({str(o.get("field")) for o in needed})
        detail = ", ".join(f"{o.get('path')} ({o.get('type')})" for o in needed[:8])
        more = f" and {len(needed) - 8} more" if len(needed) > 8 else ""
        msg = (
            f"{directory} stores pickled objects in field(s) {', '.join(repr(n) for n in names)}: "
            f"{detail}{more}. Unpickling can run arbitrary code, so it is refused by default; pass "
            "trusted=True for checkpoints you made yourself (or whose author you trust), or store plain data "
            "(numbers, strings, lists, dicts, tensors) in these fields"
        )
        raise _Refused("untrusted", msg)
    verification = _Verification(directory, manifest, CONTENT) if stream else None
    if verification is None:
        _verify(directory, manifest, CONTENT)
    try:
        node, tensors, devices = _parse(state, directory, manifest, trusted, strict, applied, needed)
    except BaseException:
        if verification is not None:
            verification.wait()  # a checksum mismatch explains a parse failure best
        raise
    _apply(state, node, tensors, devices, verification.wait if verification is not None else None)


def _parse(
    state: Any,
    directory: Path,
    manifest: dict[str, Any],
    trusted: bool,
    strict: bool,
    applied: list[str],
    needed: list[Any],
) -> tuple[StateNode, list[torch.Tensor], list[str]]:
    """Load the content (weights_only, mmap) and objects, decode the skeleton and check it against the
    live state. Writes nothing into the state."""
    objects: list[Any] = []
    if needed:
        _verify(directory, manifest, OBJECTS)
        try:
            with open(directory / OBJECTS, "rb") as f:
                objects = cloudpickle.load(f)
        except Exception as exc:
            msg = (
                f"could not unpickle {directory / OBJECTS} ({type(exc).__name__}: {exc}); the classes and "
                "functions it refers to must be importable here"
            )
            raise _Refused("error", msg) from None
        if not isinstance(objects, list):
            raise InvalidCheckpoint(f"{directory / OBJECTS}: does not hold a list of objects")
    try:
        payload = torch.load(directory / CONTENT, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise InvalidCheckpoint(
            f"{directory / CONTENT}: cannot be loaded safely ({type(exc).__name__}: {text})"
        ) from None
    tensors, devices, skeleton = _unpack(directory, payload, applied, objects)
    node = _reconcile(skeleton, state, (), strict, tensors, directory)
    return node, tensors, devices


def _unpack(
    directory: Path, payload: Any, applied: list[str], objects: list[Any]
) -> tuple[list[torch.Tensor], list[str], StateNode]:
    where = directory / CONTENT
    if not (isinstance(payload, dict) and payload.get("format") == CONTENT_VERSION):
        raise InvalidCheckpoint(f"{where}: is not an elastic-state content file of version {CONTENT_VERSION}")
    tensors, devices, plain = payload.get("tensors"), payload.get("devices"), payload.get("skeleton")
    if not (
        isinstance(tensors, list)
        and all(isinstance(t, torch.Tensor) for t in tensors)
        and isinstance(devices, list)
        and len(devices) == len(tensors)
        and all(isinstance(d, str) for d in devices)
        and isinstance(plain, dict)
        and isinstance(plain.get("f"), dict)
    ):
        raise InvalidCheckpoint(f"{where}: has a malformed layout")
    pruned = dict(plain)
    pruned["f"] = {n: v for n, v in plain["f"].items() if n in applied}

    def obj(i: int) -> Any:
        if i >= len(objects):
            raise FormatError(f"object {i} is not in {OBJECTS}")
        return objects[i]

    try:
        skeleton = decode_skeleton(pruned, len(tensors), obj)
    except FormatError as exc:
        raise InvalidCheckpoint(f"{where}: {exc}") from None
    return tensors, devices, skeleton


def _check_fields(directory: Path, live: list[str], saved: list[str], strict: bool, prefix: str) -> None:
    missing = [prefix + n for n in live if n not in saved]
    extra = [prefix + n for n in saved if n not in live]
    if not (missing or extra):
        return
    if strict:
        parts = []
        if missing:
            parts.append(f"missing from the checkpoint: {', '.join(missing)}")
        if extra:
            parts.append(f"in the checkpoint but not in the class: {', '.join(extra)}")
        msg = (
            f"{directory} does not match the state's fields ({'; '.join(parts)}). Pass strict=False to keep "
            "current values for missing fields and ignore extra ones"
        )
        raise _Refused("mismatch", msg)
    if extra:
        text = f"load: {directory} has fields the class no longer has, ignored: {', '.join(extra)}"
        log.warning("%s", text)
        warnings.warn(text, RuntimeWarning, stacklevel=6)
    if missing:
        log.info("load: %s lacks fields %s; their current values are kept", directory, ", ".join(missing))


_STATEFUL = frozenset({"module", "optimizer", "stateful", "state"})


def _saved_kind(node: Any) -> str:
    if isinstance(node, TensorSlot):
        return "tensor"
    if isinstance(node, StatefulNode):
        return node.kind
    if isinstance(node, StateNode):
        return "state"
    if isinstance(node, ContainerNode):
        return node.kind
    return "none" if node is None else "object"


def _reconcile(
    node: StateNode,
    state: Any,
    path: tuple[Any, ...],
    strict: bool,
    tensors: list[torch.Tensor],
    directory: Path,
) -> StateNode:
    """Check the checkpoint's fields against the live state before anything is written; prune extras."""
    live = [a.name for a in saved_fields(type(state))]
    if path:
        prefix = path_str(path) + "."
        _check_fields(directory, live, list(node.fields), strict, prefix)
    fields: dict[str, Any] = {}
    for name, child in node.fields.items():
        if name not in live:
            continue
        current = getattr(state, name)
        where = path_str((*path, name))
        have, want = kind_of(current), _saved_kind(child)
        if have != want and (have in _STATEFUL or want in _STATEFUL):
            msg = (
                f"{directory}: field {where} holds a {want} in the checkpoint but a {have} in this state; "
                "build the state with the same kinds of values as the one that was saved"
            )
            raise _Refused("mismatch", msg)
        if isinstance(child, StateNode):
            child = _reconcile(child, current, (*path, name), strict, tensors, directory)
        elif isinstance(child, StatefulNode) and child.kind == "module":
            _check_module(child, current, where, tensors, directory)
        fields[name] = child
    return StateNode(qualname=type(state).__qualname__, fields=fields)


def _check_module(
    node: StatefulNode, module: Any, where: str, tensors: list[torch.Tensor], directory: Path
) -> None:
    inner = node.inner
    if not isinstance(inner, ContainerNode) or inner.kind != "dict":
        return
    saved = {
        k: tuple(tensors[c.index].shape)
        for k, c in zip(inner.keys, inner.children)
        if isinstance(c, TensorSlot)
    }
    have = {k: tuple(v.shape) for k, v in module.state_dict().items() if isinstance(v, torch.Tensor)}
    problems = [f"{k}: missing from the checkpoint" for k in have if k not in saved]
    problems += [f"{k}: not in this module" for k in saved if k not in have]
    problems += [
        f"{k}: shape {saved[k]} saved, {have[k]} here" for k in saved if k in have and saved[k] != have[k]
    ]
    if problems:
        more = f"; and {len(problems) - 8} more" if len(problems) > 8 else ""
        msg = (
            f"{directory}: module {where} does not match the checkpoint ({'; '.join(problems[:8])}{more}); "
            "build the model with the same architecture and sizes as the one that was saved"
        )
        raise _Refused("mismatch", msg)


def _placed(tensor: torch.Tensor, device_type: str) -> torch.Tensor:
    """A loaded tensor moved off the memory map, onto the device type it was saved from where available."""
    if device_type == "cuda" and torch.cuda.is_available():
        return tensor.to(torch.device("cuda", torch.cuda.current_device()), copy=True)
    return tensor.clone()


def _apply(
    state: Any,
    node: StateNode,
    tensors: list[torch.Tensor],
    devices: list[str],
    verified: Callable[[], None] | None = None,
) -> None:
    """Write the checkpoint into `state`: tensors in place where shape and dtype match. Torn on failure.

    `verified`, when given, is waited for after the tensors are copied and before anything else changes;
    it raises if the checksums do not match (the state is then left torn)."""
    paths = slot_paths(node)
    index = tensor_index(state, "save")
    targets = list(tensors)
    in_place = [False] * len(tensors)
    set_lineage(state, token=None, torn=True)  # until the whole checkpoint is in
    with torch.no_grad():
        for i, p in paths.items():
            src = tensors[i]
            mine = index.get(p)
            if mine is not None and mine.shape == src.shape and mine.dtype == src.dtype:
                mine.detach().copy_(src)
                targets[i] = mine
                in_place[i] = True
            else:
                targets[i] = _placed(src, devices[i])
        if verified is not None:
            verified()
        apply_fields(state, node, targets, in_place)
    set_lineage(state, token=None, torn=False)


# ---------------------------------------------------------------------------------------------------------
# torch's Stateful protocol (torch.distributed.checkpoint)

#: Key of the small record `state_dict()` adds so that `load_state_dict()` can tell when DCP had nowhere to
#: put an optimizer's state (DCP loads only into tensors the target state dict already has).
META_KEY = "_elastic"


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
        if kind in ("module", "optimizer", "stateful", "state"):
            out[attribute.name] = value.state_dict()
            if kind == "optimizer":
                with_state[attribute.name] = len(value.state)
        else:
            out[attribute.name] = value
    out[META_KEY] = {"optimizer_state": with_state}
    return out


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
        if kind == "optimizer" and counts.get(name, 0) and not current.state and not (new or {}).get("state"):
            msg = (
                f"load_state_dict(): optimizer field {name!r} has no state yet, so none of the saved state "
                f"({counts[name]} parameters) could be loaded into it (torch.distributed.checkpoint only "
                "fills tensors the target already has). Initialise the optimizer's state first, or use "
                "elastic.load"
            )
            raise CheckpointMismatchError(msg) from None
        if kind in ("module", "optimizer", "stateful") or is_elastic_state(current):
            current.load_state_dict(new)
        elif (
            kind == "tensor"
            and isinstance(new, torch.Tensor)
            and new.shape == current.shape
            and new.dtype == current.dtype
        ):
            if new is not current:
                with torch.no_grad():
                    current.copy_(new)
        else:
            object.__setattr__(self, name, new)
