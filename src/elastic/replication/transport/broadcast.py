"""`BroadcastTransport`: the source's tensors to every receiver by the group's broadcasts, and the bucket
plans, packers and unpackers that the shared-memory transport shares.

`BroadcastTransport` moves large tensors straight into their storage and small ones through a few reused
buckets. Both sides derive the same plan from the source's metadata. Tensors the source marks `direct`
(plain contiguous tensors on the communication device of at least `direct_bytes`) are broadcast as they
are: the receiver's own tensor is the destination when it has the same shape, dtype and device, so
nothing is copied or pickled. All other tensors form one byte stream cut into buckets of at most
`bucket_bytes`, each tensor aligned to its element size. `in_flight` buckets travel at once: while they
do, the source packs the next one and the receiver unpacks the oldest, so the receiver never holds more
than `in_flight * bucket_bytes` of extra memory, plus one temporary at a time for a tensor whose bytes cannot
be written where they are (a non-contiguous direct tensor or one split across buckets, or a tensor on
another device). The bucket buffers are kept between calls: fresh buffers would cost page faults on every
sync. Which device the buckets and temporaries live on is the communicator's `Placement`
(`elastic._util.placement`).

A run of whole tensors of one dtype in a bucket is packed (and unpacked) with two C++ calls: views of the
bucket shaped like the tensors, then one copy per pair, which also handles non-contiguous tensors and
lazy conjugates. Packing and unpacking run with torch's intra-op pool limited to one thread: on a small
machine its OpenMP workers otherwise spin next to the backend's communication threads (docs/performance.md,
"How the tensors move", has the measurements).

The views and the grouped copy use two private torch functions, ``torch._C._nn.unflatten_dense_tensors``
and ``torch._foreach_copy_``; where a torch release lacks them, the same results come from public calls
(`narrow`/`view` and one ``copy_`` per pair), only slower.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import attrs
import torch
import torch.distributed as dist

from elastic._util.threads import one_torch_thread
from elastic.replication.comm import Comm, fault_point
from elastic.replication.transport.protocol import OnError, at_least
from elastic.state.tensors import TensorMeta

__all__ = [
    "BUCKET_BYTES",
    "DIRECT_BYTES",
    "IN_FLIGHT",
    "RAMP_MIN",
    "BroadcastTransport",
    "Bucket",
    "Packer",
    "Unpacker",
    "Segment",
    "byte_view",
    "cached_bytes",
    "forget_splits",
    "kept_plan",
    "plan_buckets",
    "release_buffers",
]

#: Default upper bound of one coalescing bucket, in bytes.
BUCKET_BYTES = 16 * 2**20
#: Default size from which plain contiguous tensors on the communication device are broadcast on their
#: own, straight into the receiver's storage. Below it, one collective per tensor costs more than copying
#: the tensor through a bucket (gloo on 2 CPU cores: 1 MiB tensors move faster in buckets, 2 MiB ones on
#: their own).
DIRECT_BYTES = 2 * 2**20
#: Default number of buckets travelling at once, each in its own reused buffer: a receiver's extra memory
#: during a transfer is at most ``in_flight * bucket_bytes`` (plus one temporary for a tensor it cannot
#: take in place).
IN_FLIGHT = 2
#: Default smallest first and last bucket (below this the ramp is not worth an extra collective).
RAMP_MIN = 4096


class Segment(NamedTuple):
    """Bytes ``[offset, offset + length)`` of tensor number `tensor` sit at byte `at` of their bucket."""

    tensor: int
    offset: int
    length: int
    at: int


class Bucket(NamedTuple):
    """`size` bytes made of `segments`, in stream order."""

    size: int
    segments: tuple[Segment, ...]


def _nbytes(meta: TensorMeta) -> int:
    return math.prod(meta.shape) * meta.dtype.itemsize


def _cap(k: int, remaining: int, bound: int, ramp_min: int) -> int:
    """How many bytes bucket `k` may hold when `remaining` bytes are left to send.

    The first buckets ramp up from ``bound / 8`` (at least `ramp_min`) and the last ones down to it, so
    that packing the first bucket and unpacking the last, which no communication overlaps, stay short.
    """
    low = max(bound // 8, min(bound, ramp_min))
    tail = max(low, (remaining + 1) // 2)
    if remaining - tail < low // 2:  # what is left goes in this bucket: no crumb of a last one
        tail = bound
    return max(1, min(bound, low << min(k, 3), tail))


def plan_buckets(
    metas: list[TensorMeta], direct: list[bool], bucket_bytes: int = BUCKET_BYTES, ramp_min: int = RAMP_MIN
) -> list[Bucket]:
    """Cut the non-direct tensors' bytes, in order, into buckets of at most `bucket_bytes`.

    Each tensor starts at a multiple of its element size (so a bucket's bytes can be viewed as the tensor's
    dtype); a tensor larger than the room left continues at the start of the next bucket. Empty tensors
    have no segment. A bucket's `size` is the end of its last segment. The first and last buckets are
    smaller (see `_cap`).
    """
    if bucket_bytes < 1:
        msg = f"bucket_bytes must be at least 1, got {bucket_bytes}"
        raise ValueError(msg) from None
    sizes = [0 if direct[i] else math.prod(m.shape) * m.dtype.itemsize for i, m in enumerate(metas)]
    remaining = sum(sizes)
    buckets: list[Bucket] = []
    segments: list[Segment] = []
    fill = 0
    cap = _cap(0, remaining, bucket_bytes, ramp_min)

    def close() -> None:
        nonlocal segments, fill, cap
        buckets.append(Bucket(fill, tuple(segments)))
        segments, fill = [], 0
        cap = _cap(len(buckets), remaining, bucket_bytes, ramp_min)

    for i, meta in enumerate(metas):
        left, offset = sizes[i], 0
        if left == 0:
            continue
        itemsize = meta.dtype.itemsize
        pad = -fill % itemsize
        if fill and fill + pad >= cap:
            close()
            pad = 0
        fill += pad
        while left > 0:
            take = min(left, cap - fill)
            segments.append(Segment(i, offset, take, fill))
            fill += take
            offset += take
            left -= take
            remaining -= take
            if fill == cap:
                close()
    if segments:
        buckets.append(Bucket(fill, tuple(segments)))
    return buckets


def _plain(tensor: torch.Tensor) -> bool:
    """Whether the tensor's storage bytes are its values (contiguous, no lazy conjugate or negation)."""
    return tensor.is_contiguous() and not tensor.is_conj() and not tensor.is_neg()


