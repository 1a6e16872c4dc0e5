"""A tensor saved with `torch.save` read as a view of the bytes that hold it, without copying them.

DCP stores every tensor of a checkpoint as one `torch.save` blob (a zip archive: a small pickle that says
which storage, dtype, offset, size and stride, and the storage's raw bytes in a record of their own).
``torch.load`` of a blob allocates a new storage, copies the record into it and rebuilds the tensor with
torch's weights-only unpickler, written in Python; a load that copies each piece into its target right
away needs none of that. `tensor_in` finds the record in the zip's central directory, reads the pickle with
a C unpickler that resolves nothing but the handful of names a plain tensor's pickle holds, and returns a
tensor over the caller's buffer (`torch.frombuffer`). Anything else (another layout, a big-endian blob, a
tensor subclass, a compressed record) returns None: the caller then uses ``torch.load``.
"""

from __future__ import annotations

import collections
import io
import pickle
import struct
import sys
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import attrs
import torch

__all__ = ["Layout", "locate", "tensor_in", "view_of"]

_END = b"PK\x05\x06"  # end of the central directory
_ENTRY = b"PK\x01\x02"  # a central directory entry
_LOCAL = b"PK\x03\x04"  # a local file header
_END_SIZE = 22
#: How much of a blob's start (its pickle and the local headers before the values) and end (the central
#: directory) `locate` reads at once.
_HEAD = _TAIL = 4096
#: The legacy storage classes a tensor's pickle names (``torch.FloatStorage``, ...) and their dtypes; others
#: (quantized, newer dtypes) go through ``torch.load``.
_DTYPES = {
    "DoubleStorage": torch.float64,
    "FloatStorage": torch.float32,
    "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16,
    "LongStorage": torch.int64,
    "IntStorage": torch.int32,
    "ShortStorage": torch.int16,
    "CharStorage": torch.int8,
    "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool,
    "ComplexDoubleStorage": torch.complex128,
    "ComplexFloatStorage": torch.complex64,
}


class _Record(NamedTuple):
    header: int  # offset of the local file header in the blob
    size: int  # stored bytes (uncompressed)


class _Storage(NamedTuple):
    dtype: torch.dtype
    key: str
    numel: int


class _Rebuilt(NamedTuple):
    storage: _Storage
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


class _NotPlain(Exception):
    pass


def _rebuild_tensor_v2(
    storage: Any, offset: int, size: Any, stride: Any, grad: Any = False, hooks: Any = None, *rest: Any
) -> _Rebuilt:
    if not isinstance(storage, _Storage) or hooks or rest:
        raise _NotPlain
    return _Rebuilt(storage, int(offset), tuple(int(s) for s in size), tuple(int(s) for s in stride))


class _TensorPickle(pickle.Unpickler):
    """The pickle of a plain tensor, and nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return _rebuild_tensor_v2
        if module == "collections" and name == "OrderedDict":
            return collections.OrderedDict
        if module == "torch" and name in _DTYPES:
            return _DTYPES[name]
        raise _NotPlain

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise _NotPlain
        _, dtype, key, _, numel = pid
        if not isinstance(dtype, torch.dtype):
            raise _NotPlain
        return _Storage(dtype, str(key), int(numel))


@attrs.frozen
class Layout:
    """Where a plain tensor's values lie in its `torch.save` blob."""

    dtype: torch.dtype
    data: int  # where the storage's bytes start, from the start of the blob
    numel: int  # of the storage
    offset: int  # the tensor's storage offset, in elements
    size: tuple[int, ...]
    stride: tuple[int, ...]

    def extent(self, offsets: Sequence[int], lengths: Sequence[int]) -> tuple[int, int] | None:
        """The storage elements [lo, hi) that the tensor narrowed to `offsets`/`lengths` (per dimension)
        touches; None when the narrowing does not fit the tensor."""
        if len(offsets) != len(self.size) or len(lengths) != len(self.size):
            return None
        lo, last = self.offset, 0
        for o, n, dim, st in zip(offsets, lengths, self.size, self.stride):
            if o < 0 or n < 0 or o + n > dim or st < 0:
                return None
            if n == 0:
                return lo, lo
            lo += o * st
            last += (n - 1) * st
        return lo, lo + last + 1


Read = Callable[[int, int], Any]  # bytes [a, b) of the blob


