"""Moving tensors to receivers on the source's host through shared memory: `SharedMemoryTransport`.

Over gloo, a bucketed broadcast copies every byte four times: the source packs a bucket, the kernel copies
it into a loopback socket and out again, the receiver unpacks it. When every receiver runs on the source's
host (and in its pid namespace) two copies suffice: the source packs each bucket into a shared memory
segment and every receiver unpacks it from there, all at once. The collectives that remain are tiny
all-reduces that say when a slot is full and when every receiver is done with it.

The segment is a memfd the source creates (``elastic-<random token>``): it has no name in any file
system, so nothing is left behind when a process is killed, and the kernel frees it once the last process
holding it closes or unmaps it. Its plan (pid, fd, token, size, inode) travels to the receivers inside the
sync payload; a receiver opens it through ``/proc/<pid>/fd/<fd>`` after checking that the link names the
memfd with that token, so a pid from another host or pid namespace never makes it open an unrelated file
(a FIFO would block, a device could act). The source keeps its segment and receivers keep their mappings
between syncs (fresh memory would page-fault on every sync); `release_shared` drops them.

One all-reduce (MIN of a flag) at the start tells every rank whether every receiver mapped the segment;
if one could not (another host, another pid namespace, permissions), every rank runs the fallback
transport (a `TcpTransport`, whose own fallback is a `BroadcastTransport`) for this sync instead. Then
the tensors' bytes are cut into buckets (`plan_buckets`, every tensor included) that go round a ring of
`slots` slots: bucket ``k`` lives in slot ``k % slots``. For each bucket every rank joins one all-reduce
``c_k``: the source after packing bucket ``k``, a receiver after unpacking bucket ``k - 1``; a receiver
unpacks bucket ``k`` once ``c_k`` completed, and the source packs bucket ``k >= slots`` only after
``c_(k - slots + 1)``, when every receiver has left the bucket that occupied the slot before. A last
all-reduce after the last unpack tells the source that no receiver reads the segment any more, so the next
sync may write it. Packing and unpacking use the same grouped copies as `BroadcastTransport`; local
failures go to `on_error` and every rank still joins every all-reduce, so no rank is left waiting; a
communication failure raises `SyncError`.
"""

from __future__ import annotations

import logging
import mmap
import operator
import os
import secrets
import stat
import threading
import warnings
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Any, NamedTuple

import attrs
import torch
import torch.distributed as dist

from elastic.replication.comm import Comm, fault_point
from elastic.replication.transport.broadcast import (
    RAMP_MIN,
    Bucket,
    Packer,
    Unpacker,
    _quiet,
    forget_splits,
    kept_plan,
)
from elastic.replication.transport.protocol import Transport, at_least
from elastic.replication.transport.tcp import TcpTransport
from elastic.state.tensors import TensorMeta

__all__ = [
    "MIN_BYTES",
    "SHM_BUCKET_BYTES",
    "SLOTS",
    "SegmentRef",
    "SharedMemoryTransport",
    "ShmPlan",
    "expected_link",
    "link_matches",
    "release_shared",
    "shared_cached_bytes",
]

log = logging.getLogger("elastic")

OnError = Callable[[BaseException], None]

#: Default bucket bound (the measurements behind it: docs/performance.md, "How the tensors move"). Fewer,
#: larger buckets mean fewer all-reduce round trips; two 16 MiB slots keep the shared memory to the
#: broadcast transport's two 16 MiB buckets.
SHM_BUCKET_BYTES = 16 * 2**20
#: Default ring depth: slots of the shared segment, buckets the source may fill before receivers catch up
#: (at least 2: the source packs one slot while receivers unpack another).
SLOTS = 2
#: Default size below which the shared-memory path is not worth its extra all-reduce: plain broadcast.
MIN_BYTES = 2**20
#: At most this many receiver mappings are kept between syncs (one per source process, usually one).
MAX_MAPPINGS = 4
#: Slots start at multiples of this (the page size on every platform torch supports is a divisor).
_ALIGN = 4096
_PREFIX = "elastic-"


class SegmentRef(NamedTuple):
    """Where receivers find the source's segment: its process, descriptor, memfd token, bytes and inode."""

    pid: int
    fd: int
    token: str
    size: int
    inode: int


