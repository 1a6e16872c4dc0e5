"""The checkpoint's files: a state skeleton as plain data, files written and read with chunked checksums.

A checkpoint directory holds ``state.pt`` (tensors and plain data; loads with ``torch.load(weights_only=True,
mmap=True)``), ``objects.pkl`` (cloudpickle, only when some leaf is not plain data) and ``manifest.json``.

The skeleton of `_tree.flatten` is encoded as nested dicts, lists and plain leaves. Every node that is not a
plain leaf becomes a dict with a ``"$"`` tag (the encoder never emits any other dict), so decoding is
unambiguous: ``{"$": "t", "i": 3}`` is tensor 3, ``{"$": "o", "i": 0}`` is object 0 of ``objects.pkl``,
``{"$": "state" | "stateful" | "dict" | "odict" | "list" | "tuple" | "ntuple" | "set" | "fset", ...}`` are
the containers. A namedtuple's type is an object too (importing a class can run code).

Each file's checksum is a hash tree of depth one: the SHA-256 of the concatenated CRC-32s of its
`CHUNK`-byte pieces (the manifest records the root and the chunk size). CRC-32 detects any single damaged
byte with certainty and costs a fraction of SHA-256 on two cores. The pieces can be hashed
in parallel: writing hashes the pieces of each buffer on helper threads while the calling thread writes
it, and reading hashes them in parallel over a memory map, so verification costs one pass over the bytes
spread over the cores. While a file is written, the kernel is asked to start writing back what is already
written (Linux `sync_file_range`), so the final `fsync` finds little left to do.
"""

from __future__ import annotations

import ctypes
import hashlib
import math
import mmap
import os
import sys
import threading
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import attrs
import cloudpickle
import torch

from ._tree import (
    RNG_KINDS,
    ContainerNode,
    RestoreNode,
    StatefulNode,
    StateNode,
    TensorSlot,
    as_nodes,
    from_nodes,
    path_str,
)

__all__ = [
    "CHUNK",
    "CONTENT",
    "HASH",
    "TREE_KEY",
    "MANIFEST",
    "OBJECTS",
    "Encoded",
    "FileRecord",
    "FormatError",
    "decode_skeleton",
    "encode_skeleton",
    "fsync_dir",
    "hash_file",
    "one_torch_thread",
    "slot_paths",
    "write_bytes",
    "write_content",
]

#: File names inside a checkpoint directory.
MANIFEST = "manifest.json"
CONTENT = "state.pt"
OBJECTS = "objects.pkl"
#: The checksum algorithm and the size of each checksummed chunk.
HASH = "sha256"  # of the manifest, and of the list of chunk checksums (the tree root)
TREE_KEY = "crc32_tree"
CHUNK = 2 * 2**20
#: Version of the layout of ``state.pt``'s top-level dict.
CONTENT_VERSION = 1

#: Writes smaller than this are gathered into one buffer before being hashed and written.
_SMALL = 256 * 2**10
_GATHER = 4 * 2**20


class FormatError(Exception):
    """A checkpoint file does not have the structure this version writes (corrupt or tampered)."""


# ---------------------------------------------------------------------------------------------------------
# Skeleton <-> plain data


_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size)


def _is_plain(value: Any) -> bool:
    return type(value) in _PLAIN


@attrs.define
class Encoded:
    """A skeleton as plain data, the objects it refers to and where each object sits."""

    plain: Any
    objects: list[Any]
    object_paths: list[tuple[Any, ...]]

    def object_summary(self) -> list[dict[str, str]]:
        """Per object: its path in the state and its type, for the manifest and for error messages."""
        return [
            {"path": path_str(p), "field": str(p[0]) if p else "", "type": _type_name(o)}
            for p, o in zip(self.object_paths, self.objects)
        ]


def _type_name(obj: Any) -> str:
    tp = obj if isinstance(obj, type) else type(obj)
    return f"{tp.__module__}.{tp.__qualname__}"


