"""`elastic.recovery.builder`: `Built`, the state of a builder `run` across generations, on two real gloo
ranks, and its helpers that need no processes.

`release` keeps the pieces and the state, which lets go of everything that holds the generation's process
groups (FSDP2's mesh infos, the mesh's registry, torch's DTensor caches): a group still referenced keeps its
sockets open, and a peer blocked on this rank then waits its whole timeout. `start` on a mesh equal to the
last one, the ranks swapped, rebuilds the state and fills it at the new coordinates (torch's DTensor caches
compare meshes by value and would hand the new DTensors the old mesh); with the same ranks it keeps the state,
the same objects on the new groups.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from dist_harness import free_port, run_on_ranks
from elastic.recovery import builder
from elastic.recovery.builder import snapshot_every_mismatch


def body(rank: int, world: int, port: int) -> dict[str, Any]:
    import types
    import weakref
    from datetime import timedelta

    import torch.distributed as dist
    import torch.distributed.nn.functional  # noqa: F401  (as run does: before any group, see _import_sharded)

    from elastic.recovery.builder import Built, MeshPlan
    from elastic.state.shards import find_dtensor
    from sharded_model import build, digest, full, mesh_for, train

    # one store for the later generations, served by this test's rank 0 throughout (ports next to
    # `port` may be another test's: a run under load once hung on one)
    base = dist.TCPStore("127.0.0.1", port, world, rank == 0)

    def regroup(new_rank: int, generation: int) -> types.SimpleNamespace:
        if dist.is_initialized():
            dist.destroy_process_group()
        store = dist.PrefixStore(f"generation/{generation}/", base)
        dist.init_process_group("gloo", store=store, rank=new_rank, world_size=world)
        return types.SimpleNamespace(size=world, mesh=None, generation=generation)

    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = mesh_for(world)
    old = build(mesh)
    train(old, 2)
    before = digest(full(old))  # full_tensor: torch caches the mesh's topology
    built = Built(
        build=lambda w: build(w.mesh, seed=7),
        plan=MeshPlan(lambda n: (n,)),
        ckpt=None,
        timeout=timedelta(seconds=30),
    )
    built.state = old
    groups = [weakref.ref(mesh.get_group(0)), weakref.ref(dist.group.WORLD)]
    model = weakref.ref(old.model)
    del mesh
    built.release()
    out: dict[str, Any] = {"kept": built.kept is old, "held": built.held is not None}
    del old
    # the groups go with their destruction, no garbage collection needed: the kept state let go of them
    dist.destroy_process_group()
    out["freed"] = [g() is None for g in groups]

    # the next generation: the same mesh shape, the ranks swapped: the kept state does not fit, it is rebuilt
    generation = regroup(world - 1 - rank, 1)
    built.start(generation)
    new = built.state
    out["rebuilt"] = model() is None and new.model is not None  # the dropped state collected once filled
    coordinate = generation.mesh.get_coordinate()
    meshes = [d.device_mesh for _, d in find_dtensor(new)]
    meshes += [s["exp_avg"].device_mesh for s in new.optimizer.state.values()]
    out["coordinates"] = {m.get_coordinate() == coordinate for m in meshes}
    out["after"] = digest(full(new))
    out["before"] = before

    # and the one after: the same ranks again, the state kept (the same objects, on the new groups)
    param = next(new.model.parameters())._local_tensor.data_ptr()
    built.release()
    generation = regroup(world - 1 - rank, 2)
    built.start(generation)
    out["same"] = built.state is new and next(new.model.parameters())._local_tensor.data_ptr() == param
    out["mesh"] = generation.mesh is new.table.device_mesh  # world.mesh is the state's own, rebound
    out["kept_digest"] = digest(full(new))
    train(new, 1)  # its collectives run on the new groups
    out["trained"] = new.step
    return out


def test_release_keeps_the_state_freeing_its_groups_a_swapped_mesh_rebuilds_the_same_one_keeps() -> None:
    for r in run_on_ranks(body, 2, args=(free_port(),), timeout=120, init_group=False):
        assert r["kept"] and r["held"] and r["freed"] == [True, True]
        assert r["rebuilt"] and r["coordinates"] == {True}
        assert r["after"] == r["before"]  # the same state, resharded onto the swapped ranks
        assert (r["same"], r["mesh"], r["kept_digest"]) == (True, True, r["after"])
        assert r["trained"] == 3


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
