"""The state tree: flatten into tensors + skeleton, apply back in place, schema digests."""

from __future__ import annotations

import collections
import copy
from typing import Any

import attrs
import cloudpickle
import pytest
import torch
from hypothesis import HealthCheck, given, settings

import elastic
from elastic.state.apply import apply_fields, fill_aliases, receive_targets
from elastic.state.nodes import StateNode, TensorSlot, Which, kind_of, path_str, walk
from elastic.state.schema import compatible, schema_digests, strict_schema
from elastic.state.tensors import carriers
from elastic.state.tree import flatten, tensor_index
from tree_values import same, values

Point = collections.namedtuple("Point", "x y")


def copy_state(src: Any, dst: Any, which: Which = "sync") -> list[bool]:
    """Make `dst` hold `src`'s `which` fields as a sync would, without communication (in place where it
    can). Returns which tensors were written in place."""
    flat = flatten(src, which)
    targets, in_place = receive_targets(dst, flat.metas, which, lambda m: torch.device(m.device_type))
    with torch.no_grad(), torch.inference_mode(False):
        for i in carriers(flat.metas):
            targets[i].detach().copy_(flat.tensors[i])
        fill_aliases(targets, flat.metas)
        apply_fields(dst, flat.skeleton, targets, in_place)
    return in_place


class Counter:
    """A user object with state_dict/load_state_dict: an 'other stateful'."""

    def __init__(self) -> None:
        self.n = 0
        self.t = torch.zeros(2)

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n, "t": self.t}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.n = sd["n"]
        self.t = sd["t"].clone()


@elastic.elastic_state(tenure="step")
@attrs.frozen
class Inner:
    step: int
    w: torch.Tensor


@elastic.elastic_state(tenure="step")
@attrs.define
class Everything:
    model: torch.nn.Module
    opt: torch.optim.Optimizer
    sched: Any
    scaler: Any
    counter: Counter
    inner: Inner
    ema: torch.Tensor
    step: int = 0
    buffers: dict = attrs.field(factory=dict)  # type: ignore[type-arg]
    history: list = attrs.field(factory=list)  # type: ignore[type-arg]
    pair: tuple = (1, 2)  # type: ignore[type-arg]
    point: Any = Point(0, 0)
    fn: Any = None
    scratch: dict = elastic.local(factory=dict)  # type: ignore[type-arg]


def make(seed: int, trained: bool) -> Everything:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**seed)
    s = Everything(model, opt, sched, scaler, Counter(), Inner(0, torch.zeros(2)), torch.zeros(3))
    if trained:
        for _ in range(3):
            model(torch.randn(5, 3)).pow(2).sum().backward()
            opt.step()
            sched.step()
        s.step = 3
        s.counter.n = 11
        s.counter.t = torch.tensor([1.0, 2.0])
        object.__setattr__(s, "inner", Inner(5, torch.tensor([3.0, 4.0])))
        s.ema = torch.arange(5.0)  # another shape than the receiver's
        s.buffers = {"a": torch.ones(2, 2), "b": torch.arange(4).view(2, 2).t()}  # non-contiguous
        s.history = [0.5, 0.25, torch.tensor(7)]
        s.pair = (torch.ones(1), "x")
        s.point = Point(torch.full((2,), 9.0), 3)
        k = 10
        s.fn = lambda v: v + k  # a closure
    s.scratch["mine"] = seed
    return s


def test_kinds() -> None:
    s = make(0, True)
    assert [
        kind_of(getattr(s, f)) for f in ("model", "opt", "sched", "scaler", "counter", "inner", "ema")
    ] == [
        "module",
        "optimizer",
        "stateful",
        "stateful",
        "stateful",
        "state",
        "tensor",
    ]
    assert kind_of({}) == "dict" and kind_of(collections.OrderedDict()) == "dict"
    assert kind_of([1]) == "list" and kind_of((1,)) == "tuple" and kind_of(Point(1, 2)) == "tuple"
    assert kind_of(None) == "none" and kind_of(lambda: 0) == "object" and kind_of(3) == "object"


