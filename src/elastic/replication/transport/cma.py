"""Moving tensors to receivers on the source's host by one copy: `CrossMemoryTransport`.

The shared-memory ring copies every byte twice (the source packs a slot, each receiver unpacks it), as a
loopback broadcast does in the kernel. On Linux a receiver may instead read the source's tensors straight
out of the source's memory into its own (``process_vm_readv``, "cross-memory attach"): one copy, made by
the receiver, while the source only waits. On a host whose cores are all busy (more ranks than cores, every
copy competing with the others) that saves half of a transfer's CPU time; with idle cores it takes about
as long as the ring, without its shared segment.

Reading another process's memory takes the permission to trace it: the same user (or ``CAP_SYS_PTRACE``),
where Yama's ``ptrace_scope`` allows it (at 1, Ubuntu's default, only an ancestor may), and a seccomp
profile that allows the call. The source's plan (`CmaPlan`) names its pid, the address and length of each
tensor, and where in its memory it keeps a random token (`SourceRef`). A receiver first reads the token
back from there: only the source process (and no other, not even a fork of it: a child draws a new
token) holds it at that address, so a plan whose pid names another process here (a source on another
host or in another pid namespace) never makes a receiver read unrelated memory into its tensors. One
all-reduce (MIN of a flag) says whether every receiver could; if one could not, the source plans its
fallback (a `SharedMemoryTransport`), broadcasts that plan, and every rank runs the fallback for this
transfer (a source that finds Yama forbids reading a sibling plans the fallback alone, without that
round). The plan also names the source's kernel and pid namespace (`host_key`): a receiver under another
kernel or in another pid namespace can open no ``/proc/<pid>`` of the source, so the flag it gives says
so, and when one does, every rank skips the shared-memory ring (whose source would pack its first slots
for nothing) and runs the ring's own fallback (the `TcpTransport` between hosts) instead. Otherwise
each receiver reads every tensor into its target, in place (a target whose bytes are not its values in
order, or of another dtype, goes through a temporary, one at a time), and a last all-reduce tells the
source that no receiver reads its memory any more: `send` returns only then, so the caller's tensors stay
as they are while they are read. A read that fails goes to `on_error` (every rank
still joins the last all-reduce); a communication failure raises `SyncError`.
"""

from __future__ import annotations

import array
import ctypes
import itertools
import logging
import os
import pickle
import secrets
import threading
from typing import Any, NamedTuple

import attrs
import torch

from elastic.replication.comm import Comm, fault_point
from elastic.replication.transport.broadcast import _quiet
from elastic.replication.transport.protocol import OnError, Transport, at_least
from elastic.replication.transport.shm import MIN_BYTES, SharedMemoryTransport, _signal
from elastic.state.tensors import TensorMeta

__all__ = [
    "AGREE_PHASE",
    "DONE_PHASE",
    "READ_PHASE",
    "CmaPlan",
    "CrossMemoryTransport",
    "SourceRef",
    "can_read",
    "host_key",
    "plain_cpu",
    "ptrace_refusal",
    "read_refusal",
    "read_regions",
    "source_ref",
    "yama_refusal",
]

log = logging.getLogger("elastic")

#: Name of the all-reduce that says whether every receiver can read the source's memory.
AGREE_PHASE = "cross memory"
#: Name of a receiver's read (its fault point) and of the all-reduce after every read.
READ_PHASE = "read"
DONE_PHASE = "reads done"
#: Name of the broadcast of the fallback's plan when some receiver cannot read the source's memory.
FALLBACK_PHASE = "fallback plan"
#: At most this many tensors per ``process_vm_readv`` call (Linux's ``IOV_MAX``).
IOV_MAX = 1024
_TOKEN_BYTES = 16


class SourceRef(NamedTuple):
    """Where receivers read the source: its pid, and the address of its token and the token itself."""

    pid: int
    address: int
    token: bytes


