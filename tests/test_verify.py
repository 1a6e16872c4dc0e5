"""`verify`: identical replicas pass; any difference is named on every rank."""

from __future__ import annotations

from typing import Any

import attrs
import pytest
import torch

import elastic
from dist_harness import run_on_ranks
from elastic._verify import digests


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
