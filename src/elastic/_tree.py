"""The state tree: a state as tensor leaves plus a small picklable skeleton, and back.

`flatten` walks the chosen fields of a state and replaces every tensor it meets by a `TensorSlot`; what is
left (plain values, lambdas, any other object) stays in the skeleton, which travels in one cloudpickle
payload. Modules, optimizers, LR schedulers, `GradScaler` and anything else with `state_dict()` /
`load_state_dict()` are walked through their state dicts; nested `@elastic_state` classes, dicts, lists
and tuples recurse. `materialize` puts a skeleton and its tensors back into a receiving state, keeping
the receiver's own objects (modules, optimizers, containers, tensors written in place) wherever it can.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any, Literal

import attrs
import torch

from ._config import config_of, is_elastic_state, saved_fields, synced_fields

__all__ = [
    "ContainerNode",
    "Flat",
    "StateNode",
    "StatefulNode",
    "TensorMeta",
    "TensorSlot",
    "field_digests",
    "flatten",
    "kind_of",
    "materialize",
    "copy_state",
    "path_str",
    "receive_targets",
    "schema_of",
    "tensor_index",
]

Which = Literal["sync", "save"]
Path = tuple[Any, ...]

#: Kinds a field value can have; part of the schema digest.
KINDS = ("tensor", "module", "optimizer", "stateful", "state", "dict", "list", "tuple", "object", "none")
#: Kinds a receiver can build from the source's skeleton alone, so `None` on one rank is compatible.
BUILDABLE = frozenset({"tensor", "dict", "list", "tuple", "object", "none"})


@attrs.frozen
class TensorSlot:
    """Where tensor number `index` of the flattened state goes."""

    index: int

    def __reduce__(self) -> tuple[Any, ...]:  # pickles ~2x faster than attrs' slotted __getstate__
        return (TensorSlot, (self.index,))


@attrs.frozen
class StatefulNode:
    """A module, optimizer or other `state_dict()` object: `inner` is the skeleton of its state dict."""

    kind: str
    inner: Any


@attrs.frozen
class StateNode:
    """A nested `@elastic_state` instance: one skeleton per chosen field."""

    qualname: str
    fields: dict[str, Any]


@attrs.frozen
class ContainerNode:
    """A dict, list or tuple (namedtuples and OrderedDicts keep their type)."""

    kind: str
    type: type
    keys: tuple[Any, ...]
    children: tuple[Any, ...]
    #: every child is a plain scalar (a long metrics history, say): no node to walk below
    atomic: bool = False


@attrs.frozen
class TensorMeta:
    """What a receiver needs to place a tensor it does not have: path, shape, dtype, device type."""

    path: Path
    shape: tuple[int, ...]
    dtype: torch.dtype
    device_type: str

    def __reduce__(self) -> tuple[Any, ...]:
        return (TensorMeta, (self.path, self.shape, self.dtype, self.device_type))

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * _itemsize(self.dtype)


def _itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize


@attrs.define
class Flat:
    """A flattened state: the skeleton and its tensors, in slot order."""

    skeleton: StateNode
    tensors: list[torch.Tensor]
    metas: list[TensorMeta]


def path_str(path: Path) -> str:
    """`("optimizer", "state", 0, "exp_avg")` as `optimizer.state.0.exp_avg`."""
    return ".".join(str(p) for p in path) if path else "<root>"


def _is_namedtuple(value: Any) -> bool:
    return isinstance(value, tuple) and hasattr(type(value), "_fields") and hasattr(type(value), "_make")


def _is_stateful(value: Any) -> bool:
    if isinstance(value, type):
        return False
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))


def kind_of(value: Any) -> str:
    """The kind of a field value, as the schema digest sees it."""
    if value is None:
        return "none"
    if isinstance(value, torch.Tensor):
        return "tensor"
    if isinstance(value, torch.nn.Module):
        return "module"
    if isinstance(value, torch.optim.Optimizer):
        return "optimizer"
    if is_elastic_state(value):
        return "state"
    if _is_stateful(value):
        return "stateful"
    if type(value) in (dict, OrderedDict):
        return "dict"
    if type(value) is list:
        return "list"
    if type(value) is tuple or _is_namedtuple(value):
        return "tuple"
    return "object"


def _fields_of(state: Any, which: Which) -> list[str]:
    cls = type(state)
    chosen = synced_fields(cls) if which == "sync" else saved_fields(cls)
    return [a.name for a in chosen]


def check_tensor(tensor: torch.Tensor, path: Path) -> None:
    """Reject tensors that cannot be transferred, with the fix."""
    if not (tensor.is_meta or tensor.layout != torch.strided or tensor.is_quantized):
        return  # the common case, without building the path's text
    where = path_str(path)
    if tensor.is_meta:
        msg = (
            f"tensor {where} is on the meta device and holds no data to sync or save; "
            "materialise it first (module.to_empty(device=...) then initialise it)"
        )
        raise TypeError(msg) from None
    if tensor.layout != torch.strided:
        msg = (
            f"tensor {where} has layout {tensor.layout}; elastic moves dense tensors only: store "
            "tensor.to_dense() (or its indices and values as two dense tensors) in the state instead"
        )
        raise TypeError(msg) from None
    if tensor.is_quantized:
        msg = f"tensor {where} is quantized; store tensor.dequantize() or its int_repr() and scales instead"
        raise TypeError(msg) from None


def flatten(state: Any, which: Which = "sync") -> Flat:
    """Flatten the `which` fields of a state into a skeleton and its tensors (never modifies `state`)."""
    tensors: list[torch.Tensor] = []
    metas: list[TensorMeta] = []

    def leaf(tensor: torch.Tensor, path: Path) -> TensorSlot:
        check_tensor(tensor, path)
        t = tensor.detach()
        tensors.append(t)
        metas.append(TensorMeta(path, tuple(t.shape), t.dtype, t.device.type))
        return TensorSlot(len(tensors) - 1)

    skeleton = _walk_state(state, (), which, leaf)
    return Flat(skeleton=skeleton, tensors=tensors, metas=metas)


def tensor_index(state: Any, which: Which = "sync") -> dict[Path, torch.Tensor]:
    """The tensors a state holds, by path: where a receiver writes in place."""
    found: dict[Path, torch.Tensor] = {}

    def leaf(tensor: torch.Tensor, path: Path) -> TensorSlot:
        check_tensor(tensor, path)
        found[path] = tensor  # the object itself: written in place, it keeps its identity
        return TensorSlot(-1)

    _walk_state(state, (), which, leaf)
    return found


Leaf = Callable[[torch.Tensor, Path], TensorSlot]


def _walk_state(state: Any, path: Path, which: Which, leaf: Leaf) -> StateNode:
    fields = {
        name: _walk(getattr(state, name), (*path, name), which, leaf) for name in _fields_of(state, which)
    }
    return StateNode(qualname=type(state).__qualname__, fields=fields)


def _walk(value: Any, path: Path, which: Which, leaf: Leaf) -> Any:
    kind = kind_of(value)
    if kind == "tensor":
        return leaf(value, path)
    if kind in ("module", "optimizer", "stateful"):
        try:
            sd = value.state_dict()
        except Exception as exc:
            msg = f"{path_str(path)}.state_dict() raised {type(exc).__name__}: {exc}"
            raise TypeError(msg) from exc
        return StatefulNode(kind=kind, inner=_walk(sd, path, which, leaf))
    if kind == "state":
        return _walk_state(value, path, which, leaf)
    if kind == "dict":
        keys = tuple(value.keys())
        children = tuple(_walk(value[k], (*path, k), which, leaf) for k in keys)
        return ContainerNode("dict", type(value), keys, children)
    if kind in ("list", "tuple"):
        if all(type(v) in _ATOMIC for v in value):
            return ContainerNode(kind, type(value), (), tuple(value), atomic=True)
        children = tuple(_walk(v, (*path, i), which, leaf) for i, v in enumerate(value))
        return ContainerNode(kind, type(value), (), children)
    return value


_ATOMIC = frozenset({int, float, bool, str, bytes, complex, type(None)})


def slots_in(node: Any) -> Iterator[int]:
    """The tensor indices below a skeleton node."""
    if isinstance(node, TensorSlot):
        yield node.index
    elif isinstance(node, StatefulNode):
        yield from slots_in(node.inner)
    elif isinstance(node, StateNode):
        for child in node.fields.values():
            yield from slots_in(child)
    elif isinstance(node, ContainerNode) and not node.atomic:
        for child in node.children:
            yield from slots_in(child)


def _only_tensors(node: Any) -> bool:
    """Whether every leaf below a (state-dict) node is a tensor."""
    if isinstance(node, TensorSlot):
        return True
    if isinstance(node, ContainerNode):
        return all(_only_tensors(c) for c in node.children)
    return False


def materialize(
    node: Any, current: Any, tensors: list[torch.Tensor], in_place: list[bool], path: Path
) -> Any:
    """The value `node` stands for, built into `current` wherever `current` can take it.

    Modules, optimizers and other stateful objects keep their identity and receive `load_state_dict`;
    a module whose tensors were all written in place is left alone. Dicts and lists of the same type are
    updated in place. Nested states are updated field by field. Returns the value to store.
    """
    if isinstance(node, TensorSlot):
        return tensors[node.index]
    if isinstance(node, StateNode):
        if not is_elastic_state(current) or type(current).__qualname__ != node.qualname:
            found = type(current).__qualname__
            msg = f"{path_str(path)}: expected a nested {node.qualname} state, found {found}"
            raise TypeError(msg)
        apply_fields(current, node, tensors, in_place, path)
        return current
    if isinstance(node, StatefulNode):
        if kind_of(current) != node.kind:
            msg = f"{path_str(path)}: expected a {node.kind}, found {type(current).__qualname__}"
            raise TypeError(msg)
        if (
            node.kind == "module"
            and _only_tensors(node.inner)
            and all(in_place[i] for i in slots_in(node.inner))
        ):
            return current  # every parameter and buffer was written in place
        sd = materialize(node.inner, None, tensors, in_place, path)
        current.load_state_dict(sd)
        return current
    if isinstance(node, ContainerNode):
        if node.kind == "dict":
            cur: Any = current if type(current) is node.type else None
            values = [
                materialize(c, cur.get(k) if cur is not None else None, tensors, in_place, (*path, k))
                for k, c in zip(node.keys, node.children)
            ]
            if cur is not None:
                cur.clear()
                cur.update(zip(node.keys, values))
                return cur
            return node.type(zip(node.keys, values))
        if node.atomic:
            items = list(node.children)
            if node.kind == "list" and type(current) is list:
                current[:] = items
                return current
            return items if node.kind == "list" else _rebuild_tuple(node.type, items)
        same: Any = current if type(current) is node.type else None
        seq: Any = same if same is not None and len(same) == len(node.children) else None
        items = [
            materialize(c, seq[i] if seq is not None else None, tensors, in_place, (*path, i))
            for i, c in enumerate(node.children)
        ]
        if node.kind == "list":
            if type(current) is list:
                current[:] = items
                return current
            return items
        return _rebuild_tuple(node.type, items)
    return node


def receive_targets(
    state: Any,
    metas: list[TensorMeta],
    which: Which,
    device_for: Callable[[TensorMeta], torch.device],
    index: dict[Path, torch.Tensor] | None = None,
    *,
    any_device: bool = False,
) -> tuple[list[torch.Tensor], list[bool]]:
    """Where each incoming tensor goes: the receiver's own tensor at the same path when it has the same
    shape, dtype and device type (any device type with `any_device`: the caller copies across devices),
    written in place; otherwise a new tensor allocated from the metadata on `device_for(meta)`. Returns the
    targets and which of them are in place."""
    if index is None:
        index = tensor_index(state, which)
    targets: list[torch.Tensor] = []
    in_place: list[bool] = []
    for meta in metas:
        mine = index.get(meta.path)
        fits = (
            mine is not None
            and tuple(mine.shape) == meta.shape
            and mine.dtype == meta.dtype
            and (any_device or mine.device.type == meta.device_type)
        )
        if fits:
            assert mine is not None
            targets.append(mine)
        else:
            targets.append(torch.empty(meta.shape, dtype=meta.dtype, device=device_for(meta)))
        in_place.append(fits)
    return targets, in_place


def copy_state(src: Any, dst: Any, which: Which = "sync") -> list[bool]:
    """Make `dst` hold `src`'s `which` fields as a sync would, without communication (in place where it
    can). Returns which tensors were written in place. Used for local round trips and tests."""
    flat = flatten(src, which)
    targets, in_place = receive_targets(dst, flat.metas, which, lambda m: torch.device(m.device_type))
    with torch.no_grad():
        for target, tensor in zip(targets, flat.tensors):
            target.detach().copy_(tensor)
        apply_fields(dst, flat.skeleton, targets, in_place)
    return in_place


def _rebuild_tuple(tp: Any, items: list[Any]) -> Any:
    if tp is tuple:
        return tuple(items)
    return tp._make(items) if _is_namedtuple_type(tp) else tp(items)


def _is_namedtuple_type(tp: type) -> bool:
    return issubclass(tp, tuple) and hasattr(tp, "_fields") and hasattr(tp, "_make")


def apply_fields(
    state: Any, node: StateNode, tensors: list[torch.Tensor], in_place: list[bool], path: Path = ()
) -> None:
    """Write every field of `node` into `state` (frozen classes included)."""
    for name, child in node.fields.items():
        current = getattr(state, name)
        value = materialize(child, current, tensors, in_place, (*path, name))
        if value is not current:
            object.__setattr__(state, name, value)


# ---------------------------------------------------------------------------------------------------------
# Schema: what must match across ranks before anything moves.


def _digest(obj: Any) -> str:
    return hashlib.blake2b(repr(obj).encode(), digest_size=8).hexdigest()


def _value_schema(value: Any) -> Any:
    kind = kind_of(value)
    if kind == "module":
        sd = value.state_dict()
        return (
            "module",
            tuple((k, tuple(v.shape), str(v.dtype)) for k, v in sd.items() if isinstance(v, torch.Tensor)),
        )
    if kind == "state":
        return ("state", schema_of(value))
    if kind == "stateful":
        return ("stateful", type(value).__qualname__)
    return (kind,)


def schema_of(state: Any) -> tuple[str, tuple[tuple[str, Any], ...]]:
    """The class's qualified name and, per synced field, its kind (and module layout)."""
    config_of(state)
    fields = tuple((name, _value_schema(getattr(state, name))) for name in _fields_of(state, "sync"))
    return (type(state).__qualname__, fields)


def field_digests(state: Any) -> tuple[str, tuple[tuple[str, str, str], ...]]:
    """A compact schema: the class name and, per synced field, (name, kind, digest)."""
    qualname, fields = schema_of(state)
    return qualname, tuple((name, sch[0], _digest(sch)) for name, sch in fields)


def compatible(a: tuple[str, str, str], b: tuple[str, str, str]) -> bool:
    """Whether two fields' (name, kind, digest) match; `None` matches any kind a receiver can build."""
    if a[0] != b[0]:
        return False
    if a[2] == b[2]:
        return True
    kinds = {a[1], b[1]}
    return "none" in kinds and kinds <= BUILDABLE