class CmaPlan(NamedTuple):
    """A `CrossMemoryTransport` plan. `source` is `None` when this transfer takes the fallback alone (then
    `fallback` is the fallback's plan); else `regions` holds each tensor's address and length in bytes in
    the source's memory, `host` the source's `host_key`, and the fallback is planned only if some receiver
    cannot read."""

    source: SourceRef | None
    regions: tuple[tuple[int, int], ...] = ()
    fallback: Any = None
    host: str = ""


# -----------------------------------------------------------------------------------------------------------
# The system call and the token


class _Iovec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


#: An array of iovecs is built as a flat array of machine words (address, length, address, ...): one C
#: call for a thousand tensors, where ctypes structures cost ~1 us each.
_WORD = next((code for code in "LQI" if array.array(code).itemsize == ctypes.sizeof(ctypes.c_size_t)), "")
_FLAT = bool(_WORD) and ctypes.sizeof(ctypes.c_void_p) == ctypes.sizeof(ctypes.c_size_t)


def _iovecs(pairs: list[tuple[int, int]]) -> Any:
    """`pairs` as a C array of iovecs (kept alive by the returned object)."""
    if _FLAT:
        return array.array(_WORD, itertools.chain.from_iterable(pairs))
    return (_Iovec * len(pairs))(*[_Iovec(*p) for p in pairs])


def _address(iovecs: Any) -> Any:
    if isinstance(iovecs, array.array):
        return ctypes.cast(iovecs.buffer_info()[0], ctypes.POINTER(_Iovec))
    return iovecs


_libc_lock = threading.Lock()
_readv: list[Any] = []  # process_vm_readv once looked up, or None where there is none


def _process_vm_readv() -> Any:
    """libc's ``process_vm_readv`` (None where the platform has none)."""
    with _libc_lock:
        if not _readv:
            fn = None
            if os.name == "posix" and os.path.isdir("/proc/self"):
                try:
                    fn = getattr(ctypes.CDLL(None, use_errno=True), "process_vm_readv", None)
                except OSError:
                    fn = None
            if fn is not None:
                iov = ctypes.POINTER(_Iovec)
                fn.argtypes = [ctypes.c_int, iov, ctypes.c_ulong, iov, ctypes.c_ulong, ctypes.c_ulong]
                fn.restype = ctypes.c_ssize_t
            _readv.append(fn)
        return _readv[0]


class _Token:
    """This process's random token, at a fixed address for its life; a forked child draws its own."""

    def __init__(self) -> None:
        self.buffer = ctypes.create_string_buffer(_TOKEN_BYTES)
        self.renew()

    def renew(self) -> None:
        self.buffer.raw = secrets.token_bytes(_TOKEN_BYTES)

    def ref(self) -> SourceRef:
        return SourceRef(os.getpid(), ctypes.addressof(self.buffer), self.buffer.raw)


_token = _Token()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_token.renew)


_host: list[str] = []


def host_key() -> str:
    """This process's kernel (its boot id) and pid namespace (its inode), as text ("" where unknown): two
    processes with different keys cannot reach each other through ``/proc/<pid>``."""
    if not _host:
        try:
            with open("/proc/sys/kernel/random/boot_id") as f:
                boot = f.read().strip()
            key = f"{boot}/{os.stat('/proc/self/ns/pid').st_ino}"
        except OSError:
            key = ""
        _host.append(key)
    return _host[0]


if hasattr(os, "register_at_fork"):  # a forked child may enter another pid namespace (unshare --fork)
    os.register_at_fork(after_in_child=_host.clear)


def source_ref() -> SourceRef:
    """Where receivers find this process's token (what a source publishes for `can_read`)."""
    return _token.ref()


#: Where Linux's Yama module says who may trace (and so read) whom, and the capability that overrides it.
YAMA_SCOPE = "/proc/sys/kernel/yama/ptrace_scope"
CAP_SYS_PTRACE = 19
_refusal: list[str | None] = []  # ptrace_refusal() once found