class ShmPlan(NamedTuple):
    """A `SharedMemoryTransport` plan. `segment` is `None` when this sync takes the fallback alone (not on
    the CPU, too few bytes, no memfd); `fallback` is the fallback's plan, taken when some receiver cannot
    map the segment. `slot_bytes`, `slots`, `bucket_bytes` and `ramp_min` are the source's, so that every
    rank cuts the same buckets whatever its own options."""

    segment: SegmentRef | None
    fallback: Any
    slot_bytes: int = 0
    slots: int = 0
    bucket_bytes: int = 0
    ramp_min: int = 0


def expected_link(token: str) -> str:
    """What ``readlink`` of a descriptor of the memfd with `token` says (Linux)."""
    return f"/memfd:{_PREFIX}{token} (deleted)"


def link_matches(link: str, token: str) -> bool:
    """Whether `link` (a ``readlink`` result) names the memfd with `token`, and nothing else."""
    return bool(token) and token.isalnum() and link == expected_link(token)


# -----------------------------------------------------------------------------------------------------------
# The source's segments


class _Region:
    """Mapped shared bytes and their slot views, kept with them: the same view objects from one transfer to
    the next (kept bucket plans keep their split of a bucket for the buffer object it was made for), gone
    with the mapping."""

    def __init__(self, data: torch.Tensor) -> None:
        self.bytes = data
        self._slots: tuple[tuple[int, int], list[torch.Tensor]] | None = None

    def slots(self, count: int, slot_bytes: int) -> list[torch.Tensor]:
        if self._slots is None or self._slots[0] != (count, slot_bytes):
            views = [self.bytes[n * slot_bytes : (n + 1) * slot_bytes] for n in range(count)]
            self._slots = ((count, slot_bytes), views)
        return self._slots[1]


class _Segment:
    """A memfd of `size` bytes mapped read-write in this process; the descriptor stays open (receivers open
    the memfd through it) until `close` or garbage collection."""

    def __init__(self, size: int) -> None:
        token = secrets.token_hex(16)
        fd = os.memfd_create(_PREFIX + token, os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            mapped = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            inode = os.fstat(fd).st_ino
        except BaseException:
            os.close(fd)
            raise
        self.fd, self.token, self.size, self.inode = fd, token, size, inode
        self.region = _Region(torch.frombuffer(mapped, dtype=torch.uint8))  # keeps the mapping alive
        self._close = weakref.finalize(self, os.close, fd)

    def ref(self) -> SegmentRef:
        return SegmentRef(os.getpid(), self.fd, self.token, self.size, self.inode)

    def close(self) -> None:
        """Close the descriptor (the mapping goes with the last view of its bytes) and let the kept bucket
        plans forget their views of it."""
        self._close()
        forget_splits()


_lock = threading.Lock()
#: The source's segments not in use by a transfer (at most two: the newest and the largest).
_free: list[_Segment] = []
#: A receiver's mappings of sources' segments, least recently used first.
_mapped: OrderedDict[SegmentRef, _Region] = OrderedDict()


def _segment_for(size: int) -> _Segment:
    """A free segment of at least `size` bytes, created if none is; it stays free (`_take` claims it)."""
    with _lock:
        for seg in _free:
            if seg.size >= size:
                return seg
    seg = _Segment(size)
    with _lock:
        smaller = [s for s in _free if s.size < size]
        _free[:] = [s for s in _free if s.size >= size] + [seg]
    for s in smaller:  # a transfer that planned with one of them finds it gone and falls back
        s.close()
    return seg


def _take(token: str) -> _Segment | None:
    """Claim the free segment with `token` for one transfer (`None`: released or claimed meanwhile)."""
    with _lock:
        for n, seg in enumerate(_free):
            if seg.token == token:
                return _free.pop(n)
    return None


def _give_back(seg: _Segment) -> None:
    """Make `seg` free again, keeping at most two free segments (the largest ones)."""
    with _lock:
        _free.append(seg)
        _free.sort(key=lambda s: s.size, reverse=True)
        dropped = _free[2:]
        del _free[2:]
    for s in dropped:
        s.close()


# -----------------------------------------------------------------------------------------------------------
# A receiver's mappings


def _open_checked(ref: SegmentRef) -> int:
    """A read-only descriptor of the source's memfd, opened only once its link names the memfd.

    Raises `OSError` or `ValueError` saying why the segment cannot be used."""
    path = f"/proc/{ref.pid}/fd/{ref.fd}"
    link = os.readlink(path)
    if not link_matches(link, ref.token):
        msg = f"{path} names {link!r}, not the source's segment (another host or pid namespace?)"
        raise ValueError(msg)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY)
    try:
        st = os.fstat(fd)
        mine = os.readlink(f"/proc/self/fd/{fd}")
        if not (stat.S_ISREG(st.st_mode) and st.st_ino == ref.inode and link_matches(mine, ref.token)):
            msg = f"{path} changed between the check and the open (now {mine!r}, inode {st.st_ino})"
            raise ValueError(msg)
        if st.st_size < ref.size:
            msg = f"{path} holds {st.st_size} bytes, the plan says {ref.size}"
            raise ValueError(msg)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _map(ref: SegmentRef) -> _Region:
    """The source's segment mapped read-only (a kept mapping when there is one)."""
    with _lock:
        cached = _mapped.get(ref)
        if cached is not None:
            _mapped.move_to_end(ref)
            return cached
    fd = _open_checked(ref)
    try:
        mapped = mmap.mmap(fd, ref.size, mmap.MAP_SHARED, mmap.PROT_READ)
    finally:
        os.close(fd)  # the mapping keeps the memfd alive
    with warnings.catch_warnings():  # read-only memory: torch warns that writing would be undefined
        warnings.simplefilter("ignore", UserWarning)
        view = torch.frombuffer(mapped, dtype=torch.uint8)
    region = _Region(view)
    with _lock:
        stale = [r for r in _mapped if r.pid == ref.pid]  # the source replaced its segment
        for old in stale:
            del _mapped[old]
        _mapped[ref] = region
        while len(_mapped) > MAX_MAPPINGS:
            _mapped.popitem(last=False)
            stale.append(ref)
    if stale:
        forget_splits()  # the kept bucket plans' views of the dropped mappings would keep them mapped
    return region


