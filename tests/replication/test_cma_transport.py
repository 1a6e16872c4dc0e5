"""The cross-memory transport: options, plans, the token check, reads in one process, and transfers on 2
and 3 gloo ranks (direct calls and through `elastic.sync`), with the fallback, a failed read and a dying
receiver."""

from __future__ import annotations

import ctypes
import os
import pickle
import subprocess
import sys
from datetime import timedelta
from typing import Any

import attrs
import pytest
import torch

import elastic
import elastic.replication.transport.cma as cma
from dist_harness import counting_collectives, run_on_ranks
from elastic._util.placement import Placement
from elastic.replication.comm import Comm
from elastic.replication.transport.broadcast import BroadcastTransport, byte_view
from elastic.replication.transport.cma import CmaPlan, CrossMemoryTransport, SourceRef
from elastic.replication.transport.protocol import Transport
from elastic.replication.transport.shm import SharedMemoryTransport, ShmPlan
from elastic.state.tensors import TensorMeta


def _probe() -> str | None:
    """Why a process started from here cannot read this one's memory (None: it can), like two ranks."""
    ref = cma._token.ref()
    code = (
        "import sys; from elastic.replication.transport.cma import SourceRef, can_read; "
        f"print(can_read(SourceRef({ref.pid}, {ref.address}, bytes.fromhex('{ref.token.hex()}'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return None if out.strip() == "None" else out.strip()


_why_not = _probe() if sys.platform.startswith("linux") else "not Linux"
needs_cma = pytest.mark.skipif(_why_not is not None, reason=f"no cross-memory reads here: {_why_not}")


def _comm(device: str = "cpu") -> Comm:
    comm = Comm.__new__(Comm)
    comm.placement = Placement(torch.device("cpu"))
    comm.device = torch.device(device)
    return comm


def _bits(t: torch.Tensor) -> bytes:
    return bytes(byte_view(t.detach().resolve_conj().resolve_neg().contiguous()).tolist())


# -----------------------------------------------------------------------------------------------------------
# Options, plans, the token, reads (one process)


def test_options_are_checked() -> None:
    with pytest.raises(
        ValueError, match=r"CrossMemoryTransport\(min_bytes=\.\.\.\) must be an int of at least 0"
    ):
        CrossMemoryTransport(min_bytes=-1)
    with pytest.raises(TypeError, match=r"fallback=\.\.\.\) must be a Transport other than"):
        CrossMemoryTransport(fallback=object())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="got CrossMemoryTransport"):
        CrossMemoryTransport(fallback=CrossMemoryTransport())
    chosen = CrossMemoryTransport()
    assert chosen.fallback == SharedMemoryTransport() and isinstance(chosen, Transport)


def test_plan_names_the_source_or_only_the_fallback() -> None:
    chosen = CrossMemoryTransport(min_bytes=4096, fallback=BroadcastTransport())
    small = [torch.zeros(1000), torch.zeros(20)]  # 4,080 bytes
    assert chosen.plan(small, _comm()) == CmaPlan(None, (), [False, False])
    big = [torch.zeros(100_000), torch.zeros(3, dtype=torch.int8), torch.zeros(0)]
    plan = chosen.plan(big, _comm())
    assert plan.source is not None and plan.fallback is None
    assert plan.source.pid == os.getpid() and len(plan.source.token) == 16
    assert plan.regions == tuple((t.data_ptr(), t.numel() * t.element_size()) for t in big)
    assert pickle.loads(pickle.dumps(plan)) == plan  # it travels with the objects
    assert chosen.plan(big, _comm()).source == plan.source  # one token per process, at one address
    assert plan.source.address == ctypes.addressof(cma._token.buffer)
    # a source tensor whose bytes are not its values in order, or another device: the fallback alone
    for odd in ([*big, torch.zeros(64, 64).t()], [*big, torch.zeros(3, dtype=torch.complex64).conj()]):
        assert chosen.plan(odd, _comm()).source is None
    assert chosen.plan(big, _comm("meta")).source is None
    # the default fallback is the shared-memory ring, planned alone
    alone = CrossMemoryTransport(min_bytes=10**9).plan(big, _comm())
    assert alone.source is None and isinstance(alone.fallback, ShmPlan)


