"""`verify`: identical replicas pass; any difference is named on every rank."""

from __future__ import annotations

import collections
import tracemalloc
from typing import Any

import attrs
import pytest
import torch

import elastic
from dist_harness import run_on_ranks
from elastic.replication.verify import digests


@elastic.elastic_state(tenure="step")
@attrs.define
class S:
    model: torch.nn.Module
    step: int = 0
    tags: set = attrs.field(factory=set)
    notes: dict = attrs.field(factory=dict)
    scratch: dict = elastic.local(factory=dict)


def _body(rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(rank)
    s = S(torch.nn.Linear(3, 3), step=rank, tags={"alpha", "beta", "gamma", "delta"}, notes={"a": 1})
    s.scratch["rank"] = rank  # local fields are not compared
    out: dict[str, Any] = {}
    elastic.sync(s)
    elastic.verify(s)  # identical after sync (set order differs across interpreters: still equal)
    out["ok"] = True
    if rank == 1:
        with torch.no_grad():
            s.model.bias[0] += 1
        s.notes["a"] = 2
    try:
        elastic.verify(s)
        out["diverged"] = None
    except elastic.DivergenceError as exc:
        out["diverged"] = str(exc)
    return out


@pytest.mark.timeout(90)
def test_verify_names_every_difference_on_every_rank() -> None:
    results = run_on_ranks(_body, 2)
    assert all(r["ok"] for r in results)
    msg = results[0]["diverged"]
    assert msg == results[1]["diverged"]
    assert "differ in 2 place(s)" in msg
    assert "model.bias: rank 0 vs rank 1" in msg
    assert "notes (objects): rank 0 vs rank 1" in msg
    assert "model.weight" not in msg and "scratch" not in msg


def test_digests_are_per_field_and_per_tensor_and_local_without_group() -> None:
    s = S(torch.nn.Linear(2, 2), tags={"x"})
    d = digests(s)
    assert set(d) == {
        "model (objects)",
        "step (objects)",
        "tags (objects)",
        "notes (objects)",
        "model.weight",
        "model.bias",
    }
    with torch.no_grad():
        s.model.weight[0, 0] += 1
    d2 = digests(s)
    assert [k for k in d if d[k] != d2[k]] == ["model.weight"]
    elastic.verify(s)  # no process group: nothing to compare, no error


@attrs.define
class Holder:
    """A user object holding a tensor (its pickle bytes differ between processes)."""

    t: torch.Tensor
    name: str = "h"


@elastic.elastic_state(tenure="step")
@attrs.define
class Values:
    step: int = 0
    value: Any = None


def _digest(value: Any) -> dict[str, str]:
    return digests(Values(0, value))  # the objects' digest and those of any tensors they hold


def test_digests_compare_values_not_pickle_bytes() -> None:
    assert _digest({"a": 1, "b": [2, 3]}) == _digest({"b": [2, 3], "a": 1})  # dict order
    assert _digest({"x": Holder(torch.ones(2)), "y": 1}) == _digest({"y": 1, "x": Holder(torch.ones(2))})
    assert _digest(Holder(torch.ones(2))) != _digest(Holder(torch.zeros(2)))
    assert _digest({3, 1, 2}) == _digest({2, 3, 1})
    assert _digest(torch.Generator().manual_seed(1)) == _digest(torch.Generator().manual_seed(1))
    assert _digest(torch.Generator().manual_seed(1)) != _digest(torch.Generator().manual_seed(2))
    od = collections.OrderedDict
    assert _digest(od(a=1, b=2)) != _digest(od(b=2, a=1))  # OrderedDict order is part of its value
    assert _digest([1, "1"]) != _digest(["1", 1])


def test_large_bytes_are_streamed_not_repred() -> None:
    data = bytes(20 << 20)
    changed = bytearray(data)
    changed[10 << 20] = 1
    tracemalloc.start()
    try:
        first = _digest(data)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20  # a repr would be ~80 MiB
    assert first == _digest(bytes(20 << 20)) and first != _digest(bytes(changed))


def _values_body(rank: int, world: int) -> dict[str, Any]:
    import random

    import numpy as np

    # Built independently on each rank, identical by value (dict order and set order differ).
    items = [("a", 1), ("b", Holder(torch.arange(3.0))), ("c", {"x", "y", "z"})]
    s = Values(0, dict(items if rank == 0 else items[::-1]))
    s.value["gen"] = torch.Generator().manual_seed(7)
    s.value["rnd"] = random.Random(7)
    s.value["np"] = np.random.default_rng(7)
    elastic.verify(s)
    out: dict[str, Any] = {"same": True}
    if rank == 1:
        torch.rand(1, generator=s.value["gen"])
    try:
        elastic.verify(s)
    except elastic.DivergenceError as exc:
        out["diverged"] = str(exc)
    return out


@pytest.mark.timeout(90)
def test_verify_compares_values_across_processes() -> None:
    results = run_on_ranks(_values_body, 2)
    assert [r["same"] for r in results] == [True, True]
    assert results[0]["diverged"] == results[1]["diverged"]
    assert "differ in 1 place(s):\n  value.gen.state: rank 0 vs rank 1\n" in results[0]["diverged"]
