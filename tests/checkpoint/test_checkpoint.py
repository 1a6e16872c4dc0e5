"""Checkpoints: `save`/`load` round trips, format and manifest, atomicity under SIGKILL, integrity, trust,
schema changes, retention, async saves, DCP interop, and the collective behaviour on real gloo ranks.

Single-process tests run without a process group (save simply writes, load simply reads); the grouped
tests spawn 2 gloo ranks once per scenario group and assert in the parent.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import pickle
import random
import signal
import socket
import subprocess
import sys
import time
import warnings
import zlib
from collections import OrderedDict
from pathlib import Path
from typing import Any, NamedTuple

import attrs
import pytest
import torch

import elastic
from dist_harness import run_on_ranks
from elastic.checkpoint import manifest as M
from elastic.checkpoint import read as R
from elastic.checkpoint import saveload as C
from elastic.checkpoint import write as W
from elastic.checkpoint.content import CHUNK, hash_file
from elastic.checkpoint.options import LoadOptions, SaveOptions
from elastic.checkpoint.storage import local as S

# ---------------------------------------------------------------------------------------------------------
# States


class Pair(NamedTuple):
    a: int
    b: torch.Tensor


class Opaque:
    """An arbitrary object: stored in objects.pkl, so it needs trusted=True."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Opaque) and other.value == self.value

    __hash__ = None  # type: ignore[assignment]


@elastic.elastic_state(tenure="step")
@attrs.frozen
class Sub:
    step: int
    w: torch.Tensor


calls: list[Any] = []


@elastic.elastic_state(tenure=lambda s: s.step, on_sync=lambda s, r: calls.append(r))
@attrs.define
class Everything:
    model: torch.nn.Module
    opt: torch.optim.Optimizer
    sched: Any
    scaler: Any
    sub: Sub
    step: int = 0
    best: float = float("inf")
    name: str = "run"
    flag: bool = False
    nothing: Any = None
    t: torch.Tensor = attrs.field(factory=lambda: torch.zeros(4))
    bag: dict = attrs.field(factory=dict)
    seq: list = attrs.field(factory=list)
    pair: tuple = (0, "x")
    nt: Any = None
    od: Any = attrs.field(factory=OrderedDict)
    tags: Any = attrs.field(factory=set)
    dtype: Any = torch.float32
    fn: Any = None
    obj: Any = None
    nosync: torch.Tensor = elastic.field(sync=False, factory=lambda: torch.zeros(2))
    nosave: list = elastic.field(save=False, factory=list)
    mine: dict = elastic.local(factory=dict)


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


def _everything(seed: int, trained: bool) -> Everything:
    model = _model(seed)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**seed)
    s = Everything(model, opt, sched, scaler, Sub(0, torch.zeros(3)))
    if trained:
        for _ in range(2):
            opt.zero_grad()
            model(torch.randn(5, 6)).pow(2).mean().backward()
            opt.step()
            sched.step()
        s.step = 7
        s.best = 0.25
        s.name = "trained"
        s.flag = True
        s.nothing = None
        s.t += 3
        s.bag = {"w": torch.randn(3, 2), 5: "five", ("k", 1): 2.5, "nested": {"x": [1, 2, (3, 4)]}}
        s.seq = [1.5, torch.ones(2, 3).t(), "s", None]  # a transposed (non-contiguous) tensor
        s.pair = (torch.tensor([7]), "p")
        s.nt = Pair(3, torch.arange(3))
        s.od = OrderedDict(b=1, a=torch.ones(1))
        s.tags = {"x", "y"}
        s.dtype = torch.bfloat16
        s.fn = lambda x: x * 7
        s.obj = Opaque(42)
        s.nosync = torch.full((2,), 9.0)
        s.nosave.append("unsaved")
        s.mine["rank"] = "mine"
        object.__setattr__(s, "sub", Sub(7, torch.full((3,), 7.0)))
    return s


@elastic.elastic_state(tenure="step")
@attrs.define
class Plain:
    """Tensors, modules, optimizers and plain data only: never needs trusted=True."""

    model: torch.nn.Module
    opt: torch.optim.Optimizer
    sched: Any
    scaler: Any
    step: int = 0
    losses: list = attrs.field(factory=list)


def _plain(seed: int = 0, steps: int = 0) -> Plain:
    model = _model(seed)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 0.9**e)
    s = Plain(model, opt, sched, torch.amp.GradScaler("cpu"))
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(4, 6)).pow(2).mean().backward()
        opt.step()
        sched.step()
        s.step += 1
        s.losses.append(0.5 / s.step)
    return s


def _sd_equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_sd_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_sd_equal(x, y) for x, y in zip(a, b))
    return bool(a == b)


def _ckpts(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if not p.name.startswith("."))


