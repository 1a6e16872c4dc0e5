"""`elastic.run` with a builder: a 2x2 HSDP state loses a worker, the survivors go on as 1x3 with the state
resharded in memory (the whole state's digest equal across the change, at most the step in flight lost), the
replacement joins and the mesh is 2x2 again; every worker ends with the same state."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest

import elastic

pytestmark = pytest.mark.timeout(240)

STEPS = 24
KILL_AT = 6


def worker(mesh_of: Any) -> dict[str, Any]:
    from sharded_model import build, digest, full, train

    slot, life = int(os.environ["ELASTIC_SLOT"]), int(os.environ["ELASTIC_SLOT_RESTARTS"])
    record: dict[str, Any] = {"slot": slot, "life": life, "gens": [], "digests": {}, "starts": []}

    def fn(state: Any, world: Any) -> str:
        record["gens"].append((world.generation, world.size, tuple(world.mesh.mesh.shape), state.step))
        record["starts"].append((state.step, digest(full(state))))
        while state.step < STEPS:
            if (slot, life) == (3, 0) and state.step == KILL_AT:
                os.kill(os.getpid(), signal.SIGKILL)
            train(state, 1)
            record["digests"][state.step] = digest(full(state))
            if world.size == 3:
                time.sleep(1.0)  # room for the replacement to start and join before the end
            world.check()
        return digest(full(state))

    if life == 1:
        time.sleep(5)  # the survivors form a generation of three first
    record["final"] = elastic.run(
        fn, lambda world: build(world.mesh), mesh=mesh_of, min_workers=3, first_workers=4, timeout=5
    )
    return record


def hsdp_or_flat(n: int) -> tuple[int, ...]:
    return (2, 2) if n == 4 else (n,)


def test_a_lost_fsdp_worker_is_resharded_in_memory_and_its_replacement_rejoins() -> None:
    results = elastic.spawn(worker, 4, args=(hsdp_or_flat,), restart="worker", max_restarts=1, timeout=200)
    finals = {r["final"] for r in results}
    assert len(finals) == 1  # every worker ends with the same state
    survivor = results[0]
    shapes = [g[2] for g in survivor["gens"]]
    assert shapes[0] == (2, 2) and (3,) in shapes and shapes[-1] == (2, 2), shapes
    for _, size, shape, _ in survivor["gens"]:
        assert size == (4 if shape == (2, 2) else 3)
    # each generation starts from the state the previous one had reached at that step (nothing lost
    # beyond the step in flight): its whole-state digest equals the one recorded when that step completed
    starts = survivor["starts"]
    assert starts[0][0] == 0 and starts[1][0] >= KILL_AT - 1
    for step, d in starts[1:]:
        assert d == survivor["digests"][step], step
    joiner = results[3]
    assert joiner["life"] == 1 and joiner["gens"][0][2] == (2, 2) and joiner["gens"][0][3] > KILL_AT
    step, d = joiner["starts"][0]
    assert d == survivor["digests"][step]  # the replacement received the survivors' state
    assert joiner["digests"][STEPS] == survivor["digests"][STEPS]
