"""Checksummed IO: checkpoint files written and read with chunked checksums computed on a hash pool.

Each file's checksum is a hash tree of depth one: the SHA-256 of the concatenated CRC-32s of its
`CHUNK`-byte pieces (the manifest records the root and the chunk size). CRC-32 detects any single damaged
byte with certainty and costs a fraction of SHA-256 on two cores. The pieces can be hashed
in parallel: writing hashes the pieces of each buffer on helper threads while the calling thread writes
it, and reading hashes them in parallel over a memory map (where the storage maps files; otherwise while
streaming), so verification costs one pass over the bytes spread over the cores. Where the storage can,
it starts writing back what is already written (Linux `sync_file_range`), so the final `fsync` finds little
left to do. Files go to and come from a `Storage` (`elastic.checkpoint.storage.base`); this module never
touches the filesystem.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import struct
import threading
import zlib
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import attrs
import torch

from elastic.checkpoint.storage.base import Pending, Sink, Storage

__all__ = [
    "CHUNK",
    "HASH",
    "TREE_KEY",
    "ChunkSum",
    "FileRecord",
    "HashingWriter",
    "hash_file",
    "hash_stream",
    "listed_crcs",
    "tree_root",
    "without_zip_crc",
    "write_bytes",
    "write_content",
]

#: The checksum algorithm and the size of each checksummed chunk.
HASH = "sha256"  # of the manifest, and of the list of chunk checksums (the tree root)
TREE_KEY = "crc32_tree"
CHUNK = 2 * 2**20

#: Writes smaller than this are gathered into one buffer before being hashed and written.
_SMALL = 256 * 2**10
_GATHER = 4 * 2**20


# ---------------------------------------------------------------------------------------------------------
# Hashing


_pool_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_pool_pid = -1


def _pool_workers() -> int:
    return min(4, os.cpu_count() or 1)


def _hash_pool() -> ThreadPoolExecutor:
    """Threads for hashing (hashlib releases the GIL); made on first use, again after a fork."""
    global _pool, _pool_pid
    with _pool_lock:
        if _pool is None or _pool_pid != os.getpid():
            _pool = ThreadPoolExecutor(max_workers=_pool_workers(), thread_name_prefix="elastic-hash")
            _pool_pid = os.getpid()
        return _pool


@attrs.frozen
class FileRecord:
    """One file of a checkpoint as the manifest lists it."""

    name: str
    size: int
    digest: str
    chunk: int = CHUNK
    #: the CRC-32 of every chunk, listed in the manifest where pieces of the file are read alone (a
    #: sharded checkpoint's files); empty otherwise
    crcs: tuple[int, ...] = ()

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"size": self.size, "chunk": self.chunk, TREE_KEY: self.digest}
        if self.crcs:
            out["crc32"] = "".join(f"{c:08x}" for c in self.crcs)  # one JSON string: cheap to encode
        return out


def listed_crcs(record: dict[str, Any]) -> list[int]:
    """The chunk CRC-32s a manifest's file record lists (a hex string, 8 digits a chunk, or a list of
    ints as the first sharded checkpoints wrote them)."""
    value = record["crc32"]
    if isinstance(value, str):
        raw = bytes.fromhex(value)
        return list(struct.unpack(f">{len(raw) // 4}I", raw))
    return [int(c) for c in value]


class ChunkSum:
    """The checksum of one chunk: CRC-32 (zlib, which releases the GIL on large buffers).

    CRC-32 detects every burst error up to 32 bits, so any single flipped byte, with certainty; a
    cryptographic hash would add nothing here (whoever can edit a file can rewrite its manifest) and costs
    more than a bare `torch.load` on two cores.
    """

    __slots__ = ("value",)

    def __init__(self, data: Any = b"") -> None:
        self.value = zlib.crc32(data) if len(data) else 0

    def update(self, data: Any) -> None:
        self.value = zlib.crc32(data, self.value)

    def digest(self) -> bytes:
        return self.value.to_bytes(4, "little")


def tree_root(chunk_digests: list[bytes]) -> str:
    """The checksum of a file from the digests of its chunks, in order."""
    return hashlib.new(HASH, b"".join(chunk_digests)).hexdigest()


def n_chunks(size: int, chunk: int) -> int:
    return math.ceil(size / chunk) if size else 0


#: Start writeback after this many new bytes.
_WRITEBACK = 32 * 2**20


class HashingWriter:
    """A binary file object that writes to a `Sink` and checksums what it writes, chunk by chunk.

    Large buffers are hashed on the hash pool while this thread writes them; small writes are gathered
    first. Each write returns only once its bytes are written and hashed, so the caller may reuse them.
    """

    def __init__(self, sink: Sink, chunk: int = CHUNK) -> None:
        self._sink = sink
        self._chunk = chunk
        self._hashes: list[Any] = []
        self._pos = 0  # bytes written to the file so far
        self._gathered = bytearray()
        self._flushed = 0  # bytes whose writeback has been started

    def write(self, data: Any) -> int:
        view = memoryview(data)
        if not view.contiguous:
            view = memoryview(view.tobytes())
        view = view.cast("B")
        n = view.nbytes
        if n < _SMALL:
            self._gathered += view
            if len(self._gathered) >= _GATHER:
                self._flush_gathered()
            return n
        self._flush_gathered()
        self._write_hashed(view)
        return n

    def flush(self) -> None:
        self._flush_gathered()

    def digest(self) -> str:
        self._flush_gathered()
        return tree_root([h.digest() for h in self._hashes])

    @property
    def size(self) -> int:
        return self._pos + len(self._gathered)

    def chunk_crcs(self) -> list[int]:
        """The CRC-32 of each chunk written so far, in order (the last one partial)."""
        self._flush_gathered()
        return [h.value for h in self._hashes]

    def _flush_gathered(self) -> None:
        if self._gathered:
            data = bytes(self._gathered)
            self._gathered.clear()
            self._write_hashed(memoryview(data))

    def _pieces(self, view: memoryview) -> list[tuple[int, memoryview]]:
        pieces = []
        offset = 0
        while offset < view.nbytes:
            k = (self._pos + offset) // self._chunk
            take = min(view.nbytes - offset, (k + 1) * self._chunk - (self._pos + offset))
            pieces.append((k, view[offset : offset + take]))
            offset += take
        while len(self._hashes) <= (pieces[-1][0] if pieces else -1):
            self._hashes.append(ChunkSum())
        return pieces

    def _write_hashed(self, view: memoryview) -> None:
        pieces = self._pieces(view)
        if view.nbytes < _SMALL:
            for k, piece in pieces:
                self._hashes[k].update(piece)
            self._sink.write(view)
        else:
            pool = _hash_pool()
            futures: list[Future[None]] = []
            batch: list[tuple[ChunkSum, memoryview]] = []  # small chunks: one task hashes ~CHUNK bytes
            size = 0
            for k, piece in pieces:
                batch.append((self._hashes[k], piece))
                size += piece.nbytes
                if size >= CHUNK:
                    futures.append(pool.submit(_update, batch))
                    batch, size = [], 0
            if batch:
                futures.append(pool.submit(_update, batch))
            try:
                self._sink.write(view)
            finally:
                for f in futures:  # the buffer must outlive the hashing of it
                    f.result()
        self._pos += view.nbytes
        if self._pos - self._flushed >= _WRITEBACK:
            self._sink.written(self._flushed, self._pos - self._flushed)
            self._flushed = self._pos


def _update(batch: list[tuple[ChunkSum, memoryview]]) -> None:
    for h, piece in batch:
        h.update(piece)


@contextlib.contextmanager
def without_zip_crc(skip: bool = True) -> Iterator[None]:
    """`torch.save` without torch's own zip CRC-32 inside (when `skip`): the chunk checksums replace it,
    and computing both costs a second pass over the bytes. The setting is process-wide, so only a caller
    on the thread that asked for the save skips it (never a background writer, which would change it
    while the caller's thread may be saving something else). ``torch.load`` reads such files alike."""
    get = getattr(torch.serialization, "get_crc32_options", None)  # torch >= 2.6
    put = getattr(torch.serialization, "set_crc32_options", None)
    if not skip or get is None or put is None:
        yield
        return
    before = get()
    put(False)
    try:
        yield
    finally:
        put(before)


def write_content(pending: Pending, name: str, payload: dict[str, Any], *, crc32: bool = False) -> FileRecord:
    """`torch.save(payload)` into the new file `name` of `pending`, checksummed as written and synced.

    torch's own zip CRC-32 is skipped by default (`crc32=False`, `without_zip_crc`); the async writer keeps
    it on.
    """
    with pending.create(name) as sink:
        writer = HashingWriter(sink)
        with without_zip_crc(not crc32):
            torch.save(payload, writer)  # type: ignore[arg-type]
        writer.flush()
        sink.sync()
    return FileRecord(name, writer.size, writer.digest())


def write_bytes(pending: Pending, name: str, data: bytes, *, crcs: bool = False) -> FileRecord:
    """Write `data` to the new file `name` of `pending`, checksummed and synced (`crcs`: the record lists
    every chunk's CRC-32)."""
    with pending.create(name) as sink:
        writer = HashingWriter(sink)
        writer.write(data)
        writer.flush()
        sink.sync()
    return FileRecord(name, writer.size, writer.digest(), crcs=tuple(writer.chunk_crcs()) if crcs else ())


def hash_file(storage: Storage, location: Any, chunk: int = CHUNK) -> tuple[int, str]:
    """The size and checksum (see the module's docstring) of a file.

    Where the storage maps files, the chunks are hashed in parallel over the memory map, split into a few
    runs of consecutive chunks, one per helper thread; elsewhere while the file is streamed.
    """
    with storage.mapped(location) as view:
        if view is None:
            if storage.local_path(location) is not None:  # an empty local file
                return 0, tree_root([])
            with storage.open_read(location) as f:
                return hash_stream(f, chunk)
        size = view.nbytes
        total = n_chunks(size, chunk)
        workers = _pool_workers()
        per_run = max(1, math.ceil(total / workers))
        runs = [(k, min(total, k + per_run)) for k in range(0, total, per_run)]
        if len(runs) == 1:
            digests = _digest_run(view, chunk, size, *runs[0])
        else:
            futures = [_hash_pool().submit(_digest_run, view, chunk, size, a, b) for a, b in runs]
            digests = [d for fut in futures for d in fut.result()]
    return size, tree_root(digests)


def hash_stream(f: Any, chunk: int = CHUNK) -> tuple[int, str]:
    """The size and checksum of what `f.read` gives until its end, read one chunk at a time."""
    digests = []
    size = 0
    while True:
        piece = f.read(chunk)
        if not piece:
            break
        size += len(piece)
        digests.append(ChunkSum(piece).digest())
    return size, tree_root(digests)


def _digest_run(view: memoryview, chunk: int, size: int, first: int, stop: int) -> list[bytes]:
    """The digests of chunks `first` to `stop - 1` of a mapped file."""
    out = []
    for k in range(first, stop):
        piece = view[k * chunk : min(size, (k + 1) * chunk)]
        try:
            out.append(ChunkSum(piece).digest())
        finally:
            piece.release()
    return out
