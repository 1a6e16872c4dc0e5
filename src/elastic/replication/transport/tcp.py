"""Moving tensors to receivers on other hosts over TCP connections of their own: `TcpTransport`.

A gloo broadcast of a bucket costs the source a pack, the kernel two copies and the receiver an unpack,
and gloo moves each bucket through its own threads in steps that a small machine's cores cannot overlap
well (the bucketed broadcasts measured 1.5-1.9x one flat broadcast of the same bytes, however the packing
was overlapped). Here the source writes its tensors' own memory into a socket with ``sendmsg`` (a
scatter-gather list of the tensors' bytes, no copy in user space) and each receiver reads straight into
its own tensors with ``recvmsg_into``: the kernel's two copies are all that is left. Tensors smaller than
`direct_bytes`, and source tensors whose bytes are not their values in order (non-contiguous, a lazy
conjugate, another device), are packed into a few reused buckets as `BroadcastTransport` packs them
(`Packer`, `Unpacker`: the same bucket plans).

How a transfer goes. The source's `plan` opens a listening socket of its own on the address gloo uses
(`listen_address`) with a port the kernel picks, and draws a random 16-byte token; the address, the port
and the token ride in the sync's object payload (no collective of their own). Every receiver connects,
presents the token and its rank, and waits for the source's one-byte answer; the source accepts on a
helper thread (a connection with a wrong token, a rank that is no receiver of this transfer or a second
connection of one rank is closed unanswered, and logged) and closes the listening socket once every
receiver is in. One all-reduce (MIN of a flag) then tells every rank whether every receiver got in; if
one did not (no route, a firewall, a wrong token), every rank runs `fallback` (a `BroadcastTransport`,
whose plan the payload also carried) for this transfer, the failure is logged once at WARNING, and the
sources of the next `retry_after` seconds plan the fallback alone. Otherwise the source serves each
receiver on a thread of its own: the large tensors in place, in order, then the buckets, which the
calling thread packs into `in_flight` reused buffers shared by every receiver's thread while the large
tensors go out; each receiver writes the large tensors into its targets (a target whose bytes cannot be
written where they are goes through one temporary at a time) and unpacks the buckets, then answers one
byte, after which the source's `send` returns.

Every blocking call is bounded by the transfer's timeout (the sync's, else the group's): connecting by
the smaller of it and `connect_timeout`, each ``sendmsg``/``recvmsg_into`` by the kernel's
``SO_SNDTIMEO``/``SO_RCVTIMEO``, so a peer that makes no progress for that long ends the transfer. A
timeout or a broken connection raises `SyncError` naming the phase, this rank, the peer's rank and its
address; a local failure (a fault point, a copy into a target) goes to `on_error` and the transfer goes
on, so every rank learns of it at commit.

Not taken, without the agreement round (the plan names the fallback alone): on a CUDA communication
device (NCCL's own broadcasts move GPU tensors better than host sockets), for transfers of fewer than
`min_bytes`, when ``ELASTIC_TCP_TRANSPORT=0`` (the escape hatch back to the broadcasts: the source's
setting decides, so set it on every rank), when no address to listen on is found, or within
`retry_after` seconds of a failed agreement. Under gloo, CUDA tensors travel through the host buckets
(pageable memory, as `BroadcastTransport` stages them), never in place.
"""

from __future__ import annotations

import contextlib
import ctypes
import hmac
import logging
import os
import secrets
import selectors
import socket
import struct
import threading
import time
from collections import OrderedDict, deque
from datetime import timedelta
from typing import Any, NamedTuple

import attrs
import torch
import torch.distributed as dist

from elastic._util.address import listen_address
from elastic._util.errors import SyncError
from elastic.replication.comm import Comm, fault_point
from elastic.replication.transport.broadcast import (
    BUCKET_BYTES,
    IN_FLIGHT,
    RAMP_MIN,
    BroadcastTransport,
    Packer,
    Unpacker,
    _plain,
    _quiet,
    _return_buffers,
    _take_buffers,
    kept_plan,
)
from elastic.replication.transport.protocol import OnError, Transport, at_least
from elastic.state.tensors import TensorMeta

__all__ = [
    "AGREE_PHASE",
    "CONNECT_TIMEOUT",
    "DIRECT_BYTES",
    "ENV_SWITCH",
    "MIN_BYTES",
    "RECEIVE_PHASE",
    "RETRY_AFTER",
    "SEND_PHASE",
    "TcpPlan",
    "TcpTransport",
    "open_listeners",
    "release_listeners",
]

