"""The election of sharded states, on records alone (no process group): complete versions, replica sets;
then the pieces' transports on four gloo ranks (shared memory, broadcasts, the fallback between them)."""

from __future__ import annotations

from typing import Any

import pytest

from elastic import SyncError, TenureError
from elastic.replication.sharded import ShardRecord, elect_version
from elastic.state.shards import Layout

#: A 2x2 HSDP mesh: ranks 0 and 2 hold position (0,), ranks 1 and 3 position (1,).
HSDP = Layout(shape=(2, 2), names=("replicate", "shard"), position={0: (0,), 1: (1,), 2: (0,), 3: (1,)})
RANKS = [0, 1, 2, 3]


def records(*tenures: object, torn: tuple[int, ...] = ()) -> list[ShardRecord]:
    return [
        ShardRecord(tenure=t, torn=r in torn, token="a", position=HSDP.position[r])
        for r, t in enumerate(tenures)
    ]


def test_the_most_tenured_complete_version_wins_with_the_lowest_holder_of_each_position() -> None:
    v = elect_version(records(3, 3, 2, 2), HSDP, RANKS, "sync")
    assert (v.tenure, v.src, v.sources) == (3, 0, {(0,): 0, (1,): 1})
    v = elect_version(records(2, 3, 3, 3), HSDP, RANKS, "sync")
    assert (v.tenure, v.src, v.sources) == (3, 1, {(0,): 2, (1,): 1})


def test_a_version_missing_a_position_loses_to_an_older_complete_one() -> None:
    v = elect_version(records(5, 4, 4, 4), HSDP, RANKS, "sync")
    assert (v.tenure, v.sources) == (4, {(0,): 2, (1,): 1})


def test_torn_ranks_hold_nothing() -> None:
    v = elect_version(records(5, 5, 5, 4, torn=(0,)), HSDP, RANKS, "sync")
    assert (v.tenure, v.src, v.sources) == (5, 1, {(0,): 2, (1,): 1})


def test_no_complete_version_names_the_missing_positions_and_the_fix() -> None:
    with pytest.raises(SyncError) as info:
        elect_version(records(5, 4, 3, 4, torn=(2,)), HSDP, RANKS, "sync")
    text = str(info.value)
    assert "no complete version of the sharded state (2x2 mesh ('replicate', 'shard'))" in text
    assert "(tenure 5) lacks shard position(s) [(1,)]" in text
    assert "ckpt=" in text and "replicate" in text


def test_a_forced_source_must_hold_a_complete_version() -> None:
    v = elect_version(records(5, 5, 4, 4), HSDP, RANKS, "sync", src=2)
    assert (v.tenure, v.sources) == (4, {(0,): 2, (1,): 3})
    with pytest.raises(SyncError, match=r"src=0.*not complete.*\[\(1,\)\]"):
        elect_version(records(5, 4, 4, 4), HSDP, RANKS, "sync", src=0)


def test_incomparable_tenures_raise_the_tenure_error() -> None:
    with pytest.raises(TenureError):
        elect_version(records(1, "a", 1, 1), HSDP, RANKS, "sync")


def test_every_rank_torn_is_an_error() -> None:
    with pytest.raises(SyncError, match="every rank's state is torn"):
        elect_version(records(1, 1, 1, 1, torn=(0, 1, 2, 3)), HSDP, RANKS, "sync")


# ---------------------------------------------------------------------------------------------------------
# The pieces' transports, on a 2x2 HSDP mesh of four gloo ranks


def _locals(s: Any) -> list[int]:
    """Where this rank's pieces live: parameters, Adam's moments, the table."""
    out = [p._local_tensor.data_ptr() for p in s.model.parameters()]
    for st in s.optimizer.state.values():
        out += [st[k]._local_tensor.data_ptr() for k in ("exp_avg", "exp_avg_sq")]
    return [*out, s.table._local_tensor.data_ptr()]


def _transports(rank: int, world: int) -> dict[str, Any]:
    import os

    import torch

    import elastic
    import elastic.replication.transport.shm as shm
    from dist_harness import use_transport
    from sharded_model import build, differences, full, mesh_for, perturb, train

    s = build(mesh_for(world))
    train(s, 3)
    elastic.sync(s)
    good = full(s)
    out: dict[str, Any] = {}

    def lagging_sync(name: str) -> None:
        shm.release_shared()
        if rank >= 2:  # replica index 1 lags
            s.step -= 1
            perturb(s)
        where = _locals(s)
        report = elastic.sync(s)
        out[name] = {
            "moved": report.tensor_bytes,
            "diff": differences(good, full(s)),
            "in place": set(where) <= set(_locals(s)),  # Adam's new moments come in addition
            "shared": shm.shared_cached_bytes() > 0,
        }

    # 1. On one host the pieces go through shared memory (sources keep a segment, receivers a mapping).
    use_transport("shared-memory", bucket_bytes=64)
    lagging_sync("shared-memory")
    # 2. The broadcasts: no shared memory at all.
    use_transport("broadcast", bucket_bytes=64)
    lagging_sync("broadcast")
    # 3. Rank 3 cannot map its source's segment (another host): its replica set falls back to the
    #    broadcasts, the other one stays on shared memory.
    use_transport("shared-memory", bucket_bytes=64)
    mapped = shm._map
    if rank == 3:

        def unmappable(ref: Any) -> Any:
            raise OSError("another host")

        shm._map = unmappable
    lagging_sync("unmappable")
    shm._map = mapped
    # 4. Rank 3's optimizer has no state: it allocates Adam's moments, its source sends its list of pieces.
    if rank == 3:
        s.optimizer = torch.optim.Adam(s.model.parameters(), lr=1e-2)
    lagging_sync("no optimizer state")
    rows: list[Any] = [None] * world
    torch.distributed.all_gather_object(rows, out)  # rank 3 dies below: the others bring its results
    # 5. Rank 3 dies while pieces move on shared memory: every survivor raises, rank 2 is left torn.
    from elastic.state.lineage import lineage

    if rank >= 2:
        s.step -= 1
        perturb(s)
    os.environ["ELASTIC_FAULT"] = "3:pieces:die"
    try:
        elastic.sync(s, timeout=20)
        out["death"] = None
    except elastic.SyncError as exc:
        out["death"] = type(exc).__name__
    out["torn"] = lineage(s).torn
    return {**out, "rows": rows}


@pytest.mark.timeout(240)
def test_pieces_move_through_shared_memory_on_one_host_else_by_broadcasts() -> None:
    from dist_harness import run_on_ranks

    results = run_on_ranks(_transports, 4, timeout=200, allow_exit=True)
    assert results[3] is None  # rank 3 died at "pieces"
    rows = results[0]["rows"]
    for rank, r in enumerate(rows):
        for name in ("shared-memory", "broadcast", "unmappable", "no optimizer state"):
            assert r[name]["diff"] == [], (rank, name)
            assert r[name]["moved"] > 0 and r[name]["in place"], (rank, name)
        assert r["shared-memory"]["shared"] and not r["broadcast"]["shared"], rank
    # rank 3 took the broadcasts (no mapping kept); its source kept its segment, replica set 0 its ring
    assert [r["unmappable"]["shared"] for r in rows] == [True, True, True, False]
    assert [r["death"] for r in results[:3]] == ["SyncError"] * 3
    assert [r["torn"] for r in results[:3]] == [False, False, True]