def _directory(read: Read, length: int) -> dict[str, _Record] | None:
    """The zip's stored (uncompressed) records by name; None for anything this reader does not expect."""
    end = length - _END_SIZE
    if end < 0:
        return None
    tail = read(end, length)
    if tail[:4] != _END:  # a comment or a zip64 end: not what torch.save writes
        return None
    count, size, start = struct.unpack_from("<HII", tail, 10)
    if start + size > end:
        return None
    view = read(start, start + size)
    out: dict[str, _Record] = {}
    at = 0
    for _ in range(count):
        if view[at : at + 4] != _ENTRY:
            return None
        method, _, _, _, stored, _, nlen, xlen, clen, _, _, _, header = struct.unpack_from(
            "<HHHIIIHHHHHII", view, at + 10
        )
        if method != 0:
            return None
        name = bytes(view[at + 46 : at + 46 + nlen]).decode("utf-8", "replace")
        out[name] = _Record(header, stored)
        at += 46 + nlen + xlen + clen
    return out


def _data_start(read: Read, record: _Record) -> int | None:
    at = record.header
    head = read(at, at + 30)
    if head[:4] != _LOCAL:
        return None
    nlen, xlen = struct.unpack_from("<HH", head, 26)
    return at + 30 + nlen + xlen


def locate(read: Read, length: int) -> Layout | None:
    """Where the values of the tensor `torch.save` wrote into a blob of `length` bytes lie, reading only
    its zip directory and pickle through ``read(a, b)`` (bytes [a, b) of the blob).

    Args:
        read: returns the blob's bytes [a, b) (a buffer).
        length: the blob's size in bytes.

    Returns:
        The tensor's `Layout`, or None when the blob is not a plain little-endian tensor this reader
        understands (use ``torch.load`` then).
    """
    head = read(0, min(length, _HEAD))
    tail_at = max(0, length - _TAIL)
    tail = read(tail_at, length)

    def near(a: int, b: int) -> Any:  # what torch.save writes around the values lies in the head or the tail
        if b <= len(head):
            return head[a:b]
        if a >= tail_at:
            return tail[a - tail_at : b - tail_at]
        return read(a, b)

    read = near
    try:
        records = _directory(read, length)
        if not records:
            return None
        prefix = next(iter(records)).split("/", 1)[0]
        order = records.get(f"{prefix}/byteorder")
        if order is not None:
            start = _data_start(read, order)
            if start is None or bytes(read(start, start + order.size)) != sys.byteorder.encode():
                return None
        elif sys.byteorder != "little":
            return None
        pkl = records.get(f"{prefix}/data.pkl")
        if pkl is None or (start := _data_start(read, pkl)) is None:
            return None
        rebuilt = _TensorPickle(io.BytesIO(read(start, start + pkl.size))).load()
        if not isinstance(rebuilt, _Rebuilt):
            return None
        storage = rebuilt.storage
        data = records.get(f"{prefix}/data/{storage.key}")
        if data is None or (start := _data_start(read, data)) is None:
            return None
        if storage.numel * storage.dtype.itemsize > data.size or start + data.size > length:
            return None
        layout = Layout(storage.dtype, start, storage.numel, rebuilt.offset, rebuilt.size, rebuilt.stride)
        whole = layout.extent([0] * len(layout.size), layout.size)
        if whole is None or whole[1] > storage.numel:
            return None
        return layout
    except (_NotPlain, pickle.UnpicklingError, struct.error, ValueError, TypeError, EOFError, RuntimeError):
        return None


def tensor_in(buffer: Any, offset: int, length: int) -> torch.Tensor | None:
    """The tensor `torch.save` wrote into ``buffer[offset:offset + length]``, as a view of `buffer`.

    Args:
        buffer: a writable buffer (a ``bytearray``) that outlives the tensor's use.
        offset: where the blob starts in `buffer`.
        length: the blob's size in bytes.

    Returns:
        The tensor (on the CPU, sharing `buffer`'s memory: copy it before `buffer` changes), or None when
        the blob is not a plain little-endian tensor this reader understands (use ``torch.load`` then).
    """
    view = memoryview(buffer)[offset : offset + length]
    layout = locate(lambda a, b: view[a:b], length)
    if layout is None:
        return None
    return view_of(
        buffer, offset + layout.data, layout.dtype, layout.numel, layout.size, layout.stride, layout.offset
    )


def view_of(
    buffer: Any,
    at: int,
    dtype: torch.dtype,
    count: int,
    size: Sequence[int],
    stride: Sequence[int],
    offset: int = 0,
) -> torch.Tensor:
    """A tensor over `count` elements of `dtype` stored in `buffer` from byte `at` (no copy)."""
    if count == 0:
        return torch.empty(tuple(size), dtype=dtype)
    flat = torch.frombuffer(buffer, dtype=dtype, count=count, offset=at)
    return flat.as_strided(tuple(size), tuple(stride), offset)
