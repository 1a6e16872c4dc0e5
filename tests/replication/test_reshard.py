"""Resharding in memory, the planner on regions alone (the whole path runs on real ranks in
`tests/recovery/test_run_sharded.py`: 2x2 -> 1x3 -> 2x2 under `elastic.run`, and with snapshots in
`tests/recovery/test_run_snapshots.py`); what a receiver reads of a box; and on three gloo ranks the
reads from the holders' memory against the all-to-all, a refusal or a failed read on one rank, and pieces
held as they are."""

from __future__ import annotations

import math
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import pytest
import torch

from elastic import SyncError
from elastic.replication.reshard import Box, Offer, Region, elect_held, plan

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


# --------------------------------------------------------------------------------------------------------
# Runs of memory: what a receiver reads of a box, from a piece into a piece


def _box_copy(
    global_shape: tuple[int, ...], src_box: Box, dst_box: Box, part: Box, *, dst_view: bool = False
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The region `part` of a tensor, read by `_runs` + `read_regions` (from this process's own memory)
    out of a piece holding `src_box` into a piece holding `dst_box`; the target, what it should be, and
    the number of runs. `dst_view`: the target is a column slice of a wider tensor (strided rows)."""
    import os

    from elastic.replication.reshard import _merge_runs, _runs
    from elastic.replication.transport.cma import read_regions

    whole = torch.arange(math.prod(global_shape), dtype=torch.float64).reshape(global_shape)

    def cut(box: Box) -> tuple[slice, ...]:
        return tuple(slice(o, o + n) for o, n in zip(*box))

    src = whole[cut(src_box)].clone()
    if dst_view:
        wide = torch.full((dst_box[1][0], dst_box[1][1] + 3), -1.0, dtype=torch.float64)
        dst = wide[:, 1 : 1 + dst_box[1][1]]
    else:
        dst = torch.full(dst_box[1], -1.0, dtype=torch.float64)
    pairs = _merge_runs(
        _runs(part, 8, (src.data_ptr(), src.stride()), src_box[0], (dst.data_ptr(), dst.stride()), dst_box[0])
    )
    read_regions(os.getpid(), [(d, n) for _, d, n in pairs], [(s, n) for s, _, n in pairs])
    want = torch.full(dst_box[1], -1.0, dtype=torch.float64)
    local = tuple(slice(o - b, o - b + n) for o, b, n in zip(part[0], dst_box[0], part[1]))
    want[local] = whole[cut(part)]
    return dst, want, len(pairs)


def test_a_row_block_is_one_run_and_a_column_block_one_run_per_row() -> None:
    # Shard(0): rows 3:5 of a 9x4 tensor, from the piece of rows 0:5 into the piece of rows 3:6
    got, want, count = _box_copy((9, 4), ((0, 0), (5, 4)), ((3, 0), (3, 4)), ((3, 0), (2, 4)))
    assert torch.equal(got, want) and count == 1
    # Shard(1): columns 2:4 of a 5x6 tensor, from columns 0:4 into columns 2:6: a run per row
    got, want, count = _box_copy((5, 6), ((0, 0), (5, 4)), ((0, 2), (5, 4)), ((0, 2), (5, 2)))
    assert torch.equal(got, want) and count == 5
    # a box of whole rows of both pieces (every column held): the rows merge into one run
    got, want, count = _box_copy((6, 3), ((0, 0), (6, 3)), ((2, 0), (4, 3)), ((2, 0), (3, 3)))
    assert torch.equal(got, want) and count == 1
    # a strided target (a column slice of a wider tensor): a run per row, into the right places
    got, want, count = _box_copy((4, 5), ((0, 0), (4, 5)), ((0, 0), (4, 5)), ((1, 0), (2, 5)), dst_view=True)
    assert torch.equal(got, want) and count == 2
    # a 0-d tensor (a replicated scalar): one element
    from elastic.replication.reshard import _runs

    assert _runs(((), ()), 4, (100, ()), (), (200, ()), ()) == [(100, 200, 4)]


# --------------------------------------------------------------------------------------------------------
# The whole reshard on three gloo ranks: the sharded test state (FSDP2 MLP with Adam, a table sharded on
# its columns) on a 1x2 mesh of ranks 0-1, resharded onto a 1x3 mesh when rank 2 joins (uneven shards: some
# regions stay, some move, the table's a run per row)


def _reshards(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.utils._python_dispatch import TorchDispatchMode

    import elastic.replication.reshard as rs
    from elastic.replication.collective import Collective
    from elastic.replication.sync import tenure
    from elastic.state.lineage import lineage
    from elastic.state.shards import pieces, sharded_state_dict
    from sharded_model import build, differences, full, train

    pair = DeviceMesh("cpu", [0, 1], mesh_dim_names=("shard",))  # every rank takes part in its groups
    old = build(pair) if rank < 2 else None
    if old is not None:
        train(old, 2)
    gathered = [full(old) if old is not None else None]
    dist.broadcast_object_list(gathered, src=0)
    truth = gathered[0]
    three = DeviceMesh("cpu", [0, 1, 2], mesh_dim_names=("shard",))
    group = Collective.of(None, timedelta(seconds=60), "reshard")

    def held() -> Any:
        return rs.hold(old, tenure(old)) if old is not None else None

    out: dict[str, Any] = {}
    paths: dict[str, int] = {}
    real = {name: getattr(rs, name) for name in ("_read_moves", "_all_to_all")}

    def spy(name: str) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            paths[name] = paths.get(name, 0) + 1
            return real[name](*args, **kwargs)

        return counted

    for name in real:
        setattr(rs, name, spy(name))

    def locals_of(s: Any) -> list[torch.Tensor]:
        return [p.local.clone() for p in pieces(sharded_state_dict(s))]

    def fill(name: str, **kwargs: Any) -> Any:
        paths.clear()
        new = build(three, seed=1)  # other values: every piece is overwritten
        filled = rs.reshard(new, held(), group, **kwargs)
        out[name] = {
            "paths": dict(paths),
            "received": filled.received,
            "diff": differences(truth, full(new)),
            "torn": lineage(new).torn,
        }
        return new

    # 1. one host: every receiver reads from its holders' memory; 2. a rank refusing (cross_memory=False
    # on rank 1, a token that does not read back on rank 2): every rank takes the all-to-all, bit-equal
    direct = fill("direct")
    fallback = fill("refused", cross_memory=rank != 1)
    out["bit-equal"] = all(torch.equal(a, b) for a, b in zip(locals_of(direct), locals_of(fallback)))
    readable = rs.can_read
    if rank == 2:
        rs.can_read = lambda ref: "another host"  # type: ignore[assignment]
    fill("unreadable")
    rs.can_read = readable
    # 3. a read that fails on rank 1: the same SyncError everywhere, every new state left torn
    real_read = rs.read_regions
    if rank == 1:

        def broken(pid: int, dests: Any, regions: Any) -> None:
            raise OSError(14, "Bad address")

        rs.read_regions = broken  # type: ignore[assignment]
    new = build(three, seed=1)
    try:
        rs.reshard(new, held(), group)
        out["failed read"] = None
    except SyncError as exc:
        out["failed read"] = (str(exc), lineage(new).torn)
    rs.read_regions = real_read  # type: ignore[assignment]
    # 4. the held pieces are the target's own (the mesh stays, the state kept): nothing is copied

    class Copies(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if func is torch.ops.aten.copy_.default and args[0].is_floating_point():  # into a piece
                Copies.count += 1
            return func(*args, **(kwargs or {}))

    own = rs.hold(direct, tenure(direct))
    with Copies():
        kept = rs.reshard(direct, own, group)
    out["identity"] = {
        "copies": Copies.count,
        "received": kept.received,
        "diff": differences(truth, full(direct)),
    }
    return out


def test_reads_from_the_holders_memory_equal_the_all_to_all_and_a_refusal_or_failure_is_everyones() -> None:
    from dist_harness import run_on_ranks

    results = run_on_ranks(_reshards, 3, timeout=200)
    for rank, r in enumerate(results):
        assert r["direct"]["paths"] == {"_read_moves": 1}, (rank, r["direct"])
        # every rank takes part in the all-to-all, which fills only the refusing rank's pieces
        for case, refusing in (("refused", 1), ("unreadable", 2)):
            reads = {} if rank == refusing else {"_read_moves": 1}
            assert r[case]["paths"] == {**reads, "_all_to_all": 1}, (rank, case, r[case])
        for case in ("direct", "refused", "unreadable"):
            assert r[case]["diff"] == [] and r[case]["torn"] is False, (rank, case, r[case])
            assert r[case]["received"] == r["direct"]["received"]
        assert r["bit-equal"]
        message, torn = r["failed read"]
        assert message == results[0]["failed read"][0]  # the same error on every rank
        assert "rank 1 could not fill its new pieces" in message and "Bad address" in message
        assert "cross_memory=False" in message and torn
        assert r["identity"] == {"copies": 0, "received": 0, "diff": []}, (rank, r["identity"])
    assert sum(r["direct"]["received"] for r in results) > 0