def shared_cached_bytes() -> int:
    """Bytes of shared memory this process keeps between transfers: its own free segments (as a source)
    and its mappings of sources' segments (as a receiver; those pages are the sources')."""
    with _lock:
        return sum(s.size for s in _free) + sum(m.bytes.numel() for m in _mapped.values())


def release_shared() -> None:
    """Drop the kept segments and mappings (the next transfer makes them again)."""
    with _lock:
        dropped = list(_free)
        _free.clear()
        _mapped.clear()
    for s in dropped:
        s.close()
    forget_splits()


class _SourceRing:
    """The source's side of the ring: bucket k is packed into slot ``k % slots`` and announced by the
    all-reduce ``c_k``; the first `slots` buckets may be packed ahead (`pack_ahead`), before ``c_0``, since
    the last transfer's final all-reduce left every slot free."""

    def __init__(
        self,
        comm: Comm,
        seg: _Segment,
        tensors: list[torch.Tensor],
        kept: Any,
        plan: ShmPlan,
        on_error: OnError,
    ) -> None:
        self.comm, self.plan, self.on_error = comm, plan, on_error
        self.buckets = kept.buckets
        self.bases = seg.region.slots(plan.slots, plan.slot_bytes)
        self.packer = Packer(tensors, kept, comm.device)
        self.failed = False
        self.ahead = 0  # buckets packed ahead

    def _pack(self, k: int) -> None:
        if self.failed:
            return
        try:
            fault_point(f"bucket {k}", self.comm.rank)
            self.packer.pack(self.bases[k % len(self.bases)], k)
        except Exception as exc:
            self.failed = True
            self.on_error(exc)

    def pack_ahead(self) -> None:
        with _quiet():
            for k in range(min(self.plan.slots, len(self.buckets))):
                self._pack(k)
                self.ahead = k + 1

    def run(self) -> None:
        comm, slots = self.comm, self.plan.slots
        pending: deque[Any] = deque()  # the all-reduces issued and not waited for, oldest first
        waited = 0  # c_0 ... c_(waited - 1) are known complete
        with _quiet():
            for k in range(len(self.buckets)):
                if k >= self.ahead:
                    while waited <= k - slots + 1:  # c_(k - slots + 1): every receiver left bucket k - slots
                        work, _, done = pending.popleft()
                        comm.wait(work, done)
                        waited += 1
                    self._pack(k)
                pending.append(_signal(comm, f"bucket {k}"))
            pending.append(_signal(comm, DONE_PHASE))
            while pending:
                work, _, done = pending.popleft()
                comm.wait(work, done)


# -----------------------------------------------------------------------------------------------------------
# The transport


