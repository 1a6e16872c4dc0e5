"""The tensor transport: bucket plans, byte views, the direct rule, and one grouped 2-rank transfer."""

from __future__ import annotations

import struct
from datetime import timedelta
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import elastic.replication.transport.broadcast as transport
from dist_harness import run_on_ranks
from elastic.replication.transport.broadcast import BroadcastTransport, Bucket, byte_view, plan_buckets
from elastic.replication.transport.protocol import Transport
from elastic.state.tensors import TensorMeta

DTYPES = [
    torch.float32,
    torch.float64,
    torch.bfloat16,
    torch.float16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.int64,
    torch.complex64,
    torch.complex128,
]


def _meta(i: int, shape: tuple[int, ...], dtype: torch.dtype) -> TensorMeta:
    return TensorMeta(("t", i), shape, dtype, "cpu")


def _nbytes(meta: TensorMeta) -> int:
    n = 1
    for d in meta.shape:
        n *= d
    return n * torch.empty((), dtype=meta.dtype).element_size()


def _check_plan(metas: list[TensorMeta], direct: list[bool], buckets: list[Bucket], bound: int) -> None:
    """Every non-direct tensor's bytes exactly once, in stream order, in buckets of at most `bound`,
    each tensor starting at a multiple of its element size."""
    stream = [(seg.tensor, seg.offset, seg.length) for b in buckets for seg in b.segments]
    expected_order = [i for i, m in enumerate(metas) if not direct[i] and _nbytes(m) > 0]
    seen: list[int] = []
    for index, _, _ in stream:
        if not seen or seen[-1] != index:
            seen.append(index)
    assert seen == expected_order  # in order, each tensor in one run of segments
    for i in expected_order:
        pieces = [(o, n) for j, o, n in stream if j == i]
        at = 0
        for offset, length in pieces:
            assert offset == at and length > 0
            at += length
        assert at == _nbytes(metas[i])
    remaining = sum(_nbytes(metas[i]) for i in expected_order)
    for k, bucket in enumerate(buckets):
        assert 0 < bucket.size <= bound
        end = 0
        for seg in bucket.segments:
            itemsize = metas[seg.tensor].dtype.itemsize
            assert seg.at >= end and seg.at - end < itemsize  # no overlap; padding only to align
            if seg.offset == 0:
                assert seg.at % itemsize == 0
            else:
                assert seg.at == 0  # a continued tensor opens its bucket
            end = seg.at + seg.length
        assert end == bucket.size
        cap = transport._cap(k, remaining, bound, transport.RAMP_MIN)
        assert bucket.size <= cap
        if k < len(buckets) - 1:
            assert cap - bucket.size < 16  # closed early only when the next tensor's alignment did not fit
        remaining -= sum(seg.length for seg in bucket.segments)
    assert remaining == 0


@st.composite
def _plans(draw: Any) -> tuple[list[TensorMeta], list[bool], int]:
    n = draw(st.integers(0, 12))
    metas = [
        _meta(i, tuple(draw(st.lists(st.integers(0, 9), max_size=3))), draw(st.sampled_from(DTYPES)))
        for i in range(n)
    ]
    direct = [draw(st.booleans()) for _ in range(n)]
    return metas, direct, draw(st.integers(1, 300) | st.integers(4096, 40000))


@settings(max_examples=200, deadline=None)
@given(_plans())
def test_plan_buckets_covers_every_byte_once_in_order(plan: tuple[list[TensorMeta], list[bool], int]) -> None:
    metas, direct, bound = plan
    _check_plan(metas, direct, plan_buckets(metas, direct, bound), bound)


def test_plan_buckets_large_tensor_spans_buckets_and_directs_are_skipped() -> None:
    metas = [
        _meta(0, (10,), torch.float32),
        _meta(1, (250,), torch.float32),
        _meta(2, (1000,), torch.int8),
        _meta(3, (0,), torch.float64),
        _meta(4, (), torch.float64),
    ]
    direct = [False, False, True, False, False]
    buckets = plan_buckets(metas, direct, 400)
    _check_plan(metas, direct, buckets, 400)
    assert [b.size for b in buckets] == [400, 400, 248]
    assert [s.tensor for s in buckets[0].segments] == [0, 1]
    assert [s.tensor for s in buckets[1].segments] == [1]
    assert [(s.tensor, s.offset, s.length, s.at) for s in buckets[2].segments] == [
        (1, 760, 240, 0),
        (4, 0, 8, 240),
    ]
    assert plan_buckets(metas, [True] * 5, 400) == []
    assert plan_buckets([], [], 400) == []