def test_flatten_skeleton_and_paths() -> None:
    s = make(0, True)
    flat = flatten(s)
    assert isinstance(flat.skeleton, StateNode)
    assert "scratch" not in flat.skeleton.fields  # local fields never leave the rank
    paths = [path_str(m.path) for m in flat.metas]
    assert "model.0.weight" in paths and "opt.state.0.exp_avg" in paths and "inner.w" in paths
    assert "buffers.b" in paths and "history.2" in paths and "point.0" in paths
    for t, m in zip(flat.tensors, flat.metas):
        assert tuple(t.shape) == m.shape and t.dtype == m.dtype and m.nbytes == t.numel() * t.element_size()
    # The skeleton pickles small: tensors are slots, not data.
    cloudpickle.dumps(flat.skeleton)
    assert not any(isinstance(v, torch.Tensor) for _, v in walk(flat.skeleton))
    assert flat.skeleton.fields["step"] == 3
    assert flat.skeleton.fields["ema"] == TensorSlot(paths.index("ema"))


def test_flatten_never_modifies_the_source() -> None:
    s = make(0, True)
    before = {p: t.clone() for p, t in tensor_index(s).items()}
    dst = make(1, False)
    copy_state(s, dst)
    for p, t in tensor_index(s).items():
        assert torch.equal(t, before[p]), path_str(p)


def test_copy_state_applies_everything_in_place() -> None:
    src, dst = make(0, True), make(1, False)
    params = list(dst.model.parameters())
    ptrs = [p.data_ptr() for p in params]
    buffers_dict, history_list, counter, model, opt = (
        dst.buffers,
        dst.history,
        dst.counter,
        dst.model,
        dst.opt,
    )
    in_place = copy_state(src, dst)
    # identities kept: module, its parameters (same storage), optimizer, stateful objects, containers
    assert dst.model is model and dst.opt is opt and dst.counter is counter
    assert [p.data_ptr() for p in dst.model.parameters()] == ptrs
    assert all(a is b for a, b in zip(dst.model.parameters(), params))
    assert dst.opt.param_groups[0]["params"][0] is params[0]
    assert dst.buffers is buffers_dict and dst.history is history_list
    # values equal
    for p, q in zip(src.model.parameters(), dst.model.parameters()):
        assert torch.equal(p, q)
    assert torch.equal(src.model[1].running_mean, dst.model[1].running_mean)
    assert dst.opt.state_dict()["state"].keys() == src.opt.state_dict()["state"].keys()
    for k, v in src.opt.state_dict()["state"].items():
        for name, t in v.items():
            assert torch.equal(t, dst.opt.state_dict()["state"][k][name])
    assert dst.sched.state_dict() == src.sched.state_dict()
    assert dst.scaler.get_scale() == src.scaler.get_scale() == 1.0
    assert dst.counter.n == 11 and torch.equal(dst.counter.t, torch.tensor([1.0, 2.0]))
    assert dst.inner.step == 5 and torch.equal(dst.inner.w, torch.tensor([3.0, 4.0]))
    assert torch.equal(dst.ema, torch.arange(5.0))  # mis-shaped: allocated from the source's metadata
    assert torch.equal(dst.buffers["b"], src.buffers["b"])
    assert dst.history[:2] == [0.5, 0.25] and torch.equal(dst.history[2], torch.tensor(7))
    assert torch.equal(dst.pair[0], torch.ones(1)) and dst.pair[1] == "x"
    assert isinstance(dst.point, Point) and dst.point.y == 3
    assert dst.fn(1) == 11
    assert dst.step == 3
    assert dst.scratch == {"mine": 1}  # local: untouched
    assert not all(in_place) and any(in_place)


def test_fresh_adam_receives_state_and_steps_like_the_source() -> None:
    src, dst = make(0, True), make(1, False)
    assert dst.opt.state_dict()["state"] == {}  # fresh: no exp_avg yet
    copy_state(src, dst)
    x = torch.randn(5, 3)
    for s in (src, dst):
        s.opt.zero_grad()
        s.model(x).pow(2).sum().backward()
        s.opt.step()
    for p, q in zip(src.model.parameters(), dst.model.parameters()):
        assert torch.equal(p, q)


