"""The TCP transport: options, plans and their listening sockets, the byte loops over a socket pair, and
transfers on 3 gloo ranks (direct calls and through `elastic.sync` with a module and its optimizer): a
wrong token, an unreachable address, a stalled source, a stalled receiver, local failures and a dying
receiver. Between two simulated hosts (root only): `elastic.sync` with the default transport takes it."""

from __future__ import annotations

import json
import logging
import os
import pickle
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch

import elastic
import elastic.replication.transport.tcp as tcp
from dist_harness import counting_collectives, run_on_ranks
from elastic._util.placement import Placement
from elastic.replication.comm import Comm
from elastic.replication.transport.broadcast import BroadcastTransport, byte_view
from elastic.replication.transport.protocol import Transport
from elastic.replication.transport.shm import SharedMemoryTransport
from elastic.replication.transport.tcp import TcpTransport
from elastic.state.tensors import TensorMeta
from netns import Hosts, why_not

HERE = Path(__file__).resolve().parent


def _comm(device: str = "cpu", timeout: float = 5.0) -> Comm:
    comm = Comm.__new__(Comm)
    comm.placement = Placement(torch.device("cpu"))
    comm.device = torch.device(device)
    comm.group, comm.rank, comm.world_size, comm.op = None, 0, 2, "sync"
    comm.timeout = timedelta(seconds=timeout)
    return comm


def _bits(t: torch.Tensor) -> bytes:
    return bytes(byte_view(t.detach().resolve_conj().resolve_neg().contiguous()).tolist())


@pytest.fixture(autouse=True)
def _fresh() -> Iterator[None]:
    tcp.release_listeners()
    tcp._refused_until[0] = 0.0
    yield
    tcp.release_listeners()
    tcp._refused_until[0] = 0.0


# -----------------------------------------------------------------------------------------------------------
# Options, plans, listening sockets (one process)


def test_options_are_checked_and_it_sits_between_the_ring_and_the_broadcasts() -> None:
    for name, bad, match in [
        ("direct_bytes", -1, "an int of at least 0"),
        ("in_flight", 0, "an int of at least 1"),
        ("connect_timeout", 0, "a number of seconds of at least 0.001"),
        ("retry_after", -1.0, "a number of seconds of at least 0"),
        ("retry_after", True, "a number of seconds of at least 0"),
    ]:
        with pytest.raises(ValueError, match=rf"TcpTransport\({name}=\.\.\.\) must be {match}, got"):
            TcpTransport(**{name: bad})
    with pytest.raises(TypeError, match=r"TcpTransport\(fallback=\.\.\.\) must be a Transport other than"):
        TcpTransport(fallback=TcpTransport())
    chosen = TcpTransport()
    assert isinstance(chosen, Transport) and chosen.fallback == BroadcastTransport()
    # the default chain: cross-memory reads, the shared-memory ring, then the TCP connections, then gloo
    assert SharedMemoryTransport().fallback == TcpTransport()
    from elastic.replication.transport.default import default_transport

    assert default_transport().fallback.fallback == TcpTransport()  # type: ignore[attr-defined]


def test_plan_opens_a_listener_or_names_the_fallback_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    chosen = TcpTransport(min_bytes=4096, direct_bytes=1024)
    small = [torch.zeros(1000), torch.zeros(20)]  # 4,080 bytes
    alone = chosen.plan(small, _comm())
    assert alone.address is None and alone.fallback == [False, False] and tcp.open_listeners() == 0
    big = [torch.zeros(100_000), torch.zeros(3, dtype=torch.int8), torch.zeros(64, 64).t(), torch.zeros(0)]
    plan = chosen.plan(big, _comm())
    assert plan.address is not None and plan.address[0] == "127.0.0.1" and len(plan.token) == 16
    assert plan.direct == [True, False, False, False]  # small, non-contiguous and empty ones are packed
    assert plan.fallback == BroadcastTransport().plan(big, _comm())
    assert pickle.loads(pickle.dumps(plan)) == plan  # it travels in the sync payload
    with socket.create_connection(plan.address, timeout=2):  # it listens
        pass
    assert tcp.open_listeners() == 1
    again = chosen.plan(big, _comm())
    assert again.token != plan.token and again.address != plan.address  # a socket and a token per plan
    for _ in range(tcp.LISTENERS_KEPT + 2):
        chosen.plan(big, _comm())
    assert tcp.open_listeners() == tcp.LISTENERS_KEPT  # plans never sent do not pile up
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(plan.address, timeout=2)  # the oldest closed
    tcp.release_listeners()
    assert tcp.open_listeners() == 0
    # the fallback alone: NCCL's device, the escape hatch, a recent failed agreement
    assert chosen.plan(big, _comm("meta")).address is None
    monkeypatch.setenv(tcp.ENV_SWITCH, "0")
    assert chosen.plan(big, _comm()).address is None
    monkeypatch.setenv(tcp.ENV_SWITCH, "1")
    assert chosen.plan(big, _comm()).address is not None
    tcp._refused_until[0] = time.monotonic() + 60
    assert chosen.plan(big, _comm()).address is None
    assert tcp.open_listeners() == 1


