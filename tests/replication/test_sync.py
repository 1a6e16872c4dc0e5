"""`sync` on real gloo ranks: election, every field kind, in-place writes, errors on every rank, torn states.

Each test is one spawn of 2-3 ranks that runs several checks in sequence, to keep CI time down.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import attrs
import pytest
import torch

import elastic
from dist_harness import run_on_ranks


@elastic.elastic_state(tenure="step")
@attrs.frozen
class Sub:
    step: int
    w: torch.Tensor


def _state_class() -> Any:
    calls: list[Any] = []

    @elastic.elastic_state(tenure=lambda s: s.step, on_sync=lambda s, r: calls.append(r))
    @attrs.define(slots=True)
    class State:
        model: torch.nn.Module
        opt: torch.optim.Optimizer
        sched: Any
        scaler: Any
        sub: Sub
        step: Any = 0
        ema: Any = None
        bag: dict = attrs.field(factory=dict)
        seq: list = attrs.field(factory=list)
        pair: tuple = (0, 0)
        fn: Any = None
        mine: dict = elastic.local(factory=dict)

    return State, calls


def _build(rank: int, State: Any, trained: bool, steps: int) -> Any:
    torch.manual_seed(100 + rank)  # every rank starts from a different initialisation
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=float(rank + 1))
    s = State(model, opt, sched, scaler, Sub(0, torch.zeros(3)))
    if trained:
        for _ in range(steps):
            opt.zero_grad()
            model(torch.randn(4, 8)).pow(2).mean().backward()
            opt.step()
            sched.step()
        s.step = steps
        s.ema = torch.full((5,), float(rank))
        s.bag = {"big": torch.randn(600, 600), "small": torch.arange(10), "note": f"rank {rank}"}
        s.seq = [1.5, torch.ones(2, 3).t()]
        s.pair = (torch.tensor([rank]), "p")
        offset = rank * 1000
        s.fn = lambda x: x + offset  # a closure: travels by value
        object.__setattr__(s, "sub", Sub(steps, torch.full((3,), float(steps))))
    else:
        s.ema = torch.zeros(2)  # mis-shaped: allocated from the source's metadata
        s.bag = {"small": torch.zeros(10, dtype=torch.int64)}  # "big" missing: allocated
    s.mine["rank"] = rank
    return s


def _fingerprint(s: Any) -> dict[str, Any]:
    out = {f"model.{k}": v.clone() for k, v in s.model.state_dict().items()}
    for idx, st in s.opt.state_dict()["state"].items():
        for k, v in st.items():
            out[f"opt.{idx}.{k}"] = v.clone() if isinstance(v, torch.Tensor) else v
    out["lr"] = s.opt.param_groups[0]["lr"]
    out["sched"] = s.sched.state_dict()
    out["scale"] = s.scaler.get_scale()
    out["step"] = s.step
    out["ema"] = s.ema.clone()
    out["bag.big"] = s.bag["big"].clone()
    out["bag.small"] = s.bag["small"].clone()
    out["bag.note"] = s.bag["note"]
    out["seq"] = [s.seq[0], s.seq[1].clone()]
    out["pair"] = (s.pair[0].clone(), s.pair[1])
    out["fn(1)"] = s.fn(1)
    out["sub"] = (s.sub.step, s.sub.w.clone())
    return out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return bool(a == b)


def _election_and_kinds(rank: int, world: int) -> dict[str, Any]:
    import elastic.replication.transport.broadcast as transport
    import elastic.replication.transport.default as transports

    # several buckets even for this small state
    transports.set_default_transport(transport.BroadcastTransport(bucket_bytes=64 * 1024))
    State, calls = _state_class()
    # rank 0 is brand new (no state at all), rank 1 trained 2 steps, rank 2 trained 3 steps
    s = _build(rank, State, trained=rank > 0, steps=rank + 1)
    if rank == 0:
        s.step = None  # "I hold no state": least tenured
    out: dict[str, Any] = {"elected": elastic.most_tenured_rank(s)}
    params = list(s.model.parameters())
    ptrs = [p.data_ptr() for p in params]
    opt, model, bag, seq = s.opt, s.model, s.bag, s.seq
    source_before = _fingerprint(s) if rank == 2 else None

    report = elastic.sync(s, timeout=timedelta(seconds=30))
    out["report"] = report
    out["calls"] = list(calls)
    out["fp"] = _fingerprint(s)
    out["identity"] = (
        [p.data_ptr() for p in s.model.parameters()] == ptrs
        and all(a is b for a, b in zip(s.model.parameters(), params))
        and s.opt is opt
        and s.model is model
        and s.bag is bag
        and s.seq is seq
        and all(p is q for p, q in zip(s.opt.param_groups[0]["params"], params))
    )
    out["mine"] = dict(s.mine)
    out["tenure"] = elastic.tenure(s)
    if source_before is not None:
        out["source_unchanged"] = _same(source_before, out["fp"])

    # A fresh Adam that received a trained Adam's state steps exactly like the source.
    x = torch.arange(32.0).view(4, 8) / 32
    s.opt.zero_grad()
    s.model(x).pow(2).mean().backward()
    s.opt.step()
    out["after_step"] = [p.detach().clone() for p in s.model.parameters()]

    # Nothing to move: same tenure and lineage everywhere (replicas kept identical by training).
    s.step += 1
    out["fast"] = elastic.sync(s)
    # force always moves
    out["forced"] = elastic.sync(s, force=True)
    # ties go to the lowest rank; an explicit src overrides the election
    out["tie"] = elastic.most_tenured_rank(s)
    out["explicit"] = elastic.broadcast_state(s, 1)
    # src must be the same everywhere
    try:
        elastic.sync(s, src=rank)
    except elastic.SyncError as exc:
        out["src_error"] = str(exc)
    return out


@pytest.mark.timeout(120)
def test_election_every_kind_in_place_and_fast_path() -> None:
    results = run_on_ranks(_election_and_kinds, 3)
    assert [r["elected"] for r in results] == [2, 2, 2]
    for r in results:
        report = r["report"]
        assert (report.src, report.tenure, report.world_size) == (2, 3, 3)
        assert report.tensor_bytes > 600 * 600 * 4 and report.object_bytes > 0
        assert r["calls"] == [report]  # on_sync ran once, with the report
        assert r["identity"], "parameters, optimizer and containers must keep their identity"
        assert r["tenure"] == 3
    src_fp = results[2]["fp"]
    assert results[2]["source_unchanged"]
    for r in results[:2]:
        assert _same(r["fp"], src_fp), "every field must arrive equal"
        assert r["fp"]["fn(1)"] == 2001  # the closure of rank 2
    assert [r["mine"] for r in results] == [{"rank": 0}, {"rank": 1}, {"rank": 2}]  # local: untouched
    for r in results[:2]:
        assert all(torch.equal(a, b) for a, b in zip(r["after_step"], results[2]["after_step"]))
    for r in results:
        assert r["fast"].tensor_bytes == 0 and r["fast"].object_bytes == 0 and r["fast"].tenure == 4
        assert r["forced"].tensor_bytes > 0 and r["forced"].src == 0
        assert r["tie"] == 0
        assert r["explicit"].src == 1 and r["explicit"].tensor_bytes > 0
        assert "must be the same on every rank" in r["src_error"]
        assert "{'0': 0, '1': 1, '2': 2}" in r["src_error"]


def _errors(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}

    @elastic.elastic_state(tenure=lambda s: s.tenure_value)
    @attrs.define
    class T:
        model: torch.nn.Module
        tenure_value: Any = 0

    def attempt(key: str, s: Any) -> None:
        try:
            elastic.sync(s, timeout=20)
            out[key] = None
        except elastic.ElasticError as exc:
            out[key] = (type(exc).__name__, str(exc))

    # schema mismatch: module shapes differ
    attempt("schema", T(torch.nn.Linear(4, 4 + rank)))
    # NaN tenure
    attempt("nan", T(torch.nn.Linear(2, 2), float("nan") if rank == 1 else 1.0))
    # incomparable tenures
    attempt("types", T(torch.nn.Linear(2, 2), "step-3" if rank == 1 else 3))
    # tenures of a type that has no order
    attempt("unordered", T(torch.nn.Linear(2, 2), {"a": rank}))

    @elastic.elastic_state(tenure=lambda s: s["missing"] if isinstance(s, dict) else s.tenure_value[0])
    @attrs.define
    class U:
        tenure_value: Any = (0,)

    attempt("raise_fn", U(() if rank == 1 else (1,)))

    # a state of another class on one rank
    @elastic.elastic_state(tenure="step")
    @attrs.define
    class Other:
        step: int = 0

    attempt("class", T(torch.nn.Linear(2, 2)) if rank == 0 else Other())
    # the group survives all of these: a normal sync still works
    ok = T(torch.nn.Linear(2, 2), rank)
    out["after"] = elastic.sync(ok).src
    # a field value cloudpickle cannot serialise (only the source pickles)
    import threading

    @elastic.elastic_state(tenure="step")
    @attrs.define
    class L:
        step: int = 0
        lock: Any = None

    attempt("pickle", L(step=rank, lock=threading.Lock()))
    # a sparse tensor on the source: every rank gets the error naming the tensor and the fix
    attempt("sparse", L(step=5 if rank == 1 else 0, lock=torch.eye(2).to_sparse() if rank == 1 else None))
    # sync called on only some ranks: the caller times out with an error that says what to do
    if rank == 0:
        try:
            elastic.sync(L(step=1), timeout=timedelta(seconds=2))
        except elastic.SyncError as exc:
            out["alone"] = (str(exc), exc.phase)
    else:
        import time

        time.sleep(4)  # alive, but elsewhere in its program
    return out


@pytest.mark.timeout(120)
def test_errors_reach_every_rank_before_anything_moves() -> None:
    results = run_on_ranks(_errors, 2)
    for key in ("schema", "nan", "types", "unordered", "raise_fn", "class", "pickle", "sparse"):
        assert results[0][key] == results[1][key], f"{key}: every rank raises the same error"
    kind, msg = results[0]["schema"]
    assert kind == "StateMismatchError"
    assert "field 'model'" in msg and "weight: shape (4, 4) torch.float32 on rank 0" in msg
    assert "shape (5, 4) torch.float32 on rank 1" in msg and "nothing was moved" in msg
    kind, msg = results[0]["nan"]
    assert kind == "TenureError" and "NaN on rank 1" in msg
    kind, msg = results[0]["types"]
    assert kind == "TenureError" and "rank 0 has 3 (int) and rank 1 has 'step-3' (str)" in msg
    kind, msg = results[0]["unordered"]
    assert kind == "TenureError" and "rank 0 has {'a': 0} (dict) and rank 1 has {'a': 1} (dict)" in msg
    kind, msg = results[0]["raise_fn"]
    assert kind == "TenureError" and "on rank 1 the tenure function raised IndexError" in msg
    kind, msg = results[0]["class"]
    assert kind == "StateMismatchError" and "on rank 0" in msg and "Other on rank 1" in msg
    assert results[0]["after"] == results[1]["after"] == 1
    kind, msg = results[0]["sparse"]
    assert kind == "SyncError" and "tensor lock has layout torch.sparse_coo" in msg and "to_dense()" in msg
    msg, phase = results[0]["alone"]
    assert phase == "elect" and "timed out in phase 'elect' on rank 0 after 2s" in msg
    assert "Every rank of the group must call sync()" in msg
    kind, msg = results[0]["pickle"]
    assert kind == "SyncError" and "field 'lock'" in msg and "_thread.lock" in msg and "rank 1" in msg


def _torn(rank: int, world: int) -> dict[str, Any]:
    import os

    import elastic.replication.transport.broadcast as transport
    import elastic.replication.transport.default as transports

    transports.set_default_transport(transport.BroadcastTransport(bucket_bytes=512))  # about six buckets
    State, _ = _state_class()
    s = _build(rank, State, trained=True, steps=rank + 1)
    out: dict[str, Any] = {}
    # 1) a receiver fails while applying (rank 0 injected): every rank raises, receivers torn
    os.environ["ELASTIC_FAULT"] = "0:apply"
    before = _fingerprint(s)
    try:
        elastic.sync(s, timeout=20)
    except elastic.SyncError as exc:
        out["apply_error"] = (str(exc), exc.phase)
    out["torn_after_apply"] = elastic.tenure(s)
    if rank == 2:
        out["source_unchanged"] = _same(before, _fingerprint(s))
    del os.environ["ELASTIC_FAULT"]
    # 2) a torn rank never wins, whatever its step says
    if rank == 0:
        s.step = 1000
    out["elected_after"] = elastic.most_tenured_rank(s)
    rep = elastic.sync(s, timeout=20)
    out["resync"] = (rep.src, elastic.tenure(s))
    # 3) a receiver (rank 1) is killed mid-transfer, at bucket 1: the survivors raise SyncError within
    #    the timeout; the other receiver is torn, the source keeps its state and tenure
    os.environ["ELASTIC_FAULT"] = "1:bucket 1:die"
    s.step = 50 if rank == 2 else 40
    before = _fingerprint(s)
    try:
        elastic.sync(s, force=True, timeout=10)
        out["died"] = None
    except elastic.SyncError as exc:
        out["died"] = (str(exc), exc.phase)
    out["tenure_after_death"] = elastic.tenure(s)
    if rank == 2:
        out["source_unchanged_after_death"] = _same(before, _fingerprint(s))
    return out


@pytest.mark.timeout(120)
def test_failures_tear_receivers_and_never_hang() -> None:
    results = run_on_ranks(_torn, 3, allow_exit=True, pg_timeout=60)
    for r in (results[0],):
        msg, phase = r["apply_error"]
        assert "failed on rank 0 (receiver)" in msg and "fault injected on rank 0 at apply" in msg
        assert phase == "apply"
        assert r["torn_after_apply"] is None
        assert r["elected_after"] == 2
        assert r["resync"] == (2, 3)
    msg, _ = results[2]["apply_error"]
    assert "failed on rank 0" in msg
    assert results[2]["source_unchanged"] and results[2]["torn_after_apply"] == 3
    assert results[2]["resync"] == (2, 3)
    # rank 1 died at bucket 1 and reported nothing
    assert results[1] is None
    for r in (results[0], results[2]):
        msg, phase = r["died"]
        assert phase.startswith("bucket") or phase == "commit"
        assert "sync" in msg and ("failed in phase" in msg or "timed out in phase" in msg)
    assert results[0]["tenure_after_death"] is None  # torn receiver
    assert results[2]["tenure_after_death"] == 50  # the source is never torn
    assert results[2]["source_unchanged_after_death"]


# -----------------------------------------------------------------------------------------------------------
# What a sync carries (DESIGN "What sync carries, precisely"): one 2-rank spawn checks every item.


class Tied(torch.nn.Module):
    """A language-model-like module whose output layer shares the embedding's weight."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(10, 4)
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(x))