def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor's bytes (0-d, empty, bool, complex included).

    Writing to the view writes the tensor. Raises `ValueError` for a tensor whose bytes are not its values
    in order (non-contiguous, or a lazy conjugate/negative view): copy it first.
    """
    if not _plain(tensor):
        msg = (
            f"byte_view needs a contiguous tensor without lazy conjugation or negation, got one of shape "
            f"{tuple(tensor.shape)} and strides {tensor.stride()}; pass tensor.contiguous() (or "
            "resolve_conj()/resolve_neg()) instead"
        )
        raise ValueError(msg) from None
    flat = tensor.detach().reshape(-1)
    if flat.dtype == torch.uint8:
        return flat
    if flat.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=tensor.device)
    return flat.view(torch.uint8)


# -----------------------------------------------------------------------------------------------------------
# Reused bucket buffers

_cache_lock = threading.Lock()
_buffers: dict[torch.device, list[torch.Tensor]] = {}


def _take_buffers(device: torch.device, size: int, count: int) -> list[torch.Tensor]:
    """At least `count` uint8 buffers of at least `size` bytes on `device` (use the first `count`).

    The cached buffers that are large enough come first; the caller owns the list until it hands it back
    with `_return_buffers`, so two transfers in different threads never share a buffer.
    """
    with _cache_lock:
        cached = _buffers.pop(device, [])
    bufs = [b for b in cached if b.numel() >= size]
    while len(bufs) < count:
        bufs.append(torch.empty(size, dtype=torch.uint8, device=device))
    return bufs


def _return_buffers(device: torch.device, bufs: list[torch.Tensor]) -> None:
    """Keep `bufs` for the next transfer (unless another thread returned a larger set meanwhile)."""
    with _cache_lock:
        if device not in _buffers or sum(b.numel() for b in bufs) > sum(b.numel() for b in _buffers[device]):
            if device in _buffers:  # the kept splits view the old buffers: let those go
                for plan in _plans:
                    plan.splits.clear()
            _buffers[device] = bufs


def cached_bytes() -> int:
    """Bytes held by the reused bucket buffers (on every device)."""
    with _cache_lock:
        return sum(b.numel() * b.element_size() for bufs in _buffers.values() for b in bufs)


def release_buffers() -> None:
    """Drop the reused bucket buffers and the plans viewing them (the next transfer makes them again)."""
    with _cache_lock:
        _buffers.clear()
        _plans.clear()


@contextmanager
def _quiet() -> Iterator[None]:
    """No autograd, and torch's intra-op pool kept out of the communication threads' way."""
    with one_torch_thread(), torch.no_grad():
        yield


def unflatten_public(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """What ``torch._C._nn.unflatten_dense_tensors`` returns, from public calls (one view per tensor)."""
    out: list[torch.Tensor] = []
    offset = 0
    for t in like:
        n = t.numel()
        if n == 0:  # a fresh empty tensor, as torch does: no view sharing the others' storage
            out.append(torch.empty(t.shape, dtype=flat.dtype, device=flat.device))
        else:
            out.append(flat.narrow(0, offset, n).view(t.shape))
            offset += n
    return out


def copy_all_public(dests: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """What ``torch._foreach_copy_`` does, from public calls (one ``copy_`` per pair)."""
    for d, s in zip(dests, srcs):
        d.copy_(s)


#: The private torch calls used where they exist (one C++ call for many tensors), else public ones.
_UNFLATTEN: Callable[[torch.Tensor, list[torch.Tensor]], Any] = (
    getattr(getattr(torch._C, "_nn", None), "unflatten_dense_tensors", None) or unflatten_public
)
_FOREACH_COPY: Callable[[list[torch.Tensor], list[torch.Tensor]], Any] = (
    getattr(torch, "_foreach_copy_", None) or copy_all_public
)


def _unflatten(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """Views of `flat` shaped like `like`, one after the other (one C++ call)."""
    return list(_UNFLATTEN(flat, like))


def _raw(tensor: torch.Tensor) -> torch.Tensor:
    """`byte_view` without the checks, for plain non-empty tensors under `torch.no_grad()` (hot loops)."""
    if tensor.dim() != 1:
        tensor = tensor.reshape(-1)
    return tensor if tensor.dtype == torch.uint8 else tensor.view(torch.uint8)


def _whole(bucket: Bucket, k: int, buckets: list[Bucket]) -> tuple[bool, bool]:
    """Whether the first and the last segment of bucket `k` hold whole tensors (only they can be split)."""
    first_whole = bucket.segments[0].offset == 0
    nxt = buckets[k + 1].segments[0] if k + 1 < len(buckets) else None
    last_whole = nxt is None or nxt.offset == 0
    return first_whole, last_whole


def _copy_all(dests: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """``d.copy_(s)`` for every pair, in one call."""
    if len(dests) == 1:
        dests[0].copy_(srcs[0])
    elif dests:
        _FOREACH_COPY(dests, srcs)


class _Split(NamedTuple):
    """Bucket `k` split for packing or unpacking (see `_split`), made for one bucket buffer (`base`)."""

    base: torch.Tensor
    views: list[torch.Tensor]
    indices: list[int]
    others: list[tuple[Segment, bool]]


def _split(
    base: torch.Tensor,
    k: int,
    buckets: list[Bucket],
    tensors: list[torch.Tensor],
    takes: Callable[[int, torch.Tensor], bool],
) -> _Split:
    """Split bucket `k` (whose bytes are the start of `base`) for packing or unpacking.

    The whole tensors that `takes(index, tensor)` accepts, in runs of one dtype lying end to end, get views
    of the bucket shaped like them (one C++ call per run). Returns those views, the tensors' numbers in the
    same order, and every other segment with whether it holds a whole tensor, in bucket order.
    """
    buf = base[: buckets[k].size]
    views: list[torch.Tensor] = []
    indices: list[int] = []
    others: list[tuple[Segment, bool]] = []
    run: list[int] = []
    start = end = 0
    dtype = torch.uint8

    def flush() -> None:
        if run:
            views.extend(_unflatten(buf[start:end].view(dtype), [tensors[i] for i in run]))
            indices.extend(run)
            run.clear()

    bucket = buckets[k]
    first_whole, last_whole = _whole(bucket, k, buckets)
    last = len(bucket.segments) - 1
    for n, seg in enumerate(bucket.segments):
        tensor = tensors[seg.tensor]
        whole = (n > 0 or first_whole) and (n < last or last_whole)
        if whole and takes(seg.tensor, tensor):
            if run and (tensor.dtype != dtype or seg.at != end):
                flush()
            if not run:
                dtype, start = tensor.dtype, seg.at
            run.append(seg.tensor)
            end = seg.at + seg.length
        else:
            flush()
            others.append((seg, whole))
    flush()
    return _Split(base, views, indices, others)


# -----------------------------------------------------------------------------------------------------------
# Plans kept between transfers

#: How many layouts keep their bucket plan and bucket views between transfers.
PLANS_KEPT = 4


@attrs.define(eq=False)
class _Plan:
    """What a transfer derives from its metadata alone, kept for the next transfer of the same layout: the
    bucket plan and, per bucket, its split into views of the bucket buffer it last used.

    A state that syncs every few steps has the same layout each time; without this, planning and splitting
    cost ~8 ms per 2,000-tensor sync on each rank, before and between the copies."""

    metas: list[TensorMeta]
    direct: list[bool]
    config: tuple[int, int]
    buckets: list[Bucket]
    splits: dict[int, _Split] = attrs.Factory(dict)

    def split(
        self,
        base: torch.Tensor,
        k: int,
        tensors: list[torch.Tensor],
        takes: Callable[[int, torch.Tensor], bool],
        uniform: bool,
    ) -> _Split:
        """Bucket `k` split for `base`: the kept split when it was made for this very buffer and every tensor
        is on the buffer's device (`uniform`: then `takes` accepts the same tensors as when it was made)."""
        if not uniform:
            return _split(base, k, self.buckets, tensors, takes)
        kept = self.splits.get(k)
        if kept is None or kept.base is not base:
            kept = self.splits[k] = _split(base, k, self.buckets, tensors, takes)
        return kept