def test_a_forked_child_holds_none_of_its_parents_listeners() -> None:
    plan = TcpTransport(min_bytes=0).plan([torch.zeros(10)], _comm())
    assert plan.address is not None and tcp.open_listeners() == 1
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report what it holds, then leave without running anything else
        os.write(write, bytes([tcp.open_listeners()]))
        os._exit(0)
    os.close(write)
    held = os.read(read, 1)
    os.close(read)
    os.waitpid(pid, 0)
    assert held == b"\x00" and tcp.open_listeners() == 1
    with socket.create_connection(plan.address, timeout=2):  # the parent's still listens
        pass


def test_a_plan_without_an_address_to_listen_on_takes_the_fallback(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "elnosuch0")
    monkeypatch.setattr(tcp, "_warned", [False])
    with caplog.at_level(logging.DEBUG, logger="elastic"):
        plan = TcpTransport(min_bytes=0).plan([torch.zeros(10)], _comm())
        TcpTransport(min_bytes=0).plan([torch.zeros(10)], _comm())
    assert plan.address is None and plan.fallback == [False]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1  # once per process
    assert "GLOO_SOCKET_IFNAME names the interface 'elnosuch0'" in warnings[0]
    assert "this transfer goes by BroadcastTransport" in warnings[0]


# -----------------------------------------------------------------------------------------------------------
# The byte loops (a socket pair)


def test_the_loops_move_every_view_with_partial_calls_and_more_views_than_iov_max() -> None:
    a, b = socket.socketpair()
    with a, b:
        tcp._kernel_timeouts(a, 5.0)
        tcp._kernel_timeouts(b, 5.0)
        src = [torch.arange(n % 700 + 1, dtype=torch.float32) * 3 for n in range(2500)]
        src.append(torch.randn(3_000_000))  # more than the socket buffers: partial sends
        dst = [torch.zeros_like(t) for t in src]
        sent = [tcp._view(t.data_ptr(), t.nbytes) for t in src]
        got = [tcp._view(t.data_ptr(), t.nbytes) for t in dst]
        import threading

        sender = threading.Thread(target=tcp._send_all, args=(a, sent))
        sender.start()
        tcp._recv_all(b, got)
        sender.join()
        assert all(torch.equal(x, y) for x, y in zip(src, dst))
        assert tcp._advance(got[:3], got[0].nbytes + 2)[0] == 1
        assert len(tcp._advance(got[:3], got[0].nbytes + 2)[1] or b"") == got[1].nbytes - 2
        # the same regions give the same (kept) views; other regions new ones
        regions = tuple((t.data_ptr(), t.nbytes) for t in dst[:10])
        assert tcp._views_of(regions) is tcp._views_of(regions)
        assert tcp._views_of(regions[1:]) is not tcp._views_of(regions)