def yama_refusal(scope: str | None, capabilities: int) -> str | None:
    """Why Yama forbids reading a sibling process's memory (None: it does not), from the text of
    `YAMA_SCOPE` (None: no Yama) and this process's effective capabilities: at 1 (Ubuntu's default) only
    an ancestor may read, at 2 only a holder of ``CAP_SYS_PTRACE``, those may at 1 too; at 3 nobody."""
    level = int(scope.strip()) if scope is not None and scope.strip().isdigit() else 0
    if level == 0 or (level in (1, 2) and capabilities >> CAP_SYS_PTRACE & 1):
        return None
    return f"Yama's ptrace_scope is {level}: receivers may not read a sibling's memory"


def ptrace_refusal() -> str | None:
    """`yama_refusal` for this process (looked up once): a source that finds one plans its fallback
    alone, without the round in which every receiver would find it cannot read."""
    if not _refusal:
        try:
            with open(YAMA_SCOPE) as f:
                scope: str | None = f.read()
        except OSError:
            scope = None
        capabilities = 0
        try:
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith("CapEff:"):
                        capabilities = int(line.split()[1], 16)
        except (OSError, ValueError, IndexError):
            capabilities = 0
        _refusal.append(yama_refusal(scope, capabilities))
    return _refusal[0]


def read_refusal() -> str | None:
    """Why this process cannot read a sibling's memory at all (None: it may try, `can_read` tells per
    source): the platform has no ``process_vm_readv``, or `ptrace_refusal`."""
    if _process_vm_readv() is None:
        return "this platform has no process_vm_readv"
    return ptrace_refusal()


def read_regions(pid: int, dests: list[tuple[int, int]], regions: list[tuple[int, int]]) -> None:
    """Copy each ``(address, length)`` of `regions` in process `pid` to the same-length local region of
    `dests`, by ``process_vm_readv`` (at most `IOV_MAX` a call, resumed after a partial read).

    Raises `OSError` (with the errno: not permitted, no such process, a bad address) when a read fails.
    """
    readv = _process_vm_readv()
    if readv is None:
        msg = "this platform has no process_vm_readv"
        raise OSError(msg)
    at = 0
    while at < len(regions):
        start, end = at, min(at + IOV_MAX, len(regions))
        count = end - start
        local, remote = _iovecs(dests[start:end]), _iovecs(regions[start:end])
        got = readv(pid, _address(local), count, _address(remote), count, 0)
        if got < 0:
            errno = ctypes.get_errno()
            msg = f"process_vm_readv from pid {pid} failed: {os.strerror(errno)}"
            raise OSError(errno, msg)
        while at < end and got >= regions[at][1]:  # a partial read stops between two regions
            got -= regions[at][1]
            at += 1
        if got or at == start:
            msg = f"process_vm_readv from pid {pid} could not read a region of {regions[at][1]} bytes"
            raise OSError(msg)


def can_read(ref: SourceRef) -> str | None:
    """Why this process cannot read the memory `ref` names (None: it can, and it is the source's)."""
    buf = ctypes.create_string_buffer(_TOKEN_BYTES)
    try:
        read_regions(ref.pid, [(ctypes.addressof(buf), _TOKEN_BYTES)], [(ref.address, _TOKEN_BYTES)])
    except OSError as exc:
        return str(exc)
    if buf.raw != ref.token:
        return f"pid {ref.pid} does not hold the source's token (another host or pid namespace?)"
    return None


# -----------------------------------------------------------------------------------------------------------
# The transport


def _is_transport(instance: Any, attribute: Any, value: Any) -> None:
    if not isinstance(value, Transport) or isinstance(value, CrossMemoryTransport):
        msg = (
            f"CrossMemoryTransport(fallback=...) must be a Transport other than a CrossMemoryTransport "
            f"(e.g. SharedMemoryTransport()), got {type(value).__name__} {value!r}"
        )
        raise TypeError(msg)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def plain_cpu(t: torch.Tensor) -> bool:
    """Whether `t` is a CPU tensor whose bytes are its values in order (contiguous, no lazy conjugate or
    negation): what a receiver may read from, or into, by address."""
    return t.is_cpu and t.is_contiguous() and not t.is_conj() and not t.is_neg()