_plans: deque[_Plan] = deque(maxlen=PLANS_KEPT)


def kept_plan(metas: list[TensorMeta], direct: list[bool], bucket_bytes: int, ramp_min: int) -> _Plan:
    """The kept plan for this layout (compared by value: fast when the metadata are the same objects as
    last time, as a sync's cached layout makes them), or a new one."""
    config = (bucket_bytes, ramp_min)
    with _cache_lock:
        for plan in _plans:
            if plan.config == config and plan.direct == direct and plan.metas == metas:
                return plan
    plan = _Plan(metas, list(direct), config, plan_buckets(metas, direct, bucket_bytes, ramp_min))
    with _cache_lock:
        _plans.append(plan)
    return plan


def forget_splits() -> None:
    """Drop the kept plans' bucket views (their buffers were replaced or released: the views would keep
    them alive); the plans stay."""
    with _cache_lock:
        for plan in _plans:
            plan.splits.clear()


def _on(tensors: list[torch.Tensor], device: torch.device) -> bool:
    """Whether every tensor is on `device`."""
    return all(t.device == device for t in tensors)


class Packer:
    """Copies the source's tensors into bucket buffers (never writes to the tensors).

    Whole tensors on the bucket's device go through views of the bucket shaped like them, one copy per pair
    in one call (any strides, conjugate views included); the others byte by byte."""

    def __init__(self, tensors: list[torch.Tensor], kept: _Plan, device: torch.device) -> None:
        self.tensors, self.kept = tensors, kept
        self.uniform = _on(tensors, device)
        self.current: tuple[int, torch.Tensor] | None = None  # the byte view of a tensor that needed a copy

    def _bytes(self, i: int) -> torch.Tensor:
        tensor = self.tensors[i]
        if _plain(tensor):
            return _raw(tensor)
        if self.current is None or self.current[0] != i:  # one copy at a time: segments come in order
            self.current = (i, _raw(tensor.resolve_conj().resolve_neg().contiguous()))
        return self.current[1]

    def pack(self, base: torch.Tensor, k: int) -> None:
        """Write bucket `k` into the start of `base` (a buffer kept between calls: its split is kept)."""
        split = self.kept.split(base, k, self.tensors, lambda i, t: t.device == base.device, self.uniform)
        for seg, _ in split.others:
            base[seg.at : seg.at + seg.length].copy_(
                self._bytes(seg.tensor)[seg.offset : seg.offset + seg.length]
            )
        _copy_all(split.views, [self.tensors[i] for i in split.indices])