def test_a_silent_peer_is_a_timeout_and_a_closed_one_a_broken_connection() -> None:
    a, b = socket.socketpair()
    with a, b:
        tcp._kernel_timeouts(b, 0.3)
        started = time.monotonic()
        with pytest.raises(BlockingIOError) as silent:
            tcp._recv_all(b, [memoryview(bytearray(10))])
        assert 0.25 < time.monotonic() - started < 3
        error = tcp._failure(_comm(), tcp.RECEIVE_PHASE, 0, ("10.1.2.3", 4567), silent.value, 0.3)
        assert str(error).startswith(
            "sync timed out in phase 'tcp receive' on rank 0: no progress with rank 0 at 10.1.2.3:4567 "
            "for 0.3s. Every rank of the group must call sync() at the same point"
        )
        assert error.phase == "tcp receive"
        a.close()
        with pytest.raises(ConnectionError, match="the peer closed the connection") as closed:
            tcp._recv_all(b, [memoryview(bytearray(10))])
        broken = tcp._failure(_comm(), tcp.SEND_PHASE, 2, ("::1", 80), closed.value, 1.0)
        assert "sync failed in phase 'tcp send' on rank 0: the connection with rank 2 at ::1:80 broke" in str(
            broken
        )


# -----------------------------------------------------------------------------------------------------------
# Real gloo ranks


def _tensors(rank: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(source tensors, receiver targets): in place, through temporaries, packed, of every kind."""
    g = torch.Generator().manual_seed(5)
    src = [torch.randn(3, generator=g) for _ in range(20)]
    src += [
        torch.randn(300_000, generator=g),  # 20: direct, in place
        torch.randint(-(2**40), 2**40, (100,), generator=g),  # 21: packed
        torch.randn(400, 300, generator=g),  # 22: direct into a non-contiguous target (a temporary)
        torch.randn(7, generator=g).to(torch.bfloat16),  # 23
        torch.randint(0, 2, (9,), generator=g).bool(),  # 24
        torch.randn((), generator=g, dtype=torch.float64),  # 25: 0-d
        torch.empty(0, 4),  # 26: empty
        torch.randn(5, generator=g, dtype=torch.complex128),  # 27: a parameter target
        torch.tensor([float("nan"), -0.0, float("inf")]),  # 28: bit for bit
        torch.randn(200, 500, generator=g).t(),  # 29: a non-contiguous source (packed)
        torch.randn(40_000, generator=g).to(torch.bfloat16),  # 30: direct bfloat16
        torch.randn(50_000, generator=g, dtype=torch.float64),  # 31: direct into a parameter
    ]
    if rank == 0:
        return src, src
    targets = [torch.zeros_like(t) for t in src]
    targets[22] = torch.zeros(300, 400).t()
    targets[27] = torch.nn.Parameter(torch.zeros(5, dtype=torch.complex128))
    targets[31] = torch.nn.Parameter(torch.zeros(50_000, dtype=torch.float64))
    return src, targets


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[tuple[int, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append((record.levelno, record.getMessage()))

    def warnings(self) -> list[str]:
        found = [m for level, m in self.lines if level == logging.WARNING]
        self.lines.clear()
        return found


def _transfer(
    rank: int, chosen: TcpTransport, tamper: Any = None, seconds: float = 20.0, big: bool = False
) -> dict[str, Any]:
    """One transfer from rank 0 with the source's plan (`tamper`ed on the receivers that it names); the
    collectives issued, the errors each side reported or the `SyncError` it raised, and on receivers the
    tensors that differ and those that moved."""
    import torch.distributed as dist

    from elastic import SyncError

    src, targets = _tensors(rank)
    if big:  # more than the loopback socket buffers hold: a receiver that does not read stalls the source
        src, targets = [torch.ones(20_000_000)], [torch.zeros(20_000_000) if rank else torch.ones(20_000_000)]
        if rank == 0:
            targets = src
    comm = Comm(None, timedelta(seconds=seconds), "test")
    metas = [TensorMeta(("t", i), tuple(t.shape), t.dtype, "cpu") for i, t in enumerate(src)]
    box = [chosen.plan(src, comm) if rank == 0 else None]
    dist.broadcast_object_list(box, 0)
    plan = box[0] if tamper is None else tamper(rank, box[0])
    errors: list[str] = []
    ptrs = [t.data_ptr() for t in targets]
    out: dict[str, Any] = {"plan": plan}
    with counting_collectives() as counts:
        try:
            if rank == 0:
                chosen.send(comm, 0, src, metas, plan, lambda e: errors.append(str(e)))
            else:
                chosen.receive(comm, 0, targets, metas, plan, lambda e: errors.append(str(e)))
        except SyncError as exc:
            out["raised"] = str(exc)
    out.update(errors=errors, counts=dict(counts))
    if rank > 0:
        out["wrong"] = [i for i, (t, s) in enumerate(zip(targets, src)) if _bits(t) != _bits(s)]
        out["moved"] = [i for i, (t, p) in enumerate(zip(targets, ptrs)) if t.data_ptr() != p]
        out["parameters kept"] = big or all(isinstance(targets[i], torch.nn.Parameter) for i in (27, 31))
    return out


@elastic.elastic_state(tenure="step")
@attrs.define
class Trainer:
    step: int
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer


def _trained(steps: int) -> Trainer:
    """The same model and Adam state on every rank that calls it with the same `steps`."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256), torch.nn.LayerNorm(256)
    ).to(torch.float64)
    model[3].to(torch.bfloat16)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(steps):
        x = torch.randn(16, 256, dtype=torch.float64)
        loss = model[:3](x).pow(2).mean() + model[3].weight.float().sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return Trainer(step=steps, model=model, optimizer=optimizer)


