"""`elastic.run` with a builder and a spare: 5 workers on a 2x2 HSDP mesh, one waits in the rendezvous.

One run checks, in order:

1. A member of the 2x2 mesh is killed: the spare (slot 0, a process that was waiting all along) is admitted
   at the lost member's rank, the mesh stays 2x2, the whole state's digest is the one the survivors had when
   their last step completed. The survivors keep their ranks and their state's objects (the same state,
   modules and parameter storage: `build` is not called again and nothing is copied into them); only the
   spare builds and receives.
2. A member of that second 2x2 mesh is killed: three workers reshard onto a 1x3 mesh, and one of them dies
   while the pieces move (``ELASTIC_FAULT``'s ``reshard-pieces``, after its local copies, before the
   all-to-all). That generation never trains; the next one (two workers, 1x2) plans again from the pieces
   the survivors kept and starts from the digest the 2x2 mesh had reached: nothing half-filled is trained on.
3. Every worker that finishes ends with the same state.

A killed worker is restarted in its slot and returns at once (it does not rejoin), so the generations'
members are exactly the survivors and the spare.
"""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta
from typing import Any

import pytest

import elastic

pytestmark = pytest.mark.timeout(240)

STEPS = 18
FIRST_KILL = 6  # a member of the first 2x2 mesh dies after this step
SECOND_KILL = 12  # a member of the second 2x2 mesh dies after this step


def rendezvous_logs() -> Any:
    """A reader of the rendezvous's rounds: ``logs(n)`` is round n's log (who joined, the decision)."""
    import torch.distributed as dist

    from elastic.recovery.rendezvous import read_round
    from elastic.recovery.store import connect, parse_address

    host, port = parse_address(None)
    store = dist.PrefixStore("elastic/elastic/", connect(host, port, timeout=timedelta(seconds=30)))
    return lambda n: read_round(store, n)


def worker() -> dict[str, Any]:
    from sharded_model import build, digest, full, train

    slot, life = int(os.environ["ELASTIC_SLOT"]), int(os.environ["ELASTIC_SLOT_RESTARTS"])
    record: dict[str, Any] = {"slot": slot, "life": life, "gens": [], "digests": [], "builds": [], "kept": {}}
    if life > 0:
        return record  # a killed worker's restart stays out: the generations are the survivors and the spare
    logs = rendezvous_logs()
    if slot == 0:  # the spare: it joins once the first generation has formed without it
        while logs(0).decision is None:
            time.sleep(0.05)

    def fn(state: Any, world: Any) -> str:
        import torch.distributed as dist

        began = state.step
        members: list[Any] = [None] * world.size  # (slot, life) by rank: the dead's records are lost
        dist.all_gather_object(members, (slot, life), group=world.group)
        param = next(state.model.parameters())._local_tensor
        record["kept"][world.generation] = (id(state), id(state.model), param.data_ptr())
        record["gens"].append(
            {
                "generation": world.generation,
                "size": world.size,
                "shape": tuple(world.mesh.mesh.shape),
                "step": began,
                "digest": digest(full(state)),
                "members": members,
            }
        )
        if began == 0:
            with world.busy("waiting for the spare"):  # it waits in the next round before the first loss
                while not logs(world.generation + 1).joined:
                    time.sleep(0.05)
        if world.size == 4 and world.rank == 2 and began >= FIRST_KILL:
            # rank 2 of the second 2x2 mesh holds shard 0; in the 1x3 generation after the second kill it is
            # rank 2 again (survivors keep their ranks) and dies there while the pieces move
            os.environ["ELASTIC_FAULT"] = "2:reshard-pieces:die"
        while state.step < STEPS:
            for kill_at in (FIRST_KILL, SECOND_KILL):
                if world.size == 4 and world.rank == 3 and began < kill_at == state.step:
                    os.kill(os.getpid(), signal.SIGKILL)  # shard 1 of this 2x2 mesh: its replica survives
            train(state, 1)
            record["digests"].append((world.generation, state.step, digest(full(state))))
            world.check()
        return digest(full(state))

    def built(world: Any) -> Any:
        record["builds"].append(world.generation)
        return build(world.mesh)

    record["final"] = elastic.run(
        fn,
        built,
        mesh=lambda n: (2, 2) if n >= 4 else (n,),
        min_workers=2,
        first_workers=4,
        timeout=5,
    )
    return record


def test_a_spare_takes_a_lost_place_and_a_death_while_resharding_is_planned_again() -> None:
    results = elastic.spawn(worker, 5, restart="worker", max_restarts=1, timeout=200)
    lives = [r for r in results if r["life"] == 0]
    assert len(lives) == 2 and all(r["life"] == 1 for r in results if r not in lives)  # 3 died, 2 finished
    # what the two finishers saw of every generation they trained in (the same on every member)
    gens: dict[int, dict[str, Any]] = {}
    history: dict[tuple[int, int], str] = {}  # (generation, step) -> the whole state's digest after it
    for r in lives:
        for g in r["gens"]:
            assert gens.setdefault(g["generation"], g) == g
        for generation, step, d in r["digests"]:
            assert history.setdefault((generation, step), d) == d
    trained = sorted(gens)
    first, second, last = (gens[g] for g in trained)
    assert [(g["size"], g["shape"]) for g in (first, second, last)] == [(4, (2, 2)), (4, (2, 2)), (2, (2,))]

    # 1. the spare (the process that waited all along: life 0) takes the killed member's place in a 2x2 mesh
    assert first["members"] == [(1, 0), (2, 0), (3, 0), (4, 0)]
    assert second["members"] == [(1, 0), (2, 0), (3, 0), (0, 0)]  # slot 4 (rank 3) was killed
    assert second["step"] == FIRST_KILL  # only the step in flight is lost
    assert second["digest"] == history[(trained[0], FIRST_KILL)]  # the spare's pieces included
    for r in lives:  # survivors on the same mesh: the same objects, the same storage, no second build
        assert r["kept"][trained[1]] == r["kept"][trained[0]]
        assert trained[0] in r["builds"] and trained[1] not in r["builds"] and trained[2] in r["builds"]

    # 2. the 1x3 generation died while resharding and never trained; the 1x2 one starts from the 2x2 state
    assert trained[2] > trained[1] + 1, trained  # a generation formed in between and never reached fn
    assert last["step"] == SECOND_KILL
    assert last["digest"] == history[(trained[1], SECOND_KILL)]
    # one holder of each shard of the second 2x2 mesh is left: rank 3 was killed, rank 2 died resharding
    assert last["members"] == second["members"][:2]

    # 3. every worker that finished ends with the same state, the one of the last step
    assert {r["final"] for r in lives} == {history[(trained[2], STEPS)]}
    assert {(r["slot"], r["life"]) for r in lives} == set(last["members"])