def test_schema_digests() -> None:
    a, b = make(0, True), make(1, False)
    qa, fa = schema_digests(a)
    qb, fb = schema_digests(b)
    assert qa == qb
    # container contents, optimizer state and tensor shapes are not part of the schema
    assert all(compatible(x, y) for x, y in zip(fa, fb))
    # module layouts are
    b.model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.BatchNorm1d(5))
    _, fb2 = schema_digests(b)
    diff = [x[0] for x, y in zip(fa, fb2) if not compatible(x, y)]
    assert diff == ["model"]
    # None is compatible with the kinds of plain values, not with a module
    b.ema, b.model = None, None
    _, fb3 = schema_digests(b)
    assert [x[0] for x, y in zip(fa, fb3) if not compatible(x, y)] == ["model"]


@elastic.elastic_state(tenure="step")
@attrs.define
class Kinds:
    step: int = 0
    model: Any = None
    opt: Any = None
    sched: Any = None
    inner: Any = None
    best: Any = float("inf")


def test_plain_kinds_are_not_in_the_schema_structured_ones_are() -> None:
    model = torch.nn.Linear(2, 2)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    step_lr = torch.optim.lr_scheduler.StepLR(sgd, step_size=1)
    sampler = elastic.ElasticSampler(list(range(8)), batch_size=2)

    def digests(**values: Any) -> dict[str, str]:
        defaults = {"model": model, "opt": sgd, "sched": step_lr, "inner": Inner(0, torch.zeros(2))}
        return {n: d for n, _, d in schema_digests(Kinds(**{**defaults, **values}))[1]}

    base = digests()
    # a plain field takes the source's value whatever its kind: a float that became a 0-d tensor, None,
    # containers of mixed kinds, generators, functions; a nested state's plain fields likewise
    for best in [
        torch.tensor(0.5),
        None,
        [0.5, torch.ones(2)],
        {"val": torch.tensor(0.5)},
        (torch.ones(1), "x"),
    ]:
        assert digests(best=best) == base, best
    assert digests(best=torch.Generator(), step=torch.tensor(3)) == base
    assert digests(best=lambda: 0, inner=Inner(torch.tensor(0), [1.0])) == base
    assert dict((n, k) for n, k, _ in schema_digests(Kinds(best=torch.tensor(0.5)))[1])["best"] == "tensor"
    # structured fields keep their kind, class and layout in the digest
    for field, value in [
        ("model", None),
        ("model", torch.ones(2)),
        ("model", torch.nn.Linear(2, 3)),
        ("opt", None),
        ("opt", torch.optim.Adam(model.parameters())),
        ("sched", None),
        ("sched", torch.optim.lr_scheduler.ExponentialLR(sgd, gamma=0.5)),
        ("sched", sampler),
        ("inner", None),
        ("inner", Kinds()),
        ("inner", 0.5),
    ]:
        changed = digests(**{field: value})
        assert {n for n in base if base[n] != changed[n]} == {field}, (field, value)
    # a nested state's structured fields too
    nested = digests(inner=Kinds(model=model))
    assert nested["inner"] != digests(inner=Kinds(model=torch.nn.Linear(2, 3)))["inner"]
    assert nested["inner"] == digests(inner=Kinds(model=model, best=torch.ones(1)))["inner"]
    assert strict_schema(("tensor",)) == strict_schema(("none",)) == strict_schema(("rng", "random.Random"))
    assert strict_schema(("stateful", "StepLR")) == ("stateful", "StepLR")
    # a module inside a container is the receiver's to build: applying says so
    with pytest.raises(TypeError, match=r"value\.m: the source holds a module here and this rank a NoneType"):
        copy_state(Box(1, {"m": torch.nn.Linear(2, 2)}), Box(0, 0.5))