def _flip(path: Path, offset: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    at = len(data) // 2 if offset is None else offset
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def _resign(directory: Path) -> None:
    """Recompute a manifest's file records and digest after tampering (what an attacker could do)."""
    mpath = directory / "manifest.json"
    manifest = json.loads(mpath.read_text())
    for name, rec in manifest["files"].items():
        rec["size"], rec["crc32_tree"] = hash_file(S.LOCAL, directory / name, rec["chunk"])
    manifest["digest"] = M._digest_of(manifest)
    mpath.write_bytes(M.manifest_bytes(manifest))


# ---------------------------------------------------------------------------------------------------------
# Round trips


def test_round_trip_every_field_kind(tmp_path: Path) -> None:
    src = _everything(1, trained=True)
    saved = elastic.save(src, tmp_path)
    assert isinstance(saved, Path) and saved.parent == tmp_path and saved.name == "ckpt-000000000007"

    dst = _everything(2, trained=False)
    dst.mine["rank"] = "kept"
    dst.nosave.append("kept")
    params = list(dst.model.parameters())
    ptrs = [p.data_ptr() for p in params]
    model, opt, sched, scaler, t, bag = dst.model, dst.opt, dst.sched, dst.scaler, dst.t, dst.bag
    calls.clear()
    report = elastic.load(dst, tmp_path, trusted=True)

    assert report == elastic.LoadReport(
        source="checkpoint", src=0, tenure=7, path=saved, world_size=1, saved_world_size=1
    )
    # identities and storages survive: modules, optimizer, params (in place), tensors, containers
    assert dst.model is model and dst.opt is opt and dst.sched is sched and dst.scaler is scaler
    assert all(a is b for a, b in zip(dst.model.parameters(), params))
    assert [p.data_ptr() for p in dst.model.parameters()] == ptrs
    assert all(p is q for p, q in zip(dst.opt.param_groups[0]["params"], params))
    assert dst.t is t and dst.bag is bag
    # contents
    assert _sd_equal(dst.model.state_dict(), src.model.state_dict())
    assert _sd_equal(dst.opt.state_dict(), src.opt.state_dict())
    assert dst.sched.state_dict() == src.sched.state_dict()
    assert dst.scaler.state_dict() == src.scaler.state_dict()
    assert dst.sub.step == 7 and torch.equal(dst.sub.w, src.sub.w)
    assert (dst.step, dst.best, dst.name, dst.flag, dst.nothing) == (7, 0.25, "trained", True, None)
    assert torch.equal(dst.t, src.t)
    assert _sd_equal(dst.bag, src.bag) and list(dst.bag) == list(src.bag)
    assert _sd_equal(dst.seq, src.seq)
    assert _sd_equal(dst.pair, src.pair) and type(dst.pair) is tuple
    assert type(dst.nt) is Pair and dst.nt.a == 3 and torch.equal(dst.nt.b, torch.arange(3))
    assert type(dst.od) is OrderedDict and list(dst.od) == ["b", "a"]
    assert dst.tags == {"x", "y"} and dst.dtype is torch.bfloat16
    assert dst.fn(2) == 14 and dst.obj == Opaque(42)
    # a sync=False field is restored on the reading rank (here the only one)
    assert torch.equal(dst.nosync, torch.full((2,), 9.0))
    # save=False and local() fields are neither written nor touched
    assert dst.nosave == ["kept"] and dst.mine == {"rank": "kept"}
    # on_sync ran once, with a SyncReport
    assert len(calls) == 1 and isinstance(calls[0], elastic.SyncReport) and calls[0].tenure == 7
    assert elastic.tenure(dst) == 7

    # the next optimizer step matches the source's exactly
    x = torch.randn(5, 6)
    for s in (src, dst):
        s.opt.zero_grad()
        s.model(x).pow(2).mean().backward()
        s.opt.step()
    assert _sd_equal(dst.model.state_dict(), src.model.state_dict())


def test_plain_state_never_needs_trust_and_loads_with_torch(tmp_path: Path) -> None:
    src = _plain(0, steps=3)
    path = elastic.save(src, tmp_path)
    assert isinstance(path, Path)
    assert sorted(os.listdir(path)) == ["manifest.json", "state.pt"]  # no objects.pkl
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["objects"] == []
    # the content file is plain torch: tensors and plain containers, weights_only + mmap
    content = torch.load(path / "state.pt", weights_only=True, mmap=True)
    assert set(content) == {"format", "skeleton", "tensors", "devices"}
    assert all(isinstance(t, torch.Tensor) for t in content["tensors"])

    dst = _plain(5)  # a fresh Adam: no exp_avg yet, allocated from the checkpoint
    assert not dst.opt.state
    report = elastic.load(dst, tmp_path)  # trusted=False
    assert report.source == "checkpoint" and report.tenure == 3
    assert _sd_equal(dst.opt.state_dict(), src.opt.state_dict())
    assert dst.sched.state_dict()["last_epoch"] == 3 and dst.losses == src.losses
    assert dst.scaler.state_dict() == src.scaler.state_dict()


@elastic.elastic_state(tenure="step")
@attrs.define
class Carried:
    """What a checkpoint must carry beyond values: aliasing, layout, requires_grad, generators in place."""

    step: int = 0
    model: Any = None
    base: Any = None
    view: Any = None
    a: Any = None
    b: Any = None
    nhwc: Any = None
    learned: Any = None
    gen: Any = None
    rnd: Any = None
    nprs: Any = None
    npgen: Any = None


def _carried(step: int) -> Carried:
    import numpy as np

    torch.manual_seed(step)
    base = torch.arange(1000.0)
    shared = torch.full((3,), 7.0)
    return Carried(
        step=step,
        model=torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 2)),
        base=base,
        view=base[10:20],
        a=shared,
        b=shared,
        nhwc=torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last),
        learned=torch.ones(2, requires_grad=True),
        gen=torch.Generator().manual_seed(step),
        rnd=random.Random(step),
        nprs=np.random.RandomState(step),
        npgen=np.random.default_rng(step),
    )


def _draws(s: Carried) -> tuple[Any, ...]:
    return (torch.rand(2, generator=s.gen).tolist(), s.rnd.random(), s.nprs.rand(), s.npgen.random())


@pytest.mark.parametrize("blocking", [True, False])
def test_what_a_checkpoint_carries(tmp_path: Path, blocking: bool) -> None:
    src = _carried(3)
    src.model = torch.compile(src.model)  # saved without the `_orig_mod.` prefixes
    handle = elastic.save(src, tmp_path, blocking=blocking)
    path = handle if blocking else handle.wait()  # type: ignore[union-attr]
    assert sorted(os.listdir(path)) == ["manifest.json", "state.pt"]  # generators are plain data
    content = torch.load(path / "state.pt", weights_only=True, mmap=True)
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in content["tensors"]}
    # written once: base+view 4000, a/b 12, nhwc 480, learned 8, the generator 5056 and the model 80 bytes
    assert sum(storages.values()) == 4000 + 12 + 480 + 8 + 5056 + 80
    assert not any(k.startswith("_orig_mod") for k in content["skeleton"]["f"]["model"]["v"]["k"])

    dst = Carried(step=0, model=torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 2)))
    gen, rnd = torch.Generator(), random.Random(0)
    dst.gen, dst.rnd = gen, rnd
    with torch.inference_mode():
        report = elastic.load(dst, tmp_path)  # trusted=False: nothing pickled
    assert report.tenure == 3
    assert dst.view.untyped_storage().data_ptr() == dst.base.untyped_storage().data_ptr()
    assert dst.view.storage_offset() == 10 and torch.equal(dst.view, torch.arange(10.0, 20.0))
    assert dst.a.data_ptr() == dst.b.data_ptr()
    assert dst.nhwc.stride() == src.nhwc.stride() and torch.equal(dst.nhwc, src.nhwc)
    assert dst.learned.requires_grad and dst.learned.is_leaf and not dst.learned.is_inference()
    assert dst.gen is gen and dst.rnd is rnd  # restored in place
    assert _draws(dst) == _draws(src)
    assert _sd_equal(dst.model.state_dict(), src.model._orig_mod.state_dict())
    # and back: a plain model's checkpoint loads into a compiled one
    dst.step = 4
    with torch.no_grad():
        dst.model[0].weight.fill_(2.0)
    elastic.save(dst, tmp_path / "plain")
    back = _carried(0)
    back.model = torch.compile(back.model)
    elastic.load(back, tmp_path / "plain")
    assert torch.equal(back.model._orig_mod[0].weight, torch.full((3, 3), 2.0))


