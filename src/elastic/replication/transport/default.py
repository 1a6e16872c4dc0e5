"""Which transport `sync` uses when none is given, and the memory the transports keep between calls.

The default is a `CrossMemoryTransport`: every receiver reads the source's tensors straight from its
memory when each may (on the source's host, permitted to); else its `SharedMemoryTransport` fallback,
through a shared-memory ring when every receiver runs on the source's host; else that one's `TcpTransport`
fallback, over connections of its own from the source's tensors into the receivers' (receivers on other
hosts); else that one's `BroadcastTransport` fallback (a receiver that cannot connect, a CUDA
communication device, fewer than a megabyte to move, ``ELASTIC_TCP_TRANSPORT=0``). Nothing is created at
import: a shared segment comes with the first transfer that uses it, a listening socket with each plan
that takes the connections.
"""

from __future__ import annotations

from elastic.replication.transport.broadcast import cached_bytes as bucket_bytes_kept
from elastic.replication.transport.broadcast import release_buffers as release_buckets
from elastic.replication.transport.cma import CrossMemoryTransport
from elastic.replication.transport.protocol import Transport
from elastic.replication.transport.shm import release_shared, shared_cached_bytes
from elastic.replication.transport.tcp import release_listeners

__all__ = ["cached_bytes", "default_transport", "release_buffers", "set_default_transport"]

_default: list[Transport] = [CrossMemoryTransport()]


def default_transport() -> Transport:
    """The transport `sync` uses when none is given (a `CrossMemoryTransport` with the defaults)."""
    return _default[0]


def set_default_transport(transport: Transport) -> Transport:
    """Make `transport` the one `sync` uses when none is given; returns the previous one."""
    if not isinstance(transport, Transport):
        msg = (
            f"set_default_transport() needs a Transport (plan, device_for, send, receive), got "
            f"{type(transport).__name__} {transport!r}"
        )
        raise TypeError(msg) from None
    previous, _default[0] = _default[0], transport
    return previous


def cached_bytes() -> int:
    """Bytes the transports keep between calls: bucket buffers, shared segments and mappings."""
    return bucket_bytes_kept() + shared_cached_bytes()


def release_buffers() -> None:
    """Drop everything the transports keep between calls (the next transfer makes it again): bucket
    buffers, shared segments and mappings, listening sockets of plans not sent."""
    release_buckets()
    release_shared()
    release_listeners()
