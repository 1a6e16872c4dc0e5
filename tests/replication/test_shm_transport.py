"""The shared-memory transport: options, plans, the memfd link check, and transfers on 2 and 3 gloo ranks
(direct calls and through `elastic.sync`), with the fallback, local failures and a dying receiver."""

from __future__ import annotations

import os
import pickle
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import attrs
import pytest
import torch

import elastic
import elastic.replication.transport.shm as shm
from dist_harness import counting_collectives, run_on_ranks
from elastic._util.placement import Placement
from elastic.replication.comm import Comm
from elastic.replication.transport.broadcast import BroadcastTransport, byte_view, plan_buckets
from elastic.replication.transport.protocol import Transport
from elastic.replication.transport.shm import SegmentRef, SharedMemoryTransport, ShmPlan
from elastic.replication.transport.tcp import TcpTransport
from elastic.state.tensors import TensorMeta

needs_memfd = pytest.mark.skipif(
    not (hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd")), reason="needs Linux memfd"
)


@pytest.fixture(autouse=True)
def _released() -> Iterator[None]:
    shm.release_shared()
    yield
    shm.release_shared()


def _comm(device: str = "cpu") -> Comm:
    comm = Comm.__new__(Comm)
    comm.placement = Placement(torch.device("cpu"))
    comm.device = torch.device(device)
    return comm


def _bits(t: torch.Tensor) -> bytes:
    return bytes(byte_view(t.detach().resolve_conj().resolve_neg().contiguous()).tolist())


# -----------------------------------------------------------------------------------------------------------
# Options, plans, segments, the link check (one process)


def test_options_are_checked() -> None:
    for kwargs, match in [
        ({"bucket_bytes": 0}, "bucket_bytes=...\\) must be an int of at least 1, got 0"),
        ({"slots": 1}, "slots=...\\) must be an int of at least 2, got 1"),
        ({"min_bytes": -1}, "min_bytes=...\\) must be an int of at least 0, got -1"),
        ({"ramp_min": True}, "ramp_min=...\\) must be an int of at least 1, got True"),
    ]:
        with pytest.raises(ValueError, match="SharedMemoryTransport\\(" + match):
            SharedMemoryTransport(**kwargs)
    with pytest.raises(TypeError, match=r"fallback=\.\.\.\) must be a Transport other than"):
        SharedMemoryTransport(fallback=object())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="got SharedMemoryTransport"):
        SharedMemoryTransport(fallback=SharedMemoryTransport())
    chosen = SharedMemoryTransport()
    assert (chosen.slots, chosen.min_bytes, chosen.fallback) == (
        shm.SLOTS,
        shm.MIN_BYTES,
        TcpTransport(),  # between hosts: connections of its own, then the broadcasts
    )
    assert isinstance(chosen, Transport)


def test_link_check_accepts_only_the_memfd_with_the_token() -> None:
    token = "0123456789abcdef0123456789abcdef"
    assert shm.expected_link(token) == f"/memfd:elastic-{token} (deleted)"
    assert shm.link_matches(f"/memfd:elastic-{token} (deleted)", token)
    for link in [
        f"/memfd:elastic-{token}",  # not the memfd's form
        f"/memfd:elastic-{token[:-1]} (deleted)",
        f"/memfd:elastic-{token}x (deleted)",
        "/memfd:elastic-ffffffffffffffffffffffffffffffff (deleted)",
        "pipe:[4026532]",
        "/dev/zero",
        f"/dev/shm/elastic-{token} (deleted)",
    ]:
        assert not shm.link_matches(link, token), link
    assert not shm.link_matches("/memfd:elastic- (deleted)", "")
    assert not shm.link_matches("/memfd:elastic-../x (deleted)", "../x")


