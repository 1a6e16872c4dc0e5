"""Checkpoints of sharded states in the format of `torch.distributed.checkpoint` (DCP), resharded on load.

A sharded checkpoint is a DCP checkpoint: one ``__<rank>_0.distcp`` file per writing rank and DCP's pickled
``.metadata``, written with DCP's own planners (`DefaultSavePlanner`, `DefaultLoadPlanner`), so that
``torch.distributed.checkpoint.load(state.state_dict(), checkpoint_id=path)`` reads it on any mesh. The
library adds what DCP leaves out, by its own rules (`elastic.checkpoint.storage`): the files are written
into a pending checkpoint and published atomically with the manifest last, every file is checksummed
(CRC-32 per chunk, listed in the manifest; small chunks: `chunk_for`), retention keeps the most tenured,
and fsspec URLs work.

Writers: the elected version's holder of each shard position writes that position's pieces (one writer
per position, in parallel); the rank sending the version's objects writes the plain leaves. DCP's plans are
exchanged with the library's own collectives, so that a save can run its file writes in a background
thread (``blocking=False``) while training goes on.

Loading: every rank reads what its new shards overlap (DCP's load planner computes which saved pieces), from
a checkpoint every rank sees: of each saved piece's `torch.save` blob only its zip directory, its pickle and
the chunks holding the values the rank needs (`elastic.checkpoint.blob`), into one reused buffer; each chunk
is verified before its bytes are used, and copied from that buffer into a staging tensor of its target; once
every rank has read and verified its pieces, the staging tensors are copied into the live ones. A corrupt
piece is never loaded: the group falls back to the next candidate with the state untouched.
"""

from __future__ import annotations

import functools
import io
import logging
import pickle
import threading
import time
import zlib
from collections.abc import Sequence
from typing import Any, cast

import attrs
import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint._nested_dict import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, SavePlan, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from elastic._util.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    UntrustedCheckpointError,
)
from elastic.checkpoint.blob import locate, view_of
from elastic.checkpoint.codec import MANIFEST
from elastic.checkpoint.content import (
    CHUNK,
    FileRecord,
    HashingWriter,
    listed_crcs,
    without_zip_crc,
    write_bytes,
)
from elastic.checkpoint.manifest import (
    DCP_LAYOUT,
    DCP_METADATA,
    Candidate,
    InvalidCheckpoint,
    build_manifest,
    dir_name,
    is_checkpoint_dir,
    manifest_bytes,
    scan,
    skipped,
    validate,
)
from elastic.checkpoint.options import LoadOptions, SaveOptions
from elastic.checkpoint.storage.base import Pending, Storage
from elastic.checkpoint.write import explain, manifest_info, retain
from elastic.replication.collective import Collective, raise_first
from elastic.replication.comm import fault_point
from elastic.replication.sharded import (
    ShardRecord,
    Version,
    check_schemas,
    elect_version,
    group_layout,
    shard_record,
    sync_sharded,
)
from elastic.state.config import StateConfig
from elastic.state.lineage import lineage, set_lineage
from elastic.state.shards import apply_sharded, mesh_of, sharded_state_dict, walks_alike
from elastic.state.tenure import as_saveable, check_saveable, current, exceeds, order_key

__all__ = ["LAYOUT", "METADATA", "ShardedWrite", "load_sharded", "save_sharded"]

log = logging.getLogger("elastic")

LAYOUT, METADATA = DCP_LAYOUT, DCP_METADATA


def _file_name(rank: int) -> str:
    return f"__{rank}_0.distcp"  # DCP's own naming: the storage prefix of the rank, file 0


# ---------------------------------------------------------------------------------------------------------
# Save


class _Planner(DefaultSavePlanner):
    """DCP's save planner, resolving write items from the tensors staged for this save."""

    def __init__(self) -> None:
        super().__init__()
        self.staged: dict[MetadataIndex, Any] = {}

    def resolve_data(self, write_item: WriteItem) -> Any:
        found = self.staged.get(write_item.index)
        return found if found is not None else super().resolve_data(write_item)


