"""The election of sharded states, on records alone (no process group): complete versions, replica sets;
then the pieces' transports on four gloo ranks (reads from the source's memory, shared memory,
broadcasts, the fallbacks between them) and the state dict's kept walks."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

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


def _torch_differs(s: Any) -> list[str]:
    """Where the sharded state dict differs from torch's own (`get_model_state_dict`,
    `get_optimizer_state_dict`): keys and their order, which storage each DTensor views, plain values."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    from elastic.state.shards import is_dtensor, sharded_state_dict

    ours = sharded_state_dict(s)
    theirs = {
        "model": get_model_state_dict(s.model),
        "optimizer": get_optimizer_state_dict(s.model, s.optimizer),
    }
    out: list[str] = []

    def walk(a: Any, b: Any, path: str) -> None:
        if isinstance(a, dict) and isinstance(b, dict):
            if list(a) != list(b):
                out.append(f"{path}: keys {list(a)} vs {list(b)}")
            for k in b:
                if k in a:
                    walk(a[k], b[k], f"{path}.{k}")
        elif is_dtensor(a) and is_dtensor(b):
            if a._local_tensor.data_ptr() != b._local_tensor.data_ptr():
                out.append(f"{path}: another storage")
        elif isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            if not torch.equal(a, b):
                out.append(f"{path}: {a} vs {b}")
        elif a != b:
            out.append(f"{path}: {a!r} vs {b!r}")

    walk({k: ours[k] for k in theirs}, theirs, "")
    return out


@contextmanager
def _counted(module: Any, name: str) -> Iterator[list[int]]:
    """Count the calls of `module.name` inside the block."""
    real = getattr(module, name)
    calls = [0]

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return real(*args, **kwargs)

    setattr(module, name, spy)
    try:
        yield calls
    finally:
        setattr(module, name, real)