@pytest.mark.parametrize(
    ("make_tensor", "message"),
    [
        (lambda: torch.empty(3, device="meta"), "meta device"),
        (lambda: torch.eye(3).to_sparse(), "layout torch.sparse_coo"),
    ],
)
def test_unsupported_tensors_are_rejected_with_a_fix(make_tensor: Any, message: str) -> None:
    s = make(0, False)
    s.buffers = {"bad": make_tensor()}
    with pytest.raises(TypeError, match=rf"tensor buffers.bad .*{message}"):
        flatten(s)


# ---------------------------------------------------------------------------------------------------
# What sync carries (DESIGN "What sync carries, precisely"), checked locally through copy_state.


@elastic.elastic_state(tenure="step")
@attrs.define
class Carried:
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


def _carried_source() -> Carried:
    import random

    import numpy as np

    base = torch.arange(12.0)
    shared = torch.full((3,), 7.0)
    gen = torch.Generator().manual_seed(5)
    torch.rand(3, generator=gen)
    rnd, nprs, npgen = random.Random(3), np.random.RandomState(4), np.random.default_rng(6)
    rnd.random(), nprs.rand(), npgen.random()
    return Carried(
        step=1,
        base=base,
        view=base[2:6],
        a=shared,
        b=shared,
        nhwc=torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last),
        learned=torch.ones(2, requires_grad=True),
        gen=gen,
        rnd=rnd,
        nprs=nprs,
        npgen=npgen,
    )


def _draws(s: Carried) -> tuple[Any, ...]:
    return (
        torch.rand(2, generator=s.gen).tolist(),
        s.rnd.random(),
        float(s.nprs.rand()),
        float(s.npgen.random()),
    )


def test_aliases_strides_requires_grad_and_generators_survive_allocation() -> None:
    import random

    import numpy as np

    src = _carried_source()
    flat = flatten(src)
    moving = carriers(flat.metas)
    # base/view and a/b share storage: the view and the second field travel as aliases
    assert [path_str(flat.metas[i].path) for i in range(len(flat.metas)) if i not in moving] == ["view", "b"]
    dst = Carried()
    gen, rnd = torch.Generator(), random.Random(0)
    nprs, npgen = np.random.RandomState(0), np.random.default_rng(0)
    dst.gen, dst.rnd, dst.nprs, dst.npgen = gen, rnd, nprs, npgen
    with torch.inference_mode():
        copy_state(src, dst)
    assert dst.view.untyped_storage().data_ptr() == dst.base.untyped_storage().data_ptr()
    assert dst.view.storage_offset() == 2 and torch.equal(dst.view, torch.arange(2.0, 6.0))
    assert dst.a.data_ptr() == dst.b.data_ptr()
    assert (
        dst.nhwc.is_contiguous(memory_format=torch.channels_last) and dst.nhwc.stride() == src.nhwc.stride()
    )
    assert torch.equal(dst.nhwc, src.nhwc)
    assert dst.learned.requires_grad and not dst.learned.is_inference() and not dst.base.is_inference()
    # generators restored in place: a DataLoader(generator=g) keeps drawing from the right one
    assert (dst.gen, dst.rnd, dst.nprs, dst.npgen) == (gen, rnd, nprs, npgen)
    assert _draws(dst) == _draws(src)


def test_aliases_on_a_receiver_with_its_own_untied_tensors_get_the_values() -> None:
    src = _carried_source()
    dst = Carried(base=torch.zeros(12), view=torch.zeros(4), a=torch.zeros(3), b=torch.zeros(3))
    own_view = dst.view
    in_place = copy_state(src, dst)
    assert dst.view is own_view and torch.equal(own_view, torch.arange(2.0, 6.0))
    assert torch.equal(dst.b, torch.full((3,), 7.0))
    assert in_place[:4] == [True, True, True, True]


def test_generators_are_built_where_the_receiver_has_none() -> None:
    src, dst = _carried_source(), Carried()
    copy_state(src, dst)
    assert isinstance(dst.gen, torch.Generator) and _draws(dst) == _draws(src)