def test_manifest_contents(tmp_path: Path) -> None:
    @elastic.elastic_state(tenure=lambda s: (s.epoch, s.step))
    @attrs.define
    class Epochs:
        w: torch.Tensor
        epoch: int = 2
        step: int = 31
        fn: Any = None

    path = elastic.save(Epochs(torch.arange(1_500_000.0), fn=len), tmp_path)  # state.pt: several chunks
    assert isinstance(path, Path) and path.name == "ckpt-000000000002-000000000031"
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["format"] == "elastic-state" and manifest["version"] == 1
    assert manifest["class"].endswith("test_manifest_contents.<locals>.Epochs")
    assert manifest["fields"] == [
        {"name": "w", "kind": "tensor"},
        {"name": "epoch", "kind": "object"},
        {"name": "step", "kind": "object"},
        {"name": "fn", "kind": "object"},
    ]
    assert manifest["tenure"] == [2, 31] and manifest["tenure_repr"] == "(2, 31)"
    assert manifest["world_size"] == 1 and manifest["writer_rank"] == 0
    assert manifest["created"].endswith("+00:00") and isinstance(manifest["created_ns"], int)
    assert set(manifest["versions"]) == {"python", "torch", "cloudpickle", "elastic-state"}
    assert manifest["versions"]["torch"] == torch.__version__
    assert manifest["objects"] == [
        {"path": "fn", "field": "fn", "type": "builtins.builtin_function_or_method"}
    ]
    assert set(manifest["files"]) == {"state.pt", "objects.pkl"}
    for name, rec in manifest["files"].items():
        data = (path / name).read_bytes()
        assert rec["size"] == len(data) and rec["chunk"] == CHUNK
        chunks = [data[i : i + CHUNK] for i in range(0, len(data), CHUNK)]
        assert len(chunks) == (3 if name == "state.pt" else 1)
        crcs = b"".join(zlib.crc32(c).to_bytes(4, "little") for c in chunks)
        assert rec["crc32_tree"] == hashlib.sha256(crcs).hexdigest()
    assert manifest["digest"] == M._digest_of(manifest)
    assert M.validate(path, S.LOCAL).tenure == (2, 31)


def test_internal_calls_name_their_storage_or_fail(tmp_path: Path) -> None:
    """Forgetting the storage is a TypeError, never the local disk by default."""
    path = elastic.save(_plain(0, steps=1), tmp_path)
    assert isinstance(path, Path)
    manifest = M.validate(path, S.LOCAL).manifest
    forgotten = [
        lambda: M.is_checkpoint_dir(path),  # type: ignore[call-arg]
        lambda: M.validate(path),  # type: ignore[call-arg]
        lambda: M.scan(tmp_path),  # type: ignore[call-arg]
        lambda: R.Verification(path, manifest, "state.pt"),  # type: ignore[call-arg]
        lambda: C.SaveHandle(None, 0, None, None),  # type: ignore[call-arg, arg-type]
        lambda: SaveOptions(root=tmp_path, keep=3, blocking=True, scope="global"),  # type: ignore[call-arg]
        lambda: LoadOptions(root=tmp_path, trusted=False, strict=True),  # type: ignore[call-arg]
    ]
    for call in forgotten:
        with pytest.raises(TypeError, match="storage"):
            call()
    # the public calls resolve it once from the path
    options = SaveOptions.of(tmp_path, keep=None, blocking=False, scope="node", storage_options=None)
    assert options == SaveOptions(storage=S.LOCAL, root=tmp_path, keep=None, blocking=False, scope="node")
    loading = LoadOptions.of(str(tmp_path), trusted=True, strict=False, storage_options=None)
    assert loading == LoadOptions(storage=S.LOCAL, root=tmp_path, trusted=True, strict=False)


def test_directory_names_sort_by_tenure_and_equal_tenures_keep_both(tmp_path: Path) -> None:
    s = _plain()
    for step in (9, 10, 100, 2):
        s.step = step
        elastic.save(s, tmp_path, keep=None)
    assert _ckpts(tmp_path) == [f"ckpt-{n:012d}" for n in (2, 9, 10, 100)]
    s.step = 100
    s.losses = ["second"]
    again = elastic.save(s, tmp_path, keep=None)
    assert isinstance(again, Path) and again.name == "ckpt-000000000100.1"
    # the later checkpoint of two with the same tenure wins
    dst = _plain()
    assert elastic.load(dst, tmp_path).path == again and dst.losses == ["second"]
    assert M.dir_name("epoch-3") == "ckpt-s-epoch-3"
    assert M.dir_name(1.5) < M.dir_name(10.25)
    assert M.dir_name(-1).startswith("ckpt-h-") and M.dir_name(None).startswith("ckpt-h-")


def test_tenure_must_be_json_and_not_none(tmp_path: Path) -> None:
    @elastic.elastic_state(tenure=lambda s: s.t)
    @attrs.define
    class Odd:
        t: Any

    with pytest.raises(TypeError, match=r"tenure \[1\] \(list\) cannot be stored"):
        elastic.save(Odd([1]), tmp_path)
    with pytest.raises(elastic.CheckpointError, match="no rank holds a state to save"):
        elastic.save(Odd(None), tmp_path)
    with pytest.raises(ValueError, match="keep"):
        elastic.save(Odd(1), tmp_path, keep=0)
    with pytest.raises(ValueError, match="scope"):
        elastic.save(Odd(1), tmp_path, scope="host")  # type: ignore[arg-type]
    assert not tmp_path.exists() or _ckpts(tmp_path) == []


def test_node_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GROUP_RANK", "3")
    assert C._node_id() == "group-rank 3"  # torchrun's agent: several per host in tests
    monkeypatch.delenv("GROUP_RANK")
    assert C._node_id() == f"host {socket.gethostname()}"


def test_methods_and_on_sync(tmp_path: Path) -> None:
    src = _plain(0, steps=2)
    path = src.save(tmp_path)  # the generated method
    assert isinstance(path, Path)
    dst = _plain(1)
    report = dst.load(tmp_path)
    assert report.source == "checkpoint" and report.path == path
    assert _sd_equal(dst.model.state_dict(), src.model.state_dict())


# ---------------------------------------------------------------------------------------------------------
# Election on one rank: memory against disk


def test_memory_more_tenured_than_disk_reads_nothing(tmp_path: Path) -> None:
    s = _plain(0, steps=2)
    elastic.save(s, tmp_path)
    ahead = _plain(1, steps=4)
    before = {k: v.clone() for k, v in ahead.model.state_dict().items()}
    calls_before = len(calls)
    report = elastic.load(ahead, tmp_path)
    assert report == elastic.LoadReport(source="memory", src=0, tenure=4, path=None, world_size=1)
    assert _sd_equal(ahead.model.state_dict(), before)
    # equal tenure: memory wins too (a checkpoint must be strictly more tenured)
    same = _plain(3, steps=2)
    before = {k: v.clone() for k, v in same.model.state_dict().items()}
    assert elastic.load(same, tmp_path).source == "memory"
    assert _sd_equal(same.model.state_dict(), before)
    assert len(calls) == calls_before  # Everything's hook, not Plain's


def test_missing_or_empty_root_is_not_an_error(tmp_path: Path) -> None:
    s = _plain()
    s.step = 3
    assert elastic.load(s, tmp_path / "nowhere").source == "memory"
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.txt").write_text("not a checkpoint")
    (tmp_path / "empty" / "other").mkdir()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # unrelated entries are ignored silently
        report = elastic.load(s, tmp_path / "empty")
    assert report == elastic.LoadReport(source="memory", src=0, tenure=3, path=None, world_size=1)


# ---------------------------------------------------------------------------------------------------------
# Integrity