log = logging.getLogger("elastic")

#: Default size from which a plain CPU tensor goes into the socket straight from its own memory. Smaller
#: ones are packed into buckets: a few hundred bytes an iovec would mean thousands of iovecs (and of
#: partial-read steps) for a state of tiny tensors; for the 2,000-tensor benchmark module (1,000 biases of
#: 732 bytes) sending every tensor in place measured the same as this, within the noise.
DIRECT_BYTES = 64 * 1024
#: Default smallest transfer worth the agreement round and the connections (below: the fallback alone).
MIN_BYTES = 2**20
#: Default bound of a receiver's ``connect`` in seconds (the sync's timeout bounds it too).
CONNECT_TIMEOUT = 5.0
#: Default seconds during which, after a failed agreement, sources plan the fallback alone.
RETRY_AFTER = 300.0
#: The environment variable that turns the transport off (``0``, ``false``, ``no`` or ``off``).
ENV_SWITCH = "ELASTIC_TCP_TRANSPORT"
#: Name of the all-reduce that says whether every receiver connected (and of a receiver's fault point).
AGREE_PHASE = "tcp connect"
#: Names of the source's and a receiver's part of the stream (in `SyncError` and fault points).
SEND_PHASE = "tcp send"
RECEIVE_PHASE = "tcp receive"
#: At most this many buffers per ``sendmsg``/``recvmsg_into`` call (Linux's ``IOV_MAX``).
IOV_MAX = 1024
#: At most this many plans' listening sockets stay open waiting for their `send` (older ones close).
LISTENERS_KEPT = 4
#: How many lists of tensor memoryviews (a layout's, per side) are kept between transfers.
VIEWS_KEPT = 8

_MAGIC = b"ELT1"
_HELLO = struct.Struct("<4s16si")  # magic, token, the receiver's group rank
_ACCEPTED = b"\x01"
_DONE = b"\x02"
_TOKEN_BYTES = 16
_NOSIGNAL = getattr(socket, "MSG_NOSIGNAL", 0)
_WAITALL = getattr(socket, "MSG_WAITALL", 0)
_OFF = ("0", "false", "no", "off")


class TcpPlan(NamedTuple):
    """A `TcpTransport` plan. `address` is None when this transfer takes the fallback alone; else the
    source listens there (host, port) for connections presenting `token`, the tensors flagged `direct`
    travel in place and the others in buckets of `bucket_bytes` (ramping from `ramp_min`). `fallback` is
    the fallback's plan, for a transfer where some receiver cannot connect."""

    address: tuple[str, int] | None
    fallback: Any
    token: bytes
    direct: list[bool]
    bucket_bytes: int
    ramp_min: int


# -----------------------------------------------------------------------------------------------------------
# Listening sockets, one per plan


_lock = threading.Lock()
_listeners: OrderedDict[bytes, socket.socket] = OrderedDict()


def _listen(address: str, backlog: int) -> socket.socket:
    info = socket.getaddrinfo(address, 0, type=socket.SOCK_STREAM, flags=socket.AI_NUMERICHOST)[0]
    sock = socket.socket(info[0], socket.SOCK_STREAM)
    try:
        sock.bind(info[4])
        sock.listen(backlog)
    except BaseException:
        sock.close()
        raise
    return sock


def _keep_listener(token: bytes, sock: socket.socket) -> None:
    with _lock:
        _listeners[token] = sock
        dropped = [_listeners.popitem(last=False)[1] for _ in range(len(_listeners) - LISTENERS_KEPT)]
    for old in dropped:
        old.close()


def _take_listener(token: bytes) -> socket.socket | None:
    with _lock:
        return _listeners.pop(token, None)


def open_listeners() -> int:
    """How many plans' listening sockets this process holds, waiting for their `send`."""
    with _lock:
        return len(_listeners)


def release_listeners() -> None:
    """Close the listening sockets of plans not sent (a later `send` of such a plan takes the fallback)."""
    with _lock:
        dropped = list(_listeners.values())
        _listeners.clear()
    for sock in dropped:
        sock.close()


def _forget_in_child() -> None:
    """A forked child never serves its parent's plans (and takes no lock a parent's thread may have held)."""
    global _lock
    _lock = threading.Lock()
    for sock in _listeners.values():
        sock.close()
    _listeners.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


# -----------------------------------------------------------------------------------------------------------
# Failures, the fallback's memory, the warning


