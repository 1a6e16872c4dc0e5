"""Moving tensors: large ones straight into their storage, small ones through two reused buckets.

Both sides derive the same plan from the source's metadata. Tensors the source marks `direct` (contiguous,
on the communication device, at least `DIRECT_BYTES`) are broadcast as they are: the receiver's own tensor
is the destination when it has the same shape, dtype and device, so nothing is copied or pickled. All other
tensors form one byte stream cut into buckets of at most `BUCKET_BYTES`; while bucket k travels, the
source packs bucket k+1 and the receiver unpacks bucket k-1 (double buffering), so the receiver never holds
more than two buckets of extra memory. The bucket buffers are kept between calls: fresh buffers would cost
page faults on every sync.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

import attrs
import torch
import torch.distributed as dist

from ._comm import Comm, fault_point
from ._tree import TensorMeta

__all__ = ["BUCKET_BYTES", "DIRECT_BYTES", "Bucket", "plan_buckets", "receive_tensors", "send_tensors"]

#: Upper bound of one coalescing bucket. Two are in use at a time, so a receiver's extra memory during a
#: transfer is at most ``2 * BUCKET_BYTES`` (plus one temporary for a tensor it cannot take in place).
BUCKET_BYTES = 16 * 2**20
#: Contiguous tensors on the communication device at least this large are broadcast on their own,
#: straight into the receiver's storage.
DIRECT_BYTES = 1 * 2**20


@attrs.frozen
class Segment:
    """Bytes ``[offset, offset + length)`` of tensor `index` sit at `at` in the bucket."""

    index: int
    offset: int
    length: int
    at: int


@attrs.frozen
class Bucket:
    size: int
    segments: tuple[Segment, ...]


def plan_buckets(metas: list[TensorMeta], direct: list[bool], bucket_bytes: int | None = None) -> list[Bucket]:
    """Cut the non-direct tensors' bytes, in order, into buckets of at most `bucket_bytes` (default: the
    module's `BUCKET_BYTES`, read at call time so tests can shrink it)."""
    if bucket_bytes is None:
        bucket_bytes = BUCKET_BYTES
    buckets: list[Bucket] = []
    segments: list[Segment] = []
    fill = 0
    for i, meta in enumerate(metas):
        if direct[i]:
            continue
        left, offset = meta.nbytes, 0
        while left > 0:
            take = min(left, bucket_bytes - fill)
            segments.append(Segment(i, offset, take, fill))
            fill += take
            offset += take
            left -= take
            if fill == bucket_bytes:
                buckets.append(Bucket(fill, tuple(segments)))
                segments, fill = [], 0
    if segments:
        buckets.append(Bucket(fill, tuple(segments)))
    return buckets


def is_direct(tensor: torch.Tensor, device: torch.device) -> bool:
    """Whether the source broadcasts `tensor` on its own (see `DIRECT_BYTES`)."""
    return (
        tensor.device == device
        and tensor.is_contiguous()
        and tensor.numel() * tensor.element_size() >= DIRECT_BYTES
    )


def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor's storage (0-d and empty tensors included)."""
    flat = tensor.detach().reshape(-1)
    if flat.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=tensor.device)
    if flat.dtype == torch.uint8:
        return flat
    return flat.view(torch.uint8)


_cache_lock = threading.Lock()
_buffers: dict[torch.device, list[torch.Tensor]] = {}


def _bucket_buffers(device: torch.device, size: int) -> list[torch.Tensor]:
    """Two uint8 buffers of at least `size` bytes on `device`, reused across calls."""
    with _cache_lock:
        bufs = _buffers.get(device)
        if bufs is None or bufs[0].numel() < size:
            bufs = [torch.empty(size, dtype=torch.uint8, device=device) for _ in range(2)]
            _buffers[device] = bufs
        return bufs


def cached_bytes() -> int:
    """Bytes held by the reused bucket buffers (on every device)."""
    with _cache_lock:
        return sum(b.numel() * b.element_size() for bufs in _buffers.values() for b in bufs)


def release_buffers() -> None:
    """Drop the reused bucket buffers (the next transfer allocates them again)."""
    with _cache_lock:
        _buffers.clear()


@contextmanager
def _few_threads() -> Any:
    """Keep torch's intra-op pool out of the way of the communication threads while packing."""
    before = torch.get_num_threads()
    if before > 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if before > 1:
            torch.set_num_threads(before)


