"""The checkpoint writer: snapshot a state, write it durably into a temporary directory, publish it
with one rename, and apply the retention policy.

`prepare` runs on the caller's thread (flatten, encode, pickle the objects, and for async saves copy the
tensors into a reused CPU staging area), so that `write` can run on a background thread while training goes
on. `write` never leaves a partial checkpoint visible: a writer killed at any point leaves at most a hidden
``.tmp-<host>-<pid>-<id>`` directory, which the next save removes once its writer is gone.
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
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import attrs
import cloudpickle
import torch

from ._ckpt_format import (
    CONTENT,
    CONTENT_VERSION,
    MANIFEST,
    OBJECTS,
    encode_skeleton,
    fsync_dir,
    one_torch_thread,
    pickle_objects,
    write_bytes,
    write_content,
)
from ._comm import fault_point
from ._config import saved_fields
from ._manifest import build_manifest, dir_name, is_checkpoint_dir, manifest_bytes, scan, tenure_to_json
from ._tree import TensorMeta, carriers, flatten, kind_of, staged, staging_buffer, staging_fits, to_save

__all__ = ["DEL_PREFIX", "TMP_PREFIX", "Job", "Outcome", "explain", "prepare", "run_job", "write"]

log = logging.getLogger("elastic")

#: Prefixes of the hidden working directories inside a root: checkpoints being written, being deleted.
TMP_PREFIX = ".tmp-"
DEL_PREFIX = ".del-"
#: A temporary directory of another host is considered abandoned once it is this old (clock skew margin).
FOREIGN_STALE_SECONDS = 600.0


@attrs.define
class Job:
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
class Outcome:
    """A writer's result: the checkpoint's path, or the error text."""

    rank: int
    path: str | None = None
    error: str | None = None
    root: str = ""


def versions() -> dict[str, str]:
    package = sys.modules.get("elastic")
    return {
        "python": platform.python_version(),
        "torch": str(torch.__version__),
        "cloudpickle": str(getattr(cloudpickle, "__version__", "unknown")),
        "elastic-state": str(getattr(package, "__version__", "unknown")),
    }


def prepare(state: Any, root: Path, keep: int | None, rank: int, world: int, tenure: Any, stage: bool) -> Job:
    flat = flatten(state, "save")
    encoded = encode_skeleton(flat.skeleton)
    objects = pickle_objects(encoded) if encoded.objects else None
    tensors = stage_copy(flat.tensors, flat.metas) if stage else to_save(flat)
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
        "versions": versions(),
        "objects": encoded.object_summary(),
    }
    return Job(
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


def stage_copy(tensors: list[torch.Tensor], metas: list[TensorMeta]) -> list[torch.Tensor]:
    """CPU copies of `tensors` for a background write, in reused buffers (pinned for CUDA sources). Tensors
    sharing storage are staged once (aliases are views of their carrier's copy)."""
    global _staging
    with _staging_lock, one_torch_thread():
        old = _staging
        kept: list[torch.Tensor] = []
        devices: set[torch.device] = set()  # every device with a copy in flight, not only the current one
        pins = [t.device.type == "cuda" and torch.cuda.is_available() for t in tensors]
        buffers: dict[int, torch.Tensor] = {}
        for n, i in enumerate(carriers(metas)):
            if pins[i]:
                devices.add(tensors[i].device)
            buf = old[n] if n < len(old) else None
            if buf is None or not staging_fits(buf, metas[i], pins[i]):
                buf = staging_buffer(metas[i], pins[i])
            buffers[i] = buf
            kept.append(buf)
        out = staged(tensors, metas, buffers.__getitem__)
        for device in devices:  # the writer thread reads these buffers: every copy must have landed
            torch.cuda.synchronize(device)
        _staging = kept
        return out


_in_use_lock = threading.Lock()
_in_use: set[str] = set()  # temporary directories this process is writing right now


def host_tag() -> str:
    return socket.gethostname().replace("-", "_") or "host"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True
    return True


def clean_stale(root: Path, started: float) -> None:
    """Remove temporary directories of writers that died, and directories left half-deleted."""
    try:
        entries = list(os.scandir(root))
    except OSError:
        return
    host, pid = host_tag(), os.getpid()
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


def write(job: Job) -> Path:
    """Write one checkpoint durably under `job.root`; returns its directory."""
    root, rank = job.root, job.rank
    if is_checkpoint_dir(root):
        msg = (
            f"{root} is itself a checkpoint (it holds {MANIFEST}); pass the directory that holds checkpoints"
        )
        raise ValueError(msg)
    started = time.time()
    root.mkdir(parents=True, exist_ok=True)
    clean_stale(root, started)
    tmp = root / f"{TMP_PREFIX}{host_tag()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
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


def run_job(job: Job) -> Outcome:
    try:
        return Outcome(rank=job.rank, path=str(write(job)), root=str(job.root))
    except Exception as exc:
        return Outcome(rank=job.rank, error=explain(exc), root=str(job.root))


def explain(exc: BaseException) -> str:
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
