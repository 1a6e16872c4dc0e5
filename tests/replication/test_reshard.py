"""Resharding in memory: a 2x2 HSDP state on 4 ranks loses rank 3 and fills a 1x3 state on the survivors
from their pieces (one of them a newcomer), bit for bit; and the planner on regions alone."""

from __future__ import annotations

import os
from typing import Any

import pytest

from dist_harness import run_on_ranks
from elastic import SyncError
from elastic.replication.reshard import Region, plan

pytestmark = pytest.mark.timeout(180)


def _survivors(rank: int, world: int, store: str) -> Any:
    import torch.distributed as dist

    from elastic.replication.collective import Collective
    from elastic.replication.reshard import hold, reshard
    from sharded_model import build, differences, full, mesh_for, train

    old = build(mesh_for(4))
    train(old, 3)
    before = full(old)
    held = hold(old, old.step) if rank != 2 else None  # rank 2 comes back as a newcomer
    dist.destroy_process_group()  # the old mesh's groups are gone; the pieces stay
    if rank == 3:
        return None
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=3)
    new = build(mesh_for(3), seed=50 + rank)
    own = 3 * sum(p._local_tensor.numel() * 4 for p in new.model.parameters())  # with Adam's moments
    own += new.table._local_tensor.numel() * 4
    tenure, received, sender = reshard(new, held, Collective.of(None, None, "reshard"))
    return tenure, received, own, sender, differences(before, full(new))


def test_survivors_fill_a_new_mesh_from_their_pieces_bit_for_bit(tmp_path: Any) -> None:
    results = run_on_ranks(_survivors, 4, args=(os.fspath(tmp_path / "store"),), timeout=150, allow_exit=True)
    assert results[3] is None
    for tenure, received, own, sender, diff in results[:3]:
        assert (tenure, sender, diff) == (3, 0, [])
        assert received <= own  # every byte at most once
    assert results[2][1] > 0  # the newcomer received everything it holds
    assert results[0][1] < results[2][1]  # a survivor keeps what it already held


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