def send_tensors(
    comm: Comm,
    src: int,
    tensors: list[torch.Tensor],
    direct: list[bool],
    metas: list[TensorMeta],
    on_error: Callable[[BaseException], None],
) -> None:
    """The source's half of the tensor transfer (never writes to `tensors`).

    A local failure while packing is passed to `on_error` and the remaining collectives still run (with
    whatever the buffer holds), so the receivers are not left waiting; the failure is reported at commit.
    """
    gsrc = comm.global_rank(src)
    buckets = plan_buckets(metas, direct)
    sources: dict[int, torch.Tensor] = {}
    failed = False

    def source_bytes(i: int) -> torch.Tensor:
        if i not in sources:
            for j in [j for j in sources if j < i]:  # a contiguous copy is needed only while it is packed
                del sources[j]
            sources[i] = byte_view(tensors[i].contiguous())
        return sources[i]

    with _few_threads():
        directs = []
        for n, i in enumerate(k for k, d in enumerate(direct) if d):
            phase = f"direct {n}"
            try:
                fault_point(phase, comm.rank)
            except Exception as exc:
                failed = True
                on_error(exc)
            directs.append((phase, comm.issue(phase, dist.broadcast, tensors[i], gsrc)))
        if buckets:
            bufs = _bucket_buffers(comm.device, max(b.size for b in buckets))
            pending: deque[tuple[Any, str]] = deque()
            for k, bucket in enumerate(buckets):
                phase = f"bucket {k}"
                if len(pending) == 2:
                    comm.wait(*pending.popleft())
                buf = bufs[k % 2][: bucket.size]
                if not failed:
                    try:
                        fault_point(phase, comm.rank)
                        for seg in bucket.segments:
                            piece = source_bytes(seg.index)[seg.offset : seg.offset + seg.length]
                            buf[seg.at : seg.at + seg.length].copy_(piece)
                    except Exception as exc:
                        failed = True
                        on_error(exc)
                pending.append((comm.issue(phase, dist.broadcast, buf, gsrc), phase))
            while pending:
                comm.wait(*pending.popleft())
        for phase, work in directs:
            comm.wait(work, phase)


def receive_tensors(
    comm: Comm,
    src: int,
    targets: list[torch.Tensor],
    direct: list[bool],
    metas: list[TensorMeta],
    on_error: Callable[[BaseException], None],
) -> None:
    """The receivers' half: writes the source's tensors into `targets`.

    A local failure while writing (not a communication failure) is passed to `on_error` and the transfer
    goes on without writing, so that every rank stays in step and learns of it at commit.
    """
    gsrc = comm.global_rank(src)
    buckets = plan_buckets(metas, direct)
    staged: dict[int, torch.Tensor] = {}  # contiguous stand-ins for targets that cannot take bytes directly
    failed = False

    def dest_bytes(i: int) -> torch.Tensor:
        target = targets[i]
        if target.is_contiguous():
            return byte_view(target)
        if i not in staged:
            staged[i] = torch.empty(target.shape, dtype=target.dtype, device=target.device)
        return byte_view(staged[i])

    with _few_threads(), torch.no_grad():
        directs = []
        for n, i in enumerate(k for k, d in enumerate(direct) if d):
            target = targets[i]
            if not (target.is_contiguous() and target.device == comm.device):
                staged[i] = torch.empty(target.shape, dtype=target.dtype, device=comm.device)
                target = staged[i]
            directs.append((f"direct {n}", comm.issue(f"direct {n}", dist.broadcast, target.detach(), gsrc)))
        if buckets:
            bufs = _bucket_buffers(comm.device, max(b.size for b in buckets))
            pending: deque[tuple[int, Any]] = deque()
            for k in range(min(2, len(buckets))):
                pending.append((k, comm.issue(f"bucket {k}", dist.broadcast, bufs[k % 2][: buckets[k].size], gsrc)))
            while pending:
                k, work = pending.popleft()
                phase = f"bucket {k}"
                comm.wait(work, phase)
                buf = bufs[k % 2]
                if not failed:
                    try:
                        fault_point(phase, comm.rank)
                        for seg in buckets[k].segments:
                            dest_bytes(seg.index)[seg.offset : seg.offset + seg.length].copy_(
                                buf[seg.at : seg.at + seg.length]
                            )
                    except Exception as exc:
                        failed = True
                        on_error(exc)
                nxt = k + 2
                if nxt < len(buckets):
                    pending.append((nxt, comm.issue(f"bucket {nxt}", dist.broadcast, buf[: buckets[nxt].size], gsrc)))
        for phase, work in directs:
            comm.wait(work, phase)
        if not failed:
            try:
                for i, tmp in staged.items():
                    targets[i].detach().copy_(tmp)
            except Exception as exc:
                on_error(exc)
