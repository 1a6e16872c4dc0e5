"""Can this participant connect to its peers? A listener per participant and a bounded probe.

Every participant of `elastic.run` reaches the store, but two participants may still be unable to connect
to each other (an asymmetric partition: a firewall, a route, a switch port that drops one host's frames).
Gloo then learns it the slow way: its connect retries for five times the group's timeout, and a
collective over a link that went silent waits for the whole `timeout`. This module finds out in about a
second instead:

- `Listener`: a TCP listener for the whole `run`, bound to the address gloo binds to (`gloo_address`),
  that answers every connection with one line, ``elastic-reach <participant>``, and closes it. Its
  address is published in the store under ``elastic/<run_id>/reach/<participant>`` (`publish`). Its
  connections live for microseconds: the gloo watch of `elastic.run` (which shuts down the TCP
  connections opened during a generation) may shut one down at worst, and that probe is retried.
- `probe`: connects to peers in parallel (one thread, non-blocking sockets), each bounded by `timeout`,
  and returns those it could not reach, with why. A peer reached whose answer names another participant
  (the port now belongs to another process) or that closes without answering is not reached; one whose
  connection was accepted but that did not answer in time is (the network path works; the process is
  busy: its heartbeat judges it).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import selectors
import socket
import threading
import time
from collections.abc import Iterable, Mapping
from typing import Any

import attrs

from elastic._util.address import listen_address

__all__ = [
    "ANSWER",
    "Listener",
    "gloo_address",
    "lookup",
    "probe",
    "publish",
    "split_address",
]

log = logging.getLogger("elastic")

#: The first word of the line a listener answers with; the participant id follows.
ANSWER = b"elastic-reach "
_MAX_ANSWER = 512


def split_address(address: str) -> tuple[str, int]:
    """``(host, port)`` of ``"host:port"`` (IPv6 hosts in brackets). ValueError when malformed."""
    host, sep, port = address.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit():
        msg = f"elastic: reach address {address!r} is not 'host:port'"
        raise ValueError(msg)
    return host, int(port)


def _join_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def gloo_address() -> str:
    """The address gloo binds its pairs to (`elastic._util.address.listen_address`, the rule the TCP
    transport listens by too); when ``GLOO_SOCKET_IFNAME`` names an interface without an address here,
    a warning and the rule without the variable (the host name's address)."""
    try:
        return listen_address()
    except OSError as exc:
        log.warning("reach: %s; probing peers on the host name's address (no IPv4 address there)", exc)
    return listen_address(interfaces="")


class Listener:
    """A TCP listener answering every connection with ``elastic-reach <participant>``; a thread of its own.

    Args:
        participant: the id it answers with.
        host: the address to bind (default: `gloo_address`); the port is chosen by the system.

    Raises:
        OSError: the address cannot be bound.
    """

    def __init__(self, participant: str, host: str | None = None) -> None:
        self.participant = participant
        bind = gloo_address() if host is None else host
        family = socket.AF_INET6 if ":" in bind else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._sock.bind((bind, 0))
            self._sock.listen(128)
        except OSError:
            self._sock.close()
            raise
        self._sock.settimeout(1.0)  # the loop checks `_closed` at least once a second
        self.address = _join_address(bind, self._sock.getsockname()[1])
        self._answer = ANSWER + participant.encode() + b"\n"
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._serve, name=f"elastic-reach-{participant}", daemon=True)
        self._thread.start()

    def __enter__(self) -> Listener:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _serve(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError as exc:
                if self._closed.is_set():
                    return
                log.debug("reach: accept failed on %s: %s", self.address, exc)
                time.sleep(0.05)  # out of descriptors, say: the next probe finds it again
                continue
            with conn, contextlib.suppress(OSError):
                conn.settimeout(1.0)
                conn.sendall(self._answer)

    def close(self) -> None:
        """Stop answering and close the listening socket (idempotent)."""
        if self._closed.is_set():
            return
        self._closed.set()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept on Linux
        self._thread.join(timeout=2.0)
        self._sock.close()


def _key(run_id: str, participant: str) -> str:
    return f"elastic/{run_id}/reach/{participant}"


def publish(store: Any, run_id: str, participant: str, address: str) -> None:
    """Write `participant`'s listener address under the run's prefix of `store` (a torch Store)."""
    store.set(_key(run_id, participant), address)


def lookup(store: Any, run_id: str, participants: Iterable[str]) -> dict[str, str]:
    """The published listener addresses of `participants` (one store read; those without one are left
    out: they never listened, or run an elastic that does not)."""
    names = list(participants)
    if not names:
        return {}
    keys = [_key(run_id, p) for p in names]
    present = [(p, k) for p, k in zip(names, keys) if store.check([k])]
    if not present:
        return {}
    values = store.multi_get([k for _, k in present])
    return {p: v.decode() for (p, _), v in zip(present, values) if v}


@attrs.define
class _Attempt:
    name: str
    stage: str  # "connect", then "answer"
    received: bytes = b""


def _close(sel: selectors.BaseSelector, sock: socket.socket) -> None:
    with contextlib.suppress(KeyError, ValueError):
        sel.unregister(sock)
    sock.close()


def probe(peers: Mapping[str, str], timeout: float) -> dict[str, str]:
    """Connect to every peer at once, each within `timeout` seconds, and check who answers.

    Args:
        peers: participant id -> its listener's ``"host:port"``.
        timeout: how long a connection and its answer may take, in seconds (all peers in parallel).

    Returns:
        The peers that could not be reached, each with why ("connect timed out after 1 s", "connection
        refused", "answered as '...'", ...); empty when every peer was reached.
    """
    failed: dict[str, str] = {}
    sel = selectors.DefaultSelector()
    deadline = time.monotonic() + timeout
    try:
        for name, address in peers.items():
            try:
                host, port = split_address(address)
                sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
            except (ValueError, OSError) as exc:
                failed[name] = f"cannot connect to {address!r}: {exc}"
                continue
            sock.setblocking(False)
            code = sock.connect_ex((host, port))
            if code not in (0, errno.EINPROGRESS, errno.EWOULDBLOCK):
                sock.close()
                failed[name] = os.strerror(code).lower()
                continue
            sel.register(sock, selectors.EVENT_WRITE, _Attempt(name, "connect"))
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                break
            for key, _ in sel.select(left):
                _advance(sel, key.fileobj, key.data, peers, failed)  # type: ignore[arg-type]
        for key in list(sel.get_map().values()):
            attempt: _Attempt = key.data
            if attempt.stage == "connect":
                failed[attempt.name] = f"connect timed out after {timeout:g} s"
            else:  # connected: the path works, the process is slow to answer (its heartbeat judges it)
                log.debug("reach: %s accepted but did not answer within %g s", attempt.name, timeout)
            _close(sel, key.fileobj)  # type: ignore[arg-type]
    finally:
        sel.close()
    return failed


def _advance(
    sel: selectors.BaseSelector,
    sock: socket.socket,
    attempt: _Attempt,
    peers: Mapping[str, str],
    failed: dict[str, str],
) -> None:
    """One readiness event of one probe: its connect completed, or (part of) its answer arrived."""
    if attempt.stage == "connect":
        code = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if code:
            failed[attempt.name] = os.strerror(code).lower()
            _close(sel, sock)
            return
        attempt.stage = "answer"
        sel.modify(sock, selectors.EVENT_READ, attempt)
        return
    try:
        chunk = sock.recv(_MAX_ANSWER)
    except BlockingIOError:
        return
    except OSError as exc:
        failed[attempt.name] = f"the connection failed before an answer ({exc.strerror or exc})".lower()
        _close(sel, sock)
        return
    attempt.received += chunk
    line, newline, _ = attempt.received.partition(b"\n")
    if not chunk or newline or len(attempt.received) > _MAX_ANSWER:
        _close(sel, sock)
        if not newline:
            failed[attempt.name] = f"{peers[attempt.name]} closed the connection without answering"
        elif line != ANSWER + attempt.name.encode():
            other = line[len(ANSWER) :].decode(errors="replace") if line.startswith(ANSWER) else line[:40]
            failed[attempt.name] = f"{peers[attempt.name]} answered as {other!r}, another process"