_refused_until = [0.0]  # time.monotonic() until which sources plan the fallback alone
_warned = [False]


def _fell_back(retry_after: float, level: int, text: str, *args: Any) -> None:
    """Remember a failed agreement for `retry_after` seconds and log it (at `level` the first time in this
    process, at DEBUG afterwards)."""
    _refused_until[0] = time.monotonic() + retry_after
    with _lock:
        first = level > logging.DEBUG and not _warned[0]
        if first:
            _warned[0] = True
    log.log(level if first else logging.DEBUG, text, *args)


def _where(peer: int, address: tuple[str, int] | None) -> str:
    return f"rank {peer} at {address[0]}:{address[1]}" if address else f"rank {peer}"


def _failure(
    comm: Comm, phase: str, peer: int, address: tuple[str, int] | None, exc: BaseException, seconds: float
) -> SyncError:
    """A `SyncError` for a timeout or a broken connection with `peer` at `address`."""
    where = _where(peer, address)
    if isinstance(exc, (BlockingIOError, TimeoutError)):  # SO_SNDTIMEO/SO_RCVTIMEO, or Python's timeout
        msg = (
            f"{comm.op} timed out in phase '{phase}' on rank {comm.rank}: no progress with {where} for "
            f"{seconds:g}s. Every rank of the group must call {comm.op}() at the same point; a peer that "
            "died or is stuck elsewhere causes this (on a slow link, pass a larger timeout)"
        )
    else:
        msg = (
            f"{comm.op} failed in phase '{phase}' on rank {comm.rank}: the connection with {where} broke "
            f"({type(exc).__name__}: {exc}). A peer probably died; re-form the process group (or let "
            f"torchrun restart the workers) and {comm.op} again"
        )
    return SyncError(msg, phase=phase, op=comm.op)


def _seconds(comm: Comm) -> float:
    """The transfer's timeout in seconds: the sync's, else the group's, else torch's default."""
    limit: timedelta | None = comm.timeout
    if limit is None:
        try:
            group = comm.group or dist.group.WORLD
            limit = group._get_backend(torch.device("cpu")).options._timeout  # type: ignore[union-attr]
        except Exception:  # a backend without options: torch's default for its groups
            limit = dist.distributed_c10d.default_pg_timeout
    assert limit is not None
    return max(limit.total_seconds(), 1e-3)


def _kernel_timeouts(sock: socket.socket, seconds: float) -> None:
    """Blocking mode, every send and receive bounded by `seconds` in the kernel (Python's own timeout
    where the kernel's cannot be set)."""
    whole = int(seconds)
    micros = int((seconds - whole) * 1e6)
    timeval = struct.pack("@ll", whole, micros if whole or micros else 1)  # zero would mean no bound
    try:
        sock.settimeout(None)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
    except (OSError, struct.error):
        sock.settimeout(seconds)


# -----------------------------------------------------------------------------------------------------------
# Bytes in and out


def _view(address: int, length: int) -> memoryview:
    """The `length` bytes at `address` (of a live tensor the caller holds) as a memoryview."""
    return memoryview((ctypes.c_char * length).from_address(address))


_views: deque[tuple[tuple[tuple[int, int], ...], list[memoryview]]] = deque(maxlen=VIEWS_KEPT)


def _views_of(regions: tuple[tuple[int, int], ...]) -> list[memoryview]:
    """A memoryview of each ``(address, length)``: the kept list when the regions are the same as a recent
    transfer's (~1 us a view otherwise). The caller holds the tensors at those addresses, so a kept view
    always points into a live tensor."""
    with _lock:
        for key, views in _views:
            if key == regions:
                return views
    views = [_view(address, length) for address, length in regions]
    with _lock:
        _views.append((regions, views))
    return views


def _advance(batch: list[memoryview], n: int) -> tuple[int, memoryview | None]:
    """How many whole views of `batch` `n` bytes cover, and what is left of the next one (None: none)."""
    k = 0
    while k < len(batch) and n >= len(batch[k]):
        n -= len(batch[k])
        k += 1
    return k, (batch[k][n:] if n else None)


def _send_all(sock: socket.socket, views: list[memoryview]) -> None:
    """Every byte of `views`, in order, by ``sendmsg`` of up to `IOV_MAX` of them at a time."""
    i, head = 0, None
    while i < len(views):
        batch = views[i : i + IOV_MAX]
        if head is not None:
            batch[0] = head
        k, head = _advance(batch, sock.sendmsg(batch, (), _NOSIGNAL))
        i += k