class Unpacker:
    """Copies bucket buffers into the receiver's targets, in place (storage kept).

    As `Packer`, the other way round: whole tensors are copied from views of the bucket shaped like them
    (any target strides); split tensors byte by byte, through one temporary when the target's bytes are
    not its values in order (non-contiguous, another device, a lazy conjugate)."""

    def __init__(
        self, targets: list[torch.Tensor], metas: list[TensorMeta], kept: _Plan, device: torch.device
    ) -> None:
        self.targets, self.metas, self.kept = targets, metas, kept
        self.uniform = _on(targets, device) and all(t.dtype == m.dtype for t, m in zip(targets, metas))
        self.temp: tuple[int, torch.Tensor, torch.Tensor] | None = None  # (index, temporary, its byte view)

    def unpack(self, base: torch.Tensor, k: int) -> None:
        """Write bucket `k`, read from the start of `base`, into the targets."""
        targets, metas = self.targets, self.metas
        buf = base[: self.kept.buckets[k].size]
        split = self.kept.split(
            base, k, targets, lambda i, t: t.device == base.device and t.dtype == metas[i].dtype, self.uniform
        )
        srcs, dests = list(split.views), [targets[i] for i in split.indices]
        for seg, whole in split.others:
            target = targets[seg.tensor]
            piece = buf[seg.at : seg.at + seg.length]
            if not whole and target.device == buf.device and _plain(target):
                dests.append(_raw(target)[seg.offset : seg.offset + seg.length])
                srcs.append(piece)
                continue
            if self.temp is None or self.temp[0] != seg.tensor:
                meta = metas[seg.tensor]
                tmp = torch.empty(meta.shape, dtype=meta.dtype, device=buf.device)
                self.temp = (seg.tensor, tmp, _raw(tmp))
            self.temp[2][seg.offset : seg.offset + seg.length].copy_(piece)
            if seg.offset + seg.length == _nbytes(metas[seg.tensor]):
                target.copy_(self.temp[1])
                self.temp = None
        _copy_all(dests, srcs)

    def abandon(self) -> None:
        """Forget a half-written temporary (after a failure: nothing more is written)."""
        self.temp = None