def _transports(rank: int, world: int) -> dict[str, Any]:
    import os

    import torch.distributed as dist
    import torch.distributed.checkpoint.state_dict as torch_sd

    import elastic
    import elastic.replication.transport.cma as cma
    import elastic.replication.transport.shm as shm
    import elastic.state.shards as shards
    from dist_harness import use_transport
    from sharded_model import build, differences, full, mesh_for, perturb, train

    s = build(mesh_for(world))
    train(s, 3)
    elastic.sync(s)
    good = full(s)
    out: dict[str, Any] = {}

    def lagging_sync(name: str, note: str = "") -> None:
        shm.release_shared()
        if rank >= 2:  # replica index 1 lags
            s.step -= 1
            perturb(s)
        where = _locals(s)
        with _counted(dist, "broadcast") as broadcasts, _counted(shards, "_load_module") as loads:
            report = elastic.sync(s)
        out[name] = {
            "moved": report.tensor_bytes,
            "diff": differences({**good, "note": note}, full(s)),
            "in place": set(where) <= set(_locals(s)),  # Adam's new moments come in addition
            "shared": shm.shared_cached_bytes() > 0,
            "broadcasts": broadcasts[0],
            "objects": report.object_bytes,
            "module loads": loads[0],  # the receivers' pieces are in place: nothing to load
        }

    # 1. On one host receivers read the pieces from their source's memory: no shared memory, no broadcast.
    use_transport("cross-memory", bucket_bytes=64)
    lagging_sync("cross-memory")
    #    Objects too large to ride in the all-gather: the sender broadcasts them after it.
    s.note = "n" * 20_000 if rank < 2 else ""  # the laggers lack it
    lagging_sync("large objects", note="n" * 20_000)
    out["note"] = s.note
    s.note = ""
    # 2. The shared-memory ring (sources keep a segment, receivers a mapping), then the broadcasts.
    use_transport("shared-memory", bucket_bytes=64)
    lagging_sync("shared-memory")
    use_transport("broadcast", bucket_bytes=64)
    lagging_sync("broadcast")
    # 3. Rank 3 cannot read its source's memory, nor map its segment (another host): its replica set
    #    falls back to the broadcasts, the other one keeps reading.
    use_transport("cross-memory", bucket_bytes=64)
    readable, mapped = cma.can_read, shm._map
    if rank == 3:

        def unreadable(ref: Any) -> str:
            return "another host"

        def unmappable(ref: Any) -> Any:
            raise OSError("another host")

        cma.can_read, shm._map = unreadable, unmappable  # type: ignore[assignment]
    lagging_sync("another host")
    cma.can_read, shm._map = readable, mapped  # type: ignore[assignment]
    # 4. Rank 3's optimizer has no state: it allocates Adam's moments, its source sends its list of pieces.
    if rank == 3:
        s.optimizer = torch.optim.Adam(s.model.parameters(), lr=1e-2)
    lagging_sync("no optimizer state")
    # 5. The state dict is torch's, by torch's walk once, then by the module's and optimizer's own state
    #    dicts while the modules and parameters are the same (hyperparameters read afresh every time).
    out["torch's"] = _torch_differs(s)
    s.optimizer.param_groups[0]["lr"] = 0.25
    from elastic.state.shards import sharded_state_dict

    with (
        _counted(torch_sd, "get_model_state_dict") as model_walks,
        _counted(torch_sd, "get_optimizer_state_dict") as optimizer_walks,
    ):
        sd = sharded_state_dict(s)
        out["lr"], out["keys"] = sd["optimizer"]["param_groups"][0]["lr"], len(sd["model"])
        out["walks kept"] = (model_walks[0], optimizer_walks[0])
        s.model.add_module("extra", torch.nn.Linear(2, 2))  # another module: torch's walk again
        out["walks after a change"] = (
            len(sharded_state_dict(s)["model"]),
            model_walks[0],
            optimizer_walks[0],
        )
        out["torch's after a change"] = _torch_differs(s)
    del s.model.extra
    rows: list[Any] = [None] * world
    dist.all_gather_object(rows, out)  # rank 3 dies below: the others bring its results
    # 6. Rank 3 dies while pieces move: every survivor raises, rank 2 is left torn.
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
def test_pieces_move_by_reads_on_one_host_else_through_shared_memory_or_broadcasts() -> None:
    from dist_harness import run_on_ranks

    results = run_on_ranks(_transports, 4, timeout=200, allow_exit=True)
    assert results[3] is None  # rank 3 died at "pieces"
    rows = results[0]["rows"]
    cases = (
        "cross-memory",
        "large objects",
        "shared-memory",
        "broadcast",
        "another host",
        "no optimizer state",
    )
    for rank, r in enumerate(rows):
        for name in cases:
            assert r[name]["diff"] == [], (rank, name)
            assert r[name]["moved"] > 0 and r[name]["in place"], (rank, name)
        assert not r["cross-memory"]["shared"] and r["cross-memory"]["broadcasts"] == 0, rank
        assert r["note"] == "n" * 20_000 and r["large objects"]["broadcasts"] == 2, rank  # size, bytes
        assert r["cross-memory"]["objects"] < 8192 < 20_000 < r["large objects"]["objects"], rank
        assert r["shared-memory"]["shared"] and r["shared-memory"]["broadcasts"] == 0, rank
        assert all(r[name]["module loads"] == 0 for name in cases), rank
        assert not r["broadcast"]["shared"] and r["broadcast"]["broadcasts"] > 0, rank
        assert r["torch's"] == [] and r["torch's after a change"] == [], rank
        assert r["lr"] == 0.25 and r["walks kept"] == (0, 0), rank
        assert r["walks after a change"] == (r["keys"] + 2, 1, 1), rank  # and the optimizer's names again
    # replica set 1 (ranks 1 and 3) fell back to the broadcasts; replica set 0 kept reading
    assert [r["another host"]["broadcasts"] > 0 for r in rows] == [False, True, False, True]
    assert [r["another host"]["shared"] for r in rows] == [False, True, False, False]
    assert [r["death"] for r in results[:3]] == ["SyncError"] * 3
    assert [r["torn"] for r in results[:3]] == [False, False, True]
