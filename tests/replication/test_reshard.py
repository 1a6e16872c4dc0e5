"""Resharding in memory, the planner on regions alone (the whole path runs on real ranks in
`tests/recovery/test_run_sharded.py`: 2x2 -> 1x3 -> 2x2 under `elastic.run`, and with snapshots in
`tests/recovery/test_run_snapshots.py`)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from elastic import SyncError
from elastic.replication.reshard import Offer, Region, elect_held, plan

pytestmark = pytest.mark.timeout(180)


def region(offset: int, rows: int, total: int = 8, path: tuple[str, ...] = ("w",)) -> Region:
    return Region(path, (total, 2), "torch.float32", (offset, 0), (rows, 2))


def live(tenure: int, *regions: Region, layout: int = 0) -> Offer:
    return Offer(tenure, layout, regions)


def snap(tenure: int, *regions: Region, layout: int = 0) -> Offer:
    return Offer(tenure, layout, regions, snapshot=True)


def rows(moves: Sequence, dst: int) -> list[tuple[int, int, int, int]]:
    """(first row, rows, source rank, source offer) of every move into `dst`, in row order."""
    return sorted((m.box[0][0], m.box[1][0], m.src, m.offer) for m in moves if m.dst == dst)


def test_each_region_comes_from_one_holder_itself_first() -> None:
    held = [[live(5, region(0, 4))], [live(5, region(4, 4))], [live(5, region(0, 4))], []]
    wanted = [[region(0, 3)], [region(3, 3)], [region(6, 2)], [region(0, 0)]]
    tenure, moves, sender = plan(wanted, held)
    assert (tenure, sender) == (5, 0)
    by_dst = {d: sorted((m.src, m.box) for m in moves if m.dst == d) for d in range(4)}
    assert by_dst[0] == [(0, ((0, 0), (3, 2)))]  # its own rows, locally
    assert by_dst[1] == [(0, ((3, 0), (1, 2))), (1, ((4, 0), (2, 2)))] or by_dst[1] == [
        (1, ((4, 0), (2, 2))),
        (2, ((3, 0), (1, 2))),
    ]
    assert by_dst[2] == [(1, ((6, 0), (2, 2)))]
    assert by_dst[3] == []
    covered = sum(m.box[1][0] for m in moves)
    assert covered == 8  # every row once


def test_a_version_nobody_holds_whole_is_refused_and_an_older_whole_one_wins() -> None:
    wanted = [[region(0, 4)], [region(4, 4)]]
    with pytest.raises(SyncError, match=r"the live pieces at tenure 5 .* lack w\[4:8, 0:2\].*ckpt=") as info:
        plan(wanted, [[live(5, region(0, 4))], []])
    assert "no rank holds a snapshot" in str(info.value)
    held = [[live(6, region(0, 4))], [live(5, region(0, 4))], [live(5, region(4, 4))], []]
    tenure, _, sender = plan(wanted, held)
    assert (tenure, sender) == (5, 1)


# --------------------------------------------------------------------------------------------------------
# Snapshots as holders (pure FSDP, 3 ranks with 3 rows each of 9; rank 2 lost after step 12, snapshot at
# 10: every rank holds its own pieces of step 10 and a copy of its predecessor's on the ring)


def survivors_after_step_12() -> list[list[Offer]]:
    a, b, c = region(0, 3, 9), region(3, 3, 9), region(6, 3, 9)
    return [
        [live(12, a), snap(10, a), snap(10, c)],  # rank 0: live, own snapshot, copy of rank 2's
        [live(12, b), snap(10, b), snap(10, a)],  # rank 1: live, own snapshot, copy of rank 0's
    ]


def test_snapshots_of_the_survivors_and_of_the_lost_ranks_pieces_form_a_version() -> None:
    offers = survivors_after_step_12()
    tenure, holders = elect_held(offers)
    assert tenure == 10  # the live pieces of 12 lack rank 2's rows: the snapshot of 10 is whole
    assert holders == [(0, 1), (0, 2), (1, 1), (1, 2)]
    wanted = [[region(0, 5, 9)], [region(5, 4, 9)]]
    _, moves, sender = plan(wanted, offers)
    assert sender == 0
    assert rows(moves, 0) == [(0, 3, 0, 1), (3, 2, 1, 1)]  # its own snapshot locally, rank 1's snapshot
    assert rows(moves, 1) == [(5, 1, 1, 1), (6, 3, 0, 2)]  # rank 2's rows: the copy rank 0 holds
    assert sum(n for d in (0, 1) for _, n, _, _ in rows(moves, d)) == 9  # every row once


def test_live_pieces_win_over_snapshots_of_the_same_version_and_over_older_ones() -> None:
    a, b, c = region(0, 3, 9), region(3, 3, 9), region(6, 3, 9)
    # the fault struck right after the snapshot: live pieces and snapshots both at 10, one layout
    offers = [[live(10, a), snap(10, a), snap(10, c)], [live(10, b), snap(10, b), snap(10, a)]]
    assert elect_held(offers)[0] == 10
    _, moves, _ = plan([[region(0, 5, 9)], [region(5, 4, 9)]], offers)
    assert rows(moves, 0) == [(0, 3, 0, 0), (3, 2, 1, 0)]  # live pieces (offer 0), not the snapshots
    assert rows(moves, 1) == [(5, 1, 1, 0), (6, 3, 0, 2)]  # only rank 2's rows from a snapshot
    # every position alive: the live version of 12 wins over the snapshot of 10
    offers = [[live(12, a), snap(10, a)], [live(12, b), snap(10, b)], [live(12, c), snap(10, c)]]
    assert elect_held(offers) == (12, [(0, 0), (1, 0), (2, 0)])


def test_pieces_of_two_meshes_never_combine_into_one_version() -> None:
    # tenure 5 held as rows 0:4 of generation 0's mesh and rows 3:8 of generation 1's: together they cover
    # every row, but they are cut differently (overlapping boxes): neither version is whole
    offers = [[live(5, region(0, 4), layout=0)], [live(5, region(3, 5), layout=1)]]
    with pytest.raises(SyncError, match=r"generation 1's mesh\) lack w\[0:3, 0:2\]"):
        elect_held(offers)
    # at one tenure, whole in two layouts: live pieces first, then the newest layout
    both = [[live(5, region(0, 8), layout=0), snap(5, region(0, 8), layout=1)]]
    assert elect_held(both) == (5, [(0, 0)])
    both = [[snap(5, region(0, 8), layout=0), snap(5, region(0, 8), layout=1)]]
    assert elect_held(both) == (5, [(0, 1)])


def test_no_whole_version_names_the_live_and_the_snapshot_slices_missing() -> None:
    a, b = region(0, 3, 9), region(3, 3, 9)
    # rank 2 and its successor's copy of it are gone: neither 12 nor 10 is whole
    offers = [[live(12, a), snap(10, a)], [live(12, b), snap(10, b), snap(10, a)]]
    with pytest.raises(SyncError) as info:
        elect_held(offers)
    text = str(info.value)
    assert "held whole by the 2 live rank(s)" in text
    assert "the live pieces at tenure 12 (generation 0's mesh) lack w[6:9, 0:2]" in text
    assert "the most tenured snapshot at tenure 10 (generation 0's mesh) lack w[6:9, 0:2]" in text
    assert "snapshot_every=k" in text and "ckpt=" in text and "'replicate'" in text
    assert info.value.op == "reshard"


def test_missing_slices_of_a_2d_sharded_tensor_are_named_as_boxes() -> None:
    def box(r: int, c: int) -> Region:
        return Region(("t",), (4, 6), "torch.float32", (2 * r, 3 * c), (2, 3))

    offers = [[live(3, box(0, 0), box(0, 1))], [live(3, box(1, 0))]]
    with pytest.raises(SyncError, match=r"lack t\[2:4, 3:6\]"):
        elect_held(offers)
