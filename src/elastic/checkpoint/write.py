"""The checkpoint writer: snapshot a state, write its files and manifest, publish it, and apply the
retention policy.

`prepare` runs on the caller's thread (flatten, encode, pickle the objects, and for async saves copy the
tensors into a reused CPU staging area), so that `write` can run on a background thread while training goes
on. `write` never leaves a partial checkpoint visible: the storage (`elastic.checkpoint.storage`) publishes
it atomically
(locally: a hidden temporary directory renamed into place), and a writer killed at any point leaves only
what the next save removes once its writer is gone.
"""

from __future__ import annotations

import errno
import logging
import platform
import sys
import threading
import time
from datetime import datetime, timezone
from typing import Any

import attrs
import cloudpickle
import torch

from elastic._util.threads import one_torch_thread
from elastic.checkpoint.codec import (
    CONTENT,
    CONTENT_VERSION,
    MANIFEST,
    OBJECTS,
    encode_skeleton,
    pickle_objects,
)
from elastic.checkpoint.content import write_bytes, write_content
from elastic.checkpoint.manifest import (
    build_manifest,
    dir_name,
    is_checkpoint_dir,
    manifest_bytes,
    scan,
    tenure_to_json,
)
from elastic.checkpoint.options import SaveOptions
from elastic.replication.comm import fault_point
from elastic.state.config import saved_fields
from elastic.state.nodes import kind_of
from elastic.state.tensors import TensorMeta, carriers, staged, staging_buffer, staging_fits
from elastic.state.tree import flatten, to_save

__all__ = ["Job", "Outcome", "explain", "prepare", "run_job", "write"]

log = logging.getLogger("elastic")


@attrs.frozen(kw_only=True)
class Job:
    """What the writer needs, prepared on the caller's thread (so a background write sees a snapshot)."""

    options: SaveOptions
    rank: int
    tenure: Any
    payload: dict[str, Any]
    objects: bytes | None
    info: dict[str, Any]


@attrs.frozen
class Outcome:
    """A writer's result: the checkpoint's path, or the error text (and, on the writer only, the exception
    behind it as `cause`: `shared` leaves it out of what the group is told)."""

    rank: int
    path: str | None = None
    error: str | None = None
    root: str = ""
    cause: BaseException | None = attrs.field(default=None, eq=False, repr=False)

    def shared(self) -> Outcome:
        """The outcome as the other ranks receive it (without the local `cause`)."""
        return attrs.evolve(self, cause=None)


def versions() -> dict[str, str]:
    package = sys.modules.get("elastic")
    return {
        "python": platform.python_version(),
        "torch": str(torch.__version__),
        "cloudpickle": str(getattr(cloudpickle, "__version__", "unknown")),
        "elastic-state": str(getattr(package, "__version__", "unknown")),
    }


def manifest_info(state: Any, tenure: Any, *, world: int, rank: int) -> dict[str, Any]:
    """What every manifest says of its checkpoint: class, saved fields and kinds, tenure, world size, the
    writing rank (-1: many), creation time, library versions (no objects)."""
    cls = type(state)
    now = time.time_ns()
    return {
        "class": f"{cls.__module__}.{cls.__qualname__}",
        "fields": [{"name": a.name, "kind": kind_of(getattr(state, a.name))} for a in saved_fields(cls)],
        "tenure": tenure_to_json(tenure),
        "tenure_repr": repr(tenure),
        "world_size": world,
        "writer_rank": rank,
        "created": datetime.fromtimestamp(now / 1e9, tz=timezone.utc).isoformat(timespec="milliseconds"),
        "created_ns": now,
        "versions": versions(),
        "objects": [],
    }


def prepare(state: Any, options: SaveOptions, *, rank: int, world: int, tenure: Any) -> Job:
    """The writer's job for `state` at `tenure`, written by `rank` of `world`; for an async save
    (``options.blocking`` False) with the tensors copied to a CPU staging area."""
    flat = flatten(state, "save")
    encoded = encode_skeleton(flat.skeleton)
    objects = pickle_objects(encoded) if encoded.objects else None
    tensors = to_save(flat) if options.blocking else stage_copy(flat.tensors, flat.metas)
    payload = {
        "format": CONTENT_VERSION,
        "skeleton": encoded.plain,
        "tensors": tensors,
        "devices": [t.device.type for t in flat.tensors],
    }
    info = {**manifest_info(state, tenure, world=world, rank=rank), "objects": encoded.object_summary()}
    return Job(options=options, rank=rank, tenure=tenure, payload=payload, objects=objects, info=info)


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


def retain(options: SaveOptions, written: Any) -> None:
    """Keep the `options.keep` most tenured complete checkpoints, and always `written`."""
    storage, root, keep = options.storage, options.root, options.keep
    if keep is None:
        return
    complete = scan(root, storage=storage, warn=False, op="save")
    keepers = {storage.name(c.path) for c in complete[:keep]} | {storage.name(written)}
    for cand in complete:
        if storage.name(cand.path) not in keepers:
            log.info("save: retention (keep=%d) removes %s", keep, cand.path)
            storage.retire(cand.path)
    storage.settle(root)


def write(job: Job) -> Any:
    """Write one checkpoint durably under `job.root`; returns its location (a directory)."""
    root, rank, storage = job.options.root, job.rank, job.options.storage
    if is_checkpoint_dir(root, storage):
        msg = (
            f"{root} is itself a checkpoint (it holds {MANIFEST}); pass the directory that holds checkpoints"
        )
        raise ValueError(msg)
    started = time.time()
    storage.make_root(root)
    storage.clean_stale(root, started)
    pending = storage.begin(root, dir_name(job.tenure))
    try:
        fault_point("write", rank)
        files = []
        if job.objects is not None:
            files.append(write_bytes(pending, OBJECTS, job.objects))
        # torch's own CRC-32 stays on in the async writer (see `write_content`)
        files.append(write_content(pending, CONTENT, job.payload, crc32=not job.options.blocking))
        fault_point("manifest", rank)
        manifest = build_manifest(job.info, files)
        pending.seal(MANIFEST, manifest_bytes(manifest))
        fault_point("rename", rank)
        final = pending.publish()
    except BaseException:
        pending.discard()
        raise
    log.info("save: rank %d wrote %s (tenure %r)", rank, final, job.tenure)
    try:
        fault_point("retain", rank)
        retain(job.options, final)
    except Exception as exc:  # the checkpoint is durable; failing to delete old ones is not fatal
        log.warning("save: retention under %s failed: %s: %s", root, type(exc).__name__, exc)
    return final


def run_job(job: Job) -> Outcome:
    root, storage = job.options.root, job.options.storage
    try:
        return Outcome(rank=job.rank, path=str(write(job)), root=str(root))
    except Exception as exc:
        return Outcome(rank=job.rank, error=storage.explain(exc) or explain(exc), root=str(root), cause=exc)


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
