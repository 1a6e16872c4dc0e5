"""`elastic.run` with a builder on a pure-FSDP mesh (no replicas): what a lost worker costs, by source.

One `spawn` of 3 workers runs three runs one after the other (run ids of their own on one store); slot 2
dies in each (SIGKILL) and comes back as a newcomer for the next one:

(a) ``snapshot_every=5``, slot 2 dies after step 12: the two survivors go back to the step-10 snapshot
    (their own pieces and their copies of the dead worker's), resharded onto a mesh of 2 in memory, and
    the whole state they resume with is the one of step 10, bit for bit;
(b) no snapshots, no ``ckpt``: the survivors hold two pieces of three; every survivor raises the same
    `SyncError` naming the tensors' missing slices and the fixes;
(c) ``ckpt`` (saved by ``elastic.save`` inside ``fn`` at step 3), no snapshots: the survivors load it,
    resharded onto a mesh of 2, and resume with the state of step 3, bit for bit.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest

import elastic

pytestmark = pytest.mark.timeout(300)

STEPS = 16


def _run(name: str, slot: int, record: dict[str, Any], kill_at: int, **options: Any) -> Any:
    """One run: train to `STEPS`, slot 2 killing itself after step `kill_at` (its first life here)."""
    from sharded_model import build, digest, full, train

    mine = record[name] = {"gens": [], "digests": {}}
    ckpt = options.get("ckpt")

    def fn(state: Any, world: Any) -> str:
        mine["gens"].append((world.generation, world.size, tuple(world.mesh.mesh.shape), state.step))
        mine.setdefault("starts", []).append((state.step, digest(full(state))))
        while state.step < STEPS:
            train(state, 1)
            mine["digests"][state.step] = digest(full(state))
            if ckpt is not None and state.step == 3:
                elastic.save(state, ckpt)
            world.check()
            if slot == 2 and state.step == kill_at:
                time.sleep(1.0)  # the snapshot in flight completes (its peers wait in the next step)
                os.kill(os.getpid(), signal.SIGKILL)
        return digest(full(state))

    try:
        mine["final"] = elastic.run(
            fn,
            lambda world: build(world.mesh),
            run_id=name,
            min_workers=2,
            first_workers=3,
            timeout=5,
            **options,
        )
    except elastic.SyncError as exc:
        mine["error"] = (type(exc).__name__, str(exc))
    return mine.get("final")


def worker(ckpt: str) -> dict[str, Any]:
    slot, life = int(os.environ["ELASTIC_SLOT"]), int(os.environ["ELASTIC_SLOT_RESTARTS"])
    record: dict[str, Any] = {"slot": slot, "life": life}
    runs = [
        ("a", {"snapshot_every": 5}, 12),
        ("b", {}, 4),
        ("c", {"ckpt": ckpt}, 5),
    ]
    # slot 2 dies once per run: its life k starts with run k
    for name, options, kill_at in runs[life if slot == 2 else 0 :]:
        _run(name, slot, record, kill_at, **options)
    return record


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    ckpt = str(tmp_path_factory.mktemp("ckpt"))
    return elastic.spawn(worker, 3, args=(ckpt,), restart="worker", max_restarts=3, timeout=280)


def _survivors(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    assert [r["slot"] for r in runs] == [0, 1, 2]
    assert runs[2]["life"] == 3  # slot 2 died once in each run
    return runs[:2]


def test_a_pure_fsdp_loss_goes_back_to_the_newest_whole_snapshot(runs: list[dict[str, Any]]) -> None:
    for r in _survivors(runs):
        a = r["a"]
        first, second = a["gens"][0], a["gens"][1]
        assert first[1:] == (3, (3,), 0)
        assert second[1:3] == (2, (2,))
        step, d = a["starts"][1]
        assert step == 10  # steps 11 and 12 lost (<= 5), not 5: the step-10 snapshot, not the step-5 one
        assert d == a["digests"][10]  # the whole state of step 10 as the three workers had it
        assert a["digests"][STEPS] == runs[0]["a"]["digests"][STEPS]
        assert "error" not in a


def test_b_no_replicas_no_snapshots_no_ckpt_is_a_clear_error_on_every_survivor(
    runs: list[dict[str, Any]],
) -> None:
    errors = {r["b"]["error"] for r in _survivors(runs)}
    assert len(errors) == 1  # the same error on every survivor
    kind, text = errors.pop()
    assert kind == "SyncError"
    assert "no version of the sharded state is held whole by the 2 live rank(s)" in text
    assert "the live pieces at tenure 4" in text
    assert "model.0.weight[" in text  # the slice nobody holds, by name
    assert "no rank holds a snapshot" in text
    assert "snapshot_every=k" in text and "ckpt=" in text and "HSDP" in text


def test_c_ckpt_without_snapshots_resumes_from_disk_resharded(runs: list[dict[str, Any]]) -> None:
    for r in _survivors(runs):
        c = r["c"]
        # the generation after the last one of three (slot 2 may join late, a generation of two first)
        last_three = max(i for i, g in enumerate(c["gens"]) if g[1] == 3)
        after = last_three + 1
        assert c["gens"][after][1:3] == (2, (2,)), c["gens"]
        step, d = c["starts"][after]
        assert step == 3  # the checkpoint's step
        assert d == c["digests"][3]
        assert "error" not in c
    assert runs[0]["c"]["final"] == runs[1]["c"]["final"]