def test_flipped_bytes_and_truncation_fall_back_with_warnings(tmp_path: Path) -> None:
    s = _plain(0)
    for step in (1, 2, 3, 4):
        s.step = step
        s.losses = [float(step)]
        elastic.save(s, tmp_path, keep=None)
    _flip(tmp_path / "ckpt-000000000004" / "state.pt")  # found only when checksums are verified
    content = tmp_path / "ckpt-000000000003" / "state.pt"
    content.write_bytes(content.read_bytes()[:-100])  # found from the manifest's sizes
    (tmp_path / "ckpt-000000000002" / "manifest.json").write_text('{"format": "elastic-state", "vers')
    (tmp_path / ".tmp-somehost-1-abcdef12").mkdir()  # a writer that died: ignored, no warning

    dst = _plain(1)
    with pytest.warns(RuntimeWarning) as record:
        report = elastic.load(dst, tmp_path)
    assert report.path == tmp_path / "ckpt-000000000001" and dst.losses == [1.0]
    texts = [str(w.message) for w in record]
    assert any("ckpt-000000000004/state.pt" in t and "checksum mismatch" in t for t in texts), texts
    assert any("ckpt-000000000003/state.pt" in t and "truncated" in t for t in texts), texts
    assert any("ckpt-000000000002/manifest.json" in t and "not valid JSON" in t for t in texts), texts
    assert not any(".tmp-" in t for t in texts)
    assert elastic.tenure(dst) == 1


def test_a_corrupt_checkpoint_never_costs_the_best_memory_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    streamed: list[Path] = []

    class Counting(R.Verification):
        def __init__(self, directory: Path, *args: Any) -> None:
            streamed.append(directory)
            super().__init__(directory, *args)

    monkeypatch.setattr(R, "Verification", Counting)
    s = _plain(0)
    for step in (3, 9):
        s.step = step
        s.losses = [float(step)]
        elastic.save(s, tmp_path, keep=None)
    _flip(tmp_path / "ckpt-000000000009" / "state.pt")

    # memory at 5 is better than every remaining candidate: checksums are verified before anything is
    # written, so when 9 turns out corrupt the state at 5 is intact and wins
    ahead = _plain(1)
    ahead.step, ahead.losses = 5, [5.0]
    before = {k: v.clone() for k, v in ahead.model.state_dict().items()}
    with pytest.warns(RuntimeWarning, match="checksum mismatch"):
        report = elastic.load(ahead, tmp_path)
    assert report.source == "memory" and report.tenure == 5 and ahead.losses == [5.0]
    assert _sd_equal(ahead.model.state_dict(), before) and streamed == []

    # memory at 2 is worth less than checkpoint 3: it is verified while copied in (one pass), left torn
    # by the corrupt 9, and 3 is loaded next
    behind = _plain(2)
    behind.step = 2
    with pytest.warns(RuntimeWarning, match="checksum mismatch"):
        report = elastic.load(behind, tmp_path)
    assert report.source == "checkpoint" and report.tenure == 3 and behind.losses == [3.0]
    assert [p.name for p in streamed] == ["ckpt-000000000009", "ckpt-000000000003"]
    assert not C._expendable([C._LoadRecord(tenure=5)], [5], 0, (0, 0), set())


def test_pointing_at_one_corrupt_checkpoint_raises(tmp_path: Path) -> None:
    s = _plain(0, steps=1)
    one = elastic.save(s, tmp_path)
    s.step = 5
    five = elastic.save(s, tmp_path)
    assert isinstance(one, Path) and isinstance(five, Path)
    dst = _plain(1)
    assert elastic.load(dst, one).path == one  # a directory: that checkpoint, though a newer one exists
    _flip(one / "state.pt")
    fresh = _plain(2)
    with pytest.warns(RuntimeWarning), pytest.raises(elastic.CheckpointCorruptError, match=r"state\.pt"):
        elastic.load(fresh, one)
    assert elastic.tenure(fresh) == 0  # verified before anything was written: not torn
    (five / "state.pt").unlink()
    with pytest.warns(RuntimeWarning), pytest.raises(elastic.CheckpointCorruptError, match="missing"):
        elastic.load(fresh, five)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda m: m["files"].__setitem__("../escape.pt", m["files"]["state.pt"]), "not a plain name"),
        (lambda m: m["files"].__setitem__("/etc/passwd", m["files"]["state.pt"]), "not a plain name"),
        (lambda m: m["files"]["state.pt"].__setitem__("size", 10), "the manifest says 10"),
        (lambda m: m.__setitem__("version", 99), "format version 99"),
        (lambda m: m.__setitem__("tenure", 8), None),  # tampered without re-signing: digest mismatch
    ],
)
def test_manifest_validation(tmp_path: Path, edit: Any, message: str | None) -> None:
    s = _plain(0, steps=1)
    path = elastic.save(s, tmp_path)
    assert isinstance(path, Path)
    mpath = path / "manifest.json"
    manifest = json.loads(mpath.read_text())
    edit(manifest)
    if message is not None:
        manifest["digest"] = M._digest_of(manifest)
    mpath.write_bytes(M.manifest_bytes(manifest))
    with pytest.raises(M.InvalidCheckpoint, match=message or "its own digest"):
        M.validate(path, S.LOCAL)
    with pytest.warns(RuntimeWarning, match="skipping checkpoint"):
        assert elastic.load(_plain(1), tmp_path).source == "memory"


def test_symlink_out_of_the_checkpoint_is_rejected(tmp_path: Path) -> None:
    path = elastic.save(_plain(0, steps=1), tmp_path / "root")
    assert isinstance(path, Path)
    outside = tmp_path / "outside.pt"
    outside.write_bytes((path / "state.pt").read_bytes())
    (path / "state.pt").unlink()
    (path / "state.pt").symlink_to(outside)
    with pytest.raises(M.InvalidCheckpoint, match="outside the checkpoint"):
        M.validate(path, S.LOCAL)


