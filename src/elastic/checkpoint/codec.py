"""The checkpoint's layout: its file names, and the state skeleton encoded as plain data.

A checkpoint directory holds ``state.pt`` (tensors and plain data; loads with ``torch.load(weights_only=True,
mmap=True)``), ``objects.pkl`` (cloudpickle, only when some leaf is not plain data) and ``manifest.json``.

The skeleton of `tree.flatten` is encoded as nested dicts, lists and plain leaves. Every node that is not a
plain leaf becomes a dict with a ``"$"`` tag (the encoder never emits any other dict), so decoding is
unambiguous: ``{"$": "t", "i": 3}`` is tensor 3, ``{"$": "o", "i": 0}`` is object 0 of ``objects.pkl``,
``{"$": "state" | "stateful" | "dict" | "odict" | "list" | "tuple" | "ntuple" | "set" | "fset", ...}`` are
the containers, ``{"$": "rng", "k": kind, "d": device, "v": state}`` a random generator restored in place.
A namedtuple's type is an object too (importing a class can run code).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import attrs
import cloudpickle
import torch

from elastic.state.nodes import (
    STATE_DICT,
    ContainerNode,
    Kind,
    RestoreNode,
    StatefulNode,
    StateNode,
    TensorSlot,
    path_str,
    walk,
)
from elastic.state.rng import RNG_KINDS

__all__ = [
    "CONTENT",
    "CONTENT_VERSION",
    "MANIFEST",
    "OBJECTS",
    "Encoded",
    "FormatError",
    "decode_skeleton",
    "encode_skeleton",
    "pickle_objects",
    "slot_paths",
]

#: File names inside a checkpoint directory.
MANIFEST = "manifest.json"
CONTENT = "state.pt"
OBJECTS = "objects.pkl"
#: Version of the layout of ``state.pt``'s top-level dict.
CONTENT_VERSION = 1


class FormatError(Exception):
    """A checkpoint file does not have the structure this version writes (corrupt or tampered)."""


# ---------------------------------------------------------------------------------------------------------
# Skeleton <-> plain data


_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size)


def _is_plain(value: Any) -> bool:
    return type(value) in _PLAIN


@attrs.define
class Encoded:
    """A skeleton as plain data, the objects it refers to and where each object sits."""

    plain: Any
    objects: list[Any]
    object_paths: list[tuple[Any, ...]]

    def object_summary(self) -> list[dict[str, str]]:
        """Per object: its path in the state and its type, for the manifest and for error messages."""
        return [
            {"path": path_str(p), "field": str(p[0]) if p else "", "type": _type_name(o)}
            for p, o in zip(self.object_paths, self.objects)
        ]


def _type_name(obj: Any) -> str:
    tp = obj if isinstance(obj, type) else type(obj)
    return f"{tp.__module__}.{tp.__qualname__}"


def encode_skeleton(skeleton: StateNode) -> Encoded:
    """The skeleton as plain nested dicts/lists/leaves; non-plain leaves are moved to an object list."""
    objects: list[Any] = []
    paths: list[tuple[Any, ...]] = []

    def obj(value: Any, path: tuple[Any, ...]) -> dict[str, Any]:
        objects.append(value)
        paths.append(path)
        return {"$": "o", "i": len(objects) - 1}

    def key(k: Any, path: tuple[Any, ...]) -> Any:
        if _is_plain(k):
            return k
        if type(k) is tuple:
            return {"$": "tuple", "v": [key(x, path) for x in k]}
        return obj(k, (*path, "<key>"))

    def enc(node: Any, path: tuple[Any, ...]) -> Any:
        if isinstance(node, TensorSlot):
            return {"$": "t", "i": node.index}
        if isinstance(node, StateNode):
            return {
                "$": "state",
                "q": node.qualname,
                "f": {n: enc(c, (*path, n)) for n, c in node.fields.items()},
            }
        if isinstance(node, StatefulNode):  # the kind as plain text: state.pt loads with weights_only
            return {"$": "stateful", "k": node.kind.value, "v": enc(node.inner, path)}
        if isinstance(node, RestoreNode):  # a generator's state is plain data: no pickle needed
            return {"$": "rng", "k": node.protocol, "d": node.device, "v": enc(_as_nodes(node.state), path)}
        if isinstance(node, ContainerNode):
            if node.kind == Kind.DICT:
                tag = "dict" if node.type is dict else "odict"
                return {
                    "$": tag,
                    "k": [key(k, path) for k in node.keys],
                    "v": [enc(c, (*path, k)) for k, c in zip(node.keys, node.children)],
                }
            values = [enc(c, (*path, i)) for i, c in enumerate(node.children)]
            if node.kind == Kind.LIST:
                return {"$": "list", "v": values}
            if node.type is tuple:
                return {"$": "tuple", "v": values}
            return {"$": "ntuple", "type": obj(node.type, path), "v": values}
        if _is_plain(node):
            return node
        if type(node) in (set, frozenset) and all(_is_plain(x) for x in node):
            return {"$": "set" if type(node) is set else "fset", "v": list(node)}
        return obj(node, path)

    plain = enc(skeleton, ())
    return Encoded(plain=plain, objects=objects, object_paths=paths)


def decode_skeleton(plain: Any, n_tensors: int, objects: Callable[[int], Any]) -> StateNode:
    """The inverse of `encode_skeleton`; `objects(i)` gives object `i`. Raises `FormatError`."""

    def need(cond: bool, what: str) -> None:
        if not cond:
            raise FormatError(what)

    def items(node: dict[str, Any]) -> list[Any]:
        v: Any = node.get("v")
        need(type(v) is list, f"container without a value list: {sorted(node)}")
        return list(v)

    def index(node: dict[str, Any], bound: int | None, what: str) -> int:
        i: Any = node.get("i")
        need(type(i) is int and i >= 0 and (bound is None or i < bound), f"bad {what} index {i!r}")
        return int(i)

    def key(k: Any) -> Any:
        if type(k) is dict:
            tag = k.get("$")
            if tag == "tuple":
                return tuple(key(x) for x in items(k))
            if tag == "o":
                return objects(index(k, None, "object"))
            raise FormatError(f"unknown key tag {tag!r}")
        need(_is_plain(k), f"unexpected key of type {type(k).__name__}")
        return k

    def dec(node: Any) -> Any:
        if type(node) is not dict:
            need(_is_plain(node), f"unexpected leaf of type {type(node).__name__}")
            return node
        tag: Any = node.get("$")
        if tag == "t":
            return TensorSlot(index(node, n_tensors, "tensor"))
        if tag == "o":
            return objects(index(node, None, "object"))
        if tag == "state":
            q: Any = node.get("q")
            f: Any = node.get("f")
            need(type(q) is str and type(f) is dict, "malformed state node")
            return StateNode(qualname=q, fields={str(n): dec(c) for n, c in f.items()})
        if tag == "stateful":
            kind: Any = node.get("k")
            need(type(kind) is str and kind in STATE_DICT, f"unknown stateful kind {kind!r}")
            return StatefulNode(kind=Kind(kind), inner=dec(node.get("v")))
        if tag == "rng":
            rng: Any = node.get("k")
            device: Any = node.get("d")
            need(
                type(rng) is str and rng in RNG_KINDS and type(device) is str,
                f"unknown generator kind {rng!r}",
            )
            return RestoreNode(protocol=rng, state=_from_nodes(dec(node.get("v"))), device=device)
        if tag in ("dict", "odict"):
            keys: Any = node.get("k")
            values = items(node)
            need(type(keys) is list and len(keys) == len(values), "malformed dict node")
            tp = dict if tag == "dict" else OrderedDict
            return ContainerNode(Kind.DICT, tp, tuple(key(k) for k in keys), tuple(dec(c) for c in values))
        if tag == "list":
            return ContainerNode(Kind.LIST, list, (), tuple(dec(c) for c in items(node)))
        if tag == "tuple":
            return ContainerNode(Kind.TUPLE, tuple, (), tuple(dec(c) for c in items(node)))
        if tag == "ntuple":
            t: Any = node.get("type")
            need(type(t) is dict and t.get("$") == "o", "malformed namedtuple node")
            tp = objects(index(t, None, "object"))
            need(isinstance(tp, type) and issubclass(tp, tuple), f"namedtuple type is {tp!r}")
            return ContainerNode(Kind.TUPLE, tp, (), tuple(dec(c) for c in items(node)))
        if tag in ("set", "fset"):
            values = items(node)
            need(all(_is_plain(x) for x in values), "set of non-plain values")
            return set(values) if tag == "set" else frozenset(values)
        raise FormatError(f"unknown node tag {tag!r}")

    root = dec(plain)
    if not isinstance(root, StateNode):
        raise FormatError("the skeleton's root is not a state")
    return root


def slot_paths(node: Any, path: tuple[Any, ...] = ()) -> dict[int, tuple[Any, ...]]:
    """The state path of every tensor slot below `node`, as `elastic.state.tree.flatten` names them."""
    return {n.index: p for p, n in walk(node, path) if isinstance(n, TensorSlot)}


def _as_nodes(value: Any) -> Any:
    """Plain data (a generator's state: nested tuples, lists, dicts of numbers) as skeleton containers, so
    the codec stores it as it stores any container."""
    if type(value) is tuple or type(value) is list:
        kind = Kind.TUPLE if type(value) is tuple else Kind.LIST
        return ContainerNode(kind, type(value), (), tuple(_as_nodes(v) for v in value))
    if type(value) is dict:
        keys = tuple(value)
        return ContainerNode(Kind.DICT, dict, keys, tuple(_as_nodes(value[k]) for k in keys))
    return value


def _from_nodes(node: Any) -> Any:
    """The inverse of `_as_nodes`."""
    if isinstance(node, ContainerNode):
        items = [_from_nodes(c) for c in node.children]
        if node.kind == Kind.DICT:
            return dict(zip(node.keys, items))
        return tuple(items) if node.kind == Kind.TUPLE else items
    return node


def pickle_objects(encoded: Encoded) -> bytes:
    """`cloudpickle` of the encoded objects; a `TypeError` naming the path of any that cannot be pickled."""
    try:
        return cloudpickle.dumps(encoded.objects)
    except Exception:
        pass
    bad = []
    for path, obj in zip(encoded.object_paths, encoded.objects):
        try:
            cloudpickle.dumps(obj)
        except Exception as exc:
            bad.append(f"{path_str(path)} ({_type_name(obj)}: {type(exc).__name__}: {exc})")
    msg = (
        f"cannot pickle {'; '.join(bad) or 'the objects'}; make these values picklable, or mark their fields "
        "elastic.field(save=False) (or elastic.local()) to leave them out of checkpoints"
    )
    raise TypeError(msg) from None
