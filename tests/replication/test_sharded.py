"""The election of sharded states, on records alone (no process group): complete versions, replica sets."""

from __future__ import annotations

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
