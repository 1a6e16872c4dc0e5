"""Resharding in memory, the planner on regions alone (the whole path runs on real ranks in
`tests/recovery/test_run_sharded.py`: 2x2 -> 1x3 -> 2x2 under `elastic.run`)."""

from __future__ import annotations

import pytest

from elastic import SyncError
from elastic.replication.reshard import Region, plan

pytestmark = pytest.mark.timeout(180)


def region(offset: int, rows: int, total: int = 8, path: tuple[str, ...] = ("w",)) -> Region:
    return Region(path, (total, 2), "torch.float32", (offset, 0), (rows, 2))


def test_each_region_comes_from_one_holder_itself_first() -> None:
    held = [[region(0, 4)], [region(4, 4)], [region(0, 4)], None]
    wanted = [[region(0, 3)], [region(3, 3)], [region(6, 2)], [region(0, 0)]]
    tenure, moves, sender = plan(wanted, held, [5, 5, 5, None])
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
    with pytest.raises(SyncError, match=r"nobody holds all of w \(8/16 elements\).*ckpt="):
        plan(wanted, [[region(0, 4)], None], [5, None])
    tenure, _, sender = plan(wanted, [[region(0, 4)], [region(0, 4)], [region(4, 4)], None], [6, 5, 5, None])
    assert (tenure, sender) == (5, 1)