def encode_skeleton(skeleton: StateNode) -> Encoded:
    """The skeleton as plain nested dicts/lists/leaves; non-plain leaves are moved to an object list."""
    objects: list[Any] = []
    paths: list[tuple[Any, ...]] = []

    def obj(value: Any, path: tuple[Any, ...]) -> dict[str, Any]:
        objects.append(value)
        paths.append(path)
        return {"$": "o", "i": len(objects) - 1}

    def key(k: Any, path: tuple[Any, ...]) -> Any:
        if _is_plain(k):
            return k
        if type(k) is tuple:
            return {"$": "tuple", "v": [key(x, path) for x in k]}
        return obj(k, (*path, "<key>"))

    def enc(node: Any, path: tuple[Any, ...]) -> Any:
        if isinstance(node, TensorSlot):
            return {"$": "t", "i": node.index}
        if isinstance(node, StateNode):
            return {
                "$": "state",
                "q": node.qualname,
                "f": {n: enc(c, (*path, n)) for n, c in node.fields.items()},
            }
        if isinstance(node, StatefulNode):
            return {"$": "stateful", "k": node.kind, "v": enc(node.inner, path)}
        if isinstance(node, RestoreNode):  # a generator's state is plain data: no pickle needed
            return {"$": "rng", "k": node.kind, "d": node.device, "v": enc(as_nodes(node.state), path)}
        if isinstance(node, ContainerNode):
            if node.kind == "dict":
                tag = "dict" if node.type is dict else "odict"
                return {
                    "$": tag,
                    "k": [key(k, path) for k in node.keys],
                    "v": [enc(c, (*path, k)) for k, c in zip(node.keys, node.children)],
                }
            values = [enc(c, (*path, i)) for i, c in enumerate(node.children)]
            if node.kind == "list":
                return {"$": "list", "v": values}
            if node.type is tuple:
                return {"$": "tuple", "v": values}
            return {"$": "ntuple", "type": obj(node.type, path), "v": values}
        if _is_plain(node):
            return node
        if type(node) in (set, frozenset) and all(_is_plain(x) for x in node):
            return {"$": "set" if type(node) is set else "fset", "v": list(node)}
        return obj(node, path)

    plain = enc(skeleton, ())
    return Encoded(plain=plain, objects=objects, object_paths=paths)


def decode_skeleton(plain: Any, n_tensors: int, objects: Callable[[int], Any]) -> StateNode:
    """The inverse of `encode_skeleton`; `objects(i)` gives object `i`. Raises `FormatError`."""

    def need(cond: bool, what: str) -> None:
        if not cond:
            raise FormatError(what)

    def items(node: dict[str, Any]) -> list[Any]:
        v: Any = node.get("v")
        need(type(v) is list, f"container without a value list: {sorted(node)}")
        return list(v)

    def index(node: dict[str, Any], bound: int | None, what: str) -> int:
        i: Any = node.get("i")
        need(type(i) is int and i >= 0 and (bound is None or i < bound), f"bad {what} index {i!r}")
        return int(i)

    def key(k: Any) -> Any:
        if type(k) is dict:
            tag = k.get("$")
            if tag == "tuple":
                return tuple(key(x) for x in items(k))
            if tag == "o":
                return objects(index(k, None, "object"))
            raise FormatError(f"unknown key tag {tag!r}")
        need(_is_plain(k), f"unexpected key of type {type(k).__name__}")
        return k

    def dec(node: Any) -> Any:
        if type(node) is not dict:
            need(_is_plain(node), f"unexpected leaf of type {type(node).__name__}")
            return node
        tag: Any = node.get("$")
        if tag == "t":
            return TensorSlot(index(node, n_tensors, "tensor"))
        if tag == "o":
            return objects(index(node, None, "object"))
        if tag == "state":
            q: Any = node.get("q")
            f: Any = node.get("f")
            need(type(q) is str and type(f) is dict, "malformed state node")
            return StateNode(qualname=q, fields={str(n): dec(c) for n, c in f.items()})
        if tag == "stateful":
            kind: Any = node.get("k")
            need(kind in ("module", "optimizer", "stateful"), f"unknown stateful kind {kind!r}")
            return StatefulNode(kind=kind, inner=dec(node.get("v")))
        if tag == "rng":
            rng: Any = node.get("k")
            device: Any = node.get("d")
            need(rng in RNG_KINDS and type(device) is str, f"unknown generator kind {rng!r}")
            return RestoreNode(kind=rng, state=from_nodes(dec(node.get("v"))), device=device)
        if tag in ("dict", "odict"):
            keys: Any = node.get("k")
            values = items(node)
            need(type(keys) is list and len(keys) == len(values), "malformed dict node")
            tp = dict if tag == "dict" else OrderedDict
            return ContainerNode("dict", tp, tuple(key(k) for k in keys), tuple(dec(c) for c in values))
        if tag == "list":
            return ContainerNode("list", list, (), tuple(dec(c) for c in items(node)))
        if tag == "tuple":
            return ContainerNode("tuple", tuple, (), tuple(dec(c) for c in items(node)))
        if tag == "ntuple":
            t: Any = node.get("type")
            need(type(t) is dict and t.get("$") == "o", "malformed namedtuple node")
            tp = objects(index(t, None, "object"))
            need(isinstance(tp, type) and issubclass(tp, tuple), f"namedtuple type is {tp!r}")
            return ContainerNode("tuple", tp, (), tuple(dec(c) for c in items(node)))
        if tag in ("set", "fset"):
            values = items(node)
            need(all(_is_plain(x) for x in values), "set of non-plain values")
            return set(values) if tag == "set" else frozenset(values)
        raise FormatError(f"unknown node tag {tag!r}")

    root = dec(plain)
    if not isinstance(root, StateNode):
        raise FormatError("the skeleton's root is not a state")
    return root