# -----------------------------------------------------------------------------------------------------------
# The bucketed broadcast


@attrs.frozen
class BroadcastTransport:
    """Today's transport: direct broadcasts for large tensors, a few reused buckets for the rest.

    `bucket_bytes` bounds one bucket; plain contiguous tensors of at least `direct_bytes` on the
    communication device go on their own; `in_flight` buckets travel at once (a receiver's extra memory is
    at most ``in_flight * bucket_bytes``); the first and last buckets ramp from ``bucket_bytes / 8``, at
    least `ramp_min`. The bucket buffers are shared by every instance (kept between calls, per device).
    """

    bucket_bytes: int = attrs.field(default=BUCKET_BYTES, validator=at_least(1))
    direct_bytes: int = attrs.field(default=DIRECT_BYTES, validator=at_least(0))
    in_flight: int = attrs.field(default=IN_FLIGHT, validator=at_least(1))
    ramp_min: int = attrs.field(default=RAMP_MIN, validator=at_least(1))

    def is_direct(self, tensor: torch.Tensor, device: torch.device) -> bool:
        """Whether the source broadcasts `tensor` on its own (see `direct_bytes`)."""
        return (
            tensor.device == device
            and tensor.numel() * tensor.element_size() >= self.direct_bytes
            and _plain(tensor)
        )

    def plan(self, tensors: list[torch.Tensor], comm: Comm) -> list[bool]:
        """Which of the source's tensors are broadcast on their own (`is_direct`), in order (the size first:
        most tensors are small)."""
        least, device = self.direct_bytes, comm.device
        return [t.numel() * t.element_size() >= least and self.is_direct(t, device) for t in tensors]

    def device_for(self, meta: TensorMeta, comm: Comm) -> torch.device:
        """Where a receiver allocates a tensor it lacks (see `Placement.allocate_on`)."""
        return comm.placement.allocate_on(meta.device_type)

    def send(
        self,
        comm: Comm,
        src: int,
        tensors: list[torch.Tensor],
        metas: list[TensorMeta],
        plan: Any,
        on_error: OnError,
    ) -> None:
        """The source's half of the tensor transfer (never writes to `tensors`).

        A local failure while packing is passed to `on_error` and the remaining collectives still run
        (with whatever the buffers hold), so the receivers are not left waiting; the failure is reported
        at commit. A communication failure raises `SyncError` (from `comm.wait`).
        """
        gsrc = comm.global_rank(src)
        direct: list[bool] = plan
        kept = kept_plan(metas, direct, self.bucket_bytes, self.ramp_min)
        buckets = kept.buckets
        depth = self.in_flight
        failed = False
        packer = Packer(tensors, kept, comm.device)

        with _quiet():
            works: list[tuple[Any, str]] = []
            for n, i in enumerate(k for k, d in enumerate(direct) if d):
                phase = f"direct {n}"
                try:
                    fault_point(phase, comm.rank)
                except Exception as exc:
                    failed = True
                    on_error(exc)
                works.append((comm.issue(phase, dist.broadcast, tensors[i], gsrc), phase))
            if buckets:
                owned = _take_buffers(comm.device, max(b.size for b in buckets), min(depth, len(buckets)))
                bufs = owned[: min(depth, len(buckets))]
                pending: deque[tuple[Any, str]] = deque()
                for k, bucket in enumerate(buckets):
                    phase = f"bucket {k}"
                    if len(pending) == len(bufs):
                        comm.wait(*pending.popleft())
                    base = bufs[k % len(bufs)]
                    if not failed:
                        try:
                            fault_point(phase, comm.rank)
                            packer.pack(base, k)
                        except Exception as exc:
                            failed = True
                            on_error(exc)
                    pending.append((comm.issue(phase, dist.broadcast, base[: bucket.size], gsrc), phase))
                while pending:
                    comm.wait(*pending.popleft())
                _return_buffers(comm.device, owned)
            for work, phase in works:
                comm.wait(work, phase)

    def receive(
        self,
        comm: Comm,
        src: int,
        targets: list[torch.Tensor],
        metas: list[TensorMeta],
        plan: Any,
        on_error: OnError,
    ) -> None:
        """The receivers' half: writes the source's tensors into `targets` (in place: storage kept).

        A target whose bytes cannot be written directly (non-contiguous, another device, a lazy
        conjugate) goes through one temporary at a time, copied into it once complete. A local failure
        while writing (not a communication failure) is passed to `on_error` and the transfer goes on
        without writing, so that every rank stays in step and learns of it at commit. A communication
        failure raises `SyncError`.
        """
        gsrc = comm.global_rank(src)
        direct: list[bool] = plan
        kept = kept_plan(metas, direct, self.bucket_bytes, self.ramp_min)
        depth = self.in_flight
        failed = False

        def fail(exc: BaseException) -> None:
            nonlocal failed
            failed = True
            on_error(exc)

        with _quiet():
            # Directs: into the target itself, or into one temporary at a time.
            works: list[tuple[Any, str]] = []
            staged: tuple[int, torch.Tensor, Any, str] | None = None

            def finish_staged() -> None:
                nonlocal staged
                if staged is None:
                    return
                i, tmp, work, phase = staged
                staged = None
                comm.wait(work, phase)
                if not failed:
                    try:
                        targets[i].copy_(tmp)
                    except Exception as exc:
                        fail(exc)

            for n, i in enumerate(k for k, d in enumerate(direct) if d):
                phase = f"direct {n}"
                target = targets[i]
                if not failed:
                    try:
                        fault_point(phase, comm.rank)
                    except Exception as exc:
                        fail(exc)
                if comm.placement.carries(target) and _plain(target):
                    works.append((comm.issue(phase, dist.broadcast, target.detach(), gsrc), phase))
                else:
                    finish_staged()
                    tmp = torch.empty(target.shape, dtype=target.dtype, device=comm.device)
                    staged = (i, tmp, comm.issue(phase, dist.broadcast, tmp, gsrc), phase)

            if kept.buckets:
                _receive_buckets(comm, gsrc, kept, targets, metas, depth, lambda: failed, fail)
            finish_staged()
            for work, phase in works:
                comm.wait(work, phase)


