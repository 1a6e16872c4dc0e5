"""Snapshots' ring on in-process fake groups (threads and queues, no sockets): what counts, what is kept.

Three "ranks" of a pure-FSDP state (rows 0:3, 3:6, 6:9 of one tensor) take rounds; a round's copy counts
only once it is whole on its holder, the previous round is dropped only once every rank holds the new one,
and the election (`elect_held`) over what the survivors hold then finds the newest whole version. The ring
on real processes runs in `tests/recovery/test_run_snapshots.py`.
"""

from __future__ import annotations

import queue
import threading
from collections import defaultdict
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch

from elastic.replication import snapshot
from elastic.replication.reshard import Held, Region, elect_held
from elastic.replication.snapshot import Snapshots, ring_peers, unpack
from elastic.state.shards import Layout

pytestmark = pytest.mark.timeout(60)

TIMEOUT = timedelta(seconds=5)


class _Work:
    def __init__(self, fn: Callable[[], None] = lambda: None) -> None:
        self._fn = fn

    def wait(self, timeout: Any = None) -> bool:
        self._fn()
        return True


class Wire:
    """What the fake groups of one "world" share: a queue per (src, dst, tag), an all-reduce barrier."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.queues: dict[tuple[int, int, int], queue.Queue[torch.Tensor]] = defaultdict(queue.Queue)
        self.lock = threading.Lock()
        self.barrier = threading.Barrier(size, timeout=TIMEOUT.total_seconds())
        self.values: dict[int, int] = {}


class FakeGroup:
    """`send`/`recv`/`allreduce` (MIN) like a torch ProcessGroup's; `fail_recv(tag)` makes a receive of
    that tag fail after half its bytes have landed (a fault mid-transfer); `hold_recv` blocks receives
    until released."""

    def __init__(self, wire: Wire, rank: int) -> None:
        self.wire, self.rank = wire, rank
        self.fail_tag: int | None = None
        self.hold = threading.Event()
        self.hold.set()

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> _Work:
        self.wire.queues[(self.rank, dst, tag)].put(tensors[0].clone())
        return _Work()

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> _Work:
        def run() -> None:
            assert self.hold.wait(TIMEOUT.total_seconds())
            data = self.wire.queues[(src, self.rank, tag)].get(timeout=TIMEOUT.total_seconds())
            if tag == self.fail_tag:
                half = data.numel() // 2
                tensors[0][:half].copy_(data[:half])
                raise RuntimeError("Connection closed by peer")
            tensors[0].copy_(data)

        return _Work(run)

    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> _Work:
        def run() -> None:
            with self.wire.lock:
                self.wire.values[self.rank] = int(tensors[0].item())
            self.wire.barrier.wait()
            tensors[0].fill_(min(self.wire.values.values()))
            self.wire.barrier.wait()

        return _Work(run)


ROWS = [Region(("w",), (9, 2), "torch.float32", (3 * r, 0), (3, 2)) for r in range(3)]


def fake_pack(state: Any, tenure: Any, layout: int, rank: int) -> tuple[Held, torch.Tensor]:
    """What `pack` makes of a state, for rank `rank`'s rows of `w`, valued by the tenure and the rank."""
    local = torch.full((3, 2), float(10 * tenure + rank))
    return snapshot.pack_pieces([ROWS[rank]], [local], {"step": tenure}, tenure, layout, rank)


@pytest.fixture
def world(monkeypatch: pytest.MonkeyPatch) -> tuple[list[Snapshots], list[FakeGroup]]:
    monkeypatch.setattr(snapshot, "pack", fake_pack)
    wire = Wire(3)
    groups = [FakeGroup(wire, r) for r in range(3)]
    snaps = [Snapshots() for _ in range(3)]
    for r in range(3):
        snaps[r].open(groups[r], r, ((r + 1) % 3, (r - 1) % 3), 0, TIMEOUT)
    return snaps, groups


def take(snaps: list[Snapshots], tenure: int) -> None:
    for s in snaps:
        s.take(None, tenure)
    for s in snaps:
        assert s._thread is not None
        s._thread.join(10)


def kinds(s: Snapshots) -> list[tuple[Any, str | None]]:
    return sorted((h.tenure, h.snapshot) for h in s.held())


def test_rounds_commit_and_keep_one_snapshot_each_own_and_copy(world: Any) -> None:
    snaps, _ = world
    take(snaps, 5)
    take(snaps, 10)
    for r, s in enumerate(snaps):
        assert kinds(s) == [(10, f"copy of rank {(r - 1) % 3}"), (10, "own")]  # round 5 dropped
        copy = next(h for h in s.held() if h.snapshot != "own")
        assert copy.regions == [ROWS[(r - 1) % 3]] and copy.plain == {"step": 10} and copy.layout == 0
        assert torch.equal(copy.tensors[0], torch.full((3, 2), 100.0 + (r - 1) % 3))  # the peer's values
    assert snaps[0].nbytes == 2 * 3 * 2 * 4
    # rank 2 lost: the survivors' snapshots and rank 0's copy of rank 2 make the step-10 version whole
    offers = [[h.offer() for h in s.held()] for s in snaps[:2]]
    assert elect_held(offers)[0] == 10


