"""The skeleton codec: kinds written as plain text (``state.pt`` loads with ``weights_only``), read back as
`Kind`s, and malformed kinds refused as a `FormatError`."""

from __future__ import annotations

import io
import random
from typing import Any

import attrs
import pytest
import torch

import elastic
from elastic.checkpoint.codec import FormatError, decode_skeleton, encode_skeleton, slot_paths
from elastic.state.nodes import ContainerNode, Kind, RestoreNode, StatefulNode
from elastic.state.tree import flatten


@elastic.elastic_state(tenure="step")
@attrs.define
class Box:
    step: int
    model: Any
    opt: Any
    gen: Any
    rnd: Any
    pairs: Any


def box() -> Box:
    model = torch.nn.Linear(2, 2)
    return Box(
        1,
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        torch.Generator(),
        random.Random(0),
        [(1, torch.ones(1))],
    )


def _kinds(plain: Any) -> list[Any]:
    """The kind or protocol ("k") of every stateful and generator node in an encoded skeleton."""
    if type(plain) is dict:
        own = [plain["k"]] if plain.get("$") in ("stateful", "rng") else []
        return own + [k for v in plain.values() for k in _kinds(v)]
    if type(plain) is list:
        return [k for v in plain for k in _kinds(v)]
    return []


def test_kinds_round_trip_as_plain_text() -> None:
    flat = flatten(box(), "save")
    encoded = encode_skeleton(flat.skeleton)
    kinds = _kinds(encoded.plain)
    assert kinds == ["module", "optimizer", "torch.Generator", "random.Random"]
    assert all(type(k) is str for k in kinds)  # never a Kind: weights_only refuses enum members
    buf = io.BytesIO()
    torch.save({"tree": encoded.plain}, buf)
    buf.seek(0)
    plain = torch.load(buf, weights_only=True)["tree"]
    root = decode_skeleton(plain, len(flat.tensors), encoded.objects.__getitem__)
    model, opt, gen = root.fields["model"], root.fields["opt"], root.fields["gen"]
    assert isinstance(model, StatefulNode) and model.kind is Kind.MODULE and opt.kind is Kind.OPTIMIZER
    assert isinstance(gen, RestoreNode) and gen.protocol == "torch.Generator"
    pairs = root.fields["pairs"]
    assert (
        isinstance(pairs, ContainerNode) and pairs.kind is Kind.LIST and pairs.children[0].kind is Kind.TUPLE
    )
    assert slot_paths(root) == dict(enumerate(flat.paths))


@pytest.mark.parametrize(
    ("node", "what"),
    [
        ({"$": "stateful", "k": "tensor", "v": 1}, "unknown stateful kind 'tensor'"),
        ({"$": "stateful", "k": ["module"], "v": 1}, "unknown stateful kind"),  # unhashable
        ({"$": "rng", "k": "os.urandom", "d": "cpu", "v": 1}, "unknown generator kind"),
        ({"$": "rng", "k": ["torch.Generator"], "d": "cpu", "v": 1}, "unknown generator kind"),
    ],
)
def test_malformed_kinds_are_format_errors(node: dict[str, Any], what: str) -> None:
    plain = {"$": "state", "q": "Box", "f": {"x": node}}
    with pytest.raises(FormatError, match=what):
        decode_skeleton(plain, 0, lambda i: None)