def _keep(item: WriteItem, writes_pieces: bool, writes_objects: bool) -> bool:
    """Whether this rank writes `item`: DTensor chunks by their position's writer, the rest by the
    sender."""
    return writes_pieces if item.type == WriteItemType.SHARD else writes_objects


@attrs.frozen
class _Written:
    """What a rank reports once its file is written: DCP's write results and the file record."""

    results: tuple[WriteResult, ...] = ()
    file: FileRecord | None = None
    error: str | None = None


#: A sharded file's checksum chunks: small, so that a rank reading part of a saved piece reads (and
#: verifies) little more than that part, and at most about `MAX_CHUNKS` of them (their CRCs are listed in the
#: manifest).
MIN_CHUNK, MAX_CHUNKS = 64 * 2**10, 4096


def chunk_for(nbytes: int) -> int:
    """The checksum chunk of a sharded file of about `nbytes`: a power of two from `MIN_CHUNK` to `CHUNK`."""
    chunk = MIN_CHUNK
    while chunk < CHUNK and chunk * MAX_CHUNKS < nbytes:
        chunk *= 2
    return chunk


def _write_file(
    storage: Storage, handle: Any, name: str, items: list[tuple[WriteItem, Any]], rank: int, foreground: bool
) -> _Written:
    """Write this rank's items into `name` of the pending checkpoint, as DCP's `FileSystemWriter` lays them
    out (bytes first, then `torch.save` of each tensor), checksummed, and sync it."""
    contribution = storage.contribute(handle)
    try:
        fault_point("write", rank)
        results = []
        chunk = chunk_for(
            sum(d.numel() * d.element_size() for i, d in items if i.type != WriteItemType.BYTE_IO)
        )
        with contribution.create(name) as sink, without_zip_crc(foreground):
            writer = HashingWriter(sink, chunk)
            ordered = [x for x in items if x[0].type == WriteItemType.BYTE_IO]
            ordered += [x for x in items if x[0].type != WriteItemType.BYTE_IO]
            for item, data in ordered:
                offset = writer.size
                if item.type == WriteItemType.BYTE_IO:
                    writer.write(data.getbuffer())
                else:
                    torch.save(data.detach().cpu() if data.device.type != "cpu" else data.detach(), writer)  # type: ignore[arg-type]
                length = writer.size - offset
                results.append(
                    WriteResult(
                        index=item.index,
                        size_in_bytes=length,
                        storage_data=_StorageInfo(name, offset, length),
                    )
                )
            writer.flush()
            sink.sync()
        return _Written(
            tuple(results), FileRecord(name, writer.size, writer.digest(), chunk, tuple(writer.chunk_crcs()))
        )
    except Exception as exc:
        return _Written(error=storage.explain(exc) or explain(exc))
    finally:
        contribution.close()