class Evil:
    """Unpickling this creates a directory: the stand-in for arbitrary code."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (os.mkdir, (self.marker,))


def test_malicious_pickles_never_run(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    s = _everything(0, trained=True)
    root = tmp_path / "root"
    path = elastic.save(s, root)
    assert isinstance(path, Path)
    (path / "objects.pkl").write_bytes(pickle.dumps([Evil(str(marker))]))
    _resign(path)  # an attacker can rewrite the manifest too

    dst = _everything(1, trained=False)
    with pytest.raises(elastic.UntrustedCheckpointError) as info:
        elastic.load(dst, root)
    text = str(info.value)
    assert "'fn'" in text and "'obj'" in text and "'nt'" in text and "trusted=True" in text
    assert "made yourself" in text
    assert not marker.exists()
    assert elastic.tenure(dst) == 0  # refused before anything was written

    # state.pt is loaded with weights_only=True: even trusted=True never runs a pickle hidden there
    s2 = _plain(0, steps=2)
    root2 = tmp_path / "root2"
    s2.step = 1
    elastic.save(s2, root2)
    s2.step = 2
    bad = elastic.save(s2, root2)
    assert isinstance(bad, Path)
    torch.save({"format": 1, "skeleton": Evil(str(marker)), "tensors": [], "devices": []}, bad / "state.pt")
    _resign(bad)
    dst2 = _plain(3)
    with pytest.warns(RuntimeWarning, match="cannot be loaded safely"):
        report = elastic.load(dst2, root2, trusted=True)
    assert report.tenure == 1  # fell back to the previous checkpoint
    assert not marker.exists()


def test_a_failed_read_keeps_the_cause(tmp_path: Path) -> None:
    # torch.load refuses the content file: its whole error (several lines of advice) is the cause
    s = _plain(0, steps=1)
    s.step = 1
    bad = elastic.save(s, tmp_path / "root")
    assert isinstance(bad, Path)
    content = {"format": 1, "skeleton": Evil(str(tmp_path / "pwned")), "tensors": [], "devices": []}
    torch.save(content, bad / "state.pt")
    _resign(bad)
    with (
        pytest.warns(RuntimeWarning, match="cannot be loaded safely"),
        pytest.raises(elastic.CheckpointCorruptError, match="cannot be loaded safely") as info,
    ):
        elastic.load(_plain(1), bad, trusted=True)  # that checkpoint alone: nothing replaces it
    cause = info.value.__cause__
    assert isinstance(cause, pickle.UnpicklingError)
    assert str(cause).startswith("Weights only load failed") and len(str(cause).splitlines()) > 1
    assert not (tmp_path / "pwned").exists()

    # objects that cannot be unpickled here: the unpickler's error is the cause
    @elastic.elastic_state(tenure="step")
    @attrs.define
    class WithObject:
        obj: Any = None
        step: int = 0

    w = WithObject(obj=Evil(str(tmp_path / "made")), step=1)
    path = elastic.save(w, tmp_path / "objects")
    assert isinstance(path, Path)
    (tmp_path / "made").write_text("a file")  # unpickling fails: os.mkdir finds the path taken
    with pytest.raises(elastic.CheckpointError, match="could not unpickle") as info:
        elastic.load(WithObject(), path, trusted=True)
    assert isinstance(info.value.__cause__, FileExistsError)


# ---------------------------------------------------------------------------------------------------------
# Schema changes


def test_strict_and_non_strict_schema_changes(tmp_path: Path) -> None:
    @elastic.elastic_state(tenure="step")
    @attrs.define
    class V1:
        model: torch.nn.Module
        step: int = 0
        old: str = "old"
        kept: list = attrs.field(factory=list)

    @elastic.elastic_state(tenure="step")
    @attrs.define
    class V2:
        model: torch.nn.Module
        step: int = 0
        kept: list = attrs.field(factory=list)
        new: str = "default"

    v1 = V1(_model(0), step=4, kept=[1, 2])
    elastic.save(v1, tmp_path)

    v2 = V2(_model(1))
    with pytest.raises(elastic.CheckpointMismatchError) as info:
        elastic.load(v2, tmp_path)
    text = str(info.value)
    assert "missing from the checkpoint: new" in text and "not in the class: old" in text
    assert "strict=False" in text
    assert v2.step == 0 and elastic.tenure(v2) == 0

    with pytest.warns(RuntimeWarning, match="no longer has, ignored: old"):
        report = elastic.load(v2, tmp_path, strict=False)
    assert report.source == "checkpoint"
    assert (v2.step, v2.kept, v2.new) == (4, [1, 2], "default")
    assert _sd_equal(v2.model.state_dict(), v1.model.state_dict())

    # module shapes that differ are refused before anything is written
    wide = V2(torch.nn.Sequential(torch.nn.Linear(6, 9), torch.nn.ReLU(), torch.nn.Linear(9, 3)))
    before = {k: v.clone() for k, v in wide.model.state_dict().items()}
    shapes = r"0\.weight: shape \(8, 6\) saved, \(9, 6\) here"
    with pytest.warns(RuntimeWarning), pytest.raises(elastic.CheckpointMismatchError, match=shapes):
        elastic.load(wide, tmp_path, strict=False)
    assert _sd_equal(wide.model.state_dict(), before) and elastic.tenure(wide) == 0

    # a field whose kind changed from a module to something else is refused too
    @elastic.elastic_state(tenure="step")
    @attrs.define
    class V3:
        model: Any = None
        step: int = 0
        kept: list = attrs.field(factory=list)
        new: str = ""

    with pytest.warns(RuntimeWarning), pytest.raises(elastic.CheckpointMismatchError, match="holds a module"):
        elastic.load(V3(), tmp_path, strict=False)


@elastic.elastic_state(tenure="step")
@attrs.define
class Restarted:
    """A training script's state whose best loss starts as a float and becomes a 0-d tensor."""

    model: Any = None
    step: int = 0
    best_val_loss: Any = float("inf")
    hist: Any = attrs.field(factory=dict)


def _kind(v: Any) -> Any:
    return (type(v).__name__, v.dtype, v.tolist()) if isinstance(v, torch.Tensor) else (type(v).__name__, v)


def test_a_plain_field_loads_whatever_its_kind_was_when_saved(tmp_path: Path) -> None:
    saved = Restarted(
        step=7, best_val_loss=torch.tensor(0.25, dtype=torch.float64), hist={"val": torch.ones(2)}
    )
    elastic.save(saved, tmp_path / "tensor")
    fresh = Restarted(hist={"val": 0.5, "n": torch.tensor(3)})
    hist = fresh.hist
    report = elastic.load(fresh, tmp_path / "tensor", strict=True)  # plain data: no trusted=True
    assert (report.source, report.tenure) == ("checkpoint", 7)
    assert _kind(fresh.best_val_loss) == ("Tensor", torch.float64, 0.25)
    assert fresh.best_val_loss.shape == () and not fresh.best_val_loss.is_inference()
    assert fresh.hist is hist and {k: _kind(v) for k, v in hist.items()} == {
        "val": ("Tensor", torch.float32, [1.0, 1.0])
    }
    # a tensor of the same shape and dtype is written in place
    mine = torch.zeros((), dtype=torch.float64)
    again = Restarted(best_val_loss=mine)
    elastic.load(again, tmp_path / "tensor")
    assert again.best_val_loss is mine and mine.item() == 0.25
    # and back: floats saved, tensors held
    elastic.save(Restarted(step=8, best_val_loss=0.125, hist={"val": [1.5]}), tmp_path / "float")
    elastic.load(again, tmp_path / "float", strict=True)
    assert (_kind(again.best_val_loss), again.hist) == (("float", 0.125), {"val": [1.5]})
    # a structured field is no plain one: a tensor saved where this state holds a module is refused
    with pytest.raises(
        elastic.CheckpointMismatchError, match="holds a tensor in the checkpoint but a module"
    ):
        elastic.load(Restarted(best_val_loss=torch.nn.Linear(2, 2)), tmp_path / "tensor")
    with pytest.raises(elastic.CheckpointMismatchError, match="holds None in the checkpoint but a module"):
        elastic.load(Restarted(model=torch.nn.Linear(2, 2)), tmp_path / "tensor")