@elastic.elastic_state(tenure="step")
@attrs.define
class Carry:
    model: Any
    opt: Any
    step: int = 0
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
    extra: Any = None


def _carry(rank: int, world: int, root: str) -> dict[str, Any]:
    import random

    import numpy as np
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DistributedSampler

    out: dict[str, Any] = {}
    alone = dist.new_group([0])  # rank 0 wraps its model in DDP on a group of its own
    torch.manual_seed(rank)
    tied = Tied()
    model: Any = DDP(tied, process_group=alone) if rank == 0 else tied
    s = Carry(model, torch.optim.Adam(tied.parameters(), lr=0.1))
    gen, rnd = torch.Generator().manual_seed(rank), random.Random(rank)
    nprs, npgen = np.random.RandomState(rank), np.random.default_rng(rank)
    s.gen, s.rnd, s.nprs, s.npgen = gen, rnd, nprs, npgen
    if rank == 0:
        s.step = 5
        model(torch.tensor([1, 2])).sum().backward()
        s.opt.step()  # rank 1's fresh Adam has no exp_avg: it allocates them
        s.base = torch.arange(12.0)
        s.view = s.base[2:6]
        s.a = s.b = torch.full((3,), 7.0)
        s.nhwc = torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last)
        s.learned = torch.ones(2, requires_grad=True)
    with torch.inference_mode():  # e.g. called from an evaluation loop
        report = elastic.sync(s)
    out["tensor_bytes"] = report.tensor_bytes
    out["tied"] = tied.head.weight is tied.emb.weight
    out["view_shares"] = s.view.untyped_storage().data_ptr() == s.base.untyped_storage().data_ptr()
    out["view"] = (s.view.storage_offset(), s.view.tolist())
    out["a_is_b"] = s.a.data_ptr() == s.b.data_ptr()
    out["nhwc"] = (s.nhwc.stride(), s.nhwc.sum().item())
    out["learned"] = (s.learned.requires_grad, s.learned.is_inference())
    out["same_generators"] = (s.gen, s.rnd, s.nprs, s.npgen) == (gen, rnd, nprs, npgen)
    out["draws"] = (torch.rand(2, generator=gen).tolist(), rnd.random(), nprs.rand(), npgen.random())
    s.opt.zero_grad()
    tied(torch.tensor([3])).sum().backward()
    s.opt.step()  # fails on an inference tensor
    out["weights"] = tied.emb.weight.sum().item()
    elastic.sync(s, force=True)
    elastic.verify(s)  # generators, numpy states and all: identical by value
    out["verified"] = True

    # A checkpoint written from rank 0's DDP-wrapped model loads into plain models, and back.
    written = elastic.save(s, f"{root}/wrapped")
    plain_model = Tied()
    plain = Carry(plain_model, torch.optim.Adam(plain_model.parameters(), lr=0.1))
    elastic.load(plain, f"{root}/wrapped")
    out["ddp to plain"] = (written.name, plain_model.emb.weight.sum().item(), plain.step)
    out["plain tied"] = plain_model.head.weight is plain_model.emb.weight
    plain.step = 6
    with torch.no_grad():
        plain_model.emb.weight.fill_(0.5)
    elastic.save(plain, f"{root}/plain")
    back_model = Tied()
    wrapped = DDP(back_model, process_group=alone) if rank == 0 else back_model
    back = Carry(wrapped, torch.optim.Adam(back_model.parameters(), lr=0.1))
    elastic.load(back, f"{root}/plain")
    out["plain to ddp"] = (back_model.emb.weight.sum().item(), back.step)

    def attempt(key: str, state: Any) -> None:
        before = [p.detach().clone() for p in tied.parameters()]
        try:
            elastic.sync(state, force=True, timeout=20)
            out[key] = None
        except elastic.ElasticError as exc:
            out[key] = (type(exc).__name__, str(exc))
        out[key + " untouched"] = all(torch.equal(p, q) for p, q in zip(before, tied.parameters()))
        out[key + " tenure"] = elastic.tenure(state)

    # an optimizer of another class, or a param group on one rank only: caught before anything moves
    sgd = torch.optim.SGD(tied.parameters(), lr=0.1) if rank == 1 else s.opt
    attempt("optimizer class", Carry(tied, sgd, step=9 - rank))
    groups = torch.optim.Adam([{"params": [tied.emb.weight]}], lr=0.1)
    if rank == 0:
        groups.add_param_group({"params": [torch.nn.Parameter(torch.ones(1))]})
    attempt("param groups", Carry(tied, groups, step=9 - rank))
    sampler = DistributedSampler(list(range(8)), num_replicas=world, rank=rank)
    attempt("sampler", Carry(tied, s.opt, step=9 - rank, extra=sampler))
    mesh = init_device_mesh("cpu", (world,))
    dtensor = distribute_tensor(torch.arange(4.0), mesh)
    attempt("dtensor", Carry(tied, s.opt, step=9 - rank, extra=dtensor))
    return out