def _receive_buckets(
    comm: Comm,
    gsrc: int,
    kept: _Plan,
    targets: list[torch.Tensor],
    metas: list[TensorMeta],
    depth: int,
    failed: Callable[[], bool],
    fail: Callable[[BaseException], None],
) -> None:
    buckets = kept.buckets
    owned = _take_buffers(comm.device, max(b.size for b in buckets), min(depth, len(buckets)))
    bufs = owned[: min(depth, len(buckets))]
    unpacker = Unpacker(targets, metas, kept, comm.device)

    pending: deque[tuple[int, Any]] = deque()
    for k in range(len(bufs)):
        pending.append((k, comm.issue(f"bucket {k}", dist.broadcast, bufs[k][: buckets[k].size], gsrc)))
    while pending:
        k, work = pending.popleft()
        phase = f"bucket {k}"
        comm.wait(work, phase)
        buf = bufs[k % len(bufs)]
        if not failed():
            try:
                fault_point(phase, comm.rank)
                unpacker.unpack(buf, k)
            except Exception as exc:
                unpacker.abandon()
                fail(exc)
        nxt = k + len(bufs)
        if nxt < len(buckets):
            pending.append((nxt, comm.issue(f"bucket {nxt}", dist.broadcast, buf[: buckets[nxt].size], gsrc)))
    _return_buffers(comm.device, owned)