def _restart(rank: int, world: int, root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    # the run before the restart: every rank's best loss had become a 0-d tensor
    s = Restarted(
        torch.nn.Linear(2, 2), step=7, best_val_loss=torch.tensor(0.25), hist={"val": torch.ones(2)}
    )
    elastic.save(s, f"{root}/tensor", timeout=30)
    # torchrun restarts every worker: each builds a fresh state of floats; one reads, the others receive
    fresh = Restarted(torch.nn.Linear(2, 2), hist={"val": 0.5})
    report = elastic.load(fresh, f"{root}/tensor", strict=True, timeout=30)
    out["tensor"] = (report.source, report.tenure, _kind(fresh.best_val_loss), _kind(fresh.hist["val"]))
    # and back: a checkpoint of floats, workers built with tensors
    s = Restarted(torch.nn.Linear(2, 2), step=8, best_val_loss=0.125, hist={"val": 1.5})
    elastic.save(s, f"{root}/float", timeout=30)
    fresh = Restarted(torch.nn.Linear(2, 2), best_val_loss=torch.tensor(9.0), hist={"val": torch.zeros(2)})
    report = elastic.load(fresh, f"{root}/float", strict=True, timeout=30)
    out["float"] = (report.source, report.tenure, _kind(fresh.best_val_loss), _kind(fresh.hist["val"]))
    return out


@pytest.mark.timeout(120)
def test_a_restart_resumes_from_a_checkpoint_whose_plain_field_changed_kind(tmp_path: Path) -> None:
    for r in run_on_ranks(_restart, world=2, args=(str(tmp_path),)):
        assert r["tensor"] == (
            "checkpoint",
            7,
            ("Tensor", torch.float32, 0.25),
            ("Tensor", torch.float32, [1.0, 1.0]),
        )
        assert r["float"] == ("checkpoint", 8, ("float", 0.125), ("float", 1.5))


# ---------------------------------------------------------------------------------------------------------
# Retention, temporary directories, writer errors


def test_retention_keeps_the_most_tenured_and_the_new_one(tmp_path: Path) -> None:
    s = _plain()
    for step in range(1, 6):
        s.step = step
        elastic.save(s, tmp_path, keep=2)
    assert _ckpts(tmp_path) == ["ckpt-000000000004", "ckpt-000000000005"]
    s.step = 3  # less tenured than both: written, and never deleted by its own save
    elastic.save(s, tmp_path, keep=2)
    assert _ckpts(tmp_path) == ["ckpt-000000000003", "ckpt-000000000004", "ckpt-000000000005"]
    s.step = 6
    elastic.save(s, tmp_path, keep=1)
    assert _ckpts(tmp_path) == ["ckpt-000000000006"]
    elastic.save(s, tmp_path, keep=None)
    assert len(_ckpts(tmp_path)) == 2


def test_stale_temporary_directories_are_cleaned(tmp_path: Path) -> None:
    host = S.host_tag()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f".tmp-{host}-{dead.pid}-0123abcd"
    alive = tmp_path / f".tmp-{host}-{os.getppid()}-0123abcd"  # another live process may be writing
    doomed = tmp_path / ".del-ckpt-000000000001-0123abcd"
    foreign = tmp_path / ".tmp-otherhost-12-0123abcd"
    for d in (stale, alive, doomed, foreign):
        d.mkdir(parents=True)
        (d / "state.pt").write_bytes(b"partial")
    s = _plain()
    s.step = 1
    elastic.save(s, tmp_path)
    assert not stale.exists() and not doomed.exists()
    assert alive.exists() and foreign.exists()  # in use, or too recent to judge from another host
    old = time.time() - 3600
    os.utime(foreign, (old, old))
    s.step = 2
    elastic.save(s, tmp_path)
    assert not foreign.exists() and alive.exists()


def test_writer_errors_leave_nothing_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    s = _plain(0, steps=1)
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(elastic.CheckpointError, match=r"afile.*pass a directory"):
        elastic.save(s, afile)
    one = elastic.save(s, tmp_path / "root")
    assert isinstance(one, Path)
    with pytest.raises(elastic.CheckpointError, match="is itself a checkpoint"):
        elastic.save(s, one)
    for phase in ("write", "manifest", "rename"):
        monkeypatch.setenv("ELASTIC_FAULT", f"0:{phase}")
        s.step += 1
        with pytest.raises(elastic.CheckpointError, match=f"fault injected on rank 0 at {phase}"):
            elastic.save(s, tmp_path / "root")
        assert os.listdir(tmp_path / "root") == [one.name]  # no temporary directory, no checkpoint
    monkeypatch.setenv("ELASTIC_FAULT", "0:retain")
    s.step += 1
    assert isinstance(elastic.save(s, tmp_path / "root"), Path)  # durable: a retention failure is logged

    class NoSpace:
        def __reduce__(self) -> Any:
            raise OSError(28, "No space left on device")

    monkeypatch.delenv("ELASTIC_FAULT")

    def full(fd: int, view: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(S, "_write_all", full)
    with pytest.raises(
        elastic.CheckpointError, match=r"No space left on device\. Free disk space, lower keep="
    ) as info:
        elastic.save(s, tmp_path / "root")
    assert isinstance(info.value.__cause__, OSError) and info.value.__cause__.errno == errno.ENOSPC
    monkeypatch.undo()
    assert not [n for n in os.listdir(tmp_path / "root") if n.startswith(".tmp-")]
    s.losses = [NoSpace()]
    with pytest.raises(elastic.CheckpointError, match=r"cannot pickle losses\.0") as info:
        elastic.save(s, tmp_path / "root")
    assert isinstance(info.value.__cause__, TypeError)  # the writer's own exception is the cause
    assert W.explain(OSError(28, "No space left on device")).endswith("lower keep=, or save to another path")


# ---------------------------------------------------------------------------------------------------------
# Async save


def test_async_save_snapshot_wait_and_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    s = _plain(0, steps=1)
    s.step = 10
    handle = elastic.save(s, tmp_path, blocking=False)
    assert isinstance(handle, C.SaveHandle)
    expected = {k: v.clone() for k, v in s.model.state_dict().items()}
    with torch.no_grad():
        for p in s.model.parameters():
            p.add_(100.0)  # after save() returned: not in the checkpoint (a staged copy is written)
    s.losses.append("later")
    path = handle.wait()
    assert path == tmp_path / "ckpt-000000000010" and handle.wait() == path and handle.done()
    dst = _plain(1)
    elastic.load(dst, tmp_path)
    assert _sd_equal(dst.model.state_dict(), expected) and dst.losses == [0.5]

    # a second async save waits for the first before staging
    s.step = 11
    first = elastic.save(s, tmp_path, blocking=False)
    s.step = 12
    second = elastic.save(s, tmp_path, blocking=False)
    assert isinstance(first, C.SaveHandle) and isinstance(second, C.SaveHandle)
    assert first.done()
    assert first.wait().name == "ckpt-000000000011" and second.wait().name == "ckpt-000000000012"

    # the writer's error is raised by wait(), and by the next save if nobody waited
    monkeypatch.setenv("ELASTIC_FAULT", "0:write")
    s.step = 13
    failing = elastic.save(s, tmp_path, blocking=False)
    assert isinstance(failing, C.SaveHandle)
    with pytest.raises(elastic.CheckpointError, match="fault injected on rank 0 at write") as info:
        failing.wait()
    assert type(info.value.__cause__).__name__ == "FaultInjected"
    with pytest.raises(elastic.CheckpointError, match="fault injected"):
        failing.wait()  # the same verdict again
    s.step = 14
    unwaited = elastic.save(s, tmp_path, blocking=False)
    assert isinstance(unwaited, C.SaveHandle)
    while not unwaited.done():  # local: does not settle the handle
        time.sleep(0.01)
    monkeypatch.delenv("ELASTIC_FAULT")
    previous = r"previous save\(blocking=False\) failed.*fault injected"
    with pytest.raises(elastic.CheckpointError, match=previous) as info:
        elastic.save(s, tmp_path)
    assert isinstance(info.value.__cause__, elastic.CheckpointError)  # the unwaited handle's error
    assert elastic.save(s, tmp_path) == tmp_path / "ckpt-000000000014"
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".tmp-")]