@pytest.mark.timeout(120)
def test_what_sync_carries_on_real_ranks(tmp_path: Any) -> None:
    r0, r1 = run_on_ranks(_carry, 2, args=(str(tmp_path),))
    # tied weights, the view and the second field travel once: 40 (tied) + 81 (Adam's two moments and
    # step) + 12 + 3 + 120 + 2 floats, and the generator's 5056 bytes
    assert r0["tensor_bytes"] == r1["tensor_bytes"] == (40 + 81 + 12 + 3 + 120 + 2) * 4 + 5056
    assert r1["tied"] and r1["view_shares"] and r1["a_is_b"]
    assert r1["view"] == (2, [2.0, 3.0, 4.0, 5.0])
    assert r1["nhwc"] == r0["nhwc"] and r1["nhwc"][0] == (60, 1, 15, 3)  # channels_last strides
    assert r1["learned"] == (True, False)
    assert r1["same_generators"] and r1["draws"] == r0["draws"]
    assert r1["weights"] == r0["weights"]
    assert r0["verified"] and r1["verified"]
    for r in (r0, r1):
        assert r["ddp to plain"] == ("ckpt-000000000005", r0["weights"], 5) and r["plain tied"]
        assert r["plain to ddp"] == (0.5 * 40, 6)
    for key, needle in [
        ("optimizer class", "field 'opt': Adam optimizer with 1 param group(s)"),
        ("param groups", "Adam optimizer with 2 param group(s)"),
    ]:
        for r in (r0, r1):
            kind, msg = r[key]
            assert kind == "StateMismatchError" and needle in msg and "nothing was moved" in msg
            assert r[key + " untouched"] and r[key + " tenure"] == 9 - (r is r1)
    assert "SGD optimizer" in r0["optimizer class"][1]
    for r in (r0, r1):
        kind, msg = r["sampler"]
        assert kind == "SyncError" and "field extra holds a torch DistributedSampler" in msg
        assert "elastic.local()" in msg and "elastic.ElasticSampler" in msg
        kind, msg = r["dtensor"]
        # a DTensor field makes the state sharded: tenures 9 and 8 each hold one shard position only
        assert kind == "SyncError" and "no complete version of the sharded state" in msg, msg
        assert "lacks shard position(s) [(1,)]" in msg
        for key in ("sampler", "dtensor"):
            assert r[key + " untouched"] and r[key + " tenure"] == 9 - (r is r1)