def _is_transport(instance: Any, attribute: Any, value: Any) -> None:
    if not isinstance(value, Transport) or isinstance(value, SharedMemoryTransport):
        msg = (
            f"SharedMemoryTransport(fallback=...) must be a Transport other than a SharedMemoryTransport "
            f"(e.g. BroadcastTransport()), got {type(value).__name__} {value!r}"
        )
        raise TypeError(msg)


def _signal(comm: Comm, phase: str, value: int = 1) -> Any:
    """Issue one all-reduce (MIN) of a one-element int flag; returns ``(work, flag, phase)``."""
    flag = torch.tensor([value], dtype=torch.int32)
    return comm.issue(phase, dist.all_reduce, flag, op=dist.ReduceOp.MIN), flag, phase


#: Name of the all-reduce that says whether every receiver mapped the segment.
AGREE_PHASE = "shared memory"


def _agree(comm: Comm, ok: bool, phase: str = AGREE_PHASE) -> bool:
    """Whether every rank of `comm` says `ok` (one all-reduce named `phase`); the same answer on every
    rank."""
    work, flag, phase = _signal(comm, phase, 1 if ok else 0)
    comm.wait(work, phase)
    return int(flag.item()) == 1


_RING = object()


def _fallback_alone(plan: Any) -> Any:
    """The fallback's plan when a transfer takes the fallback alone (a plan of the fallback's own transport,
    as a source without shared memory makes, or one without a segment), else `_RING`."""
    if not isinstance(plan, ShmPlan):
        return plan
    return plan.fallback if plan.segment is None else _RING


#: Name of the all-reduce after the last bucket (the buckets' own are "bucket k").
DONE_PHASE = "buckets done"