def test_yama_decides_who_may_read_a_sibling(monkeypatch: pytest.MonkeyPatch) -> None:
    ptrace = 1 << cma.CAP_SYS_PTRACE
    assert cma.yama_refusal(None, 0) is None and cma.yama_refusal("0\n", 0) is None  # no Yama, classic
    assert cma.yama_refusal("1\n", ptrace) is None and cma.yama_refusal("2\n", ptrace | 1) is None
    for scope, caps in [("1\n", 0), ("2\n", ptrace - 1), ("3\n", ptrace)]:
        why = cma.yama_refusal(scope, caps)
        assert why == f"Yama's ptrace_scope is {scope.strip()}: receivers may not read a sibling's memory"
    # a source that Yama forbids reading plans its fallback alone: no round to find out
    monkeypatch.setattr(cma, "_refusal", [cma.yama_refusal("1", 0)])
    plan = CrossMemoryTransport(min_bytes=0, fallback=BroadcastTransport()).plan([torch.zeros(4)], _comm())
    assert plan == CmaPlan(None, (), [False])


def test_the_token_check_reads_only_the_source() -> None:
    ref = cma._token.ref()
    assert cma.can_read(ref) is None  # this process holds its own token
    wrong = cma.can_read(ref._replace(token=bytes(16)))
    assert wrong is not None and "does not hold the source's token" in wrong
    gone = cma.can_read(SourceRef(2**22 + 12345, ref.address, ref.token))  # no such pid
    assert gone is not None and "failed" in gone
    bad = cma.can_read(ref._replace(address=8))  # an unmapped address
    assert bad is not None and "failed" in bad


def test_the_host_key_names_this_kernel_and_pid_namespace() -> None:
    key = cma.host_key()
    with open("/proc/sys/kernel/random/boot_id") as f:
        assert key == f"{f.read().strip()}/{os.stat('/proc/self/ns/pid').st_ino}"
    plan = CrossMemoryTransport(min_bytes=0).plan([torch.zeros(4)], _comm())
    assert plan.host == key and pickle.loads(pickle.dumps(plan)).host == key


def test_a_forked_child_draws_its_own_token() -> None:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report its token, then leave without running anything else
        os.write(write, cma._token.buffer.raw)
        os._exit(0)
    os.close(write)
    child = os.read(read, 16)
    os.close(read)
    os.waitpid(pid, 0)
    assert len(child) == 16 and child != cma._token.buffer.raw


def test_reads_in_one_process_cover_every_region() -> None:
    src = [torch.arange(n, dtype=torch.float32) * 3 for n in range(1, 1500)]  # more than IOV_MAX regions
    dst = [torch.zeros_like(t) for t in src]
    regions = [(t.data_ptr(), t.numel() * 4) for t in src]
    cma.read_regions(os.getpid(), [(t.data_ptr(), t.numel() * 4) for t in dst], regions)
    assert all(torch.equal(a, b) for a, b in zip(src, dst))
    with pytest.raises(OSError, match="process_vm_readv from pid"):
        cma.read_regions(os.getpid(), [(dst[0].data_ptr(), 4)], [(8, 4)])


def test_reads_go_into_targets_in_place_or_through_a_temporary() -> None:
    src = [torch.randn(5, 6), torch.arange(12, dtype=torch.int64), torch.randn(4, 3)]
    metas = [TensorMeta(("t", i), tuple(t.shape), t.dtype, "cpu") for i, t in enumerate(src)]
    targets = [torch.zeros(5, 6), torch.zeros(12, dtype=torch.int64), torch.zeros(3, 4).t()]
    ptrs = [t.data_ptr() for t in targets]
    plan = CrossMemoryTransport(min_bytes=0).plan(src, _comm())
    assert cma._mismatch(targets, metas, plan) is None
    cma._read_into(os.getpid(), targets, metas, plan.regions)
    assert [_bits(a) for a in targets] == [_bits(b) for b in src]
    assert [t.data_ptr() for t in targets] == ptrs and not targets[2].is_contiguous()
    short = plan._replace(regions=plan.regions[:2])
    assert "2 regions for 3 tensors" in (cma._mismatch(targets, metas, short) or "")
    longer = plan._replace(regions=((plan.regions[0][0], 8), *plan.regions[1:]))
    assert "a region of 8 bytes for 120 bytes" in (cma._mismatch(targets, metas, longer) or "")