def test_plan_buckets_aligns_each_tensor_to_its_element_size() -> None:
    metas = [_meta(0, (3,), torch.int8), _meta(1, (2,), torch.float32), _meta(2, (1,), torch.complex128)]
    lay = [
        [(s.tensor, s.offset, s.length, s.at) for s in b.segments]
        for b in plan_buckets(metas, [False] * 3, 100)
    ]
    assert lay == [[(0, 0, 3, 0), (1, 0, 8, 4), (2, 0, 16, 16)]]
    buckets = plan_buckets(metas, [False] * 3, 16)  # the complex tensor's padding leaves no room: next bucket
    assert [b.size for b in buckets] == [12, 16] and buckets[1].segments == ((2, 0, 16, 0),)
    _check_plan(metas, [False] * 3, buckets, 16)
    buckets = plan_buckets(metas, [False] * 3, 17)  # one byte of room after padding: split
    assert [(s.tensor, s.offset, s.length, s.at) for s in buckets[0].segments][-1] == (2, 0, 1, 16)
    _check_plan(metas, [False] * 3, buckets, 17)


def test_plan_buckets_ramps_the_first_and_last_buckets() -> None:
    mib = 2**20
    metas = [_meta(i, (mib // 8,), torch.float32) for i in range(320)]  # 160 MiB in 512 KiB tensors
    sizes = [b.size / mib for b in plan_buckets(metas, [False] * 320, 16 * mib)]
    assert sizes == [2, 4, 8] + [16] * 8 + [9, 4.5, 2.25, 2.25]
    _check_plan(metas, [False] * 320, plan_buckets(metas, [False] * 320, 16 * mib), 16 * mib)
    # small transfers too: 3 MiB goes in 2 + 1 MiB, so that the first bucket travels while the next is packed
    assert [b.size / mib for b in plan_buckets(metas[:6], [False] * 6, 16 * mib)] == [2, 1]


def test_plan_buckets_takes_the_bound_as_an_argument() -> None:
    metas = [_meta(0, (100,), torch.float32)]
    assert [b.size for b in plan_buckets(metas, [False], 64)] == [64] * 6 + [16]
    assert [b.size for b in plan_buckets(metas, [False])] == [400]  # the default bound: one bucket
    with pytest.raises(ValueError, match="bucket_bytes must be at least 1, got 0"):
        plan_buckets(metas, [False], 0)


def test_byte_view_of_every_kind_of_tensor() -> None:
    zero_d = torch.tensor(1.5)
    v = byte_view(zero_d)
    assert v.dtype == torch.uint8 and bytes(v.tolist()) == struct.pack("<f", 1.5)
    assert v.data_ptr() == zero_d.data_ptr()

    empty = torch.empty(0, 3)
    assert byte_view(empty).numel() == 0 and byte_view(empty).dtype == torch.uint8

    flags = torch.tensor([True, False, True])
    assert byte_view(flags).tolist() == [1, 0, 1]

    small = torch.tensor([-1, 2, -128], dtype=torch.int8)
    assert byte_view(small).tolist() == [255, 2, 128]

    half = torch.tensor([1.0, -2.0], dtype=torch.bfloat16)
    hv = byte_view(half)
    assert hv.numel() == 4
    hv[:2].copy_(byte_view(torch.tensor([3.0], dtype=torch.bfloat16)))  # writing the view writes the tensor
    assert half.tolist() == [3.0, -2.0]

    c = torch.tensor([1 + 2j, -3.5j], dtype=torch.complex64)
    out = torch.zeros(2, dtype=torch.complex64)
    byte_view(out).copy_(byte_view(c))
    assert torch.equal(out, c) and byte_view(c).numel() == 16

    raw = torch.arange(6, dtype=torch.uint8).reshape(2, 3)
    assert byte_view(raw).data_ptr() == raw.data_ptr() and byte_view(raw).tolist() == [0, 1, 2, 3, 4, 5]

    param = torch.nn.Parameter(torch.ones(3))
    assert byte_view(param).data_ptr() == param.data_ptr() and not byte_view(param).requires_grad


def test_byte_view_rejects_tensors_whose_bytes_are_not_their_values() -> None:
    with pytest.raises(ValueError, match=r"shape \(2, 3\) and strides \(1, 2\).*tensor.contiguous\(\)"):
        byte_view(torch.zeros(3, 2).t())
    with pytest.raises(ValueError, match="lazy conjugation"):
        byte_view(torch.zeros(2, dtype=torch.complex64).conj())


def test_is_direct() -> None:
    cpu = torch.device("cpu")
    is_direct = BroadcastTransport(direct_bytes=400).is_direct
    assert is_direct(torch.zeros(100), cpu)  # 400 bytes: at the threshold
    assert not is_direct(torch.zeros(99), cpu)
    assert not is_direct(torch.zeros(20, 10).t(), cpu)  # large but not contiguous
    assert not is_direct(torch.zeros(100), torch.device("cuda", 0))  # not on the communication device
    assert not is_direct(torch.zeros(100, dtype=torch.complex64).conj(), cpu)
    assert not BroadcastTransport(direct_bytes=4000).is_direct(torch.zeros(100), cpu)


def test_buffers_are_reused_and_can_be_released() -> None:
    transport.release_buffers()
    cpu = torch.device("cpu")
    first = transport._take_buffers(cpu, 100, 2)
    assert [b.numel() for b in first] == [100, 100]
    transport._return_buffers(cpu, first)
    assert transport.cached_bytes() == 200
    one = transport._take_buffers(cpu, 80, 1)  # a smaller need reuses the cached buffers, all kept
    assert [b.data_ptr() for b in one] == [b.data_ptr() for b in first]
    assert transport.cached_bytes() == 0  # owned by the transfer until it hands them back
    transport._return_buffers(cpu, one)
    bigger = transport._take_buffers(cpu, 300, 2)  # too small: replaced
    assert [b.numel() for b in bigger] == [300, 300]
    transport._return_buffers(cpu, bigger)
    transport._return_buffers(cpu, first)  # a smaller set returned later does not replace a larger one
    assert transport.cached_bytes() == 600
    transport.release_buffers()
    assert transport.cached_bytes() == 0


def test_kept_plans_are_found_by_value_and_split_for_the_buffer_given() -> None:
    transport.release_buffers()
    metas = [_meta(i, (4,), torch.float32) for i in range(6)]
    tensors = [torch.arange(4.0) + i for i in range(6)]
    plan = transport.kept_plan(metas, [False] * 6, 32, 4096)
    assert transport.kept_plan(list(metas), [False] * 6, 32, 4096) is plan  # equal metadata: kept
    assert [b.size for b in plan.buckets] == [32, 32, 32]
    assert transport.kept_plan(metas, [False] * 6, 64, 4096) is not plan  # other buckets
    assert transport.kept_plan(metas, [True] + [False] * 5, 32, 4096) is not plan  # other direct tensors
    other = [*metas[:5], _meta(5, (2, 2), torch.float32)]
    assert transport.kept_plan(other, [False] * 6, 32, 4096) is not plan  # other metadata
    a, b = torch.zeros(32, dtype=torch.uint8), torch.zeros(32, dtype=torch.uint8)
    first = plan.split(a, 1, tensors, lambda i, t: True, True)
    assert plan.split(a, 1, tensors, lambda i, t: True, True) is first
    assert first.indices == [2, 3] and first.views[0].data_ptr() == a.data_ptr()
    second = plan.split(b, 1, tensors, lambda i, t: True, True)  # another buffer: split anew
    assert second is not first and second.views[0].data_ptr() == b.data_ptr()
    assert plan.split(b, 1, tensors, lambda i, t: i != 2, False).indices == [3]  # not uniform: not kept
    assert plan.split(b, 1, tensors, lambda i, t: True, True) is second
    transport.release_buffers()
    assert len(transport._plans) == 0


# -----------------------------------------------------------------------------------------------------------
# Two real gloo ranks


def _tensors(rank: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(source tensors, receiver targets) for direct_bytes = 1024 and bucket_bytes = 256."""
    g = torch.Generator().manual_seed(7)
    src = [
        torch.randn(600, generator=g),  # 0: direct, in place
        torch.randn(10, generator=g),  # 1: bucketed
        torch.randn(7, generator=g).to(torch.bfloat16),  # 2
        torch.randint(-128, 127, (5,), generator=g, dtype=torch.int8),  # 3
        torch.randint(0, 2, (9,), generator=g).bool(),  # 4
        torch.randn(3, generator=g, dtype=torch.complex64),  # 5
        torch.randn((), generator=g, dtype=torch.float64),  # 6: 0-d
        torch.empty(0, 4),  # 7: empty
        torch.randint(-(2**40), 2**40, (100,), generator=g),  # 8: 800 bytes, spans four buckets
        torch.randn(5, 6, generator=g).t(),  # 9: non-contiguous source
        torch.randn(20, 8, generator=g),  # 10: non-contiguous receiver target, spans buckets
        torch.randn(40, 30, generator=g).t(),  # 11: large but non-contiguous source: bucketed
        torch.randn(30, 40, generator=g),  # 12: direct at the source, non-contiguous target: staged
        torch.randn(30, 40, generator=g),  # 13: the same, right after (one temporary at a time)
        torch.randn(4, generator=g, dtype=torch.complex64).conj(),  # 14: lazy conjugate at the source
        torch.randn(512, generator=g, dtype=torch.float16),  # 15: direct, exactly direct_bytes
        torch.randn(13, generator=g, dtype=torch.float16),  # 16: odd byte count
        torch.randn(3, 4, generator=g),  # 17: non-contiguous target inside one bucket
        torch.randn(5, generator=g, dtype=torch.complex128),  # 18: a parameter target (16-byte alignment)
        torch.randn(2, 3, generator=g).t(),  # 19: non-contiguous source inside one bucket
        # 19-23: one run of float32 tensors of different shapes, copied through views of the bucket
        torch.randn(2, 3, generator=g),  # 20
        torch.randn((), generator=g),  # 21: 0-d
        torch.randn(4, generator=g),  # 22
        torch.randn(3, 2, generator=g),  # 23: non-contiguous target inside the run
    ]
    if rank == 0:
        return src, src
    targets = [torch.zeros_like(t.resolve_conj(), memory_format=torch.contiguous_format) for t in src]
    targets[10] = torch.zeros(8, 20).t()
    targets[12] = torch.zeros(40, 30).t()
    targets[13] = torch.zeros(40, 30).t()
    targets[17] = torch.zeros(4, 3).t()
    targets[18] = torch.nn.Parameter(torch.zeros(5, dtype=torch.complex128))
    targets[23] = torch.zeros(2, 3).t()
    return src, targets


def _transfer_checks(rank: int, world: int) -> dict[str, Any]:
    import os

    import elastic.replication.transport.broadcast as transport
    from elastic.replication.comm import Comm

    comm = Comm(None, timedelta(seconds=20), "test")
    cpu = torch.device("cpu")
    out: dict[str, Any] = {}
    chosen = transport.BroadcastTransport()

    def run(tag: str, src: list[torch.Tensor], targets: list[torch.Tensor]) -> list[str]:
        errors: list[str] = []
        metas = [TensorMeta(("t", i), tuple(t.shape), t.dtype, "cpu") for i, t in enumerate(src)]
        direct = chosen.plan(src, comm)
        if rank == 0:
            chosen.send(comm, 0, src, metas, direct, lambda e: errors.append(repr(e)))
        else:
            chosen.receive(comm, 0, targets, metas, direct, lambda e: errors.append(repr(e)))
        out[f"{tag} direct"] = direct
        return errors

    for depth in (1, 2, 3):
        # depth 2: first and last buckets ramp (32 bytes up)
        ramp = 1 if depth == 2 else 4096
        chosen = transport.BroadcastTransport(
            bucket_bytes=256, direct_bytes=1024, in_flight=depth, ramp_min=ramp
        )
        src, targets = _tensors(rank)
        before = [t.clone() for t in src]
        ptrs = [t.data_ptr() for t in targets]
        out[f"errors {depth}"] = run(f"depth {depth}", src, targets)
        if rank == 0:
            out[f"source unchanged {depth}"] = [
                i
                for i, (a, b) in enumerate(zip(src, before))
                if not torch.equal(a.resolve_conj(), b.resolve_conj())
            ]
        else:
            out[f"wrong values {depth}"] = [
                i
                for i, (t, s) in enumerate(zip(targets, src))
                if t.dtype != s.dtype or not torch.equal(t, s.resolve_conj())
            ]
            out[f"moved storage {depth}"] = [
                i for i, (t, p) in enumerate(zip(targets, ptrs)) if t.data_ptr() != p
            ]
            out[f"noncontiguous kept {depth}"] = not any(
                targets[i].is_contiguous() for i in (10, 12, 13, 17, 23)
            )
            out[f"parameter kept {depth}"] = (
                isinstance(targets[18], torch.nn.Parameter) and targets[18].requires_grad
            )
    out["cached"] = [b.data_ptr() for b in transport._buffers[cpu]]
    src, targets = _tensors(rank)
    run("again", src, targets)
    out["cached again"] = [b.data_ptr() for b in transport._buffers[cpu]]
    # The same layout again while the kept buffers are held elsewhere: this transfer takes new buffers, and
    # the kept plan must split them anew (its views of the held buffers would write the wrong memory).
    held = transport._take_buffers(cpu, 1, 0)
    src, targets = _tensors(rank)
    out["new buffers"] = run("new buffers", src, targets)
    out["new buffers values"] = rank == 0 or all(
        torch.equal(t, s.resolve_conj()) for t, s in zip(targets, src)
    )
    out["new buffers taken"] = [b.data_ptr() for b in transport._buffers[cpu]] != out["cached"]
    transport._return_buffers(cpu, held)

    # Local failures go to on_error; the collectives still run to the end on both sides.
    for spec in ("1:bucket 1", "0:bucket 2", "1:direct 1"):
        os.environ["ELASTIC_FAULT"] = spec
        src, targets = _tensors(rank)
        try:
            out[f"fault {spec}"] = run(spec, src, targets)
        finally:
            del os.environ["ELASTIC_FAULT"]
        if rank == 1:
            out[f"fault {spec} bucket 0 written"] = torch.equal(targets[1], src[1])
            out[f"fault {spec} last not written"] = not targets[22].any().item()
    # ...and afterwards the same ranks transfer correctly again.
    src, targets = _tensors(rank)
    out["after faults"] = run("after", src, targets)
    out["after faults values"] = rank == 0 or all(
        torch.equal(t, s.resolve_conj()) for t, s in zip(targets, src)
    )
    return out


@pytest.mark.timeout(120)
def test_transfer_on_two_ranks() -> None:
    source, receiver = run_on_ranks(_transfer_checks, 2)
    direct = source["depth 2 direct"]
    assert [i for i, d in enumerate(direct) if d] == [0, 12, 13, 15]
    for depth in (1, 2, 3):
        assert source[f"errors {depth}"] == [] and receiver[f"errors {depth}"] == []
        assert source[f"source unchanged {depth}"] == []
        assert receiver[f"wrong values {depth}"] == []
        assert receiver[f"moved storage {depth}"] == []
        assert receiver[f"noncontiguous kept {depth}"] and receiver[f"parameter kept {depth}"]
    # the bucket buffers are reused from one transfer to the next (in_flight 3: three of them)
    assert len(receiver["cached"]) == 3 and receiver["cached again"] == receiver["cached"]
    assert len(source["cached"]) == 3 and source["cached again"] == source["cached"]
    for side in (source, receiver):
        assert side["new buffers"] == [] and side["new buffers values"] and side["new buffers taken"]
    # a receiver failing at bucket 1: it reports, keeps receiving, the source notices nothing
    assert source["fault 1:bucket 1"] == []
    assert len(receiver["fault 1:bucket 1"]) == 1 and "rank 1 at bucket 1" in receiver["fault 1:bucket 1"][0]
    assert receiver["fault 1:bucket 1 bucket 0 written"] and receiver["fault 1:bucket 1 last not written"]
    # the source failing while packing bucket 2: it reports, still sends every bucket
    assert len(source["fault 0:bucket 2"]) == 1 and "rank 0 at bucket 2" in source["fault 0:bucket 2"][0]
    assert receiver["fault 0:bucket 2"] == []
    # a receiver failing at a direct broadcast
    assert source["fault 1:direct 1"] == []
    assert len(receiver["fault 1:direct 1"]) == 1 and "rank 1 at direct 1" in receiver["fault 1:direct 1"][0]
    assert source["after faults"] == [] and receiver["after faults"] == [] and receiver["after faults values"]


# -----------------------------------------------------------------------------------------------------------
# The transport seam


def test_broadcast_transport_takes_its_sizes_as_arguments() -> None:
    default = BroadcastTransport()
    assert (default.bucket_bytes, default.direct_bytes, default.in_flight) == (16 * 2**20, 2 * 2**20, 2)
    assert isinstance(default, Transport)
    small = BroadcastTransport(bucket_bytes=64, direct_bytes=8, in_flight=3)
    assert (small.bucket_bytes, small.direct_bytes, small.in_flight) == (64, 8, 3)
    for bad in ({"bucket_bytes": 0}, {"in_flight": 0}, {"direct_bytes": -1}, {"bucket_bytes": 1.5}):
        name = next(iter(bad))
        with pytest.raises(
            ValueError, match=rf"BroadcastTransport\({name}=\.\.\.\) must be an int of at least"
        ):
            BroadcastTransport(**bad)  # type: ignore[arg-type]


def test_default_transport_can_be_replaced() -> None:
    import elastic.replication.transport.default as transports
    from elastic.replication.transport.cma import CrossMemoryTransport
    from elastic.replication.transport.shm import SharedMemoryTransport

    # reads from the source's memory, else the shared-memory ring, else the broadcasts
    assert transports.default_transport() == CrossMemoryTransport()
    assert transports.default_transport().fallback == SharedMemoryTransport()  # type: ignore[attr-defined]
    mine = BroadcastTransport(bucket_bytes=1024)
    previous = transports.set_default_transport(mine)
    try:
        assert transports.default_transport() is mine
        with pytest.raises(TypeError, match="set_default_transport\\(\\) needs a Transport"):
            transports.set_default_transport(object())  # type: ignore[arg-type]
        assert transports.default_transport() is mine
    finally:
        assert transports.set_default_transport(previous) is mine
    assert transports.default_transport() is previous


def test_device_for_follows_the_placement() -> None:
    from elastic._util.placement import Placement
    from elastic.replication.comm import Comm

    comm = Comm.__new__(Comm)
    comm.placement = Placement(torch.device("cpu"))
    chosen = BroadcastTransport()
    assert chosen.device_for(_meta(0, (2,), torch.float32), comm) == torch.device("cpu")
    assert chosen.device_for(TensorMeta(("t", 1), (2,), torch.float32, "meta"), comm) == torch.device("cpu")


def test_public_fallbacks_match_the_private_torch_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    like = [torch.zeros(2, 3), torch.zeros(()), torch.zeros(0, 4), torch.zeros(4)]
    flat = torch.arange(11, dtype=torch.float32)
    fast = list(torch._C._nn.unflatten_dense_tensors(flat, like))
    slow = transport.unflatten_public(flat, like)
    assert [t.shape for t in slow] == [t.shape for t in fast] == [(2, 3), (), (0, 4), (4,)]
    assert all(torch.equal(a, b) for a, b in zip(fast, slow))
    assert slow[0].data_ptr() == flat.data_ptr()  # views, not copies
    dests, srcs = [torch.zeros(3), torch.zeros(2, 2).t()], [torch.ones(3), torch.arange(4.0).view(2, 2)]
    transport.copy_all_public(dests, srcs)
    assert torch.equal(dests[0], srcs[0]) and torch.equal(dests[1], srcs[1])
    # with the private calls missing, the transport's helpers give the same results
    monkeypatch.setattr(transport, "_UNFLATTEN", transport.unflatten_public)
    monkeypatch.setattr(transport, "_FOREACH_COPY", transport.copy_all_public)
    views = transport._unflatten(flat, like)
    assert all(torch.equal(a, b) for a, b in zip(views, fast))
    dests = [torch.zeros(3), torch.zeros(2)]
    transport._copy_all(dests, [torch.ones(3), torch.full((2,), 2.0)])
    assert dests[0].tolist() == [1.0] * 3 and dests[1].tolist() == [2.0, 2.0]