def _recv_all(sock: socket.socket, views: list[memoryview]) -> None:
    """Fill every view of `views`, in order, by ``recvmsg_into`` (waiting for all) of up to `IOV_MAX` at a
    time. Raises `ConnectionError` when the peer closes the connection first."""
    i, head = 0, None
    while i < len(views):
        batch = views[i : i + IOV_MAX]
        if head is not None:
            batch[0] = head
        n = sock.recvmsg_into(batch, 0, _WAITALL)[0]
        if n == 0:
            msg = "the peer closed the connection"
            raise ConnectionError(msg)
        k, head = _advance(batch, n)
        i += k


def _drain(sock: socket.socket, n: int) -> None:
    """Read `n` bytes and drop them."""
    scratch = memoryview(bytearray(min(n, 2**20)))
    while n:
        take = min(n, len(scratch))
        _recv_all(sock, [scratch[:take]])
        n -= take


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    _recv_all(sock, [memoryview(buf)])
    return bytes(buf)


def _agree(comm: Comm, ok: bool) -> bool:
    """Whether every rank says `ok` (one all-reduce, MIN of a flag): the same answer on every rank."""
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    comm.wait(comm.issue(AGREE_PHASE, dist.all_reduce, flag, op=dist.ReduceOp.MIN), AGREE_PHASE)
    return int(flag.item()) == 1


# -----------------------------------------------------------------------------------------------------------
# The source: accepting the receivers


class _Acceptor(threading.Thread):
    """Accepts the receivers of one transfer on the plan's listening socket (closed when done)."""

    def __init__(
        self, listener: socket.socket, token: bytes, receivers: list[int], seconds: float, rank: int
    ) -> None:
        super().__init__(name="elastic-tcp-accept", daemon=True)
        self.listener, self.token, self.seconds, self.rank = listener, token, seconds, rank
        self.expected = set(receivers)
        self.conns: dict[int, tuple[socket.socket, tuple[str, int]]] = {}
        self._wake_r, self._wake_w = socket.socketpair()
        self._stopped = False

    def stop(self) -> None:
        """End the accepting (the agreement failed, or it raised) and close every connection."""
        self._stopped = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x", _NOSIGNAL)
        self.join()
        self._wake_w.close()
        self.close()

    def run(self) -> None:
        deadline = time.monotonic() + self.seconds
        pending: dict[socket.socket, tuple[bytearray, tuple[str, int]]] = {}
        with selectors.DefaultSelector() as sel:
            self.listener.setblocking(False)
            sel.register(self.listener, selectors.EVENT_READ)
            sel.register(self._wake_r, selectors.EVENT_READ)
            try:
                while self.expected - set(self.conns) and not self._stopped:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    for key, _ in sel.select(left):
                        if key.fileobj is self.listener:
                            self._accept(sel, pending)
                        elif key.fileobj is not self._wake_r:
                            self._hello(sel, pending, key.fileobj)  # type: ignore[arg-type]
            finally:
                for conn in pending:
                    conn.close()
                self.listener.close()
                self._wake_r.close()

    def _accept(self, sel: Any, pending: dict[socket.socket, tuple[bytearray, tuple[str, int]]]) -> None:
        try:
            conn, peer = self.listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        conn.setblocking(False)
        pending[conn] = (bytearray(), (str(peer[0]), int(peer[1])))
        sel.register(conn, selectors.EVENT_READ)

    def _hello(
        self, sel: Any, pending: dict[socket.socket, tuple[bytearray, tuple[str, int]]], conn: socket.socket
    ) -> None:
        buf, peer = pending[conn]
        try:
            data = conn.recv(_HELLO.size - len(buf))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if data:
            buf += data
            if len(buf) < _HELLO.size:
                return
        sel.unregister(conn)
        del pending[conn]
        why = self._refusal(bytes(buf)) if data else "it closed before presenting a token"
        if why is None:
            rank = _HELLO.unpack(bytes(buf))[2]
            try:
                _kernel_timeouts(conn, self.seconds)
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                conn.sendall(_ACCEPTED)
            except OSError as exc:
                why = f"answering it failed: {exc}"
            else:
                self.conns[rank] = (conn, peer)
                return
        conn.close()
        log.warning("tcp transport: rank %d refused a connection from %s:%d: %s", self.rank, *peer, why)

    def _refusal(self, hello: bytes) -> str | None:
        magic, token, rank = _HELLO.unpack(hello)
        if magic != _MAGIC or not hmac.compare_digest(token, self.token):
            return "it did not present this transfer's token"
        if rank not in self.expected:
            return f"rank {rank} is not a receiver of this transfer"
        if rank in self.conns:
            return f"rank {rank} is connected already"
        return None

    def close(self) -> None:
        """Close every accepted connection (the agreement failed, or serving is over)."""
        for conn, _ in self.conns.values():
            conn.close()
        self.conns.clear()


