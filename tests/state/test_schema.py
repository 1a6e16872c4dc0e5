"""The schema digests are a wire format between ranks of one job: pinned, so that a refactor that changes
them (a kind written as ``<Kind.MODULE: 'module'>``, say) is seen."""

from __future__ import annotations

from typing import Any

import attrs
import torch

import elastic
from elastic.state.schema import schema_digests


@elastic.elastic_state(tenure="step")
@attrs.define
class Sub:
    step: int
    w: Any


class Counter:
    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        pass


@elastic.elastic_state(tenure="step")
@attrs.define
class Pinned:
    step: int
    model: Any
    inner: Any
    sched: Any
    gen: Any
    nothing: Any = None


def test_schema_digests_are_pinned() -> None:
    state = Pinned(1, torch.nn.Linear(3, 2), Sub(0, torch.zeros(2)), Counter(), torch.Generator())
    plain = "87adb03d3001fa2f"  # every plain field, whatever its kind
    assert schema_digests(state) == (
        "Pinned",
        (
            ("step", "object", plain),
            ("model", "module", "1422b4f9793904fb"),
            ("inner", "state", "a4bf0db4948ab94f"),
            ("sched", "stateful", "be1a250411d6ee4f"),
            ("gen", "rng", plain),
            ("nothing", "none", plain),
        ),
    )
    assert all(type(kind) is str for _, kind, _ in schema_digests(state)[1])  # plain text on the wire