def test_a_copy_cut_off_mid_transfer_never_counts_and_the_previous_round_stays(world: Any) -> None:
    snaps, groups = world
    take(snaps, 5)
    groups[1].fail_tag = 1  # rank 1's receive of rank 0's pieces breaks halfway
    take(snaps, 10)
    # rank 1 holds its own pieces of 10 but no copy of 10; nobody committed round 10, so round 5 stays
    assert kinds(snaps[1]) == [(5, "copy of rank 0"), (5, "own"), (10, "own")]
    assert kinds(snaps[0]) == [(5, "copy of rank 2"), (5, "own"), (10, "copy of rank 2"), (10, "own")]
    # rank 0 lost: its rows of 10 are nowhere whole (rank 1's copy was cut off): back to 5, whole
    offers = [[h.offer() for h in s.held()] for s in snaps[1:]]
    tenure, holders = elect_held(offers)
    assert tenure == 5
    assert all(offers[r][i].tenure == 5 for r, i in holders)
    # the next round commits and drops everything older, the half-made round included
    groups[1].fail_tag = None
    take(snaps, 15)
    assert all(sorted(t for t, _ in kinds(s)) == [15, 15] for s in snaps)


def test_a_round_abandoned_by_the_end_of_its_generation_installs_nothing_more(world: Any) -> None:
    snaps, groups = world
    take(snaps, 5)
    groups[2].hold.clear()  # rank 2's copy is still on its way when its generation ends
    for s in snaps:
        s.take(None, 10)
    snaps[2].close(wait=False)
    groups[2].hold.set()
    for s in snaps:
        if s._thread is not None:
            s._thread.join(10)
    threads = [t for t in threading.enumerate() if t.name == "elastic-snapshot"]
    for t in threads:
        t.join(10)
    assert kinds(snaps[2]) == [(5, "copy of rank 1"), (5, "own"), (10, "own")]  # its copy came too late
    assert (5, "own") in kinds(snaps[0])  # and so nobody committed round 10


def test_a_new_round_keeps_only_the_newest_committed_one() -> None:
    s = Snapshots()
    old, _ = fake_pack(None, 5, 0, 0)
    half, _ = fake_pack(None, 10, 0, 0)
    s._entries = [snapshot._Entry(old, 1, committed=True), snapshot._Entry(half, 2)]
    assert [e.round for e in s._keep_newest()] == [1]
    s._entries = [snapshot._Entry(half, 2)]
    assert [e.round for e in s._keep_newest()] == [2]


def test_settle_drops_a_timeline_given_up_and_keeps_the_snapshot_used() -> None:
    s = Snapshots()
    five, ten = fake_pack(None, 5, 0, 0)[0], fake_pack(None, 10, 0, 0)[0]
    s._entries = [snapshot._Entry(five, 1, committed=True), snapshot._Entry(ten, 2)]
    s.settle(5, from_snapshot=False)  # filled at 5 (a checkpoint): the snapshot of 10 is of another future
    assert [h.tenure for h in s.held()] == [5]
    s._entries = [snapshot._Entry(five, 1, committed=True), snapshot._Entry(ten, 2)]
    s.settle(10, from_snapshot=True)  # filled from the snapshot of 10: it is whole, the older one goes
    assert [(e.held.tenure, e.committed) for e in s._entries] == [(10, True)]


def test_a_snapshot_buffer_round_trips_any_dtype_and_empty_pieces() -> None:
    regions = [
        Region(("a",), (4, 3), "torch.float16", (0, 0), (1, 3)),
        Region(("b",), (5,), "torch.int64", (0,), (0,)),
        Region(("c",), (), "torch.bool", (), ()),
        Region(("d",), (2, 2), "torch.float64", (0, 0), (2, 2)),
    ]
    tensors = [
        torch.tensor([[1.5, -2.0, 3.25]], dtype=torch.float16),
        torch.empty(0, dtype=torch.int64),
        torch.tensor(True),
        torch.arange(4, dtype=torch.float64).reshape(2, 2).t(),  # not contiguous
    ]
    own, buf = snapshot.pack_pieces(regions, tensors, {"step": 3, "note": "x"}, 3, 7, 1)
    copy = unpack(buf.clone())
    for held in (own, copy):
        assert held.tenure == 3 and held.layout == 7 and held.plain == {"step": 3, "note": "x"}
        assert held.regions == regions
        for got, want in zip(held.tensors, tensors):
            assert got.dtype == want.dtype and torch.equal(got, want)
    assert copy.snapshot == "copy of rank 1" and own.snapshot == "own"
    tensors[0].fill_(0)  # the snapshot is a copy: training goes on
    assert copy.tensors[0][0, 0] == 1.5 and own.tensors[0][0, 0] == 1.5


def test_ring_peers_go_to_the_next_shard_position_outside_the_replica_set() -> None:
    flat = Layout((3,), ("shard",), {0: (0,), 1: (1,), 2: (2,)})
    assert [ring_peers(flat, r) for r in range(3)] == [(1, 2), (2, 0), (0, 1)]
    hsdp = Layout((2, 2), ("replicate", "shard"), {0: (0,), 1: (1,), 2: (0,), 3: (1,)})
    assert [ring_peers(hsdp, r) for r in range(4)] == [(1, 1), (0, 0), (3, 3), (2, 2)]
    replicas_only = Layout((2, 1), ("replicate", "shard"), {0: (0,), 1: (0,)})
    assert ring_peers(replicas_only, 0) is None