# -----------------------------------------------------------------------------------------------------------
# The source: serving the receivers


class _Feed:
    """The buckets the calling thread packs into `depth` slots, which every receiver's thread sends: bucket
    k goes into slot ``k % depth`` once every receiver still served has sent bucket ``k - depth``."""

    def __init__(self, receivers: list[int], depth: int) -> None:
        self.cond = threading.Condition()
        self.depth = depth
        self.packed = 0
        self.sent = dict.fromkeys(receivers, 0)
        self.live = set(receivers)

    def wait_packed(self, k: int) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.packed > k)

    def publish(self, count: int) -> None:
        with self.cond:
            self.packed = count
            self.cond.notify_all()

    def wait_free(self, k: int) -> bool:
        """Wait until slot ``k % depth`` is free; False when no receiver is served any more."""
        with self.cond:
            self.cond.wait_for(lambda: all(self.sent[r] > k - self.depth for r in self.live))
            return bool(self.live)

    def sent_one(self, rank: int, k: int) -> None:
        with self.cond:
            self.sent[rank] = k + 1
            self.cond.notify_all()

    def leave(self, rank: int) -> None:
        with self.cond:
            self.live.discard(rank)
            self.cond.notify_all()


def _serve(
    conn: socket.socket,
    rank: int,
    directs: list[memoryview],
    slots: list[memoryview],
    sizes: list[int],
    feed: _Feed,
) -> None:
    """One receiver's stream: the direct tensors, the buckets as they are packed, then its answer."""
    try:
        _send_all(conn, directs)
        for k, size in enumerate(sizes):
            feed.wait_packed(k)
            _send_all(conn, [slots[k % len(slots)][:size]])
            feed.sent_one(rank, k)
        if _recv_exactly(conn, 1) != _DONE:
            msg = "the receiver answered something other than 'done'"
            raise ConnectionError(msg)
    finally:
        feed.leave(rank)


def _run_serving(
    comm: Comm,
    conns: dict[int, tuple[socket.socket, tuple[str, int]]],
    tensors: list[torch.Tensor],
    metas: list[TensorMeta],
    plan: TcpPlan,
    depth: int,
    seconds: float,
    on_error: OnError,
) -> None:
    cpu = torch.device("cpu")
    kept = kept_plan(metas, plan.direct, plan.bucket_bytes, plan.ramp_min)
    buckets = kept.buckets
    regions = tuple(
        (tensors[i].data_ptr(), n) for i, d in enumerate(plan.direct) if d and (n := tensors[i].nbytes)
    )
    directs = _views_of(regions)
    count = min(depth, len(buckets))
    owned = _take_buffers(cpu, max(b.size for b in buckets), count) if buckets else []
    bufs = owned[:count]
    slots = [_view(b.data_ptr(), b.numel()) for b in bufs]
    sizes = [b.size for b in buckets]
    feed = _Feed(list(conns), max(1, count))
    errors: dict[int, SyncError] = {}

    def serve(rank: int, conn: socket.socket, peer: tuple[str, int]) -> None:
        try:
            _serve(conn, rank, directs, slots, sizes, feed)
        except Exception as exc:
            errors[rank] = _failure(comm, SEND_PHASE, rank, peer, exc, seconds)

    threads = [
        threading.Thread(target=serve, args=(r, c, p), name=f"elastic-tcp-send-{r}", daemon=True)
        for r, (c, p) in conns.items()
    ]
    for thread in threads:
        thread.start()
    failed = False
    packer = Packer(tensors, kept, cpu)
    try:
        with _quiet():
            for k in range(len(buckets)):
                if not feed.wait_free(k):
                    break
                if not failed:
                    try:
                        fault_point(f"bucket {k}", comm.rank)
                        packer.pack(bufs[k % count], k)
                    except Exception as exc:  # the bucket goes out as it is; reported at commit
                        failed = True
                        on_error(exc)
                feed.publish(k + 1)
    except BaseException:  # the receivers must not take unpacked buckets for the source's values
        for conn, _ in conns.values():
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        raise
    finally:
        feed.publish(len(buckets))
        for thread in threads:
            thread.join()
        if owned:
            _return_buffers(cpu, owned)
    if errors:
        raise errors[min(errors)]