def objects_in(plain: Any) -> set[int]:
    """The object indices a plain skeleton refers to."""
    found: set[int] = set()

    def walk(node: Any) -> None:
        if type(node) is dict:
            if node.get("$") == "o" and type(node.get("i")) is int:
                found.add(node["i"])
            for v in node.values():
                walk(v)
        elif type(node) is list:
            for v in node:
                walk(v)

    walk(plain)
    return found


def slot_paths(node: Any, path: tuple[Any, ...] = ()) -> dict[int, tuple[Any, ...]]:
    """The state path of every tensor slot below `node`, as `_tree.flatten` names them."""
    out: dict[int, tuple[Any, ...]] = {}

    def walk(n: Any, p: tuple[Any, ...]) -> None:
        if isinstance(n, TensorSlot):
            out[n.index] = p
        elif isinstance(n, StateNode):
            for name, child in n.fields.items():
                walk(child, (*p, name))
        elif isinstance(n, StatefulNode):
            walk(n.inner, p)
        elif isinstance(n, RestoreNode):
            walk(n.state, (*p, "state"))  # a torch.Generator's state, as `_tree.flatten` names it
        elif isinstance(n, ContainerNode):
            if n.kind == "dict":
                for k, child in zip(n.keys, n.children):
                    walk(child, (*p, k))
            else:
                for i, child in enumerate(n.children):
                    walk(child, (*p, i))

    walk(node, path)
    return out


# ---------------------------------------------------------------------------------------------------------
# Copies


@contextmanager
def one_torch_thread() -> Iterator[None]:
    """Run bulk tensor copies on the calling thread only.

    torch parallelises large `copy_` calls over its intra-op pool; copying out of a memory-mapped file
    that way makes the pool's threads fault pages in concurrently and spin while they wait, which costs
    several times a plain single-threaded copy (and hurts most when the cores are busy, e.g. hashing).
    """
    before = torch.get_num_threads()
    if before > 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if before > 1:
            torch.set_num_threads(before)


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

    def to_json(self) -> dict[str, Any]:
        return {"size": self.size, "chunk": self.chunk, TREE_KEY: self.digest}


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


_sync_range: Any = None


def _start_writeback(fd: int, offset: int, length: int) -> None:
    """Ask the kernel to start writing `length` bytes at `offset` to disk now (Linux; a no-op elsewhere)."""
    global _sync_range
    if _sync_range is None:
        _sync_range = False
        if sys.platform.startswith("linux"):
            try:
                fn = ctypes.CDLL(None, use_errno=True).sync_file_range
                fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
                fn.restype = ctypes.c_int
                _sync_range = fn
            except (OSError, AttributeError):
                pass
    if _sync_range:
        _sync_range(fd, offset, length, 2)  # SYNC_FILE_RANGE_WRITE: start writeback, do not wait


#: Start writeback after this many new bytes.
_WRITEBACK = 32 * 2**20