class ShardedWrite:
    """A sharded save in progress: this rank's file write (maybe in a thread), then the collective finish
    (`finish`): every rank's results reach the coordinator, which writes DCP's metadata and the manifest and
    publishes; every rank returns the path or raises the same `CheckpointError`."""

    def __init__(
        self,
        g: Collective,
        options: SaveOptions,
        coordinator: int,
        pending: Pending | None,
        handle: Any,
        metadata: Metadata | None,
        items: list[tuple[WriteItem, Any]],
        info: dict[str, Any],
        failure: str | None,
    ) -> None:
        self.g = g
        self.options = options
        self.coordinator = coordinator
        self.pending = pending
        self.metadata = metadata
        self.info = info
        self._written: _Written | None = _Written(error=failure) if failure is not None else None
        self._args = (options.storage, handle, _file_name(g.rank), items, g.rank)
        self.thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._result: Any = None

    def start(self, background: bool) -> None:
        if self._written is not None:
            return
        if not self._args[3] and self.g.rank != self.coordinator:
            self._written = _Written()  # nothing to write here
            return
        if background:
            self.thread = threading.Thread(target=self._work, name="elastic-save", daemon=False)
            self.thread.start()
        else:
            self._work()

    def _work(self) -> None:
        self._written = _write_file(*self._args, foreground=self.thread is None)

    def done(self) -> bool:
        return self.thread is None or not self.thread.is_alive()

    def finish(self) -> Any:
        with self._lock:
            if self._result is None:
                self._result = self._finish()
            if isinstance(self._result, CheckpointError):
                raise self._result
            return self._result

    def _finish(self) -> Any:
        if self.thread is not None:
            self.thread.join()
        written = self._written or _Written(error="the write never ran")
        rows = self.g.gather(written, "save-commit")
        outcome: tuple[str | None, str | None] = (None, None)
        if self.g.rank == self.coordinator:
            outcome = self._publish(rows)
        final = self.g.gather(outcome if self.g.rank == self.coordinator else None, "save-publish")[
            self.coordinator
        ]
        assert final is not None  # the coordinator always reports
        path, error = final
        if error is not None:
            return CheckpointError(
                f"save: {error}. No checkpoint was published; older checkpoints stay valid"
            )
        return self.options.storage.result(path)

    def _publish(self, rows: Sequence[_Written]) -> tuple[str | None, str | None]:
        storage = self.options.storage
        pending = self.pending
        failed = [(r, w.error) for r, w in enumerate(rows) if w.error is not None]
        if pending is None or self.metadata is None:
            return None, failed[0][1] if failed else "the checkpoint could not be started"
        if failed:
            pending.discard()
            return None, "; ".join(
                f"writing the pieces of rank {r} under {self.options.root} failed: {e}" for r, e in failed
            )
        try:
            md = self.metadata
            md.storage_data = {wr.index: wr.storage_data for w in rows for wr in w.results}
            buf = io.BytesIO()
            pickle.dump(md, buf)
            files = [w.file for w in rows if w.file is not None]
            files.append(write_bytes(pending, METADATA, buf.getvalue(), crcs=True))
            fault_point("manifest", self.g.rank)
            manifest = build_manifest(self.info, files)
            pending.seal(MANIFEST, manifest_bytes(manifest))
            fault_point("rename", self.g.rank)
            final = pending.publish()
        except Exception as exc:
            pending.discard()
            return None, storage.explain(exc) or explain(exc)
        log.info(
            "save: %d writers wrote the sharded checkpoint %s (tenure %r)",
            len(files) - 1,
            final,
            self.info["tenure_repr"],
        )
        try:
            retain(self.options, final)
        except Exception as exc:
            log.warning("save: retention under %s failed: %s: %s", self.options.root, type(exc).__name__, exc)
        return str(final), None


def _stage(data: Any, copy: bool) -> Any:
    """A write item's data as the writer will see it: tensors detached (copied to CPU for an async save)."""
    if isinstance(data, torch.Tensor):
        t = data.detach()
        if copy or t.device.type != "cpu":
            return t.to("cpu", copy=True)
        if t.untyped_storage().nbytes() != t.numel() * t.element_size():  # a view: torch.save writes its
            return t.clone()  # whole storage (as DCP does, copy it out)
        return t
    return data


