"""The rendezvous store: addresses, serve/connect, and `python -m elastic.store`."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest

from elastic import ElasticError
from elastic.recovery.store import (
    RDZV_ENV,
    connect,
    connect_first,
    format_address,
    parse_address,
    parse_addresses,
    probe,
    serve,
)

ROOT = Path(__file__).resolve().parents[2]


def test_parse_address_from_argument_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse_address("127.0.0.1:29400") == ("127.0.0.1", 29400)
    assert parse_address(" node-7.cluster:1 ") == ("node-7.cluster", 1)
    assert parse_address("[::1]:29400") == ("::1", 29400)
    assert format_address("::1", 29400) == "[::1]:29400"
    assert format_address("h", 5) == "h:5"
    monkeypatch.setenv(RDZV_ENV, "10.0.0.2:1234")
    assert parse_address(None) == ("10.0.0.2", 1234)
    monkeypatch.delenv(RDZV_ENV)
    with pytest.raises(ElasticError, match=r"no rendezvous address.*ELASTIC_RDZV=host:port"):
        parse_address(None)


@pytest.mark.parametrize("bad", ["localhost", ":29400", "host:", "host:0", "host:70000", "host:x1"])
def test_parse_address_rejects_malformed(bad: str) -> None:
    with pytest.raises(ElasticError, match=re.escape(repr(bad))):
        parse_address(bad)


def test_a_list_of_addresses_is_tried_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse_addresses("a:1, b:2,") == [("a", 1), ("b", 2)]
    monkeypatch.setenv(RDZV_ENV, "h:3")
    assert parse_addresses(None) == [("h", 3)]
    with pytest.raises(ElasticError, match=re.escape("'b:x'")):
        parse_addresses("a:1,b:x")
    server = serve("127.0.0.1", 0, timeout=timedelta(seconds=5))
    dead = serve("127.0.0.1", 0, timeout=timedelta(seconds=5))
    dead_port = dead.port
    del dead  # nobody listens there now
    store, address = connect_first(
        [("127.0.0.1", dead_port), ("127.0.0.1", server.port)],
        timeout=timedelta(seconds=5),
        attempt=timedelta(seconds=0.5),
    )
    assert address == ("127.0.0.1", server.port)  # the first that answers: the standby
    store.set("k", "v")
    assert server.get("k") == b"v"
    with pytest.raises(ElasticError, match=rf"any rendezvous store of \[127\.0\.0\.1:{dead_port}\]"):
        connect_first(
            [("127.0.0.1", dead_port)], timeout=timedelta(seconds=1), attempt=timedelta(seconds=0.3)
        )


def test_a_reconnect_to_a_store_that_is_down_is_refused_by_the_probe_not_torchs_retry() -> None:
    # torch's client retries a refused connection after a random 0.4-1 s whatever its timeout: a
    # participant that tried while the store restarted would re-seed it up to a second late
    import elastic.recovery.rendezvous as rendezvous

    server = serve("127.0.0.1", 0, timeout=timedelta(seconds=5))
    port = server.port
    probe("127.0.0.1", port, timedelta(seconds=1))  # a listening store: no error, and it still serves
    client = connect("127.0.0.1", port, timeout=timedelta(seconds=5))
    r = rendezvous.Rendezvous(
        client, "probe", "a", join_timeout=timedelta(seconds=5), timeout=timedelta(seconds=5)
    )
    try:
        r._clone().set("k", "v")
        assert server.get("k") == b"v"
        del server
        with pytest.raises(ConnectionRefusedError):
            r._clone()  # the probe's error: no TCPStore client was attempted
        with pytest.raises(ElasticError, match=r"Connection refused"):
            connect_first([("127.0.0.1", port)], timeout=timedelta(seconds=1), attempt=timedelta(seconds=1))
    finally:
        r.close()


def test_serve_and_connect_share_keys_and_name_unreachable_address() -> None:
    server = serve("127.0.0.1", 0, timeout=timedelta(seconds=5))
    client = connect("127.0.0.1", server.port, timeout=timedelta(seconds=5))
    client.set("k", "v")
    assert server.get("k") == b"v"
    taken = server.port
    with pytest.raises(ElasticError, match=rf"cannot serve a rendezvous store on 127\.0\.0\.1:{taken}"):
        serve("127.0.0.1", taken, timeout=timedelta(seconds=1))
    del client, server
    with pytest.raises(ElasticError, match=rf"cannot reach the rendezvous store at 127\.0\.0\.1:{taken}"):
        connect("127.0.0.1", taken, timeout=timedelta(seconds=1))


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_entry_point_logs_its_address_serves_and_exits_cleanly(signum: int) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "elastic.store", "--host", "127.0.0.1", "--port", "0"],
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
    )
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()
        found = re.search(
            r"serving the rendezvous store at 127\.0\.0\.1:(\d+) \(workers: ELASTIC_RDZV=", line
        )
        assert found, line
        client = connect("127.0.0.1", int(found.group(1)), timeout=timedelta(seconds=5))
        client.set("alive", "1")
        assert client.get("alive") == b"1"
        proc.send_signal(signum)
        assert proc.wait(timeout=30) == 0
        rest = proc.stderr.read()
        assert f"received {signal.Signals(signum).name}, stopping" in rest
        assert "stopped serving 127.0.0.1:" in rest
    finally:
        proc.kill()
        proc.wait(timeout=10)
