"""Snapshots' ring on in-process fake groups (threads and queues, no sockets): what counts, what is kept.

Three "ranks" of a pure-FSDP state (rows 0:3, 3:6, 6:9 of one tensor) take rounds; a round's copy counts
only once it is whole on its holder, the previous round is dropped only once every rank holds the new one,
and the election (`elect_held`) over what the survivors hold then finds the newest whole version. The ring
on real processes runs in `tests/recovery/test_run_snapshots.py`.
"""

from __future__ import annotations

import queue
import threading
import time
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

pytestmark = pytest.mark.timeout(120)

#: Generous: on a loaded 2-core CI a thread may wait seconds for the GIL; no test here waits it out (the
#: deadline tests pass their own short one).
TIMEOUT = timedelta(seconds=20)
JOIN = 30.0


class _Work:
    """A pending operation: it completes in the background; `wait(timeout)` raises when it has not by
    then (like gloo's), leaving it pending."""

    def __init__(self, fn: Callable[[], None]) -> None:
        self.done = threading.Event()
        self.error: BaseException | None = None

        def run() -> None:
            try:
                fn()
            except BaseException as exc:
                self.error = exc
            self.done.set()

        threading.Thread(target=run, daemon=True).start()

    def wait(self, timeout: timedelta) -> bool:
        if not self.done.wait(timeout.total_seconds()):
            raise RuntimeError(f"Timed out waiting {timeout} for a fake operation")
        if self.error is not None:
            raise self.error
        return True


class Wire:
    """What the fake groups of one "world" share: a queue per (src, dst, tag), the all-reduces by their
    sequence number on each rank (like gloo's: the k-th of every rank reduce together)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.queues: dict[tuple[int, int, int], queue.Queue[torch.Tensor]] = defaultdict(queue.Queue)
        self.cond = threading.Condition()
        self.values: dict[int, dict[int, int]] = defaultdict(dict)

    def queue(self, src: int, dst: int, tag: int) -> queue.Queue[torch.Tensor]:
        """The queue of (src, dst, tag), made once under the lock: a defaultdict's miss runs Python code
        (Queue()), so a sender and a receiver that missed it together could each make one, and the
        message went into the queue the other overwrote (a fake op waiting out its 20 s on a loaded CI)."""
        with self.cond:
            return self.queues[(src, dst, tag)]


class FakeGroup:
    """`send`/`recv`/`allreduce` (MIN) like a torch ProcessGroup's; `fail_buffers` makes a receive of a
    snapshot buffer fail after half its bytes have landed (a fault mid-transfer); `hold` (cleared) keeps
    receives pending until set; `abort()` fails every pending receive."""

    def __init__(self, wire: Wire, rank: int) -> None:
        self.wire, self.rank = wire, rank
        self.fail_buffers = False
        self.hold = threading.Event()
        self.hold.set()
        self.aborted = threading.Event()
        self.reduces = 0
        self.tags: list[int] = []

    def _until(self, ready: Callable[[], bool]) -> None:
        while not ready():
            if self.aborted.is_set():
                raise RuntimeError("the group was aborted")
            time.sleep(0.005)

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> _Work:
        self.wire.queue(self.rank, dst, tag).put(tensors[0].clone())
        return _Work(lambda: None)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> _Work:
        self.tags.append(tag)
        fail = self.fail_buffers and tag % 2 == 1

        def run() -> None:
            self._until(self.hold.is_set)
            q = self.wire.queue(src, self.rank, tag)
            self._until(lambda: not q.empty())
            data = q.get()
            if fail:
                half = data.numel() // 2
                tensors[0][:half].copy_(data[:half])
                raise RuntimeError("Connection closed by peer")
            tensors[0].copy_(data)

        return _Work(run)

    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> _Work:
        self.reduces += 1
        seq, wire = self.reduces, self.wire
        with wire.cond:
            wire.values[seq][self.rank] = int(tensors[0].item())

        def run() -> None:
            self._until(lambda: len(wire.values[seq]) == wire.size)
            tensors[0].fill_(min(wire.values[seq].values()))

        return _Work(run)

    def abort(self) -> None:
        self.aborted.set()


ROWS = [Region(("w",), (9, 2), "torch.float32", (3 * r, 0), (3, 2)) for r in range(3)]


def fake_pack(state: Any, tenure: Any, layout: int, rank: int) -> tuple[Held, torch.Tensor]:
    """What `pack` makes of a state, for rank `rank`'s rows of `w`, valued by the tenure and the rank."""
    local = torch.full((3, 2), float(10 * tenure + rank))
    return snapshot.pack_pieces([ROWS[rank]], [local], {"step": tenure}, tenure, layout, rank)


def make_world(
    monkeypatch: pytest.MonkeyPatch, timeout: timedelta = TIMEOUT
) -> tuple[list[Snapshots], list[FakeGroup]]:
    monkeypatch.setattr(snapshot, "pack", fake_pack)
    wire = Wire(3)
    groups = [FakeGroup(wire, r) for r in range(3)]
    snaps = [Snapshots() for _ in range(3)]
    for r in range(3):
        snaps[r].open(groups[r], r, ((r + 1) % 3, (r - 1) % 3), 0, timeout)
    return snaps, groups


@pytest.fixture
def world(monkeypatch: pytest.MonkeyPatch) -> tuple[list[Snapshots], list[FakeGroup]]:
    return make_world(monkeypatch)