def save_sharded(state: Any, config: StateConfig, g: Collective, options: SaveOptions) -> ShardedWrite:
    """Start a sharded save (collective); the caller runs `ShardedWrite.finish` (now, or in `wait`)."""
    comm = g.comm
    op = "save"
    if options.scope != "global":
        msg = (
            f"save(scope={options.scope!r}) is not supported for sharded states: their pieces are written "
            "by one rank per shard position into one checkpoint, which every rank must see; use "
            "scope='global' with a shared filesystem or an fsspec URL"
        )
        raise ValueError(msg)
    layout, ranks = group_layout(comm, mesh_of(state, "save"), op)
    record, _ = shard_record(state, config, layout, ranks[g.rank], "save")
    records = g.gather(record, "save-elect")
    check_schemas(records, op)
    version = elect_version(records, layout, ranks, op)
    tenure = as_saveable(version.tenure)
    check_saveable(tenure)
    coordinator = version.src
    writes_pieces = version.sources.get(records[g.rank].position) == g.rank
    writes_objects = g.rank == coordinator
    # The coordinator opens the pending checkpoint; every writer learns where it is.
    pending: Pending | None = None
    opened: tuple[Any, str | None] = (None, None)
    storage = options.storage
    if g.rank == coordinator:
        try:
            if is_checkpoint_dir(options.root, storage):
                msg = f"{options.root} is a checkpoint itself (holds {MANIFEST}); pass its parent directory"
                raise ValueError(msg)
            storage.make_root(options.root)
            storage.clean_stale(options.root, time.time())
            pending = storage.begin(options.root, dir_name(tenure))
            opened = (pending.handle(), None)
        except Exception as exc:
            opened = (None, storage.explain(exc) or explain(exc))
    handle, error = g.gather(opened if g.rank == coordinator else None, "save-open")[coordinator]  # type: ignore[misc]
    if error is not None:
        raise CheckpointError(
            f"save: opening a checkpoint under {options.root} failed on rank {coordinator}: {error}"
        )
    # DCP's plans, exchanged with the library's collectives.
    failure: str | None = None
    items: list[tuple[WriteItem, Any]] = []
    metadata: Metadata | None = None
    planner = _Planner()
    try:
        sd = sharded_state_dict(state, "save")
        planner.set_up_planner(sd, None, g.rank == coordinator)
        local = planner.create_local_plan()
        local = SavePlan(
            [i for i in local.items if _keep(i, writes_pieces, writes_objects)],
            storage_data=None,
            planner_data=local.planner_data,
        )
    except Exception as exc:
        local = SavePlan([])
        failure = f"{type(exc).__name__}: {exc}"
    plans = g.gather((local, failure), "save-plan")
    raise_first(
        [f for _, f in plans],
        lambda r, e: CheckpointError(f"save: rank {r} could not plan its part: {e}"),
        error_of=lambda e: e,
    )
    try:
        global_plans, metadata = planner.create_global_plan([p for p, _ in plans])
        mine = planner.finish_plan(global_plans[g.rank])
        items = [(item, _stage(planner.resolve_data(item), not options.blocking)) for item in mine.items]
    except Exception as exc:
        failure = f"{type(exc).__name__}: {exc}"
    info = {
        **manifest_info(state, tenure, world=g.world, rank=-1),
        "layout": LAYOUT,
        "mesh": layout.describe(),
    }
    write = ShardedWrite(g, options, coordinator, pending, handle, metadata, items, info, failure)
    write.start(background=not options.blocking)
    return write


# ---------------------------------------------------------------------------------------------------------
# Load


class _LoadPlanner(DefaultLoadPlanner):
    """DCP's load planner over the live state dict that reads every tensor into a staging tensor of its own
    (`commit` copies them in once every rank has read and verified its pieces), and unpickles only plain
    data unless the caller trusts the checkpoint."""

    def __init__(self, trusted: bool, strict: bool) -> None:
        super().__init__(allow_partial_load=not strict)
        self.trusted = trusted
        self.refused: list[str] = []
        self.staged: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # fqn: (live local tensor, staging)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        got = self.staged.get(index.fqn)
        if got is None:
            live = super().lookup_tensor(index)  # a DTensor's local tensor, or the plain tensor
            got = self.staged[index.fqn] = (live, torch.empty_like(live))
        return got[1]

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        try:
            loaded = torch.load(value, weights_only=not self.trusted)
        except pickle.UnpicklingError:
            self.refused.append(read_item.dest_index.fqn)
            return
        set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)

    def commit(self) -> Any:
        """Copy the staged tensors into the live ones; the state dict to apply (objects set, the tensors
        live)."""
        for live, staging in self.staged.values():
            live.copy_(staging)
        self.staged.clear()
        return self.original_state_dict


class _Corrupt(Exception):
    pass