# -----------------------------------------------------------------------------------------------------------
# A receiver


def _receive_stream(
    sock: socket.socket,
    comm: Comm,
    targets: list[torch.Tensor],
    metas: list[TensorMeta],
    plan: TcpPlan,
    on_error: OnError,
) -> None:
    """The source's stream into `targets`: the direct tensors in place (or through one temporary at a time),
    then the buckets, unpacked as they arrive. A local failure goes to `on_error` and reading goes on."""
    cpu = torch.device("cpu")
    failed = False

    def fail(exc: BaseException) -> None:
        nonlocal failed
        if not failed:
            failed = True
            on_error(exc)

    try:
        fault_point(RECEIVE_PHASE, comm.rank)
    except Exception as exc:
        fail(exc)
    pairs: list[tuple[int, int]] = []
    staged: list[tuple[int, int]] = []  # (position among the direct views, tensor) of the temporaries

    for i, d in enumerate(plan.direct):  # ~1 us a tensor: the cheapest checks, in C, first
        if not d:
            continue
        target, meta = targets[i], metas[i]
        if (
            target.dtype is meta.dtype
            and target.is_contiguous()
            and target.shape == meta.shape
            and target.is_cpu
            and not target.is_conj()
            and not target.is_neg()
        ):
            if n := target.nbytes:
                pairs.append((target.data_ptr(), n))
        elif n := meta.nbytes:
            staged.append((len(pairs), i))
            pairs.append((0, n))
    if staged:  # views of temporaries, made one at a time between the runs of in-place targets
        start = 0
        for at, i in staged:
            _recv_all(sock, _views_of(tuple(pairs[start:at])))
            meta = metas[i]
            try:
                tmp: torch.Tensor | None = torch.empty(meta.shape, dtype=meta.dtype, device=cpu)
            except Exception as exc:  # no memory for it: its bytes are read and dropped
                tmp = None
                fail(exc)
            if tmp is None:
                _drain(sock, meta.nbytes)
            else:
                _recv_all(sock, [_view(tmp.data_ptr(), meta.nbytes)])
                if not failed:
                    try:
                        with torch.no_grad():
                            targets[i].copy_(tmp)
                    except Exception as exc:
                        fail(exc)
            start = at + 1
        _recv_all(sock, _views_of(tuple(pairs[start:])))
    else:
        _recv_all(sock, _views_of(tuple(pairs)))

    kept = kept_plan(metas, plan.direct, plan.bucket_bytes, plan.ramp_min)
    if kept.buckets:
        owned = _take_buffers(cpu, max(b.size for b in kept.buckets), 1)
        try:
            base = owned[0]
            view = _view(base.data_ptr(), base.numel())
            unpacker = Unpacker(targets, metas, kept, cpu)
            with _quiet():
                for k, bucket in enumerate(kept.buckets):
                    _recv_all(sock, [view[: bucket.size]])
                    if failed:
                        continue
                    try:
                        fault_point(f"bucket {k}", comm.rank)
                        unpacker.unpack(base, k)
                    except Exception as exc:
                        unpacker.abandon()
                        fail(exc)
        finally:
            _return_buffers(cpu, owned)
    sock.sendall(_DONE)


# -----------------------------------------------------------------------------------------------------------
# The transport


def _is_transport(instance: Any, attribute: Any, value: Any) -> None:
    if not isinstance(value, Transport) or isinstance(value, TcpTransport):
        msg = (
            f"TcpTransport(fallback=...) must be a Transport other than a TcpTransport "
            f"(e.g. BroadcastTransport()), got {type(value).__name__} {value!r}"
        )
        raise TypeError(msg)


def _seconds_at_least(low: float) -> Any:
    def check(instance: Any, attribute: Any, value: Any) -> None:
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not value >= low:
            msg = (
                f"TcpTransport({attribute.name}=...) must be a number of seconds of at least {low:g}, got "
                f"{value!r}"
            )
            raise ValueError(msg)

    return check


