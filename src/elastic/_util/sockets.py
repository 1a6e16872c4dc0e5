"""Ending a process's blocked gloo collectives from another thread: its TCP connections shut down.

gloo's ``abort()`` does not unblock a collective that waits for a silent peer (pytorch#130345): the
waiting thread sits in the pair's condition variable until the group's timeout. Shutting down the
connections the group opened does: gloo's event loop sees the end of each stream, fails the pairs, and
the waiting collective raises at once (``Connection closed by peer``); the peers at the other end of
those connections fail the same way. Listening sockets are left alone (gloo's listener treats a failed
``accept`` as fatal to the process).

`Sockets` notes the socket inodes of this process when a generation starts; `shutdown` later shuts down
the TCP connections opened since, except those to the addresses it is told to keep (the rendezvous
store's). It reads ``/proc/self/fd`` and ``/proc/self/net/tcp{,6}``: on a platform without them it finds
nothing, and a collective waits for its timeout as before.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import socket
from collections.abc import Iterable
from pathlib import Path

__all__ = ["Sockets", "connections", "socket_inodes"]

log = logging.getLogger("elastic")

_FDS = Path("/proc/self/fd")
_LISTEN = "0A"


def socket_inodes() -> dict[int, int]:
    """The socket inodes of this process, each with one of its file descriptors (empty without /proc)."""
    out: dict[int, int] = {}
    with contextlib.suppress(OSError):
        for name in os.listdir(_FDS):
            try:
                link = os.readlink(_FDS / name)
            except OSError:  # closed meanwhile
                continue
            if link.startswith("socket:["):
                out[int(link[8:-1])] = int(name)
    return out


def _address(hexed: str) -> tuple[str, int]:
    """An address of ``/proc/net/tcp`` (``0100007F:1F90``; IPv6: four little-endian words) as text."""
    ip_hex, port_hex = hexed.split(":")
    raw = bytes.fromhex(ip_hex)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    ip = ipaddress.ip_address(words)
    mapped = getattr(ip, "ipv4_mapped", None)  # IPv4 seen through an IPv6 socket
    return str(mapped or ip), int(port_hex, 16)


def connections() -> dict[int, tuple[str, int] | None]:
    """TCP sockets of this network namespace by inode: the remote address of a connection, None for a
    listening socket."""
    out: dict[int, tuple[str, int] | None] = {}
    for table in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/self/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10:
                continue
            try:
                out[int(fields[9])] = None if fields[3] == _LISTEN else _address(fields[2])
            except ValueError:
                continue
    return out


def _resolve(host: str) -> set[str]:
    try:
        return {str(ipaddress.ip_address(info[4][0])) for info in socket.getaddrinfo(host, None)}
    except (OSError, ValueError):
        return {host}


class Sockets:
    """The TCP connections this process opens from now on, to shut down together.

    Args:
        keep: ``(host, port)`` addresses whose connections are never shut down (the store's).
    """

    def __init__(self, keep: Iterable[tuple[str, int]] = ()) -> None:
        self._before = set(socket_inodes())  # and, later, those already shut down
        self._keep: set[tuple[str, int]] = set()
        for host, port in keep:
            self._keep.update((ip, port) for ip in _resolve(host))

    def shutdown(self) -> int:
        """Shut down (both ways) every TCP connection opened since this object was made, except those to
        the kept addresses and those an earlier call shut down; listening sockets stay open.

        Returns:
            The number of connections shut down.
        """
        tcp = connections()
        done = 0
        for inode, fd in socket_inodes().items():
            if inode in self._before or inode not in tcp:
                continue
            remote = tcp[inode]
            if remote is None or remote in self._keep:
                continue
            try:
                dup = os.dup(fd)
            except OSError:  # closed meanwhile
                continue
            try:
                with socket.socket(fileno=dup) as s:
                    s.shutdown(socket.SHUT_RDWR)
                done += 1
                self._before.add(inode)
            except OSError as exc:
                log.debug("shutting down socket %d (to %s) failed: %s", fd, remote, exc)
        return done
