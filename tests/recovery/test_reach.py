"""The listener and the bounded probe (`elastic.recovery.reach`), on this machine's loopback."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import torch.distributed as dist

from elastic.recovery import reach
from elastic.recovery.reach import Listener, lookup, probe, publish


def _closed_port() -> str:
    """An address where nothing listens (connections are refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


@contextlib.contextmanager
def _silent() -> Iterator[str]:
    """An address whose connects hang like a blackholed host's: a listener with a full backlog that never
    accepts (Linux drops the SYNs it has no room for, silently)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(0)
    address = server.getsockname()
    fillers = []
    try:
        for _ in range(3):  # more than the accept queue holds: the next SYN is dropped
            c = socket.socket()
            c.setblocking(False)
            c.connect_ex(address)
            fillers.append(c)
        time.sleep(0.1)
        yield f"127.0.0.1:{address[1]}"
    finally:
        for c in fillers:
            c.close()
        server.close()


@contextlib.contextmanager
def _server(answer: bytes | None) -> Iterator[str]:
    """A listener that answers `answer` and closes, or (None) accepts and stays silent."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    held: list[socket.socket] = []
    stop = threading.Event()

    def serve() -> None:
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            if answer is None:
                held.append(conn)
            else:
                with conn:
                    conn.sendall(answer)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.getsockname()[1]}"
    finally:
        stop.set()
        thread.join()
        for c in held:
            c.close()
        server.close()


def test_a_live_listener_is_reached_and_answers_with_its_id() -> None:
    with Listener("me", "127.0.0.1") as me, Listener("you", "127.0.0.1") as you:
        assert me.address.startswith("127.0.0.1:")
        started = time.monotonic()
        assert probe({"me": me.address, "you": you.address}, timeout=2.0) == {}
        assert time.monotonic() - started < 1.0  # no wait for anyone on a working path
        # many probes in parallel, one after the other: the listener keeps answering
        for _ in range(3):
            assert probe({"you": you.address}, timeout=2.0) == {}
    assert probe({"me": me.address}, timeout=1.0) == {"me": "connection refused"}  # closed: gone


def test_a_closed_port_is_refused_at_once() -> None:
    started = time.monotonic()
    assert probe({"p": _closed_port()}, timeout=2.0) == {"p": "connection refused"}
    assert time.monotonic() - started < 1.0


def test_a_silent_address_is_given_up_after_the_timeout_and_the_others_are_not_held_up() -> None:
    with _silent() as silent, Listener("live", "127.0.0.1") as live:
        started = time.monotonic()
        got = probe({"silent": silent, "live": live.address}, timeout=0.5)
        took = time.monotonic() - started
    assert got == {"silent": "connect timed out after 0.5 s"}
    assert 0.45 <= took < 1.5


def test_a_nonrouted_address_is_bounded_by_the_timeout() -> None:
    started = time.monotonic()
    got = probe({"far": "192.0.2.1:9"}, timeout=0.5)  # TEST-NET-1: dropped, or no route
    assert set(got) == {"far"}
    assert time.monotonic() - started < 1.5


def test_a_wrong_id_or_no_answer_is_not_the_peer_but_a_slow_answer_is() -> None:
    with Listener("someone-else", "127.0.0.1") as other:
        got = probe({"me": other.address}, timeout=1.0)
    assert got == {"me": f"{other.address} answered as 'someone-else', another process"}
    with _server(b"") as mute:  # accepts and closes: not the peer's listener
        assert probe({"p": mute}, timeout=1.0) == {"p": f"{mute} closed the connection without answering"}
    with _server(b"HTTP/1.1 400\r\n") as web:
        assert "answered as" in probe({"p": web}, timeout=1.0)["p"]
    with _server(None) as busy:  # connected, the answer late: the path works, the peer counts as reached
        started = time.monotonic()
        assert probe({"p": busy}, timeout=0.3) == {}
        assert time.monotonic() - started < 1.0


def test_a_malformed_address_is_reported_not_raised() -> None:
    got = probe({"p": "no-port"}, timeout=0.5)
    assert "cannot connect to 'no-port'" in got["p"]


def test_addresses_are_published_and_looked_up_under_the_run() -> None:
    store = dist.HashStore()
    publish(store, "run", "a", "10.0.0.1:1234")
    publish(store, "run", "b", "10.0.0.2:99")
    assert lookup(store, "run", ["a", "b", "c"]) == {"a": "10.0.0.1:1234", "b": "10.0.0.2:99"}
    assert lookup(store, "other", ["a"]) == {}
    assert lookup(store, "run", []) == {}


def test_the_listener_binds_where_gloo_does(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    assert reach.gloo_address() == "127.0.0.1"
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo,eth-none")  # a list: the first interface
    assert reach.gloo_address() == "127.0.0.1"
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "no-such-if0")
    with caplog.at_level("WARNING", logger="elastic"):
        fallback = reach.gloo_address()
    assert "no IPv4 address" in caplog.text
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    assert fallback == reach.gloo_address()  # the host name's address, as gloo without the variable
    with Listener("x") as listener:
        assert listener.address.rpartition(":")[0].strip("[]") == fallback
    assert reach.split_address("[::1]:80") == ("::1", 80)
    with pytest.raises(ValueError, match="not 'host:port'"):
        reach.split_address("host")