@attrs.frozen
class TcpTransport:
    """The source's tensors to every receiver over TCP connections of their own, straight from and into
    the tensors' memory (see the module), else `fallback` (by default a `BroadcastTransport`).

    Plain CPU tensors of at least `direct_bytes` travel in place; the others in buckets of at most
    `bucket_bytes` (the first and last ramp from ``bucket_bytes / 8``, at least `ramp_min`), `in_flight` of
    them packed ahead on the source, one at a time on a receiver. A receiver's ``connect`` waits at most
    `connect_timeout` seconds; after a failed agreement, sources plan `fallback` alone for `retry_after`
    seconds. Transfers of fewer than `min_bytes`, on a CUDA communication device or with
    ``ELASTIC_TCP_TRANSPORT=0`` take `fallback` alone.
    """

    direct_bytes: int = attrs.field(default=DIRECT_BYTES, validator=at_least(0))
    bucket_bytes: int = attrs.field(default=BUCKET_BYTES, validator=at_least(1))
    in_flight: int = attrs.field(default=IN_FLIGHT, validator=at_least(1))
    ramp_min: int = attrs.field(default=RAMP_MIN, validator=at_least(1))
    min_bytes: int = attrs.field(default=MIN_BYTES, validator=at_least(0))
    connect_timeout: float = attrs.field(default=CONNECT_TIMEOUT, validator=_seconds_at_least(1e-3))
    retry_after: float = attrs.field(default=RETRY_AFTER, validator=_seconds_at_least(0.0))
    fallback: Transport = attrs.field(factory=BroadcastTransport, validator=_is_transport)

    def _why_not(self, tensors: list[torch.Tensor], comm: Comm) -> str | None:
        if os.environ.get(ENV_SWITCH, "").strip().lower() in _OFF:
            return f"{ENV_SWITCH}={os.environ[ENV_SWITCH]}"
        if comm.device.type != "cpu":
            return f"the communication device is {comm.device}"
        total = sum(t.nbytes for t in tensors)
        if total == 0 or total < self.min_bytes:
            return f"{total} bytes to move, fewer than min_bytes={self.min_bytes}"
        if time.monotonic() < _refused_until[0]:
            return f"a receiver could not connect less than retry_after={self.retry_after:g}s ago"
        return None

    def plan(self, tensors: list[torch.Tensor], comm: Comm) -> TcpPlan:
        """The fallback's plan, and where the receivers connect (``address=None``: this transfer takes the
        fallback alone). Opens the listening socket the source's `send` accepts on.

        Args:
            tensors: the source's tensors, in transfer order.
            comm: the transfer's group.

        Returns:
            A picklable `TcpPlan`.
        """
        fallback = self.fallback.plan(tensors, comm)
        why = self._why_not(tensors, comm)
        if why is None:
            least = self.direct_bytes
            direct = [t.nbytes >= least and t.is_cpu and _plain(t) for t in tensors]
            token = secrets.token_bytes(_TOKEN_BYTES)
            try:
                host = listen_address(comm.group)
                sock = _listen(host, max(128, comm.world_size))
            except OSError as exc:
                why = f"no socket to listen on: {exc}"
                _fell_back(0.0, logging.WARNING, "tcp transport: %s; this transfer goes by %s", why, self.fb)
            else:
                _keep_listener(token, sock)
                address = (host, int(sock.getsockname()[1]))
                return TcpPlan(address, fallback, token, direct, self.bucket_bytes, self.ramp_min)
        log.debug("tcp transport: %s instead, %s", self.fb, why)
        return TcpPlan(None, fallback, b"", [], self.bucket_bytes, self.ramp_min)

    @property
    def fb(self) -> str:
        return type(self.fallback).__name__

    def device_for(self, meta: TensorMeta, comm: Comm) -> torch.device:
        """Where a receiver allocates a tensor it lacks (the fallback's choice)."""
        return self.fallback.device_for(meta, comm)

    def send(
        self,
        comm: Comm,
        src: int,
        tensors: list[torch.Tensor],
        metas: list[TensorMeta],
        plan: Any,
        on_error: OnError,
    ) -> None:
        """The source's half (never writes to `tensors`): every receiver served over its own connection
        when every receiver connected, else the fallback's `send`.

        Args:
            comm: the transfer's group.
            src: the source's group rank (this rank).
            tensors: the source's tensors, in transfer order.
            metas: their metadata, as every rank holds it.
            plan: this transfer's `TcpPlan` (or the fallback's plan).
            on_error: where a local failure (packing) goes; the transfer goes on.

        Raises:
            SyncError: a receiver's connection broke or made no progress within the timeout.
        """
        if not isinstance(plan, TcpPlan) or plan.address is None:
            alone = plan.fallback if isinstance(plan, TcpPlan) else plan
            self.fallback.send(comm, src, tensors, metas, alone, on_error)
            return
        seconds = _seconds(comm)
        listener = _take_listener(plan.token)
        receivers = [r for r in range(comm.world_size) if r != src]
        acceptor = None
        if listener is not None:
            acceptor = _Acceptor(listener, plan.token, receivers, seconds, comm.rank)
            acceptor.start()
        try:
            ok = _agree(comm, acceptor is not None)
        except BaseException:
            if acceptor is not None:
                acceptor.stop()
            raise
        if not ok or acceptor is None:
            if acceptor is not None:
                acceptor.stop()  # the receivers that got in see their connection closed
            why = "its listening socket was closed before the transfer" if acceptor is None else None
            _fell_back(
                self.retry_after,
                logging.WARNING,
                "tcp transport: %s; this transfer goes by %s, and so do those planned in the next %gs",
                why or f"a receiver could not connect to rank {src} at {plan.address[0]}:{plan.address[1]}",
                self.fb,
                self.retry_after,
            )
            self.fallback.send(comm, src, tensors, metas, plan.fallback, on_error)
            return
        acceptor.join(seconds)
        missing = sorted(set(receivers) - set(acceptor.conns))
        try:
            if missing:  # every receiver said it was accepted: only a bug gets here
                msg = f"rank {missing[0]} agreed to the transfer but rank {src} holds no connection from it"
                raise _failure(comm, SEND_PHASE, missing[0], None, ConnectionError(msg), seconds)
            _run_serving(comm, acceptor.conns, tensors, metas, plan, self.in_flight, seconds, on_error)
        finally:
            acceptor.stop()

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
        this rank's connection when every receiver connected, else by the fallback's `receive`.

        Args:
            comm: the transfer's group.
            src: the source's group rank.
            targets: where the tensors go, in transfer order.
            metas: the tensors' metadata, as the source sent it.
            plan: this transfer's `TcpPlan` (or the fallback's plan).
            on_error: where a local failure (writing a target) goes; the transfer goes on.

        Raises:
            SyncError: the connection broke or made no progress within the timeout.
        """
        if not isinstance(plan, TcpPlan) or plan.address is None:
            alone = plan.fallback if isinstance(plan, TcpPlan) else plan
            self.fallback.receive(comm, src, targets, metas, alone, on_error)
            return
        seconds = _seconds(comm)
        sock, why = self._connect(comm, plan, targets, metas, seconds)
        try:
            ok = _agree(comm, sock is not None)
        except BaseException:
            if sock is not None:
                sock.close()
            raise
        if not ok or sock is None:
            if sock is not None:
                sock.close()
            _fell_back(
                self.retry_after,
                logging.WARNING if why else logging.DEBUG,
                "tcp transport: rank %d %s; this transfer goes by %s, and so do those planned in the "
                "next %gs",
                comm.rank,
                f"cannot connect to {_where(src, plan.address)}: {why}" if why else "takes the fallback",
                self.fb,
                self.retry_after,
            )
            self.fallback.receive(comm, src, targets, metas, plan.fallback, on_error)
            return
        try:
            _receive_stream(sock, comm, targets, metas, plan, on_error)
        except OSError as exc:  # a timeout, a reset, the source closing early
            raise _failure(comm, RECEIVE_PHASE, src, plan.address, exc, seconds) from exc
        finally:
            sock.close()

    def _connect(
        self, comm: Comm, plan: TcpPlan, targets: list[torch.Tensor], metas: list[TensorMeta], seconds: float
    ) -> tuple[socket.socket | None, str | None]:
        """This receiver's connection to the source, accepted (or None and why not)."""
        assert plan.address is not None
        if not len(plan.direct) == len(metas) == len(targets):
            return None, f"a plan of {len(plan.direct)} tensors for {len(metas)} ({len(targets)} targets)"
        try:
            fault_point(AGREE_PHASE, comm.rank)
            sock = socket.create_connection(plan.address, timeout=min(self.connect_timeout, seconds))
        except Exception as exc:
            return None, f"{type(exc).__name__}: {exc}"
        try:
            sock.settimeout(seconds)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.sendall(_HELLO.pack(_MAGIC, plan.token, comm.rank))
            if sock.recv(1) != _ACCEPTED:
                msg = "the source closed the connection without accepting it (a wrong token?)"
                raise ConnectionError(msg)
            _kernel_timeouts(sock, seconds)
        except Exception as exc:
            sock.close()
            return None, f"{type(exc).__name__}: {exc}"
        return sock, None