# -----------------------------------------------------------------------------------------------------------
# A receiver that fails while decoding or applying: the same SyncError on every rank, promptly.


def _explode_on_rank_one() -> Any:
    import os

    if os.environ.get("RANK") == "1":
        raise RuntimeError("this object cannot be rebuilt on rank 1")
    return "rebuilt"


class Bomb:
    """Pickles fine; unpickling raises on rank 1 (a class missing there, a dtype its torch lacks...)."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (_explode_on_rank_one, ())


class Refuses:
    """A stateful object whose `load_state_dict` raises on rank 1."""

    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        import os

        if os.environ.get("RANK") == "1" and sd["n"] == 13:
            raise ValueError("13 is refused here")
        self.n = sd["n"]


@elastic.elastic_state(tenure="step")
@attrs.define
class Fragile:
    step: int
    w: torch.Tensor
    extra: Any = None
    stateful: Any = attrs.field(factory=Refuses)


def _receiver_failures(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    s = Fragile(step=5 - rank, w=torch.full((4,), float(rank)))
    own = s.w
    if rank == 0:
        s.extra = Bomb()

    def attempt(key: str) -> None:
        try:
            elastic.sync(s, force=True, timeout=100)  # longer than the harness: waiting for it would fail
            out[key] = None
        except elastic.ElasticError as exc:
            out[key] = (type(exc).__name__, str(exc), getattr(exc, "phase", None))
        out[key + " tenure"] = elastic.tenure(s)
        out[key + " w"] = s.w.tolist()

    attempt("decode")  # rank 1 cannot unpickle the source's objects
    if rank == 0:  # a tensor under a dict key rank 1 cannot unpickle: its metadata do not decode there
        s.extra = {Bomb(): torch.ones(2)}
    attempt("key")
    s.extra = None
    elastic.sync(s, timeout=30)  # the next sync on the same group works
    out["after decode"] = (elastic.tenure(s), s.w.tolist(), s.w is own)
    if rank == 0:
        s.step, s.stateful.n = 9, 13
        s.w.fill_(7.0)
    attempt("apply")  # rank 1's load_state_dict raises, after its tensors were written
    if rank == 0:
        s.stateful.n = 14
    report = elastic.sync(s, timeout=30)
    out["after apply"] = (report.src, elastic.tenure(s), s.stateful.n, s.w.tolist())
    return out


@pytest.mark.timeout(120)
def test_a_receiver_failing_to_decode_or_apply_fails_every_rank_promptly() -> None:
    r0, r1 = run_on_ranks(_receiver_failures, 2, timeout=60)
    for r in (r0, r1):
        kind, msg, phase = r["decode"]
        assert kind == "SyncError" and phase == "apply"
        assert "failed on rank 1 (receiver): RuntimeError: this object cannot be rebuilt on rank 1" in msg
        kind, msg, phase = r["apply"]
        assert kind == "SyncError" and "failed on rank 1 (receiver): ValueError: 13 is refused here" in msg
        kind, msg, phase = r["key"]
        assert kind == "SyncError" and "failed on rank 1 (receiver): RuntimeError: this object cannot" in msg
    assert r1["decode tenure"] == 4 and r1["decode w"] == [1.0] * 4  # nothing written: not torn
    assert r1["key tenure"] == 4 and r1["key w"] == [1.0] * 4
    assert r0["decode tenure"] == 5 and r0["decode w"] == [0.0] * 4
    assert r0["after decode"] == r1["after decode"] == (5, [0.0] * 4, True)
    assert r1["apply tenure"] is None and r0["apply tenure"] == 9  # written, then failed: torn
    assert r0["after apply"] == r1["after apply"] == (0, 9, 14, [7.0] * 4)


# -----------------------------------------------------------------------------------------------------------
# Layouts kept between syncs (`elastic.replication.layout`, the transport's kept plans): every change to
# the tensors is seen.


@elastic.elastic_state(tenure="step")
@attrs.define
class Kept:
    step: int
    model: Any
    opt: Any = None
    extra: Any = None


def _kept_layouts(rank: int, world: int) -> dict[str, Any]:
    from elastic.replication import sync as _sync

    out: dict[str, Any] = {}
    placed = []  # receive_targets runs only when this rank's tensor metadata differ from the source's
    inner = _sync.receive_targets

    def spy(*args: Any, **kwargs: Any) -> Any:
        placed.append(1)
        return inner(*args, **kwargs)

    _sync.receive_targets = spy
    torch.manual_seed(rank)
    s = Kept(step=0, model=torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)))
    s.extra = torch.zeros(4, 4)

    def check(key: str, change: Any = None) -> None:
        s.step += 1 if rank == 0 else 0  # rank 0 stays the most tenured: the source of every sync
        if change is not None:
            change()
        with torch.no_grad():  # new values on the source for every sync: a stale layout would show
            if rank == 0:
                for t in s.model.state_dict().values():
                    t.copy_(torch.randn(t.shape))
        params = list(s.model.parameters())
        del placed[:]
        try:
            report = elastic.sync(s, force=True, timeout=20)
        except elastic.ElasticError as exc:
            out[key] = (type(exc).__name__, str(exc))
            return
        sd = s.model.state_dict(keep_vars=True)
        out[key] = {
            "model": [(k, tuple(v.shape), v.stride(), v.tolist()) for k, v in sd.items()],
            "extra": (tuple(s.extra.shape), s.extra.tolist()),
            "opt": None if s.opt is None else repr(s.opt.state_dict()["state"]),
            "in place": all(a is b for a, b in zip(params, s.model.parameters())),
            "placed": len(placed),
            "bytes": report.tensor_bytes,
        }

    check("first")
    check("again")

    def swap_data() -> None:  # new storage under the same parameter, on the receiver
        if rank == 1:
            w = s.model[0].weight
            w.data = w.data.clone()
            out["swapped ptr"] = w.data_ptr()

    check("data swapped", swap_data)
    out["swapped ptr after"] = s.model[0].weight.data_ptr()

    def transpose() -> None:  # the same shape, other strides, on the source only
        if rank == 0:
            s.extra = torch.arange(16.0).view(4, 4).t()

    check("transposed", transpose)

    def reshape_extra() -> None:  # a plain tensor of another shape on the source: allocated on receivers
        if rank == 0:
            s.extra = torch.arange(6.0)

    check("reshaped", reshape_extra)

    def new_layers() -> None:  # the module's layout changes on every rank
        s.model[0] = torch.nn.Linear(4, 3)
        s.model[1] = torch.nn.Linear(3, 4)

    check("new layers", new_layers)

    def receiver_only() -> None:
        if rank == 1:
            s.model[0].bias.data = torch.zeros(5)

    check("receiver only", receiver_only)
    s.model[0].bias.data = torch.zeros(3)
    check("restored")

    def no_grad() -> None:
        if rank == 0:
            s.model[0].weight.requires_grad_(False)

    check("requires_grad", no_grad)
    s.model[0].weight.requires_grad_(True)

    def optimizer() -> None:
        s.opt = torch.optim.Adam(s.model.parameters(), lr=0.1)
        if rank == 0:
            s.model(torch.ones(1, 4)).sum().backward()
            s.opt.step()  # rank 1 has no Adam state yet: allocated

    check("optimizer state on the source only", optimizer)
    check("optimizer state everywhere")

    def untie() -> None:
        s.model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
        s.opt = None

    check("untied", untie)

    def tie() -> None:  # the same names and shapes as before, one storage: its bytes travel once
        s.model[1].weight = s.model[0].weight

    check("tied later", tie)
    out["tied"] = s.model[1].weight is s.model[0].weight
    return out


@pytest.mark.timeout(120)
def test_kept_layouts_see_every_change_to_the_tensors() -> None:
    r0, r1 = run_on_ranks(_kept_layouts, 2)
    for key in [
        "first",
        "again",
        "data swapped",
        "transposed",
        "reshaped",
        "new layers",
        "restored",
        "requires_grad",
        "optimizer state on the source only",
        "optimizer state everywhere",
        "untied",
        "tied later",
    ]:
        a, b = r0[key], r1[key]
        assert a["model"] == b["model"], key
        assert a["extra"] == b["extra"], key
        assert a["opt"] == b["opt"], key
        assert b["in place"] or key == "tied later", key
    # rank 1's own tensors sit as rank 0's: no metadata travel, its tensors are the targets
    # (modules carry no requires_grad: their state dicts hold detached tensors)
    alike = ["first", "again", "data swapped", "new layers", "restored", "requires_grad"]
    for key in [*alike, "optimizer state everywhere"]:
        assert r1[key]["placed"] == 0, key
    # otherwise they are placed from rank 0's metadata
    for key in ["transposed", "reshaped", "optimizer state on the source only"]:
        assert r1[key]["placed"] == 1, key
    assert r1["swapped ptr"] == r1["swapped ptr after"]  # the new storage was written, in place
    assert r1["transposed"]["extra"] == (
        (4, 4),
        torch.arange(16.0).view(4, 4).t().tolist(),
    )
    assert r1["reshaped"]["extra"] == ((6,), [0.0, 1.0, 2.0, 3.0, 4.0, 5.0])
    assert [row[1] for row in r1["new layers"]["model"]] == [(3, 4), (3,), (4, 3), (4,)]
    for r in (r0, r1):
        kind, msg = r["receiver only"]
        assert kind == "StateMismatchError" and "0.bias: shape (3,) torch.float32 on rank 0" in msg
        assert "shape (5,) torch.float32 on rank 1" in msg
    assert r1["optimizer state on the source only"]["opt"] != "{}"
    assert r1["tied"]
    assert r0["untied"]["bytes"] == r1["untied"]["bytes"] == (16 + 4 + 16 + 4 + 6) * 4
    assert r0["tied later"]["bytes"] == r1["tied later"]["bytes"] == (16 + 4 + 4 + 6) * 4


# -----------------------------------------------------------------------------------------------------------
# Kinds of plain fields: a plain field takes the elected value whatever its kind; structured ones must agree.


@elastic.elastic_state(tenure="step")
@attrs.define
class Losses:
    step: int = 0
    val: Any = 0.0


@elastic.elastic_state(tenure="step")
@attrs.define
class Kinds:
    model: Any
    step: int = 0
    best_val_loss: Any = float("inf")
    hist: Any = attrs.field(factory=dict)
    seq: Any = (0.0, 0.0)
    losses: Any = attrs.field(factory=Losses)


def _value(v: Any) -> Any:
    return (type(v).__name__, v.dtype, v.tolist()) if isinstance(v, torch.Tensor) else (type(v).__name__, v)


def _kinds(rank: int, world: int, root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    torch.manual_seed(0)
    s = Kinds(torch.nn.Linear(2, 2))
    hist = s.hist
    # 1) rank 2 trained: its best loss became a 0-d tensor (losses['val']), containers hold other kinds;
    #    ranks 0 and 1 are fresh workers holding the floats they were built with
    if rank == 2:
        s.step = 3
        s.best_val_loss = torch.tensor(0.25, dtype=torch.float64)
        s.hist.update(val=torch.tensor([1.0, 2.0]), n=2)
        s.seq = [torch.ones(2), "x"]
        s.losses.val = torch.tensor(7)
    else:
        s.hist.update(val=0.5, n=torch.tensor(5))
    with torch.inference_mode():  # allocated tensors are ordinary ones all the same
        report = elastic.sync(s, timeout=30)
    best = s.best_val_loss
    out["best"] = (*_value(best), tuple(best.shape), best.is_inference(), best.requires_grad)
    out["hist"] = (s.hist is hist, {k: _value(v) for k, v in s.hist.items()})
    out["seq"] = [_value(v) for v in s.seq] + [type(s.seq).__name__]
    out["losses"] = _value(s.losses.val)
    out["moved"] = (report.src, report.tensor_bytes)
    elastic.verify(s)
    # 2) the replicas agree now: nothing moves; a tensor of the same shape, dtype and device is written in
    #    place (rank 2 holds a new tensor object, the receivers keep theirs)
    out["fast"] = elastic.sync(s).tensor_bytes
    mine = s.best_val_loss
    if rank == 2:
        s.step, s.best_val_loss = 4, torch.tensor(0.125, dtype=torch.float64)
    elastic.sync(s)
    out["in place"] = (s.best_val_loss is mine, s.best_val_loss.item())
    # 3) and back: the source holds floats again
    if rank == 2:
        s.step, s.best_val_loss, s.hist, s.losses.val = 5, 0.0625, {"val": 1.5}, 3.5
    elastic.sync(s)
    out["back"] = (_value(s.best_val_loss), s.hist, _value(s.losses.val))
    # 4) rank 1 restarts at the same tenure, as a fresh worker holding floats, while ranks 0 and 2 trained
    #    on to a tensor: its lineage differs, so it receives even though every tenure is equal
    if rank == 1:
        s = Kinds(torch.nn.Linear(2, 2), step=5)
    else:
        s.best_val_loss = torch.tensor(0.03125)
    report = elastic.sync(s)
    out["restart"] = (report.src, report.tensor_bytes > 0, _value(s.best_val_loss))
    # 5) broadcast_state from a rank whose field holds a float again
    if rank == 1:
        s.best_val_loss = 2.0
    elastic.broadcast_state(s, 1)
    out["broadcast"] = _value(s.best_val_loss)
    # 6) load's in-memory branch (no checkpoint under root): rank 0's tensor wins
    if rank == 0:
        s.step, s.best_val_loss = 6, torch.tensor([9.0])
    loaded = elastic.load(s, root)
    out["load"] = (loaded.source, loaded.src, _value(s.best_val_loss))
    # 7) kinds that differ after all (no sync since) are a divergence, named
    if rank == 0:
        s.best_val_loss = [9.0]
    try:
        elastic.verify(s)
        out["diverged"] = None
    except elastic.DivergenceError as exc:
        out["diverged"] = str(exc)
    elastic.sync(s, force=True)

    # 8) structure must still agree: a module of another shape on rank 1, no module on rank 2 (and another
    #    kind in a plain field, which is no mismatch): every rank raises before anything moves
    def attempt(key: str, state: Any) -> None:
        try:
            elastic.sync(state, timeout=20)
            out[key] = None
        except elastic.ElasticError as exc:
            out[key] = (type(exc).__name__, str(exc))
        out[key + " kept"] = (elastic.tenure(state), _value(state.best_val_loss))

    other = Kinds(torch.nn.Linear(2, 2 + (rank == 1)), step=10 + rank, best_val_loss=float(rank))
    attempt("shapes", other)
    attempt("no module", Kinds(None if rank == 2 else torch.nn.Linear(2, 2), step=10 + rank))
    return out


@pytest.mark.timeout(120)
def test_plain_fields_take_the_elected_value_whatever_its_kind(tmp_path: Any) -> None:
    results = run_on_ranks(_kinds, 3, args=(str(tmp_path / "empty"),))
    for r in results:
        assert r["best"] == ("Tensor", torch.float64, 0.25, (), False, False)
        assert r["hist"][1] == {"val": ("Tensor", torch.float32, [1.0, 2.0]), "n": ("int", 2)}
        assert r["seq"] == [("Tensor", torch.float32, [1.0, 1.0]), ("str", "x"), "list"]
        assert r["losses"] == ("Tensor", torch.int64, 7)
        assert r["fast"] == 0
        assert r["in place"][1] == 0.125
        assert r["back"] == (("float", 0.0625), {"val": 1.5}, ("float", 3.5))
        assert r["restart"] == (0, True, ("Tensor", torch.float32, 0.03125))
        assert r["broadcast"] == ("float", 2.0)
        assert r["load"] == ("memory", 0, ("Tensor", torch.float32, [9.0]))
        assert (
            "best_val_loss (objects): rank 0 vs ranks 1, 2" in r["diverged"]
        )  # a list on rank 0, tensors elsewhere
        assert "best_val_loss: no tensor on rank 0 vs ranks 1, 2" in r["diverged"]
        assert "hist" not in r["diverged"] and "losses" not in r["diverged"]
    # the model's 6 floats, the loss (float64), the history's 2 floats, the sequence's 2, the int64 loss
    assert [r["moved"] for r in results] == [(2, 6 * 4 + 8 + 2 * 4 + 2 * 4 + 8)] * 3
    assert results[0]["hist"][0] and results[1]["hist"][0]  # the receivers' own dicts, updated
    assert results[0]["in place"][0] and results[1]["in place"][0]
    for rank, r in enumerate(results):
        kind, msg = r["shapes"]
        assert kind == "StateMismatchError" and "nothing was moved" in msg
        assert "field 'model': weight: shape (2, 2) torch.float32 on ranks 0, 2, shape (3, 2)" in msg
        assert "best_val_loss" not in msg and "construct the model identically everywhere" in msg
        assert r["shapes kept"] == (10 + rank, ("float", float(rank)))
        kind, msg = r["no module"]
        assert kind == "StateMismatchError" and "module with 2 tensors on ranks 0, 1; none on rank 2" in msg
        assert "build the field's module" in msg and "cannot build one" in msg
        assert "construct the model identically" not in msg
