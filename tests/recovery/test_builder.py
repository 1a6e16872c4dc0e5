"""`elastic.recovery.builder` helpers that need no processes (the builder `run` spawns in
`tests/recovery/test_run_sharded.py` and `tests/recovery/test_run_snapshots.py`)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from elastic.recovery import builder
from elastic.recovery.builder import snapshot_every_mismatch


def test_snapshot_every_alike_on_every_rank_is_fine() -> None:
    assert snapshot_every_mismatch([10, 10, 10]) is None
    assert snapshot_every_mismatch([None, None]) is None


def test_snapshot_every_differing_between_ranks_names_the_ranks_and_their_values() -> None:
    msg = snapshot_every_mismatch([10, 5, 10, None])
    assert msg == (
        "elastic.run: the workers were given different snapshot_every (ranks [0, 2]: snapshot_every=10; "
        "ranks [1]: snapshot_every=5; ranks [3]: snapshot_every=None); pass the same snapshot_every to "
        "elastic.run on every worker"
    )


def test_a_snapshot_reshards_fsdp_modules_before_copying_the_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[Any, ...]] = []
    monkeypatch.setattr(builder, "_reshard_fsdp", lambda state: calls.append(("reshard", state)))
    monkeypatch.setattr(builder, "tenure", lambda state: 7)
    built = builder.Built(
        build=lambda world: None,
        plan=builder.MeshPlan(lambda n: (n,)),
        ckpt=None,
        timeout=timedelta(seconds=5),
        snapshot_every=2,
        state="the state",
    )
    monkeypatch.setattr(built.snapshots, "take", lambda state, t: calls.append(("take", state, t)))
    built.snapshot()
    assert calls == [("reshard", "the state"), ("take", "the state", 7)]