def test_optimizer_class_and_param_groups_are_in_the_schema() -> None:
    def digests_with(opt_of: Any) -> Any:
        torch.manual_seed(0)
        s = make(0, False)
        s.opt = opt_of(s.model)
        return dict((n, d) for n, _, d in schema_digests(s)[1])

    adam = digests_with(lambda m: torch.optim.Adam(m.parameters(), lr=0.1))
    adam_other_lr = digests_with(lambda m: torch.optim.Adam(m.parameters(), lr=0.5))
    sgd = digests_with(lambda m: torch.optim.SGD(m.parameters(), lr=0.1))
    two_groups = digests_with(
        lambda m: torch.optim.Adam([{"params": m[0].parameters()}, {"params": m[1].parameters()}])
    )
    assert adam["opt"] == adam_other_lr["opt"]  # hyperparameter values are state, not schema
    assert adam["opt"] != sgd["opt"] and adam["opt"] != two_groups["opt"]
    assert {k for k in adam if adam[k] != sgd[k]} == {"opt"}


def test_module_names_are_canonical_without_wrapper_prefixes() -> None:
    torch.manual_seed(0)
    plain = make(0, False)
    compiled = make(0, False)
    compiled.model = torch.compile(compiled.model)  # an OptimizedModule: `_orig_mod.` prefixes
    assert next(iter(compiled.model.state_dict())).startswith("_orig_mod.")
    assert schema_digests(plain) == schema_digests(compiled)
    assert [m.path for m in flatten(compiled).metas] == [m.path for m in flatten(plain).metas]
    # a compiled submodule keeps its place, without the prefix
    nested = make(0, False)
    nested.model[0] = torch.compile(nested.model[0])
    assert schema_digests(nested) == schema_digests(plain)
    with torch.no_grad():
        plain.model[0].weight.fill_(3.0)
    copy_state(plain, nested)
    assert torch.equal(nested.model[0].weight, plain.model[0].weight)
    copy_state(nested, compiled)
    assert torch.equal(compiled.model._orig_mod[0].weight, plain.model[0].weight)


class _Sub(torch.Tensor):
    pass


def test_samplers_and_tensor_subclasses_are_rejected_before_anything_moves() -> None:
    from torch.utils.data import DistributedSampler

    s = Box(0, DistributedSampler(list(range(8)), num_replicas=2, rank=1))
    with pytest.raises(TypeError, match=r"field value holds a torch DistributedSampler.*elastic\.local\(\)"):
        schema_digests(s)
    with pytest.raises(TypeError, match=r"elastic\.ElasticSampler"):
        flatten(Box(0, {"nested": s.value}))
    sub = torch.ones(2).as_subclass(_Sub)
    with pytest.raises(TypeError, match=r"tensor value is a .*_Sub, a tensor subclass"):
        schema_digests(Box(0, sub))
    m = torch.nn.Linear(2, 2)
    m.register_buffer("odd", torch.zeros(2).as_subclass(_Sub))
    with pytest.raises(TypeError, match=r"tensor value\.odd is a .*tensor subclass"):
        schema_digests(Box(0, m))


# ---------------------------------------------------------------------------------------------------
# Property: any nested structure of tensors and plain values round-trips through flatten/apply.


@elastic.elastic_state(tenure="step")
@attrs.define
class Box:
    step: int = 0
    value: Any = None


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(src_value=values, dst_value=values)
def test_round_trip_property(src_value: Any, dst_value: Any) -> None:
    src, dst = Box(1, src_value), Box(0, dst_value)
    before = copy.deepcopy(src_value)  # tensors cloned: what the source held before the copy
    # whatever the kinds on either side, the schemas agree: the receiver takes the source's value
    assert all(compatible(a, b) for a, b in zip(schema_digests(src)[1], schema_digests(dst)[1]))
    copy_state(src, dst)
    assert same(src.value, dst.value)
    assert same(src.value, before)  # the source is untouched