def _values(state: Trainer) -> list[bytes]:
    sd = state.optimizer.state_dict()["state"]
    moments = [_bits(v) for k in sorted(sd) for _, v in sorted(sd[k].items()) if torch.is_tensor(v)]
    return [_bits(t) for t in state.model.state_dict().values()] + moments


def _three_rank_checks(rank: int, world: int, folder: str) -> dict[str, Any]:
    from elastic import SyncError
    from elastic.replication.transport.default import set_default_transport

    records = _Records()
    logging.getLogger("elastic").addHandler(records)
    logging.getLogger("elastic").setLevel(logging.DEBUG)
    chosen = TcpTransport(min_bytes=0, direct_bytes=64 * 1024, bucket_bytes=4096, retry_after=0)
    out: dict[str, Any] = {"first": _transfer(rank, chosen), "second": _transfer(rank, chosen)}
    out["listeners"] = tcp.open_listeners()

    # rank 2 presents a wrong token: the source refuses it, every rank takes the broadcasts
    records.warnings()
    tokened = _transfer(rank, chosen, lambda r, p: p._replace(token=bytes(16)) if r == 2 else p)
    out["wrong token"] = {**tokened, "warnings": records.warnings()}
    # rank 1 is given an address nothing listens on: the same fallback, and the sources of the next
    # retry_after seconds plan the broadcasts alone
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    remembering = TcpTransport(min_bytes=0, retry_after=60)
    moved = _transfer(
        rank, remembering, lambda r, p: p._replace(address=("127.0.0.1", port)) if r == 1 else p
    )
    out["unreachable"] = {**moved, "port": port, "warnings": records.warnings()}
    out["remembered"] = _transfer(rank, remembering)
    tcp._refused_until[0] = 0.0

    # a source that stalls (3 s before serving, timeout 1 s): the receivers time out, naming it
    real_run = tcp._run_serving

    def late(*args: Any, **kwargs: Any) -> None:
        time.sleep(3.0)
        real_run(*args, **kwargs)

    if rank == 0:
        tcp._run_serving = late  # type: ignore[assignment]
    out["stalled source"] = _transfer(rank, chosen, seconds=1.0)
    tcp._run_serving = real_run  # type: ignore[assignment]
    # a receiver that stalls (rank 1, 4 s before reading 80 MB): the source times out on it, rank 2 is
    # served all the same
    real_receive = tcp._receive_stream

    def slow(*args: Any, **kwargs: Any) -> None:
        time.sleep(4.0)
        real_receive(*args, **kwargs)

    if rank == 1:
        tcp._receive_stream = slow  # type: ignore[assignment]
    out["stalled receiver"] = _transfer(rank, chosen, seconds=1.0, big=True)
    tcp._receive_stream = real_receive  # type: ignore[assignment]
    out["after stalls"] = _transfer(rank, chosen)

    # local failures: reported, every collective still ran, the others written
    os.environ["ELASTIC_FAULT"] = "1:tcp receive,0:bucket 1"
    try:
        out["faults"] = _transfer(rank, chosen)
    finally:
        del os.environ["ELASTIC_FAULT"]

    # through elastic.sync: a module of several dtypes and its Adam state, from rank 0 (3 steps) to a
    # receiver with fewer steps and one with a fresh optimizer (its moments allocated)
    set_default_transport(TcpTransport())
    state = _trained(3 if rank == 0 else rank - 1)
    before = [p.data_ptr() for p in state.model.parameters()]
    with counting_collectives() as counts:
        report = elastic.sync(state, timeout=20)
    expected = _values(_trained(3))
    out["sync"] = {
        "src": report.src,
        "step": state.step,
        "bytes": report.tensor_bytes,
        "equal": _values(state) == expected,
        "in place": [p.data_ptr() for p in state.model.parameters()] == before,
        "counts": dict(counts),
        "warnings": records.warnings(),
    }
    out["resync"] = elastic.sync(state, force=True, timeout=20).tensor_bytes

    with open(Path(folder) / f"{rank}.pkl", "wb") as f:  # what rank 2 found, before it dies
        pickle.dump(out, f)

    # a receiver dies in the middle: the source raises, naming it; the other receiver is served
    os.environ["ELASTIC_FAULT"] = "2:tcp receive:die"
    try:
        out["died"] = _transfer(rank, chosen)
    finally:
        del os.environ["ELASTIC_FAULT"]
    try:
        out["died"]["commit"] = elastic.sync(state, force=True, timeout=10).tensor_bytes
    except SyncError as exc:
        out["died"]["commit"] = str(exc)
    return out