def take(snaps: list[Snapshots], tenure: int) -> None:
    for s in snaps:
        s.take(None, tenure)
    for s in snaps:
        assert s._thread is not None
        s._thread.join(JOIN)


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
    groups[1].fail_buffers = True  # rank 1's receive of rank 0's pieces breaks halfway
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
    groups[1].fail_buffers = False
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
            s._thread.join(JOIN)
    threads = [t for t in threading.enumerate() if t.name == "elastic-snapshot"]
    for t in threads:
        t.join(JOIN)
    assert kinds(snaps[2]) == [(5, "copy of rank 1"), (5, "own"), (10, "own")]  # its copy came too late
    assert (5, "own") in kinds(snaps[0])  # and so nobody committed round 10
    assert groups[2].aborted.is_set() and not groups[0].aborted.is_set()  # its sockets close
    abandoned = snaps[2]._abandoned
    assert abandoned is not None and not abandoned.thread.is_alive()
    snaps[2].open(groups[2], 2, (0, 1), 1, TIMEOUT)  # the next generation joins it and lets go
    assert snaps[2]._abandoned is None and snaps[2]._thread is None


def test_a_receive_past_the_round_deadline_fails_that_round_everywhere_and_the_next_pairs_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    snaps, groups = make_world(monkeypatch, timedelta(seconds=2))
    take(snaps, 5)
    groups[2].hold.clear()  # rank 2's receives of round 10 outlast the round's deadline, left pending
    take(snaps, 10)
    for s in snaps:  # nobody committed round 10, and nobody stopped taking rounds
        assert (5, "own") in kinds(s) and (10, "own") in kinds(s)
    groups[2].hold.set()  # the pending receives of round 10 now complete: they must not feed round 15
    take(snaps, 15)
    for r, s in enumerate(snaps):
        assert kinds(s) == [(15, f"copy of rank {(r - 1) % 3}"), (15, "own")]
    copy = next(h for h in snaps[2].held() if h.snapshot != "own")
    assert torch.equal(copy.tensors[0], torch.full((3, 2), 151.0))
    assert len(set(groups[2].tags)) == len(groups[2].tags)  # every message of every round its own tag


def test_a_copy_of_another_tenure_is_never_installed(world: Any) -> None:
    snaps, _ = world
    snaps[0].take(None, 10)  # rank 0 copies another step than its peers
    for s in snaps[1:]:
        s.take(None, 15)
    for s in snaps:
        assert s._thread is not None
        s._thread.join(JOIN)
    assert kinds(snaps[1]) == [(15, "own")]  # rank 0's pieces of 10 are not rank 1's copy of round 15
    assert kinds(snaps[0]) == [(10, "own")]


def test_a_new_round_keeps_only_the_newest_committed_one() -> None:
    s = Snapshots()
    old, _ = fake_pack(None, 5, 0, 0)
    half, _ = fake_pack(None, 10, 0, 0)
    s._entries = [snapshot._Entry(old, 1, committed=True), snapshot._Entry(half, 2)]
    assert [e.round for e in s._keep_newest()] == [1]
    s._entries = [snapshot._Entry(half, 2)]
    assert [e.round for e in s._keep_newest()] == [2]
    # round 2 whole here (own and copy) but its commit unseen: a peer may have seen it commit; round 3
    # (own only) goes
    copy = unpack(fake_pack(None, 10, 0, 2)[1])
    newer, _ = fake_pack(None, 15, 0, 0)
    s._entries = [
        snapshot._Entry(old, 1, committed=True),
        snapshot._Entry(half, 2),
        snapshot._Entry(copy, 2),
        snapshot._Entry(newer, 3),
    ]
    assert [(e.round, e.held.snapshot) for e in s._keep_newest()] == [
        (1, "own"),
        (2, "own"),
        (2, "copy of rank 2"),
    ]


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


def test_a_failed_copy_or_a_torn_state_withholds_the_commit_and_the_ring_goes_on(
    world: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    snaps, _ = world
    take(snaps, 5)

    def broken(state: Any, tenure: Any, layout: int, rank: int) -> tuple[Held, torch.Tensor]:
        if rank == 1:
            raise RuntimeError("CUDA error: out of memory")
        return fake_pack(state, tenure, layout, rank)

    monkeypatch.setattr(snapshot, "pack", broken)
    with caplog.at_level("WARNING", logger="elastic"):
        take(snaps, 10)
    assert "copying this rank's pieces failed (RuntimeError: CUDA error: out of memory)" in caplog.text
    assert all((5, "own") in kinds(s) for s in snaps)  # round 10 committed nowhere
    assert (10, "copy of rank 1") not in kinds(snaps[2])  # rank 1 sent nothing to copy
    monkeypatch.setattr(snapshot, "pack", fake_pack)
    for s in snaps:  # rank 0's state is torn: it sends nothing and withholds the commit
        s.take(None, None if s is snaps[0] else 15)
    for s in snaps:
        assert s._thread is not None
        s._thread.join(JOIN)
    assert all((5, "own") in kinds(s) for s in snaps) and (15, "own") not in kinds(snaps[0])
    take(snaps, 20)  # the messages still pair up: the next round commits everywhere
    for r, s in enumerate(snaps):
        assert kinds(s) == [(20, f"copy of rank {(r - 1) % 3}"), (20, "own")]


def test_close_waiting_for_a_round_that_outlives_its_timeout_warns(
    world: Any, caplog: pytest.LogCaptureFixture
) -> None:
    snaps, groups = world
    release = threading.Event()
    stuck = threading.Thread(target=release.wait, name="elastic-snapshot", daemon=True)
    stuck.start()
    snaps[0]._flight = snapshot._Round(stuck, time.monotonic(), 0.2)
    snaps[0]._ring_round = 4
    with caplog.at_level("WARNING", logger="elastic"):
        snaps[0].close(wait=True)
    release.set()
    assert "round 4 did not end within its timeout of 0:00:20" in caplog.text
    assert groups[0].aborted.is_set()