# -----------------------------------------------------------------------------------------------------------
# Real gloo ranks


def _tensors(rank: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(source tensors, receiver targets): plain sources of many kinds, targets in place or not."""
    g = torch.Generator().manual_seed(5)
    src = [torch.randn(3, generator=g) for _ in range(20)]
    src += [
        torch.randn(300_000, generator=g),  # 20: the bulk
        torch.randint(-(2**40), 2**40, (100,), generator=g),  # 21
        torch.randn(20, 8, generator=g),  # 22: a non-contiguous target
        torch.randn(7, generator=g).to(torch.bfloat16),  # 23
        torch.randint(0, 2, (9,), generator=g).bool(),  # 24
        torch.randn((), generator=g, dtype=torch.float64),  # 25: 0-d
        torch.empty(0, 4),  # 26: empty
        torch.randn(5, generator=g, dtype=torch.complex128),  # 27: a parameter target
        torch.tensor([float("nan"), -0.0, float("inf")]),  # 28: bit for bit
    ]
    if rank == 0:
        return src, src
    targets = [torch.zeros_like(t) for t in src]
    targets[22] = torch.zeros(8, 20).t()
    targets[27] = torch.nn.Parameter(torch.zeros(5, dtype=torch.complex128))
    return src, targets


def _transfer(rank: int, chosen: CrossMemoryTransport, tamper: Any = None) -> dict[str, Any]:
    """One transfer from rank 0 with the source's plan; the collectives it issued, the errors each side
    reported, and on receivers the values and identities."""
    import torch.distributed as dist

    src, targets = _tensors(rank)
    comm = Comm(None, timedelta(seconds=20), "test")
    metas = [TensorMeta(("t", i), tuple(t.shape), t.dtype, "cpu") for i, t in enumerate(src)]
    box = [chosen.plan(src, comm) if rank == 0 else None]
    dist.broadcast_object_list(box, 0)
    plan = box[0] if tamper is None or rank != 1 else tamper(box[0])
    errors: list[str] = []
    ptrs = [t.data_ptr() for t in targets]
    with counting_collectives() as counts:
        if rank == 0:
            chosen.send(comm, 0, src, metas, plan, lambda e: errors.append(str(e)))
        else:
            chosen.receive(comm, 0, targets, metas, plan, lambda e: errors.append(str(e)))
    out: dict[str, Any] = {"errors": errors, "counts": dict(counts)}
    if rank > 0:
        out["wrong"] = [i for i, (t, s) in enumerate(zip(targets, src)) if _bits(t) != _bits(s)]
        out["moved"] = [i for i, (t, p) in enumerate(zip(targets, ptrs)) if t.data_ptr() != p]
        out["parameter kept"] = isinstance(targets[27], torch.nn.Parameter)
    return out


def _two_rank_checks(rank: int, world: int) -> dict[str, Any]:
    import elastic.replication.transport.shm as shm
    from elastic.replication.transport.default import set_default_transport

    ring = SharedMemoryTransport(bucket_bytes=64 * 1024, min_bytes=0)
    chosen = CrossMemoryTransport(min_bytes=0, fallback=ring)
    out: dict[str, Any] = {"first": _transfer(rank, chosen), "second": _transfer(rank, chosen)}
    out["nothing kept"] = shm.shared_cached_bytes() == 0
    # rank 1 finds the source under another kernel or pid namespace: every rank skips the ring for the
    # ring's own fallback (the TCP connections)
    out["elsewhere"] = _transfer(rank, chosen, lambda p: p._replace(host="another-boot/4026531836"))
    out["ring skipped"] = shm.shared_cached_bytes() == 0
    # rank 1 holds a plan it cannot verify (another process's token): both take the shared-memory ring
    out["fallback"] = _transfer(rank, chosen, lambda p: p._replace(source=p.source._replace(token=bytes(16))))
    out["ring kept"] = shm.shared_cached_bytes() > 0
    shm.release_shared()
    # a failed read: the receiver reports it, the source notices nothing, both finish
    os.environ["ELASTIC_FAULT"] = "1:read"
    try:
        out["fault"] = _transfer(rank, chosen)
    finally:
        del os.environ["ELASTIC_FAULT"]
    out["after fault"] = _transfer(rank, chosen)

    # through elastic.sync, with the default transport (it reads from the source's memory)
    set_default_transport(CrossMemoryTransport())
    torch.manual_seed(rank)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 64))  # ~1.1 MB
    state = Net(step=5 if rank == 0 else 1, model=model)
    torch.manual_seed(0)
    expected = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 64))
    ptrs = [p.data_ptr() for p in state.model.parameters()]
    with counting_collectives() as counts:
        report = elastic.sync(state, timeout=20)
    out["sync"] = {
        "src": report.src,
        "step": state.step,
        "wrong": [
            i
            for i, (a, b) in enumerate(zip(model.parameters(), expected.parameters()))
            if _bits(a) != _bits(b)
        ],
        "moved": [i for i, (p, q) in enumerate(zip(model.parameters(), ptrs)) if p.data_ptr() != q],
        "all-reduces": counts["all_reduce"],
        "nothing kept": shm.shared_cached_bytes() == 0,
    }
    return out


@elastic.elastic_state(tenure="step")
@attrs.define
class Net:
    step: int
    model: torch.nn.Module


@needs_cma
@pytest.mark.timeout(120)
def test_transfers_on_two_ranks() -> None:
    source, receiver = run_on_ranks(_two_rank_checks, 2)
    for key in ("first", "second", "after fault"):
        for side in (source, receiver):
            assert side[key]["errors"] == [], key
            assert side[key]["counts"] == {"all_reduce": 2, "broadcast": 0}, key  # agree, done
        assert receiver[key]["wrong"] == [] and receiver[key]["moved"] == [], key
        assert receiver[key]["parameter kept"], key
    assert source["nothing kept"] and receiver["nothing kept"]
    # another host: the flag round, the fallback plan's broadcast (size, bytes), the TCP agreement
    for side in (source, receiver):
        assert side["elsewhere"]["errors"] == [] and side["ring skipped"]
        assert side["elsewhere"]["counts"] == {"all_reduce": 2, "broadcast": 2}
    assert receiver["elsewhere"]["wrong"] == [] and receiver["elsewhere"]["moved"] == []
    # the fallback: the flag round, the fallback plan's broadcast (size, bytes), then the ring
    for side in (source, receiver):
        assert side["fallback"]["errors"] == [] and side["fallback"]["counts"]["broadcast"] == 2
        assert side["fallback"]["counts"]["all_reduce"] > 3
        assert side["ring kept"]
    assert receiver["fallback"]["wrong"] == [] and receiver["fallback"]["moved"] == []
    # a failed read: reported by the receiver alone, every collective ran
    assert source["fault"]["errors"] == []
    assert receiver["fault"]["errors"] == ["fault injected on rank 1 at read"]
    assert source["fault"]["counts"] == receiver["fault"]["counts"] == {"all_reduce": 2, "broadcast": 0}
    # through elastic.sync: in place, bit for bit, by two all-reduces and no shared memory
    for side in (source, receiver):
        assert side["sync"]["src"] == 0 and side["sync"]["step"] == 5
        assert side["sync"]["all-reduces"] == 2 and side["sync"]["nothing kept"]
    assert receiver["sync"]["wrong"] == [] and receiver["sync"]["moved"] == []


def _three_rank_checks(rank: int, world: int) -> dict[str, Any]:
    from elastic import SyncError

    chosen = CrossMemoryTransport(min_bytes=0)
    out: dict[str, Any] = {"transfer": _transfer(rank, chosen)}
    os.environ["ELASTIC_FAULT"] = "2:read:die"  # a receiver dies while reading: the others raise
    try:
        _transfer(rank, chosen)
    except SyncError as exc:
        out["died"] = str(exc)
    return out


@needs_cma
@pytest.mark.timeout(120)
def test_transfers_on_three_ranks_and_a_dying_receiver() -> None:
    results = run_on_ranks(_three_rank_checks, 3, allow_exit=True)
    assert results[2] is None  # it died reading
    assert results[1]["transfer"]["wrong"] == [] and results[1]["transfer"]["moved"] == []
    for rank in (0, 1):
        side = results[rank]
        assert side["transfer"]["errors"] == [] and side["transfer"]["counts"]["broadcast"] == 0
        assert "failed in phase 'reads done'" in side["died"] and f"on rank {rank}" in side["died"]