def _read_pieces(
    storage: Storage,
    directory: Any,
    manifest: dict[str, Any] | None,
    plan: Any,
    planner: _LoadPlanner,
    md: Metadata,
) -> None:
    """DCP's reads of `plan`, each chunk verified against the manifest before its bytes are used.

    A tensor's blob is not read whole: its zip directory and pickle say where its values lie
    (`elastic.checkpoint.blob.locate`), and only the chunks holding the values this rank's piece needs are
    read, into one reused buffer, and copied from there into the target (a blob `locate` does not know is
    read whole and goes through ``torch.load``)."""
    files = manifest["files"] if manifest is not None else None
    per_file: dict[str, list[Any]] = {}
    for item in plan.items:
        info = md.storage_data[item.storage_index]
        per_file.setdefault(info.relative_path, []).append(item)
    buf = bytearray()

    def into_buffer(chunks: _Chunks, a: int, b: int) -> int:
        """Bytes [a, b) of the file in `buf` (whole chunks, verified); where byte `a` is in `buf`."""
        nonlocal buf
        start, stop = chunks.bounds(a, b)
        if len(buf) < stop - start:
            buf = bytearray(stop - start)
        chunks.read(start, stop, buf)
        return a - start

    with storage.session(directory):
        for name, reqs in per_file.items():
            if files is None:  # a plain DCP checkpoint: nothing to verify against
                rec = None
            else:
                rec = files.get(name)
                if rec is None or "crc32" not in rec:
                    raise _Corrupt(f"{name} is not listed in the manifest")
            with storage.open_read(storage.join(directory, name)) as f:
                chunks = _Chunks(f, rec, name)
                for req in sorted(reqs, key=lambda r: md.storage_data[r.storage_index].offset):
                    info = md.storage_data[req.storage_index]
                    fqn = req.storage_index.fqn
                    if req.type == LoadItemType.BYTE_IO:
                        at = into_buffer(chunks, info.offset, info.offset + info.length)
                        planner.load_bytes(req, io.BytesIO(memoryview(buf)[at : at + info.length]))
                        continue
                    base = info.offset
                    layout = locate(functools.partial(_in_blob, chunks, base), info.length)
                    if layout is not None:
                        extent = layout.extent(req.storage_offsets, req.lengths)
                        if extent is None:
                            raise _Corrupt(
                                f"{name}: the saved piece of {fqn} has shape {layout.size}, which holds no "
                                f"region at {tuple(req.storage_offsets)} of {tuple(req.lengths)}"
                            )
                        lo, hi = extent
                        size = layout.dtype.itemsize
                        a = base + layout.data + lo * size
                        at = into_buffer(chunks, a, a + (hi - lo) * size)
                        tensor = view_of(buf, at, layout.dtype, hi - lo, req.lengths, layout.stride)
                    else:
                        at = into_buffer(chunks, base, base + info.length)
                        blob = io.BytesIO(memoryview(buf)[at : at + info.length])
                        tensor = torch.load(blob, map_location="cpu", weights_only=True)
                        tensor = narrow_tensor_by_index(tensor, req.storage_offsets, req.lengths)
                    target = planner.resolve_tensor(req).detach()
                    if target.size() != tensor.size():
                        raise _Corrupt(
                            f"{name}: a piece of {fqn} has shape {tuple(tensor.size())}, expected "
                            f"{tuple(target.size())}"
                        )
                    target.copy_(tensor)
                    planner.commit_tensor(req, target)
                    del tensor


def _in_blob(chunks: _Chunks, base: int, a: int, b: int) -> Any:
    return chunks.small(base + a, base + b)