@attrs.frozen
class SharedMemoryTransport:
    """Buckets through a shared-memory ring when every receiver can map the source's segment, else
    `fallback` (by default a `TcpTransport`: connections of its own between hosts, else broadcasts).

    `bucket_bytes` bounds one bucket (the first and last ones ramp from ``bucket_bytes / 8``, at least
    `ramp_min`), `slots` buckets fit in the segment at once (the source's shared memory is ``slots *
    bucket_bytes`` at most), and transfers of fewer than `min_bytes` (or on a non-CPU communication device,
    or without ``os.memfd_create``) go by `fallback` without the extra all-reduce. The segment and the
    receivers' mappings are kept between calls (`release_shared` drops them).
    """

    bucket_bytes: int = attrs.field(default=SHM_BUCKET_BYTES, validator=at_least(1))
    slots: int = attrs.field(default=SLOTS, validator=at_least(2))
    min_bytes: int = attrs.field(default=MIN_BYTES, validator=at_least(0))
    ramp_min: int = attrs.field(default=RAMP_MIN, validator=at_least(1))
    fallback: Transport = attrs.field(factory=TcpTransport, validator=_is_transport)

    def _why_not(self, total: int, comm: Comm) -> str | None:
        if comm.device.type != "cpu":
            return f"the communication device is {comm.device}"
        if not hasattr(os, "memfd_create"):
            return "this platform has no os.memfd_create"
        if total == 0 or total < self.min_bytes:
            return f"{total} bytes to move, fewer than min_bytes={self.min_bytes}"
        return None

    def plan(self, tensors: list[torch.Tensor], comm: Comm) -> ShmPlan:
        """The fallback's plan, and where the receivers find the source's segment (``segment=None``: this
        transfer takes the fallback alone)."""
        fallback = self.fallback.plan(tensors, comm)
        itemsizes = list(map(torch.Tensor.element_size, tensors))
        total = sum(map(operator.mul, map(torch.Tensor.numel, tensors), itemsizes))
        why = self._why_not(total, comm)
        if why is None:
            aligned = total + sum(itemsizes)  # at most an element's padding before each tensor
            slot = -(-min(self.bucket_bytes, aligned) // _ALIGN) * _ALIGN
            try:
                seg = _segment_for(self.slots * slot)
            except OSError as exc:
                why = f"no shared segment of {self.slots * slot} bytes: {exc}"
            else:
                return ShmPlan(seg.ref(), fallback, slot, self.slots, self.bucket_bytes, self.ramp_min)
        log.debug("shared-memory transport: broadcast instead, %s", why)
        return ShmPlan(None, fallback)

    def device_for(self, meta: TensorMeta, comm: Comm) -> torch.device:
        """Where a receiver allocates a tensor it lacks (the fallback's choice)."""
        return self.fallback.device_for(meta, comm)

    @staticmethod
    def _buckets(metas: list[TensorMeta], plan: ShmPlan) -> Any:
        """The kept bucket plan (every tensor in the ring, none direct) for the source's bucket options."""
        return kept_plan(metas, [False] * len(metas), plan.bucket_bytes, plan.ramp_min)

    def send(
        self,
        comm: Comm,
        src: int,
        tensors: list[torch.Tensor],
        metas: list[TensorMeta],
        plan: Any,
        on_error: OnError,
    ) -> None:
        """The source's half (never writes to `tensors`): the ring when every receiver mapped the segment,
        else the fallback's `send`. A local failure while packing goes to `on_error` and every all-reduce
        still runs; a communication failure raises `SyncError` (and the segment is dropped, since a
        receiver of the broken transfer may still read it)."""
        alone = _fallback_alone(plan)
        if alone is not _RING:
            self.fallback.send(comm, src, tensors, metas, alone, on_error)
            return
        seg = _take(plan.segment.token)
        ring: _SourceRing | None = None
        try:
            work, flag, phase = _signal(comm, AGREE_PHASE, 1 if seg is not None else 0)
            if seg is not None:  # fill the first slots while the receivers map the segment
                ring = _SourceRing(comm, seg, tensors, self._buckets(metas, plan), plan, on_error)
                ring.pack_ahead()
            comm.wait(work, phase)
        except BaseException:
            if seg is not None:
                seg.close()
            raise
        if int(flag.item()) != 1:
            log.debug(
                "shared-memory transport: broadcast instead, %s",
                "the segment was released before the transfer" if seg is None else "a receiver cannot map it",
            )
            if seg is not None:
                _give_back(seg)
            self.fallback.send(comm, src, tensors, metas, plan.fallback, on_error)
            return
        assert seg is not None and ring is not None  # the agreement needs every rank's yes
        try:
            ring.run()
        except BaseException:
            seg.close()
            raise
        _give_back(seg)

    def receive(
        self,
        comm: Comm,
        src: int,
        targets: list[torch.Tensor],
        metas: list[TensorMeta],
        plan: Any,
        on_error: OnError,
    ) -> None:
        """The receivers' half: the source's tensors written into `targets` in place (storage kept), from
        the shared ring when every receiver mapped it, else by the fallback's `receive`. A local failure
        while writing goes to `on_error` and the transfer goes on without writing; a communication
        failure raises `SyncError`."""
        alone = _fallback_alone(plan)
        if alone is not _RING:
            self.fallback.receive(comm, src, targets, metas, alone, on_error)
            return
        view: _Region | None = None
        buckets: list[Bucket] = []
        try:
            kept = self._buckets(metas, plan)
            buckets = kept.buckets
            largest = max((b.size for b in buckets), default=0)
            if largest > plan.slot_bytes:
                msg = f"a bucket of {largest} bytes does not fit a slot of {plan.slot_bytes} bytes"
                raise ValueError(msg)
            if plan.slots * plan.slot_bytes > plan.segment.size:
                msg = f"{plan.slots} slots of {plan.slot_bytes} bytes do not fit {plan.segment.size} bytes"
                raise ValueError(msg)
            view = _map(plan.segment)
        except Exception as exc:  # OSError, ValueError: this rank cannot take the shared path
            log.debug(
                "shared-memory transport: cannot map the source's segment: %s: %s", type(exc).__name__, exc
            )
        if not _agree(comm, view is not None):
            if view is not None:
                log.debug(
                    "shared-memory transport: broadcast instead, another receiver cannot map the segment"
                )
            self.fallback.receive(comm, src, targets, metas, plan.fallback, on_error)
            return
        assert view is not None  # the agreement needs every rank's yes
        bases = view.slots(plan.slots, plan.slot_bytes)
        unpacker = Unpacker(targets, metas, kept, comm.device)
        failed = False
        with _quiet():
            for k in range(len(buckets)):
                phase = f"bucket {k}"
                work, _, _ = _signal(comm, phase)
                comm.wait(work, phase)  # the source packed bucket k
                if failed:
                    continue
                try:
                    fault_point(phase, comm.rank)
                    unpacker.unpack(bases[k % len(bases)], k)
                except Exception as exc:
                    failed = True
                    unpacker.abandon()
                    on_error(exc)
            work, _, _ = _signal(comm, DONE_PHASE)
            comm.wait(work, DONE_PHASE)
