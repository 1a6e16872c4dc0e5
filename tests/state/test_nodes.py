"""The skeleton's nodes: `Kind` and `kind_of`, the one walk over a skeleton, and each node's kind."""

from __future__ import annotations

import collections
import json
import random
from typing import Any

import attrs
import numpy as np
import torch

import elastic
from elastic.state.nodes import (
    PLAIN,
    STATE_DICT,
    STRUCTURED,
    Kind,
    TensorSlot,
    kind_of,
    node_kind,
    walk,
)
from elastic.state.tree import flatten

Point = collections.namedtuple("Point", "x y")


class Counter:
    def __init__(self) -> None:
        self.t = torch.ones(2)

    def state_dict(self) -> dict[str, Any]:
        return {"t": self.t}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.t = sd["t"]


@elastic.elastic_state(tenure="step")
@attrs.define
class Inner:
    step: int
    w: torch.Tensor
    gen: Any


@elastic.elastic_state(tenure="step")
@attrs.define
class Mixed:
    step: int
    model: torch.nn.Module
    opt: Any
    counter: Any
    inner: Any
    gen: Any
    rnd: Any
    nprs: Any
    npg: Any
    od: Any
    point: Any
    atoms: Any
    nested: Any
    tags: Any
    nothing: Any = None


def mixed() -> Mixed:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    return Mixed(
        step=3,
        model=model,
        opt=opt,
        counter=Counter(),
        inner=Inner(1, torch.zeros(2), torch.Generator().manual_seed(1)),
        gen=torch.Generator().manual_seed(2),
        rnd=random.Random(3),
        nprs=np.random.RandomState(4),
        npg=np.random.default_rng(5),
        od=collections.OrderedDict(a=torch.ones(1), b=2),
        point=Point(torch.ones(1), 3),
        atoms=[1, 2.5, "x", None],
        nested=[(1, torch.arange(2)), {"k": [torch.zeros(1)]}],
        tags={"a"},
    )


def test_kind_values_are_the_names_manifests_and_digests_hold() -> None:
    names = ["tensor", "module", "optimizer", "stateful", "state", "rng", "dict", "list", "tuple", "object"]
    assert [k.value for k in Kind] == [*names, "none"]
    # a kind is its name wherever it is written: text, JSON, comparisons, dict keys
    assert str(Kind.MODULE) == f"{Kind.MODULE}" == "module" and json.dumps([Kind.DICT]) == '["dict"]'
    assert Kind.TENSOR == "tensor" and {"state": 1}[Kind.STATE] == 1 and Kind("rng") is Kind.RNG
    structured = {"module", "optimizer", "stateful", "state"}
    assert set(STRUCTURED) == structured and set(STATE_DICT) == structured - {"state"}
    assert (
        set(PLAIN) == {"tensor", "rng", "dict", "list", "tuple", "object", "none"} == set(Kind) - structured
    )


def test_kind_of() -> None:
    s = mixed()
    cases: list[tuple[Any, Kind]] = [
        (None, Kind.NONE),
        (torch.zeros(1), Kind.TENSOR),
        (torch.nn.Parameter(torch.zeros(1)), Kind.TENSOR),
        (s.model, Kind.MODULE),
        (s.opt, Kind.OPTIMIZER),
        (s.counter, Kind.STATEFUL),
        (s.inner, Kind.STATE),
        (s.gen, Kind.RNG),
        (s.rnd, Kind.RNG),
        (s.nprs, Kind.RNG),
        (s.npg, Kind.RNG),
        (random.SystemRandom(), Kind.OBJECT),  # no state to restore
        ({}, Kind.DICT),
        (collections.OrderedDict(), Kind.DICT),
        (collections.defaultdict(int), Kind.OBJECT),  # not exactly a dict: kept as an object
        ([1], Kind.LIST),
        ((1,), Kind.TUPLE),
        (Point(1, 2), Kind.TUPLE),
        (torch.Size([2]), Kind.OBJECT),  # a tuple subclass, not a namedtuple
        (True, Kind.OBJECT),
        (3, Kind.OBJECT),
        ("x", Kind.OBJECT),
        ({"a"}, Kind.OBJECT),
        (lambda: 0, Kind.OBJECT),
        (Counter, Kind.OBJECT),  # a class with state_dict methods is not itself stateful
    ]
    for value, kind in cases:
        assert kind_of(value) is kind, value


def test_walk_names_every_slot_as_flatten_does() -> None:
    s = mixed()
    flat = flatten(s, "save")
    slots = {n.index: p for p, n in walk(flat.skeleton) if isinstance(n, TensorSlot)}
    assert slots == dict(enumerate(flat.paths))
    assert ("gen", "state") in flat.paths and ("inner", "gen", "state") in flat.paths
    assert ("model", "0.weight") in flat.paths and ("nested", 1, "k", 0) in flat.paths
    # itself first, then depth first in order
    walked = [p for p, _ in walk(flat.skeleton)]
    assert walked[0] == () and walked.index(("model",)) < walked.index(("model", "0.weight"))
    assert walked.index(("nested", 0, 1)) < walked.index(("nested", 1, "k", 0))
    assert list(walk(7, ("x",))) == [(("x",), 7)]  # a leaf has nothing below it


def test_node_kind_is_the_kind_of_the_value_walked() -> None:
    s = mixed()
    skeleton = flatten(s, "save").skeleton
    for name, node in skeleton.fields.items():
        assert node_kind(node) is kind_of(getattr(s, name)), name