# ---------------------------------------------------------------------------------------------------------
# torch.distributed.checkpoint


def test_dcp_round_trip(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    src = _everything(3, trained=True)
    src.fn = None  # DCP pickles objects itself; keep the comparison simple
    src.seq = [1.5, "s", None]  # DCP's planner does not match lists that mix tensors and other values
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"app": src}, checkpoint_id=str(tmp_path / "dcp"))
        dst = _everything(4, trained=True)  # same structure (optimizer state exists), other values
        object.__setattr__(dst, "sub", Sub(0, torch.zeros(3)))
        dst.step, dst.t, dst.seq = 0, torch.zeros(4), []
        params = list(dst.model.parameters())
        dcp.load({"app": dst}, checkpoint_id=str(tmp_path / "dcp"))
    assert all(a is b for a, b in zip(dst.model.parameters(), params))
    assert _sd_equal(dst.model.state_dict(), src.model.state_dict())
    assert _sd_equal(dst.opt.state_dict(), src.opt.state_dict())
    assert dst.sched.state_dict() == src.sched.state_dict()
    assert dst.step == 7 and torch.equal(dst.t, src.t) and torch.equal(dst.sub.w, src.sub.w)
    assert dst.obj == Opaque(42) and dst.nt.a == 3 and torch.equal(dst.nt.b, src.nt.b)

    # DCP can only fill tensors the target has: a fresh optimizer is reported, not silently skipped
    fresh = _everything(5, trained=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(Exception, match="optimizer field 'opt' has no state yet"):
            dcp.load({"app": fresh}, checkpoint_id=str(tmp_path / "dcp"))


def test_state_dict_protocol_without_dcp() -> None:
    src = _plain(0, steps=2)
    sd = src.state_dict()
    assert set(sd) == {"model", "opt", "sched", "scaler", "step", "losses", "_elastic"}
    dst = _plain(1)
    with pytest.raises(elastic.CheckpointMismatchError, match="has no state yet"):
        dst.load_state_dict({**sd, "opt": {"state": {}, "param_groups": sd["opt"]["param_groups"]}})
    dst = _plain(1)
    dst.load_state_dict(sd)
    assert _sd_equal(dst.model.state_dict(), src.model.state_dict())
    assert _sd_equal(dst.opt.state_dict(), src.opt.state_dict()) and dst.step == 2


# ---------------------------------------------------------------------------------------------------------
# Atomicity: writers killed at any point


@elastic.elastic_state(tenure="step")
@attrs.define
class Big:
    model: torch.nn.Module
    blob: torch.Tensor
    step: int = 0
    losses: list = attrs.field(factory=list)


def _kill_state(step: int) -> Big:
    s = Big(_model(0), torch.empty(2**21))  # 8 MiB: saves take long enough to be hit at any point
    with torch.no_grad():
        for p in s.model.parameters():
            p.fill_(float(step))
        s.blob.fill_(float(step))
    s.step = step
    s.losses = [float(step)] * 100
    return s


def _consistent(s: Big) -> bool:
    step = float(s.step)
    tensors = [*s.model.parameters(), s.blob]
    return all(bool((t == step).all()) for t in tensors) and s.losses == [step] * 100


def _save_forever(root: Path, fault: str | None) -> None:
    """The body of a forked child: continue from the newest checkpoint, save until killed."""
    try:
        torch.set_num_threads(1)
        if fault:
            os.environ["ELASTIC_FAULT"] = fault
        s = _kill_state(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            elastic.load(s, root)
        step = s.step
        while True:
            step += 1
            elastic.save(_kill_state(step), root, keep=2)
    finally:
        os._exit(3)


@pytest.mark.timeout(90)
def test_sigkill_during_save_never_publishes_a_partial_checkpoint(tmp_path: Path) -> None:
    root = tmp_path / "root"
    rng = random.Random(1234)
    plan: list[tuple[str | None, float]] = [(None, rng.uniform(0.02, 0.3)) for _ in range(16)]
    plan += [(f"0:{phase}:die", 3.0) for phase in ("write", "manifest", "rename", "retain")]
    rng.shuffle(plan)
    plan.insert(0, (None, 0.5))  # make sure the first child gets some checkpoints written
    steps_seen = []
    for fault, delay in plan:
        pid = os.fork()
        if pid == 0:
            _save_forever(root, fault)
        deadline, ended = time.monotonic() + delay, False
        while not ended and time.monotonic() < deadline:
            time.sleep(0.01)
            ended = os.waitpid(pid, os.WNOHANG) != (0, 0)  # a child that dies at its fault point ends early
        if not ended:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        s = _kill_state(0)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a killed writer leaves nothing that looks damaged
            report = elastic.load(s, root)
        assert _consistent(s), (fault, delay, report)
        if report.source == "checkpoint":
            steps_seen.append(report.tenure)
    assert len(set(steps_seen)) >= 2, steps_seen  # the children made progress between kills
    assert steps_seen == sorted(steps_seen)

    # a real interpreter killed at a random moment, from a subprocess
    script = (
        "import sys, torch, attrs, elastic\n"
        "@elastic.elastic_state(tenure='step')\n"
        "@attrs.define\n"
        "class S:\n"
        "    w: torch.Tensor\n"
        "    step: int = 0\n"
        "s = S(torch.zeros(1 << 20))\n"
        "while True:\n"
        "    s.step += 1\n"
        "    s.w.fill_(s.step)\n"
        "    elastic.save(s, sys.argv[1], keep=2)\n"
        "    print(s.step, flush=True)\n"
    )
    sub_root = tmp_path / "sub"
    proc = subprocess.Popen([sys.executable, "-c", script, str(sub_root)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        for _ in range(3):
            proc.stdout.readline()
        time.sleep(rng.uniform(0.0, 0.05))
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()

    @elastic.elastic_state(tenure="step")
    @attrs.define
    class S:
        w: torch.Tensor
        step: int = 0

    got = S(torch.zeros(1 << 20))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        report = elastic.load(got, sub_root)
    assert report.source == "checkpoint" and got.step >= 3 and bool((got.w == got.step).all())


# ---------------------------------------------------------------------------------------------------------
# Real process groups


def _grouped_checks(rank: int, world: int, base: str, single_ckpt: str) -> dict[str, Any]:
    import elastic.checkpoint.write as writer

    out: dict[str, Any] = {}
    root = Path(base) / "shared"

    def state(seed: int, step: int) -> Plain:
        s = _plain(seed)
        with torch.no_grad():
            for p in s.model.parameters():
                p.fill_(float(step))
        s.step = step
        s.losses = [float(seed)]
        return s

    # 1. save: the most tenured rank writes; every rank gets the path
    s = state(rank, 3 + 2 * rank)  # rank 1 is ahead
    path = elastic.save(s, root, timeout=30)
    out["save_path"] = str(path)
    out["writer"] = json.loads((Path(path) / "manifest.json").read_text())["writer_rank"]

    # 2. memory more tenured than disk: nothing is read, the most tenured memory is synced
    s = state(rank, 10 * rank)  # rank 0: step 0, rank 1: step 10 > checkpoint's 5
    report = elastic.load(s, root, timeout=30)
    out["memory_report"] = report
    out["memory_state"] = (s.step, s.losses, float(next(s.model.parameters())[0, 0]))

    # 3. a checkpoint more tenured than all memory: read by one rank, broadcast to all
    s = state(rank, rank)
    report = elastic.load(s, root, timeout=30)
    out["disk_report"] = report
    out["disk_state"] = (s.step, s.losses, float(next(s.model.parameters())[0, 0]))

    # 4. node-local disks: one directory per rank; the rank that holds the best checkpoint reads it...
    mine = Path(base) / f"local{rank}"

    def write_local(step: int) -> None:
        w = state(10 + rank, step)
        options = SaveOptions(storage=S.LOCAL, root=mine, keep=None, blocking=True, scope="rank")
        assert writer.run_job(writer.prepare(w, options, rank=rank, world=1, tenure=step)).error is None

    for step in (3, 7) if rank == 1 else (5,):
        write_local(step)
    s = state(rank, 0)
    out["best_report"] = elastic.load(s, mine, timeout=30)
    out["best_state"] = (s.step, s.losses)
    #    ... and when its newest one is damaged, the group re-elects (rank 0's is next)
    write_local(9 if rank == 1 else 8)
    if rank == 1:
        _flip(mine / "ckpt-000000000009" / "state.pt")
    s = state(rank, 0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = elastic.load(s, mine, timeout=30)
    out["local_report"] = report
    out["local_state"] = (s.step, s.losses)
    out["local_warnings"] = [str(w.message) for w in caught]

    # 5. scope="node" (GROUP_RANK = rank): each node writes its own copy, after syncing the lagging one
    os.environ["GROUP_RANK"] = str(rank)
    s = state(rank, 20 + rank)
    path = elastic.save(s, Path(base) / f"node{rank}", scope="node", timeout=30)
    out["node_path"] = str(path)
    out["node_step"] = s.step
    del os.environ["GROUP_RANK"]

    # 6. the writer's error reaches every rank (rank 1 is the writer and fails)
    s = state(rank, 30 + rank)
    if rank == 1:
        os.environ["ELASTIC_FAULT"] = "1:write"
    try:
        elastic.save(s, root, timeout=30)
    except elastic.CheckpointError as exc:
        out["writer_error"] = str(exc)
    # ... and from an async save, through wait()
    handle = elastic.save(s, root, blocking=False, timeout=30)
    try:
        handle.wait()
    except elastic.CheckpointError as exc:
        out["async_error"] = str(exc)
    os.environ.pop("ELASTIC_FAULT", None)
    handle = elastic.save(s, root, blocking=False, timeout=30)
    out["async_path"] = str(handle.wait())

    # 7. a checkpoint written by a single process, loaded by two: both world sizes reported
    s = state(rank, 0)
    out["single_report"] = elastic.load(s, single_ckpt, timeout=30)

    # 8. refusing to unpickle reaches every rank
    e = _everything(rank, trained=rank == 1)
    elastic.save(e, Path(base) / "objects", timeout=30)
    e = _everything(rank, trained=False)
    try:
        elastic.load(e, Path(base) / "objects", timeout=30)
    except elastic.UntrustedCheckpointError as exc:
        out["untrusted"] = str(exc)

    # 9. a rank that does not take part: the other gets a timeout error naming the operation and phase
    if rank == 0:
        try:
            elastic.save(e, Path(base) / "alone", timeout=2)
        except elastic.ElasticError as exc:
            out["alone"] = (type(exc).__name__, str(exc))
    else:
        time.sleep(4)
    return out


@pytest.mark.timeout(120)
def test_grouped_save_and_load(tmp_path: Path) -> None:
    single = _plain(7, steps=4)
    single_ckpt = elastic.save(single, tmp_path / "single")
    r0, r1 = run_on_ranks(_grouped_checks, world=2, args=(str(tmp_path), str(single_ckpt)), timeout=110)

    root = tmp_path / "shared"
    assert r0["save_path"] == r1["save_path"] == str(root / "ckpt-000000000005")
    assert r0["writer"] == 1

    for r in (r0, r1):
        assert r["memory_report"] == elastic.LoadReport("memory", 1, 10, None, 2)
        assert r["memory_state"] == (10, [1.0], 10.0)
        assert r["disk_report"] == elastic.LoadReport("checkpoint", 0, 5, root / "ckpt-000000000005", 2, 2)
        assert r["disk_state"] == (5, [1.0], 5.0)
        assert r["best_report"] == elastic.LoadReport(
            "checkpoint", 1, 7, tmp_path / "local1" / "ckpt-000000000007", 2, 1
        )
        assert r["best_state"] == (7, [11.0])
        assert r["local_report"].source == "checkpoint" and r["local_report"].src == 0
        assert r["local_report"].tenure == 8
        assert r["local_report"].path == tmp_path / "local0" / "ckpt-000000000008"
        assert r["local_state"] == (8, [10.0])
        assert r["node_step"] == 21
        assert (
            "on rank 1 (the writer)" in r["writer_error"]
            and "fault injected on rank 1 at write" in r["writer_error"]
        )
        assert "on rank 1 (the writer)" in r["async_error"] and "fault injected" in r["async_error"]
        assert r["async_path"] == str(root / "ckpt-000000000031")
        assert r["single_report"].world_size == 2 and r["single_report"].saved_world_size == 1
        assert r["single_report"].source == "checkpoint" and r["single_report"].tenure == 4
        assert "trusted=True" in r["untrusted"] and "read by rank" in r["untrusted"]
    assert any("local1/ckpt-000000000009/state.pt" in w and "checksum" in w for w in r1["local_warnings"])
    kind, text = r0["alone"]
    assert kind == "SyncError" and "save timed out in phase 'save-elect'" in text
    assert r0["node_path"] == str(tmp_path / "node0" / "ckpt-000000000021")
    assert r1["node_path"] == str(tmp_path / "node1" / "ckpt-000000000021")
    for rank in (0, 1):
        assert M.validate(tmp_path / f"node{rank}" / "ckpt-000000000021", S.LOCAL).tenure == 21