class HashingWriter:
    """A binary file object that writes to `fd` and checksums what it writes, chunk by chunk.

    Large buffers are hashed on the hash pool while this thread writes them; small writes are gathered
    first. Each write returns only once its bytes are written and hashed, so the caller may reuse them.
    """

    def __init__(self, fd: int, chunk: int = CHUNK) -> None:
        self._fd = fd
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
            _write_all(self._fd, view)
        else:
            pool = _hash_pool()
            futures: list[Future[None]] = [pool.submit(self._hashes[k].update, piece) for k, piece in pieces]
            try:
                _write_all(self._fd, view)
            finally:
                for f in futures:  # the buffer must outlive the hashing of it
                    f.result()
        self._pos += view.nbytes
        if self._pos - self._flushed >= _WRITEBACK:
            _start_writeback(self._fd, self._flushed, self._pos - self._flushed)
            self._flushed = self._pos


def _write_all(fd: int, view: memoryview) -> None:
    while view.nbytes:
        n = os.write(fd, view)
        view = view[n:]


def _open_new(path: str | os.PathLike[str]) -> int:
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)


def write_content(
    path: str | os.PathLike[str], payload: dict[str, Any], *, crc32: bool = False
) -> FileRecord:
    """`torch.save(payload)` into a new file, checksummed as written and fsynced.

    torch's own zip CRC-32 is skipped by default (`crc32=False`): the chunk checksums replace it, and
    computing both would cost a second pass. The async writer keeps it on, so that it never changes the
    process-wide setting while the caller's thread may be saving something else.
    """
    fd = _open_new(path)
    try:
        writer = HashingWriter(fd)
        get = getattr(torch.serialization, "get_crc32_options", None)  # torch >= 2.6
        put = getattr(torch.serialization, "set_crc32_options", None)
        if crc32 or get is None or put is None:
            torch.save(payload, writer)  # type: ignore[arg-type]
        else:
            before = get()
            put(False)
            try:
                torch.save(payload, writer)  # type: ignore[arg-type]
            finally:
                put(before)
        writer.flush()
        os.fsync(fd)
    finally:
        os.close(fd)
    return FileRecord(os.path.basename(path), writer.size, writer.digest())


def write_bytes(path: str | os.PathLike[str], data: bytes) -> FileRecord:
    """Write `data` to a new file, checksummed and fsynced."""
    fd = _open_new(path)
    try:
        writer = HashingWriter(fd)
        writer.write(data)
        writer.flush()
        os.fsync(fd)
    finally:
        os.close(fd)
    return FileRecord(os.path.basename(path), writer.size, writer.digest())


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """fsync a directory, so that entries created or renamed in it are durable (no-op where unsupported)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on directories
    finally:
        os.close(fd)


def hash_file(path: str | os.PathLike[str], chunk: int = CHUNK) -> tuple[int, str]:
    """The size and checksum (see the module's docstring) of a file, hashed in parallel over a memory map.

    The chunks are split into a few runs of consecutive chunks, one per helper thread.
    """
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return 0, tree_root([])
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            view = memoryview(mapped)
            try:
                total = n_chunks(size, chunk)
                workers = _pool_workers()
                per_run = max(1, math.ceil(total / workers))
                runs = [(k, min(total, k + per_run)) for k in range(0, total, per_run)]
                if len(runs) == 1:
                    digests = _digest_run(view, chunk, size, *runs[0])
                else:
                    futures = [_hash_pool().submit(_digest_run, view, chunk, size, a, b) for a, b in runs]
                    digests = [d for fut in futures for d in fut.result()]
            finally:
                view.release()
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


def pickle_objects(encoded: Encoded) -> bytes:
    """`cloudpickle` of the encoded objects; a `TypeError` naming the path of any that cannot be pickled."""
    try:
        return cloudpickle.dumps(encoded.objects)
    except Exception:
        pass
    bad = []
    for path, obj in zip(encoded.object_paths, encoded.objects):
        try:
            cloudpickle.dumps(obj)
        except Exception as exc:
            bad.append(f"{path_str(path)} ({_type_name(obj)}: {type(exc).__name__}: {exc})")
    msg = (
        f"cannot pickle {'; '.join(bad) or 'the objects'}; make these values picklable, or mark their fields "
        "elastic.field(save=False) (or elastic.local()) to leave them out of checkpoints"
    )
    raise TypeError(msg) from None
