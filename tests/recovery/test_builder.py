"""`elastic.recovery.builder`: `Built`, the state of a builder `run` across generations, on two real gloo
ranks, and its helpers that need no processes.

`release` keeps the pieces and frees the state with everything that holds the generation's process groups
(FSDP2's modules are reference cycles, torch's DTensor caches keep their meshes): a group still referenced
keeps its sockets open, and a peer blocked on this rank then waits its whole timeout. `start` on a mesh equal
to the last one, the ranks swapped, fills the new state at the new coordinates (torch's DTensor caches compare
meshes by value and would hand the new DTensors the old mesh).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from dist_harness import free_port, run_on_ranks
from elastic.recovery import builder
from elastic.recovery.builder import snapshot_every_mismatch


def body(rank: int, world: int, port: int) -> dict[str, Any]:
    import gc
    import types
    import weakref
    from datetime import timedelta

    import torch.distributed as dist

    from elastic.recovery.builder import Built, MeshPlan
    from elastic.state.shards import find_dtensor
    from sharded_model import build, digest, full, mesh_for, train

    old = build(mesh_for(world))
    train(old, 2)
    before = digest(full(old))  # full_tensor: torch caches the mesh's topology
    built = Built(
        build=lambda w: build(w.mesh, seed=7),
        plan=MeshPlan(lambda n: (n,)),
        ckpt=None,
        timeout=timedelta(seconds=30),
    )
    built.state = old
    model, mesh = weakref.ref(old.model), weakref.ref(old.table.device_mesh)
    del old
    built.release()
    gc.collect()  # as run does after the group's destroy: FSDP2's modules are reference cycles
    out: dict[str, Any] = {"freed": (model() is None, mesh() is None), "held": built.held is not None}

    # the next generation: the same mesh shape, the ranks swapped
    dist.destroy_process_group()
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0)
    dist.init_process_group("gloo", store=store, rank=world - 1 - rank, world_size=world)
    generation = types.SimpleNamespace(size=world, mesh=None, generation=1)
    built.start(generation)
    new = built.state
    coordinate = generation.mesh.get_coordinate()
    meshes = [d.device_mesh for _, d in find_dtensor(new)]
    meshes += [s["exp_avg"].device_mesh for s in new.optimizer.state.values()]
    out["coordinates"] = {m.get_coordinate() == coordinate for m in meshes}
    out["after"] = digest(full(new))
    out["before"] = before
    return out


def test_release_frees_the_groups_holders_and_a_swapped_mesh_gets_new_coordinates() -> None:
    for r in run_on_ranks(body, 2, args=(free_port(),), timeout=120):
        assert r["freed"] == (True, True) and r["held"]
        assert r["coordinates"] == {True}
        assert r["after"] == r["before"]  # the same state, resharded onto the swapped ranks


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