def _regions(tensors: list[torch.Tensor]) -> list[tuple[int, int]] | None:
    """Each tensor's address and length in bytes (one pass: ~1 us a tensor), or None when one is not
    `plain_cpu`."""
    out = []
    for t in tensors:
        if not plain_cpu(t):
            return None
        out.append((t.data_ptr(), t.nbytes))
    return out


@attrs.frozen
class CrossMemoryTransport:
    """Receivers read the source's tensors straight from its memory when each may (see the module), else
    `fallback` (by default a `SharedMemoryTransport`).

    Transfers of fewer than `min_bytes`, on a non-CPU communication device, of a source tensor whose bytes
    are not its values in order (non-contiguous, a lazy conjugate), where the platform has no
    ``process_vm_readv`` or where Yama forbids reading a sibling (`ptrace_refusal`), go by `fallback`
    without the extra all-reduce. Nothing is kept between calls.
    """

    min_bytes: int = attrs.field(default=MIN_BYTES, validator=at_least(0))
    fallback: Transport = attrs.field(factory=SharedMemoryTransport, validator=_is_transport)

    def _why_not(self, regions: list[tuple[int, int]] | None, comm: Comm) -> str | None:
        if comm.device.type != "cpu":
            return f"the communication device is {comm.device}"
        if regions is None:
            return "a source tensor is not a plain CPU tensor"
        total = sum(length for _, length in regions)
        if total == 0 or total < self.min_bytes:
            return f"{total} bytes to move, fewer than min_bytes={self.min_bytes}"
        return read_refusal()

    def plan(self, tensors: list[torch.Tensor], comm: Comm) -> CmaPlan:
        """Where the receivers read the source's tensors (``source=None``: this transfer takes the
        fallback alone, and carries the fallback's plan)."""
        regions = _regions(tensors)
        why = self._why_not(regions, comm)
        if why is not None:
            log.debug("cross-memory transport: %s instead, %s", type(self.fallback).__name__, why)
            return CmaPlan(None, (), self.fallback.plan(tensors, comm))
        assert regions is not None
        return CmaPlan(source_ref(), tuple(regions), host=host_key())

    def device_for(self, meta: TensorMeta, comm: Comm) -> torch.device:
        """Where a receiver allocates a tensor it lacks (the fallback's choice)."""
        return self.fallback.device_for(meta, comm)

    def _fallback_for(self, level: int) -> Transport:
        """What a transfer takes when not every receiver can read: the shared-memory ring's own fallback
        when some receiver runs elsewhere (the ring cannot reach it either), else `fallback`."""
        if level == ELSEWHERE and isinstance(self.fallback, SharedMemoryTransport):
            return self.fallback.fallback
        return self.fallback

    def send(
        self,
        comm: Comm,
        src: int,
        tensors: list[torch.Tensor],
        metas: list[TensorMeta],
        plan: Any,
        on_error: OnError,
    ) -> None:
        """The source's half: nothing to copy; it waits until every receiver has read (its tensors must
        stay as they are until then), or runs the fallback when some receiver cannot read."""
        if not isinstance(plan, CmaPlan) or plan.source is None:
            alone = plan.fallback if isinstance(plan, CmaPlan) else plan
            self.fallback.send(comm, src, tensors, metas, alone, on_error)
            return
        level = _agreement(comm, READS)
        if level != READS:
            chosen = self._fallback_for(level)
            log.debug(
                "cross-memory transport: a receiver cannot read this process's memory%s; %s instead",
                " (it runs elsewhere)" if level == ELSEWHERE else "",
                type(chosen).__name__,
            )
            failed: BaseException | None = None
            try:
                fallback = chosen.plan(tensors, comm)
                data = pickle.dumps(fallback)
            except Exception as exc:  # the receivers still take the (empty) plan's collectives
                failed, fallback, data = exc, None, pickle.dumps(None)
            comm.broadcast_bytes(data, src, FALLBACK_PHASE)
            if failed is not None:
                on_error(failed)
                return
            chosen.send(comm, src, tensors, metas, fallback, on_error)
            return
        with _quiet():
            try:
                fault_point(READ_PHASE, comm.rank)
            except Exception as exc:
                on_error(exc)
            _done(comm)

    def receive(
        self,
        comm: Comm,
        src: int,
        targets: list[torch.Tensor],
        metas: list[TensorMeta],
        plan: Any,
        on_error: OnError,
    ) -> None:
        """The receivers' half: the source's tensors read straight into `targets` (in place: storage
        kept), or the fallback's `receive` when some receiver cannot read. A failed read goes to
        `on_error` (what was read stays written) and every rank still finishes the transfer."""
        if not isinstance(plan, CmaPlan) or plan.source is None:
            alone = plan.fallback if isinstance(plan, CmaPlan) else plan
            self.fallback.receive(comm, src, targets, metas, alone, on_error)
            return
        mine = host_key()
        elsewhere = bool(plan.host and mine and plan.host != mine)
        why = "the source runs under another kernel or pid namespace" if elsewhere else None
        why = why or _mismatch(targets, metas, plan) or can_read(plan.source)
        if why is not None:
            log.debug("cross-memory transport: cannot read the source's memory: %s", why)
        level = _agreement(comm, ELSEWHERE if elsewhere else SAME_HOST if why else READS)
        if level != READS:
            fallback = pickle.loads(comm.broadcast_bytes(None, src, FALLBACK_PHASE))
            if fallback is None:  # the source could not plan its fallback: it reports why
                return
            self._fallback_for(level).receive(comm, src, targets, metas, fallback, on_error)
            return
        with _quiet():
            try:
                fault_point(READ_PHASE, comm.rank)
                _read_into(plan.source.pid, targets, metas, plan.regions)
            except Exception as exc:
                on_error(exc)
            _done(comm)