class _Chunks:
    """Reads of one checkpoint file, each chunk's CRC-32 checked once per load before any of its bytes is
    used; the last few chunks of small reads (a blob's zip directory and pickle) are kept. `rec` None: a
    plain DCP file, nothing to check."""

    KEPT = 4

    def __init__(self, f: Any, rec: dict[str, Any] | None, name: str) -> None:
        self.f = f
        self.chunk = int(rec["chunk"]) if rec is not None else 0
        self.crcs = listed_crcs(rec) if rec is not None else None
        self.size = int(rec["size"]) if rec is not None else 0
        self.name = name
        self.verified: set[int] = set()
        self.kept: dict[int, bytes] = {}

    def bounds(self, a: int, b: int) -> tuple[int, int]:
        """What to read for bytes [a, b): the whole chunks they touch."""
        if self.crcs is None:
            return a, b
        chunk = self.chunk
        last = (b - 1) // chunk if b > a else a // chunk
        return a // chunk * chunk, min((last + 1) * chunk, self.size)

    def _fill(self, view: memoryview) -> None:
        got = 0
        while got < len(view):
            n = self.f.readinto(view[got:])
            if not n:
                raise _Corrupt(f"{self.name} is shorter than the manifest says")
            got += n

    def _check(self, k: int, piece: Any) -> None:
        assert self.crcs is not None
        if k >= len(self.crcs) or zlib.crc32(piece) != self.crcs[k]:
            start = k * self.chunk
            msg = f"{self.name}: chunk {k} (bytes {start}-{start + len(piece)}) fails its checksum"
            raise _Corrupt(msg)
        self.verified.add(k)

    def read(self, start: int, stop: int, buf: bytearray) -> memoryview:
        """Bytes [start, stop) (chunk bounds) read into `buf`, every chunk among them verified."""
        self.f.seek(start)
        view = memoryview(buf)[: stop - start]
        self._fill(view)
        if self.crcs is not None:
            chunk = self.chunk
            for k in range(start // chunk, (stop + chunk - 1) // chunk):
                if k not in self.verified:
                    a = k * chunk - start
                    self._check(k, view[a : min(a + chunk, len(view))])
        return view

    def _one(self, k: int) -> bytes:
        got = self.kept.pop(k, None)
        if got is None:
            start = k * self.chunk
            data = bytearray(min(self.chunk, self.size - start))
            self.f.seek(start)
            self._fill(memoryview(data))
            self._check(k, data)
            got = bytes(data)
        self.kept[k] = got  # the most recent last
        while len(self.kept) > self.KEPT:
            del self.kept[next(iter(self.kept))]
        return got

    def small(self, a: int, b: int) -> Any:
        """Bytes [a, b) of the file, verified (for reads of a few bytes: whole chunks are kept)."""
        if self.crcs is None:
            self.f.seek(a)
            data = bytearray(b - a)
            self._fill(memoryview(data))
            return data
        if b <= a:
            return b""
        chunk = self.chunk
        first, last = a // chunk, (b - 1) // chunk
        if first == last:
            return memoryview(self._one(first))[a - first * chunk : b - first * chunk]
        joined = b"".join(self._one(k) for k in range(first, last + 1))
        return memoryview(joined)[a - first * chunk : b - first * chunk]


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's metadata and nothing else: its own classes, torch's sizes, dtypes and layouts, a
    few plain containers. Anything else (code a crafted ``.metadata`` would run) is refused."""

    _MODULES = ("torch.distributed.checkpoint.",)
    _NAMES = frozenset(
        {
            ("torch.serialization", "_get_layout"),
            ("torch", "Size"),
            ("collections", "OrderedDict"),
            ("builtins", "set"),
            ("builtins", "frozenset"),
            ("builtins", "slice"),
            # DCP records the checkpoint_id it was given, a path
            ("pathlib", "Path"),
            ("pathlib", "PosixPath"),
            ("pathlib", "PurePosixPath"),
            ("pathlib", "WindowsPath"),
            ("pathlib", "PureWindowsPath"),
        }
    )

    def find_class(self, module: str, name: str) -> Any:
        allowed = (module, name) in self._NAMES or module.startswith(self._MODULES)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            allowed = True
        if not allowed:
            msg = f"DCP metadata refers to {module}.{name}, which DCP's metadata never holds"
            raise pickle.UnpicklingError(msg)
        return super().find_class(module, name)


class _UntrustedMetadata(Exception):
    pass


def _load_metadata(raw: bytes, trusted: bool, where: Any) -> Metadata:
    """DCP's pickled ``.metadata``: unpickled in full only when the caller trusts the checkpoint."""
    if trusted:
        return pickle.loads(raw)  # the caller trusts this checkpoint
    try:
        return _MetadataUnpickler(io.BytesIO(raw)).load()
    except pickle.UnpicklingError as exc:
        msg = f"{where}: {exc}; pass trusted=True only if you trust this checkpoint"
        raise _UntrustedMetadata(msg) from exc


@attrs.frozen
class _Seen:
    path: str
    tenure: Any
    created_ns: int
    world_size: int
    #: written by plain `torch.distributed.checkpoint.save` (no manifest: no tenure, no checksums)
    plain: bool = False


def is_plain_dcp(root: Any, storage: Storage) -> bool:
    """Whether `root` is a checkpoint of plain DCP: its metadata file, no manifest."""
    return storage.exists(storage.join(root, METADATA)) and not is_checkpoint_dir(root, storage)


@attrs.frozen
class _Verdict:
    kind: str = "ok"  # ok, corrupt, untrusted, mismatch, error
    message: str = ""


def sharded_candidates(options: LoadOptions) -> list[Candidate]:
    """The sharded checkpoints under the root (or the one named), most tenured first."""
    root, storage = options.root, options.storage
    if is_checkpoint_dir(root, storage):
        try:
            found = [validate(root, storage)]
        except InvalidCheckpoint as exc:
            skipped("load", str(exc))
            return []
    else:
        found = scan(root, storage=storage, op="load")
    out = []
    for c in found:
        if c.manifest.get("layout") == LAYOUT:
            out.append(c)
        else:
            log.info("load: %s holds a replicated state, not a sharded one: skipped", c.path)
    return out


def load_sharded(
    state: Any, config: StateConfig, g: Collective, options: LoadOptions
) -> tuple[str, int, Any, Any, int | None]:
    """The sharded `load` (collective): (source, src, tenure, path, saved world size)."""
    comm = g.comm
    op = "load"
    layout, ranks = group_layout(comm, mesh_of(state, "sync"), op)
    record, synced = shard_record(state, config, layout, ranks[g.rank], "sync")
    # the same walk serves the read when the fields agree and no optimizer needs its state allocated
    walked = synced if walks_alike(state) and all(has for _, has in record.stateful) else None
    try:
        if is_plain_dcp(options.root, options.storage):
            seen: tuple[_Seen, ...] = (_Seen(str(options.root), None, 0, 0, plain=True),)
        else:
            seen = tuple(
                _Seen(str(c.path), c.tenure, c.created_ns, c.world_size) for c in sharded_candidates(options)
            )
        scan_error = None
    except Exception as exc:
        seen, scan_error = (), options.storage.explain(exc) or f"{type(exc).__name__}: {exc}"
    rows = g.gather((record, seen, scan_error), "load-scan")
    raise_first(
        [e for _, _, e in rows],
        lambda r, e: CheckpointError(f"load: cannot list {options.root} on rank {r}: {e}"),
        error_of=lambda e: e,
    )
    records: list[ShardRecord] = [r for r, _, _ in rows]
    check_schemas(records, op)
    memory = _memory_version(records, layout, ranks)
    # Checkpoints every rank sees (each rank reads its own pieces), most tenured first.
    common = [s for s in rows[0][1] if all(any(o.path == s.path for o in r[1]) for r in rows[1:])]
    common.sort(key=lambda s: (order_key(s.tenure), s.created_ns), reverse=True)
    corrupt: list[str] = []
    for cand in common:
        if (
            not cand.plain
            and memory is not None
            and not exceeds(cand.tenure, memory.tenure, f"checkpoint {cand.path}", "the in-memory state", op)
        ):
            break
        verdict, planner = _read_into_staging(state, options, cand, walked)
        walked = None  # the planner wrote into it: a next candidate walks afresh
        verdicts = g.gather(verdict, "load-read")
        bad = [(r, v) for r, v in enumerate(verdicts) if v.kind != "ok"]
        if not bad:
            set_lineage(state, token=None, torn=True)  # until every rank has applied it
            try:
                apply_sharded(state, cast(_LoadPlanner, planner).commit(), "save")
                failed = None
            except Exception as exc:
                failed = f"{type(exc).__name__}: {exc}"
            outcomes = g.gather(failed, "load-apply")
            for r, e in enumerate(outcomes):
                if e is not None:
                    msg = (
                        f"load: applying {cand.path} failed on rank {r}: {e}; the state is torn (tenure "
                        "None) until its next successful load or sync"
                    )
                    raise CheckpointError(msg)
            token = f"load:{cand.path}:{cand.created_ns}"
            set_lineage(state, token=token, torn=False)
            tenure = current(state, config, lineage(state)) if cand.plain else cand.tenure
            saved = None if cand.plain else cand.world_size
            return "checkpoint", 0, tenure, options.storage.result(cand.path), saved
        kinds = {v.kind for _, v in bad}
        if kinds <= {"corrupt"}:
            text = "; ".join(f"rank {r}: {v.message}" for r, v in bad)
            skipped(op, f"{cand.path}: {text}")
            corrupt.append(f"{cand.path}: {text}")
            continue
        r, v = next((r, v) for r, v in bad if v.kind != "corrupt")
        error: type[CheckpointError] = {
            "untrusted": UntrustedCheckpointError,
            "mismatch": CheckpointMismatchError,
        }.get(v.kind, CheckpointError)
        raise error(f"load: {v.message} (read by rank {r})")
    if corrupt and is_checkpoint_dir(options.root, options.storage):
        msg = (
            f"load: the checkpoint {options.root} is corrupt: {'; '.join(corrupt)}. Load from its parent "
            "directory to fall back to the next checkpoint, or restore the files"
        )
        raise CheckpointCorruptError(msg)
    sender, tenure, _, _ = (
        sync_sharded(state, config, g, src=None, force=False, op=op, started=time.perf_counter())
        if comm is not None
        else (0, record.tenure, 0, 0)
    )
    return "memory", sender, tenure, None, None


def _memory_version(records: Sequence[ShardRecord], layout: Any, ranks: Sequence[int]) -> Version | None:
    try:
        return elect_version(records, layout, ranks, "load")
    except Exception:
        return None


def _read_into_staging(
    state: Any, options: LoadOptions, cand: _Seen, walked: dict[str, Any] | None
) -> tuple[_Verdict, _LoadPlanner | None]:
    """Read this rank's pieces of `cand` into staging tensors (the planner's: its `commit` applies them);
    `walked`: the state's `sharded_state_dict` if already made (a fresh one is made otherwise)."""
    storage = options.storage
    directory = storage.result(cand.path)
    try:
        manifest = None if cand.plain else validate(directory, storage).manifest
        rec = manifest["files"].get(METADATA) if manifest is not None else None
        if manifest is not None and (rec is None or "crc32" not in rec):
            return _Verdict("corrupt", f"{METADATA} is not listed in the manifest"), None
        with storage.open_read(storage.join(directory, METADATA)) as f:
            if rec is None:
                raw = f.read()
            else:
                raw = bytes(_Chunks(f, rec, METADATA).read(0, rec["size"], bytearray(rec["size"])))
        md = _load_metadata(raw, options.trusted, cand.path)
        if walked is not None:
            live = walked
        else:
            live = sharded_state_dict(state, "save", init_optimizers=_has_optimizer_state(md))
        planner = _LoadPlanner(options.trusted, options.strict)
        planner.set_up_planner(live, md, False)
        try:
            plan = planner.finish_plan(planner.create_local_plan())
        except Exception as exc:
            return _Verdict("mismatch", f"{cand.path} does not match the state: {exc}"), None
        _read_pieces(storage, directory, manifest, plan, planner, md)
        if planner.refused:
            return _Verdict(
                "untrusted",
                f"{cand.path} holds pickled objects in {planner.refused[:5]}; pass trusted=True only "
                "for checkpoints you trust",
            ), None
        return _Verdict(), planner
    except _UntrustedMetadata as exc:
        return _Verdict("untrusted", str(exc)), None
    except _Corrupt as exc:
        return _Verdict("corrupt", str(exc)), None
    except InvalidCheckpoint as exc:
        return _Verdict("corrupt", str(exc)), None
    except Exception as exc:
        return _Verdict("error", f"reading {cand.path} failed: {type(exc).__name__}: {exc}"), None


def _has_optimizer_state(md: Metadata) -> bool:
    return any(".state." in k for k in md.state_dict_metadata)