@needs_memfd
def test_open_refuses_a_path_that_is_not_the_segment(monkeypatch: pytest.MonkeyPatch) -> None:
    opened: list[str] = []
    real_open = os.open

    def spy(path: Any, *args: Any, **kwargs: Any) -> int:
        opened.append(str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", spy)
    read, write = os.pipe()  # a FIFO-like descriptor: opening it for reading could block
    seg = shm._Segment(8192)
    try:
        for ref, why in [
            (SegmentRef(os.getpid(), read, seg.token, 8192, seg.inode), "names 'pipe:"),
            (SegmentRef(os.getpid(), seg.fd, "f" * 32, 8192, seg.inode), "not the source's segment"),
        ]:
            with pytest.raises(ValueError, match=why):
                shm._open_checked(ref)
        assert opened == []  # refused before any open
        with pytest.raises(OSError):  # no such descriptor
            shm._open_checked(SegmentRef(os.getpid(), 10**6, seg.token, 8192, seg.inode))
        # the right link but another inode, or fewer bytes than the plan says: opened, checked, closed
        fds = len(os.listdir("/proc/self/fd"))
        with pytest.raises(ValueError, match="changed between the check and the open"):
            shm._open_checked(SegmentRef(os.getpid(), seg.fd, seg.token, 8192, seg.inode + 1))
        with pytest.raises(ValueError, match="holds 8192 bytes, the plan says 16384"):
            shm._open_checked(SegmentRef(os.getpid(), seg.fd, seg.token, 16384, seg.inode))
        assert len(os.listdir("/proc/self/fd")) == fds
        # the segment itself maps, read-only, and shows the owner's writes
        seg.region.bytes[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
        view = shm._map(seg.ref())
        assert view.bytes.tolist()[:4] == [1, 2, 3, 4] and view.bytes.numel() == 8192
        assert shm._map(seg.ref()) is view  # kept
    finally:
        seg.close()
        os.close(read)
        os.close(write)


@needs_memfd
def test_plan_names_a_kept_segment_or_only_the_fallback() -> None:
    chosen = SharedMemoryTransport(
        bucket_bytes=64 * 1024, slots=2, min_bytes=4096, fallback=BroadcastTransport()
    )
    small = [torch.zeros(1000), torch.zeros(20)]  # 4,080 bytes
    plan = chosen.plan(small, _comm())
    assert plan == ShmPlan(None, [False, False])
    assert shm.shared_cached_bytes() == 0
    big = [torch.zeros(100_000), torch.zeros(3, dtype=torch.int8), torch.zeros(64, 64).t()]
    plan = chosen.plan(big, _comm())
    assert plan.segment is not None and plan.fallback == BroadcastTransport().plan(big, _comm())
    assert (plan.slot_bytes, plan.slots, plan.bucket_bytes) == (64 * 1024, 2, 64 * 1024)
    assert plan.segment.pid == os.getpid() and plan.segment.size == 2 * 64 * 1024
    link = os.readlink(f"/proc/self/fd/{plan.segment.fd}")
    assert shm.link_matches(link, plan.segment.token)
    assert pickle.loads(pickle.dumps(plan)) == plan  # it travels in the sync payload
    again = chosen.plan(big, _comm())
    assert again.segment == plan.segment  # the same segment, kept
    assert shm.shared_cached_bytes() == 2 * 64 * 1024
    # claimed by a transfer, it is not handed to another one; a larger plan gets a new segment
    taken = shm._take(plan.segment.token)
    assert taken is not None and shm._take(plan.segment.token) is None
    other = SharedMemoryTransport(bucket_bytes=2**20, slots=3, min_bytes=0).plan(big, _comm())
    assert other.segment is not None and other.segment.token != plan.segment.token
    assert other.slot_bytes == 102 * 4096  # 416,396 bytes with alignment, up to 4 KiB: less than a bucket
    shm._give_back(taken)
    assert shm.shared_cached_bytes() == 3 * 102 * 4096 + 2 * 64 * 1024
    shm.release_shared()
    assert shm.shared_cached_bytes() == 0
    assert not os.path.exists(f"/proc/self/fd/{plan.segment.fd}") or not shm.link_matches(
        os.readlink(f"/proc/self/fd/{plan.segment.fd}"), plan.segment.token
    )
    # not on a CPU communication device: the fallback alone
    assert SharedMemoryTransport().plan(big, _comm("meta")).segment is None


# -----------------------------------------------------------------------------------------------------------
# Real gloo ranks


@elastic.elastic_state(tenure="step")
@attrs.define
class Net:
    step: int
    model: torch.nn.Module
    extra: list


def _tensors(rank: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(source tensors, receiver targets) for 256-byte buckets."""
    g = torch.Generator().manual_seed(11)
    src = [torch.randn(3, generator=g) for _ in range(40)]  # 0-39: many small tensors
    src += [
        torch.randint(-(2**40), 2**40, (100,), generator=g),  # 40: 800 bytes, split across buckets
        torch.randn(5, 6, generator=g).t(),  # 41: non-contiguous source
        torch.randn(20, 8, generator=g),  # 42: non-contiguous target, split across buckets
        torch.randn(7, generator=g).to(torch.bfloat16),  # 43
        torch.randint(-128, 127, (5,), generator=g, dtype=torch.int8),  # 44
        torch.randint(0, 2, (9,), generator=g).bool(),  # 45
        torch.randn(3, generator=g, dtype=torch.complex64).conj(),  # 46: lazy conjugate source
        torch.randn((), generator=g, dtype=torch.float64),  # 47: 0-d
        torch.empty(0, 4),  # 48: empty
        torch.randn(13, generator=g, dtype=torch.float16),  # 49: odd byte count
        torch.randn(3, 4, generator=g),  # 50: non-contiguous target inside one bucket
        torch.randn(5, generator=g, dtype=torch.complex128),  # 51: a parameter target
        torch.tensor([float("nan"), -0.0, float("inf")]),  # 52: bit for bit
    ]
    if rank == 0:
        return src, src
    targets = [torch.zeros_like(t.resolve_conj(), memory_format=torch.contiguous_format) for t in src]
    targets[42] = torch.zeros(8, 20).t()
    targets[50] = torch.zeros(4, 3).t()
    targets[51] = torch.nn.Parameter(torch.zeros(5, dtype=torch.complex128))
    return src, targets


def _fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def _transfer(
    rank: int,
    chosen: SharedMemoryTransport,
    src: list[torch.Tensor],
    targets: list[torch.Tensor],
    tamper: Any = None,
) -> dict[str, Any]:
    """One transfer from rank 0 with the source's plan (as sync sends it); the collectives it issued, the
    errors each side reported, and on receivers the values and identities."""
    import torch.distributed as dist

    comm = Comm(None, timedelta(seconds=20), "test")
    metas = [TensorMeta(("t", i), tuple(t.shape), t.dtype, "cpu") for i, t in enumerate(src)]
    box = [chosen.plan(src, comm) if rank == 0 else None]
    dist.broadcast_object_list(box, 0)
    plan = box[0] if tamper is None or rank == 0 else tamper(box[0])
    errors: list[str] = []
    ptrs = [t.data_ptr() for t in targets]
    with counting_collectives() as counts:
        if rank == 0:
            chosen.send(comm, 0, src, metas, plan, lambda e: errors.append(str(e)))
        else:
            chosen.receive(comm, 0, targets, metas, plan, lambda e: errors.append(str(e)))
    out: dict[str, Any] = {"errors": errors, "counts": dict(counts), "plan": plan}
    buckets = plan_buckets(metas, [False] * len(metas), chosen.bucket_bytes, chosen.ramp_min)
    out["ring all-reduces"] = 1 + len(buckets) + 1
    if rank > 0:
        out["wrong"] = [
            i for i, (t, s) in enumerate(zip(targets, src)) if t.dtype != s.dtype or _bits(t) != _bits(s)
        ]
        out["moved"] = [i for i, (t, p) in enumerate(zip(targets, ptrs)) if t.data_ptr() != p]
    return out


def _two_rank_checks(rank: int, world: int) -> dict[str, Any]:
    import elastic.replication.transport.shm as shm
    from elastic.replication.transport.default import set_default_transport

    out: dict[str, Any] = {}
    chosen = SharedMemoryTransport(bucket_bytes=256, min_bytes=0, ramp_min=64)

    src, targets = _tensors(rank)
    out["first"] = _transfer(rank, chosen, src, targets)
    out["noncontiguous kept"] = rank == 0 or not any(targets[i].is_contiguous() for i in (42, 50))
    out["parameter kept"] = rank == 0 or isinstance(targets[51], torch.nn.Parameter)
    # again: the same segment and mapping, no new descriptor
    kept = {ref: view.bytes.data_ptr() for ref, view in shm._mapped.items()}
    free = [s.token for s in shm._free]
    fds = _fd_count()
    src, targets = _tensors(rank)
    out["second"] = _transfer(rank, chosen, src, targets)
    out["fds stable"] = _fd_count() == fds
    out["same segment"] = [s.token for s in shm._free] == free and len(free) == (1 if rank == 0 else 0)
    out["same mapping"] = {ref: view.bytes.data_ptr() for ref, view in shm._mapped.items()} == kept
    out["mapped"] = len(kept) == (0 if rank == 0 else 1)

    # a receiver that cannot map: everyone falls back to the broadcast, with the right values
    tampers = {
        "token": lambda p: p._replace(segment=p.segment._replace(token="f" * 32)),
        "pid": lambda p: p._replace(segment=p.segment._replace(pid=os.getpid())),  # our own fd table
    }
    for name, tamper in tampers.items():
        src, targets = _tensors(rank)
        out[f"fallback {name}"] = _transfer(rank, chosen, src, targets, tamper)

    # below min_bytes: the broadcast alone, no flag round
    src, targets = _tensors(rank)
    out["small"] = _transfer(rank, SharedMemoryTransport(bucket_bytes=256, min_bytes=10**6), src, targets)

    # local failures: reported through on_error, every rank finishes, the next transfer works
    for spec in ("1:bucket 1", "0:bucket 2"):
        os.environ["ELASTIC_FAULT"] = spec
        src, targets = _tensors(rank)
        try:
            out[f"fault {spec}"] = _transfer(rank, chosen, src, targets)
        finally:
            del os.environ["ELASTIC_FAULT"]
        if rank == 1:
            out[f"fault {spec} first written"] = _bits(targets[0]) == _bits(src[0])
            out[f"fault {spec} last not written"] = not targets[52].any().item()
    src, targets = _tensors(rank)
    out["after faults"] = _transfer(rank, chosen, src, targets)

    # through elastic.sync, with the shared-memory transport as the default
    set_default_transport(SharedMemoryTransport(bucket_bytes=4096, min_bytes=0))
    out["sync"] = _sync_checks(rank)
    return out


def _sync_checks(rank: int) -> dict[str, Any]:
    def build(seed: int) -> Net:
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 8))
        return Net(step=0, model=model, extra=[torch.randn(30, 7).t(), torch.randn(50, dtype=torch.float64)])

    state = build(rank)
    state.step = 5 if rank == 0 else rank
    expected = build(0)
    ptrs = [t.data_ptr() for t in [*state.model.parameters(), *state.extra]]
    with counting_collectives() as counts:
        report = elastic.sync(state, timeout=20)
    got = [*state.model.parameters(), *state.extra]
    want = [*expected.model.parameters(), *expected.extra]
    return {
        "src": report.src,
        "tensor bytes": report.tensor_bytes,
        "wrong": [i for i, (a, b) in enumerate(zip(got, want)) if _bits(a) != _bits(b)],
        "moved": [i for i, (t, p) in enumerate(zip(got, ptrs)) if t.data_ptr() != p],
        "all-reduces": counts["all_reduce"],
        "mapped": len(shm._mapped),
        "step": state.step,
    }


@needs_memfd
@pytest.mark.timeout(120)
def test_transfers_on_two_ranks() -> None:
    source, receiver = run_on_ranks(_two_rank_checks, 2)
    for side in (source, receiver):
        for key in ("first", "second", "after faults"):
            assert side[key]["errors"] == [], key
            assert side[key]["counts"] == {"all_reduce": side[key]["ring all-reduces"], "broadcast": 0}, key
            assert side[key]["plan"].segment is not None
    for key in ("first", "second", "after faults"):
        assert receiver[key]["wrong"] == [] and receiver[key]["moved"] == [], key
    assert receiver["noncontiguous kept"] and receiver["parameter kept"]
    for side in (source, receiver):
        assert side["fds stable"] and side["same segment"] and side["same mapping"] and side["mapped"]
    # the fallback: the flag round, then the broadcast transport's collectives, the right values
    for name in ("token", "pid"):
        for side in (source, receiver):
            result = side[f"fallback {name}"]
            assert result["errors"] == [] and result["counts"]["all_reduce"] == 1
            assert result["counts"]["broadcast"] > 0
        assert receiver[f"fallback {name}"]["wrong"] == [] and receiver[f"fallback {name}"]["moved"] == []
    # below min_bytes: no flag round
    for side in (source, receiver):
        assert side["small"]["plan"].segment is None and side["small"]["counts"]["all_reduce"] == 0
    assert receiver["small"]["wrong"] == []
    # local failures: the failing rank reports, the other notices nothing, every collective ran
    assert source["fault 1:bucket 1"]["errors"] == []
    assert receiver["fault 1:bucket 1"]["errors"] == ["fault injected on rank 1 at bucket 1"]
    assert receiver["fault 1:bucket 1 first written"] and receiver["fault 1:bucket 1 last not written"]
    assert source["fault 0:bucket 2"]["errors"] == ["fault injected on rank 0 at bucket 2"]
    assert receiver["fault 0:bucket 2"]["errors"] == []
    for spec in ("1:bucket 1", "0:bucket 2"):
        for side in (source, receiver):
            assert side[f"fault {spec}"]["counts"]["all_reduce"] == side[f"fault {spec}"]["ring all-reduces"]
    # through elastic.sync: in place, bit for bit, through the ring
    for side in (source, receiver):
        assert side["sync"]["src"] == 0 and side["sync"]["step"] == 5 and side["sync"]["all-reduces"] >= 3
    assert (
        receiver["sync"]["wrong"] == []
        and receiver["sync"]["moved"] == []
        and receiver["sync"]["mapped"] == 1
    )
    assert receiver["sync"]["tensor bytes"] == (16 * 32 + 32 + 32 * 8 + 8 + 30 * 7) * 4 + 50 * 8


def _three_rank_checks(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist

    from elastic import SyncError
    from elastic.replication.transport.default import set_default_transport

    out: dict[str, Any] = {}
    chosen = SharedMemoryTransport(bucket_bytes=256, min_bytes=0, slots=3)
    src, targets = _tensors(rank)
    out["transfer"] = _transfer(rank, chosen, src, targets)
    set_default_transport(SharedMemoryTransport(bucket_bytes=1024, min_bytes=0))
    out["sync"] = _sync_checks(rank)
    mine = [out["transfer"].get(k) for k in ("wrong", "moved")] + [out["sync"][k] for k in ("wrong", "moved")]
    rows: list[Any] = [None] * world
    dist.all_gather_object(rows, mine)
    out["receivers"] = rows[1:]  # rank 2 dies below: rank 0 and 1 bring back its results
    # a receiver that dies in the ring: the others raise SyncError (a communication failure)
    os.environ["ELASTIC_FAULT"] = "2:bucket 1:die"
    src, targets = _tensors(rank)
    try:
        _transfer(rank, chosen, src, targets)
    except SyncError as exc:
        out["died"] = str(exc)
    return out


@needs_memfd
@pytest.mark.timeout(120)
def test_transfers_on_three_ranks_and_a_dying_receiver() -> None:
    results = run_on_ranks(_three_rank_checks, 3, allow_exit=True)
    assert results[2] is None  # it died at bucket 1
    for rank in (0, 1):
        side = results[rank]
        assert side["transfer"]["errors"] == []
        assert side["transfer"]["counts"] == {
            "all_reduce": side["transfer"]["ring all-reduces"],
            "broadcast": 0,
        }
        assert side["sync"]["src"] == 0 and side["sync"]["wrong"] == [] and side["sync"]["moved"] == []
        assert "failed in phase 'bucket" in side["died"] and f"on rank {rank}" in side["died"]
    assert results[0]["receivers"] == [[[], [], [], []]] * 2  # every receiver: bit for bit, in place


def test_released_segments_and_kept_views_are_unmapped() -> None:
    import gc

    from elastic.replication.transport import broadcast as _transport

    def mapped() -> int:
        with open("/proc/self/maps") as f:
            return sum("memfd:elastic-" in line for line in f)

    shm.release_shared()
    gc.collect()
    before = mapped()
    for size in (4096, 8192, 16384):  # each larger segment replaces the smaller ones
        seg = shm._segment_for(size)
        slots = seg.region.slots(2, size // 2)
        meta = TensorMeta(("t",), (4,), torch.float32, "cpu")
        plan = _transport.kept_plan([meta], [False], size // 2, 4096)
        plan.split(slots[0], 0, [torch.zeros(4)], lambda i, t: True, True)  # a kept view of the segment
        del seg, slots
    shm.release_shared()
    gc.collect()
    assert shm.shared_cached_bytes() == 0 and mapped() == before