@pytest.mark.timeout(180)
def test_transfers_on_three_ranks(tmp_path: Path) -> None:
    results = run_on_ranks(_three_rank_checks, 3, args=(str(tmp_path),), allow_exit=True, timeout=150)
    source, one = results[0], results[1]
    assert results[2] is None  # it died in the last check
    two = pickle.loads((tmp_path / "2.pkl").read_bytes())
    receivers = {1: one, 2: two}
    for key in ("first", "second", "after stalls"):
        assert source[key]["errors"] == [] and "raised" not in source[key], key
        assert source[key]["counts"] == {"all_reduce": 1, "broadcast": 0}, key  # the agreement alone
        for side in receivers.values():
            assert side[key]["errors"] == [] and side[key]["wrong"] == [] and side[key]["moved"] == [], key
            assert side[key]["parameters kept"] and side[key]["counts"] == source[key]["counts"], key
    assert source["listeners"] == 0  # each send took its plan's socket
    plan = source["first"]["plan"]
    assert plan.address[0] == "127.0.0.1" and plan.direct.count(True) == 4  # 20, 22, 30, 31

    # a wrong token (rank 2's): refused and logged; every rank took the broadcasts, values exact
    wrong = source["wrong token"]
    assert wrong["errors"] == [] and wrong["counts"]["all_reduce"] == 1 and wrong["counts"]["broadcast"] > 0
    assert len(wrong["warnings"]) == 2, wrong["warnings"]
    assert "tcp transport: rank 0 refused a connection from 127.0.0.1:" in wrong["warnings"][0]
    assert "it did not present this transfer's token" in wrong["warnings"][0]
    assert f"a receiver could not connect to rank 0 at {plan.address[0]}:" in wrong["warnings"][1]
    assert "this transfer goes by BroadcastTransport" in wrong["warnings"][1]
    assert "rank 2 cannot connect to rank 0" in two["wrong token"]["warnings"][0]
    assert "the source closed the connection without accepting it" in two["wrong token"]["warnings"][0]
    for side in receivers.values():
        assert side["wrong token"]["wrong"] == [] and side["wrong token"]["moved"] == []
        assert side["wrong token"]["counts"] == wrong["counts"]

    # an unreachable address (rank 1's): it says why, every rank falls back and remembers
    unreachable = one["unreachable"]
    assert unreachable["wrong"] == [] and unreachable["errors"] == [] and "raised" not in unreachable
    assert two["unreachable"]["wrong"] == [] and two["unreachable"]["counts"]["broadcast"] > 0
    text = unreachable["warnings"][0]
    assert len(unreachable["warnings"]) == 1
    assert f"tcp transport: rank 1 cannot connect to rank 0 at 127.0.0.1:{unreachable['port']}: " in text
    assert "ConnectionRefusedError" in text and "so do those planned in the next 60s" in text
    assert source["unreachable"]["warnings"] == []  # the source warned once already (the wrong token)
    assert source["remembered"]["plan"].address is None  # the broadcasts planned alone
    assert source["remembered"]["counts"]["all_reduce"] == 0 and one["remembered"]["wrong"] == []

    # a stalled source: both receivers time out naming it and its address; the source finds them gone
    host, port = source["stalled source"]["plan"].address
    for rank, side in receivers.items():
        assert side["stalled source"]["raised"].startswith(
            f"test timed out in phase 'tcp receive' on rank {rank}: no progress with rank 0 at "
            f"{host}:{port} for 1s. Every rank of the group must call test() at the same point"
        ), side["stalled source"]
    assert source["stalled source"]["raised"].startswith(
        "test failed in phase 'tcp send' on rank 0: the connection with rank 1 at 127.0.0.1:"
    )
    # a stalled receiver: the source times out on rank 1, naming it; rank 2 had everything
    raised = source["stalled receiver"]["raised"]
    assert raised.startswith("test timed out in phase 'tcp send' on rank 0: no progress with rank 1 at ")
    assert " for 1s. Every rank" in raised
    assert "failed in phase 'tcp receive' on rank 1" in one["stalled receiver"]["raised"]
    assert "raised" not in two["stalled receiver"] and two["stalled receiver"]["wrong"] == []

    # local failures: each side reports its own, the transfer went on
    assert source["faults"]["errors"] == ["fault injected on rank 0 at bucket 1"]
    assert one["faults"]["errors"] == ["fault injected on rank 1 at tcp receive"]
    assert two["faults"]["errors"] == []
    assert source["faults"]["counts"] == one["faults"]["counts"] == {"all_reduce": 1, "broadcast": 0}

    # through elastic.sync: bit for bit, in place, objects by two broadcasts and the tensors by TCP
    for side in (source, one, two):
        sync = side["sync"]
        assert sync["src"] == 0 and sync["step"] == 3 and sync["equal"] and sync["in place"], sync
        assert sync["bytes"] > 2**20 and sync["warnings"] == []
        assert sync["counts"] == {"all_reduce": 1, "broadcast": 2}, sync["counts"]  # agreement; payload
        assert side["resync"] == sync["bytes"]

    # a receiver dies: the source raises naming it, the other receiver was served; the next sync fails
    assert source["died"]["raised"].startswith(
        "test failed in phase 'tcp send' on rank 0: the connection with rank 2 at 127.0.0.1:"
    )
    assert one["died"]["wrong"] == [] and "raised" not in one["died"]
    for side in (source, one):
        assert "sync failed" in side["died"]["commit"] or "sync timed out" in side["died"]["commit"]


# -----------------------------------------------------------------------------------------------------------
# Between two simulated hosts


NETNS = why_not()


@pytest.mark.skipif(NETNS is not None, reason=str(NETNS))
@pytest.mark.timeout(120)
def test_sync_between_two_hosts_takes_the_connections(tmp_path: Path) -> None:
    with Hosts(2) as hosts:
        master = f"{hosts.address(0)}:29431"
        procs = [
            hosts.popen(
                k,
                [sys.executable, str(HERE / "tcp_host_worker.py"), str(k), master, str(tmp_path)],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
            for k in (0, 1)
        ]
        outputs = [p.communicate(timeout=90)[0].decode() for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    results = [json.loads((tmp_path / f"{k}.json").read_text()) for k in (0, 1)]
    assert results[0]["listen"] == hosts.address(0)  # GLOO_SOCKET_IFNAME's address
    for res in results:
        assert res["equal"] and res["src"] == 0 and res["bytes"] > 2**20, res
        assert res["warnings"] == [], res
    assert results[1]["streams"] == 1 and results[1]["in place"]  # the receiver read from its connection
    assert results[0]["served"] == 1