#: A rank's answer in the agreement (the smallest answer decides): it reads the source's memory (the
#: source's own answer), it cannot but shares the source's kernel and pid namespace, or it runs elsewhere.
READS, SAME_HOST, ELSEWHERE = 2, 1, 0


def _agreement(comm: Comm, answer: int) -> int:
    """The smallest `answer` of every rank (one all-reduce): the same on every rank."""
    work, flag, phase = _signal(comm, AGREE_PHASE, answer)
    comm.wait(work, phase)
    return int(flag.item())


def _done(comm: Comm) -> None:
    work, _, phase = _signal(comm, DONE_PHASE)
    comm.wait(work, phase)


def _mismatch(targets: list[torch.Tensor], metas: list[TensorMeta], plan: CmaPlan) -> str | None:
    """Why the plan's regions do not match the metadata every rank holds (None: they do)."""
    if len(plan.regions) != len(metas) or len(targets) != len(metas):
        return f"{len(plan.regions)} regions for {len(metas)} tensors ({len(targets)} targets)"
    for i, ((_, length), meta) in enumerate(zip(plan.regions, metas)):
        if length != meta.nbytes:
            return f"tensor {i}: a region of {length} bytes for {meta.nbytes} bytes of metadata"
    return None


def _read_into(
    pid: int, targets: list[torch.Tensor], metas: list[TensorMeta], regions: tuple[tuple[int, int], ...]
) -> None:
    """Read every region into its target: the targets whose bytes are the metadata's, in order, in one
    pass; every other one through a temporary of the metadata's shape and dtype, one at a time."""
    direct: list[int] = []
    staged: list[int] = []
    for i, (t, meta) in enumerate(zip(targets, metas)):
        length = regions[i][1]
        if not length:
            continue
        if t.dtype == meta.dtype and t.nbytes == length and plain_cpu(t):
            direct.append(i)
        else:
            staged.append(i)
    read_regions(pid, [(targets[i].data_ptr(), regions[i][1]) for i in direct], [regions[i] for i in direct])
    for i in staged:
        meta = metas[i]
        tmp = torch.empty(meta.shape, dtype=meta.dtype)
        read_regions(pid, [(tmp.data_ptr(), regions[i][1])], [regions[i]])
        targets[i].copy_(tmp)
