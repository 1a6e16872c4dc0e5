"""Sharded states (FSDP2, HSDP, DTensor) in sync, verify, save and load, across worlds of 4, 3, 2 and 5 ranks.

One spawn per world (each rank imports torch: the slow part): the 4-rank world (a 2x2 HSDP mesh) checks the
sync of a lagging replica, the fast path, verify, the missing-version error, the checkpoint layout, a plain
DCP load of our checkpoint and our load of a plain DCP checkpoint, async save, a corrupt piece, and a rank
dying while pieces move; the other worlds load its checkpoint resharded (1x3, 1x2) and the 1x3 one's
checkpoint on five ranks, every time compared bit for bit with torch's `full_state_dict` gathers.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import pytest

from dist_harness import run_on_ranks
from s3_server import bucket, endpoint

pytestmark = pytest.mark.timeout(300)

__all__ = ["bucket", "endpoint"]  # the fixtures, imported from s3_server


def _four(rank: int, world: int, root: str) -> dict[str, Any]:
    import torch
    import torch.distributed.checkpoint as dcp

    import elastic
    from elastic.state.lineage import lineage, set_lineage
    from sharded_model import build, differences, full, mesh_for, perturb, train

    out: dict[str, Any] = {}
    mesh = mesh_for(world)
    s = build(mesh)
    train(s, 3)
    first = elastic.sync(s)  # fresh states: the lineage starts here
    out["first"] = (first.src, first.tenure)
    elastic.verify(s)
    good = full(s)

    # 1. One replica (ranks 2 and 3) lags: its pieces and step are older.
    if rank >= 2:
        s.step -= 1
        perturb(s)
    mine = sum(p._local_tensor.numel() * 4 for p in s.model.parameters())
    report = elastic.sync(s)
    out["lagging"] = (report.src, report.tenure, report.tensor_bytes, mine)
    out["lagging_diff"] = differences(good, full(s))
    elastic.verify(s)
    again = elastic.sync(s)
    out["fast"] = (again.tensor_bytes, again.object_bytes)

    # 2. verify names a piece that differs inside its replica set.
    if rank == 3:
        with torch.no_grad():
            s.table._local_tensor.add_(7.0)
    try:
        elastic.verify(s)
        out["divergence"] = None
    except elastic.DivergenceError as exc:
        out["divergence"] = str(exc)
    elastic.sync(s, force=True)
    out["forced_diff"] = differences(good, full(s))

    # 3. No complete version: tenure 5 only at position (0,), tenure 4 only at (1,), rank 2 torn.
    line = lineage(s)
    s.step = {0: 5, 1: 4, 2: 3, 3: 4}[rank]
    if rank == 2:
        set_lineage(s, token=None, torn=True)
    try:
        elastic.sync(s)
        out["incomplete"] = None
    except elastic.SyncError as exc:
        out["incomplete"] = str(exc)
    out["incomplete_step"] = s.step
    s.step = 3
    set_lineage(s, token=line.token, torn=False)

    # 4. Save: one writer per shard position, DCP's files, our manifest.
    path = elastic.save(s, root + "/a")
    out["path"] = str(path)
    out["files"] = sorted(os.listdir(path))
    if rank == 0:
        out["manifest"] = json.loads((Path(path) / "manifest.json").read_text())
    # plain DCP reads it into a fresh state
    fresh = build(mesh, seed=7)
    train(fresh, 1)  # gives the optimizer its state (DCP fills only existing tensors)
    sd = fresh.state_dict()
    dcp.load(sd, checkpoint_id=str(path))
    fresh.load_state_dict(sd)
    out["dcp_reads_ours"] = differences(good, full(fresh))
    # ... and we read a checkpoint plain DCP wrote of the same state
    dcp.save(s.state_dict(), checkpoint_id=root + "/plain")
    fresh = build(mesh, seed=8)
    rep = elastic.load(fresh, root + "/plain")
    out["ours_reads_dcp"] = (rep.source, rep.tenure, differences(good, full(fresh)))

    # 5. Async save: training goes on while the pieces are written.
    train(s, 1)
    at_save = full(s)
    handle = elastic.save(s, root + "/a", blocking=False)
    train(s, 1)
    written = handle.wait()
    fresh = build(mesh, seed=9)
    rep = elastic.load(fresh, written)
    out["async"] = (rep.source, rep.tenure, differences(at_save, full(fresh)))

    # 6. A corrupt piece of the newest checkpoint: load falls back to the one before.
    newest = elastic.save(s, root + "/a")
    if rank == 0:
        victim = Path(newest) / "__1_0.distcp"
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0xFF
        victim.write_bytes(bytes(data))
    elastic.sync(s)  # a barrier: the damage is done before anyone reads
    fresh = build(mesh, seed=10)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rep = elastic.load(fresh, root + "/a")
    out["fallback"] = (rep.tenure, str(rep.path), differences(at_save, full(fresh)))
    out["fallback_warned"] = [str(w.message) for w in caught if "fails its checksum" in str(w.message)]
    try:
        elastic.load(build(mesh, seed=11), newest)
        out["named_corrupt"] = None
    except elastic.CheckpointCorruptError as exc:
        out["named_corrupt"] = str(exc)

    # 7. Pickled objects need trust; DTensors on two meshes are refused, naming the fields.
    from fractions import Fraction

    s.note = Fraction(1, 3)  # type: ignore[assignment]
    odd = elastic.save(s, root + "/odd")
    try:
        elastic.load(build(mesh, seed=12), odd)
        out["untrusted"] = None
    except elastic.UntrustedCheckpointError as exc:
        out["untrusted"] = str(exc)
    trusting = build(mesh, seed=13)
    elastic.load(trusting, odd, trusted=True)
    out["trusted"] = trusting.note
    s.note = ""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    other = init_device_mesh("cpu", (4,), mesh_dim_names=("shard",))
    table = s.table
    s.table = distribute_tensor(torch.zeros(4, 4), other, [Shard(0)])
    try:
        elastic.sync(s)
        out["two_meshes"] = None
    except ValueError as exc:
        out["two_meshes"] = str(exc)
    s.table = table

    # 8. The checkpoint the other worlds load, and its gather.
    final = elastic.save(s, root + "/final")
    out["final"] = (str(final), full(s))

    # 9. A rank dies while pieces move: the others raise, the receiver left is torn, the sources not.
    if rank >= 2:
        s.step -= 1
        perturb(s)
    os.environ["ELASTIC_FAULT"] = "3:pieces:die"
    before = s.step
    try:
        elastic.sync(s, timeout=20)
        out["death"] = None
    except elastic.SyncError as exc:
        out["death"] = type(exc).__name__
    out["death_torn"] = (lineage(s).torn, before == s.step)
    return out


def _load(
    rank: int, world: int, root: str, then_save: str | None, s3: tuple[str, dict[str, Any]] | None = None
) -> dict[str, Any]:
    import elastic
    from sharded_model import build, differences, full, mesh_for, train

    s = build(mesh_for(world), seed=100 + rank)  # different values everywhere: all must come from disk
    rep = elastic.load(s, root)
    out: dict[str, Any] = {"report": (rep.source, rep.tenure, rep.saved_world_size), "full": full(s)}
    elastic.verify(s)
    if world == 2:  # a replicated state skips sharded checkpoints, and refuses one named alone
        from golden_state import build as replicated

        plain = replicated()
        out["replicated_root"] = elastic.load(plain, root).source
        try:
            elastic.load(plain, rep.path)
            out["replicated_named"] = None
        except elastic.CheckpointMismatchError as exc:
            out["replicated_named"] = str(exc)
    if s3 is not None:  # the pieces through an object store: written by both ranks, read back resharded
        url, opts = s3
        path = elastic.save(s, url, storage_options=opts)
        fresh = build(mesh_for(world), seed=200 + rank)
        got = elastic.load(fresh, url, storage_options=opts)
        out["s3"] = (str(path), got.source, got.tenure, differences(full(s), full(fresh)))
    if then_save is not None:
        train(s, 1)
        elastic.save(s, then_save)
        out["saved"] = full(s)
    return out


@pytest.fixture(scope="module")
def four(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Any]]:
    root = tmp_path_factory.mktemp("sharded")
    results = run_on_ranks(_four, 4, args=(str(root),), timeout=240, allow_exit=True)
    return root, results


def test_a_lagging_replica_set_receives_its_pieces_and_agreeing_sets_move_nothing(four: Any) -> None:
    _, results = four
    for r in results[:3]:
        assert r["first"] == (0, 3)
        src, tenure, moved, mine = r["lagging"]
        assert (src, tenure) == (0, 3)
        assert moved >= 2 * mine > 0  # both lagging ranks' pieces (parameters, moments, table)
        assert r["lagging_diff"] == []
        assert r["fast"] == (0, 0)


def test_verify_names_the_piece_that_differs_in_its_replica_set(four: Any) -> None:
    _, results = four
    for r in results[:3]:
        text = r["divergence"]
        assert text is not None and "table (shard position (1,))" in text and "rank 1 vs rank 3" in text, text
        assert r["forced_diff"] == []


def test_no_complete_version_names_the_missing_position_and_changes_nothing(four: Any) -> None:
    _, results = four
    texts = {r["incomplete"] for r in results[:3]}
    assert len(texts) == 1
    (text,) = texts
    assert text is not None and "no complete version" in text and "tenure 5" in text
    assert "lacks shard position(s) [(1,)]" in text and "ckpt=" in text
    assert [r["incomplete_step"] for r in results[:3]] == [5, 4, 3]


def test_a_save_writes_one_file_per_shard_position_in_dcp_format(four: Any) -> None:
    _, results = four
    assert len({r["path"] for r in results[:3]}) == 1
    assert results[0]["files"] == [".metadata", "__0_0.distcp", "__1_0.distcp", "manifest.json"]
    manifest = results[0]["manifest"]
    assert manifest["layout"] == "dcp" and manifest["tenure"] == 3 and manifest["world_size"] == 4
    assert all("crc32" in rec for rec in manifest["files"].values())


def test_plain_dcp_reads_our_checkpoints_and_we_read_plain_dcp_ones(four: Any) -> None:
    _, results = four
    for r in results[:3]:
        assert r["dcp_reads_ours"] == []
        assert r["ours_reads_dcp"] == ("checkpoint", 3, [])


def test_an_async_save_holds_the_state_of_its_call(four: Any) -> None:
    _, results = four
    for r in results[:3]:
        assert r["async"] == ("checkpoint", 4, [])


def test_a_corrupt_piece_is_never_loaded(four: Any) -> None:
    _, results = four
    for r in results[:3]:
        tenure, path, diff = r["fallback"]
        assert tenure == 4 and diff == [] and path.endswith("ckpt-000000000004")
        assert r["named_corrupt"] is not None and "fails its checksum" in r["named_corrupt"]
    assert any(r["fallback_warned"] for r in results[:3])


def test_pickled_objects_need_trust_and_one_state_has_one_mesh(four: Any) -> None:
    from fractions import Fraction

    _, results = four
    for r in results[:3]:
        text = r["untrusted"]
        assert text is not None and "['note']" in text and "trusted=True" in text
        assert r["trusted"] == Fraction(1, 3)
        text = r["two_meshes"]
        assert text is not None and "one device mesh" in text and "table on mesh (4,)" in text, text
        assert "model on mesh (2, 2)" in text


def test_a_rank_dying_while_pieces_move(four: Any) -> None:
    _, results = four
    assert results[3] is None  # rank 3 died
    assert [r["death"] for r in results[:3]] == ["SyncError"] * 3
    torn = [r["death_torn"][0] for r in results[:3]]
    assert torn == [False, False, True]  # rank 2 was receiving; ranks 0 and 1 were sources
    assert results[0]["death_torn"][1] and results[1]["death_torn"][1]


@pytest.fixture(scope="module")
def three(four: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Any]]:
    root, _ = four
    saved = tmp_path_factory.mktemp("sharded3")
    return saved, run_on_ranks(_load, 3, args=(str(root / "final"), str(saved)), timeout=120)


def test_a_2x2_checkpoint_loads_resharded_onto_three_ranks(four: Any, three: Any) -> None:
    _, results = four
    reference = results[0]["final"][1]
    from sharded_model import differences

    for r in three[1]:
        assert r["report"] == ("checkpoint", 5, 4)
        assert differences(reference, r["full"]) == []


def test_a_2x2_checkpoint_loads_resharded_onto_two_ranks_and_through_an_object_store(
    four: Any, bucket: Any
) -> None:
    root, results = four
    from sharded_model import differences

    url, opts, fs = bucket
    loaded = run_on_ranks(_load, 2, args=(str(root / "final"), None, (url, opts)), timeout=120)
    path, source, tenure, diff = loaded[0]["s3"]
    assert loaded[1]["s3"][:3] == (path, source, tenure) and (source, tenure) == ("checkpoint", 5)
    assert diff == [] and loaded[1]["s3"][3] == []
    fs.invalidate_cache()
    base = path.removeprefix("s3://")
    assert sorted(p[len(base) + 1 :] for p in fs.find(base)) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
        "manifest.json",
    ]
    for r in loaded:
        assert r["report"] == ("checkpoint", 5, 4)
        assert differences(results[0]["final"][1], r["full"]) == []
        assert r["replicated_root"] == "memory"
        text = r["replicated_named"]
        assert text is not None and "holds a sharded state" in text and "fully_shard" in text


def test_a_checkpoint_of_three_ranks_loads_onto_five(three: Any) -> None:
    saved, results = three
    from sharded_model import differences

    loaded = run_on_ranks(_load, 5, args=(str(saved), None), timeout=150)
    for r in loaded:
        assert r["report"] == ("checkpoint", 6, 3)
        assert differences(results[0]["saved"], r["full"]) == []
