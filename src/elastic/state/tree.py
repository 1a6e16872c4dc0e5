"""The walk: a state as tensor leaves plus a small picklable skeleton (`elastic.state.nodes`).

`flatten` walks the chosen fields of a state and replaces every tensor it meets by a `TensorSlot`; what is
left (plain values, lambdas, any other object) stays in the skeleton, which travels in one cloudpickle
payload. Modules, optimizers, LR schedulers, `GradScaler` and anything else with `state_dict()` /
`load_state_dict()` are walked through their state dicts; nested `@elastic_state` classes, dicts, lists
and tuples recurse; random generators become a `RestoreNode`. `tensor_index` is the same walk collecting
the state's own tensors by path (where a receiver writes in place); `elastic.state.apply` puts a skeleton
back.
"""

from __future__ import annotations

import operator
from collections import OrderedDict
from typing import Any, Protocol

import attrs
import torch

from elastic.state.config import saved_fields, synced_fields
from elastic.state.nodes import (
    STATE_DICT,
    ContainerNode,
    Kind,
    Path,
    RestoreNode,
    StatefulNode,
    StateNode,
    TensorSlot,
    Which,
    kind_of,
    path_str,
)
from elastic.state.rng import rng_kind, rng_state
from elastic.state.statedict import ModuleWalk, canonical_state_dict, kept_walk
from elastic.state.tensors import TensorMeta, check_tensor, walked_metas

__all__ = [
    "Flat",
    "check_object",
    "flatten",
    "module_state",
    "tensor_index",
    "to_save",
]


@attrs.define
class Flat:
    """A flattened state: the skeleton and its tensors, in slot order.

    The walk records only each tensor and its path; the metadata a transfer needs (shape, strides,
    storage sharing) is computed on first use of `metas`, so that a sync with nothing to move pays for
    the walk and the schema only."""

    skeleton: StateNode
    tensors: list[torch.Tensor]
    paths: list[Path]
    #: the tensor objects themselves (`tensors` are their detached views): where a receiver writes in place
    originals: list[torch.Tensor]
    grads: list[bool]
    _metas: list[TensorMeta] | None = None

    @property
    def metas(self) -> list[TensorMeta]:
        """Per tensor, what a receiver needs to place it, with the aliases among them linked."""
        if self._metas is None:
            self._metas = walked_metas(self.paths, self.tensors, self.grads)
        return self._metas

    def use_metas(self, metas: list[TensorMeta]) -> None:
        """Take `metas` (kept from an earlier walk with the same `signature`) instead of computing them."""
        self._metas = metas

    def signature(self) -> tuple[Any, ...]:
        """Everything `metas` is computed from (paths, shapes, strides, dtypes, devices, `requires_grad`,
        where each tensor's bytes start in which storage), as plain values: two walks with equal signatures
        have equal metadata. Cheap (a few attribute reads per tensor, in C loops) next to the metadata."""
        ts, tensor = self.tensors, torch.Tensor
        return (
            tuple(self.paths),
            list(map(_SHAPE_DTYPE_DEVICE, ts)),
            list(map(tensor.stride, ts)),
            tuple(self.grads),
            list(map(tensor.data_ptr, ts)),
            list(map(tensor.storage_offset, ts)),
        )

    def index(self) -> dict[Path, torch.Tensor]:
        """The state's own tensors by path, as `tensor_index` finds them (from the same walk)."""
        return dict(zip(self.paths, self.originals))


_SHAPE_DTYPE_DEVICE = operator.attrgetter("shape", "dtype", "device")


def _fields_of(state: Any, which: Which) -> list[str]:
    cls = type(state)
    chosen = synced_fields(cls) if which == "sync" else saved_fields(cls)
    return [a.name for a in chosen]


def check_object(value: Any, path: Path) -> None:
    """Reject objects that must not be broadcast as they are (rank-specific by design), with the fix."""
    if isinstance(value, torch.utils.data.DistributedSampler):
        msg = (
            f"field {path_str(path)} holds a torch DistributedSampler, which is rank-specific by design "
            f"(its rank={value.rank} would reach every rank, and every rank would read the same shard); "
            "mark the field elastic.local(), or use elastic.ElasticSampler, whose position is synced"
        )
        raise TypeError(msg)


def flatten(state: Any, which: Which = "sync", state_dicts: dict[Path, Any] | None = None) -> Flat:
    """Flatten the `which` fields of a state into a skeleton and its tensors (never modifies `state`).

    `state_dicts` holds what was already taken from modules, by path (a kept walk or a state dict: not taken
    again); what this walk takes is added to it."""
    leaf = _Collector()
    sds: dict[Path, Any] = {} if state_dicts is None else state_dicts
    skeleton = _walk_state(state, (), which, leaf, sds)
    return Flat(
        skeleton=skeleton,
        tensors=leaf.tensors,
        paths=leaf.paths,
        originals=leaf.originals,
        grads=leaf.grads,
    )


class _Collector:
    """`flatten`'s leaf: records each tensor (detached), its path, the tensor itself and `requires_grad`."""

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []
        self.paths: list[Path] = []
        self.originals: list[torch.Tensor] = []
        self.grads: list[bool] = []

    def __call__(self, tensor: torch.Tensor, path: Path) -> TensorSlot:  # per tensor per sync: kept lean
        grad = tensor.requires_grad
        t = tensor.detach() if grad or type(tensor) is not torch.Tensor else tensor  # state dicts: detached
        check_tensor(t, path)
        self.tensors.append(t)
        self.paths.append(path)
        self.originals.append(tensor)
        self.grads.append(grad)
        return _slot(len(self.tensors) - 1)

    def many(self, tensors: list[torch.Tensor], paths: list[Path]) -> tuple[TensorSlot, ...]:
        """Detached tensors of a state dict (no `requires_grad`), at once."""
        for t, path in zip(tensors, paths):
            check_tensor(t, path)
        start = len(self.tensors)
        self.tensors.extend(tensors)
        self.paths.extend(paths)
        self.originals.extend(tensors)
        self.grads.extend([False] * len(tensors))
        return _slots(start, len(tensors))


_SLOTS: list[TensorSlot] = []


def _slot(i: int) -> TensorSlot:
    """`TensorSlot(i)`, shared (slots are immutable): building 2,000 per sync costs more than a lookup."""
    if i >= len(_SLOTS):
        _SLOTS.extend(TensorSlot(k) for k in range(len(_SLOTS), 2 * i + 64))
    return _SLOTS[i]


def _slots(start: int, n: int) -> tuple[TensorSlot, ...]:
    """`_slot(i)` for ``start <= i < start + n``."""
    if n:
        _slot(start + n - 1)
    return tuple(_SLOTS[start : start + n])


def to_save(flat: Flat) -> list[torch.Tensor]:
    """The tensors a checkpoint stores: the flattened ones, with `requires_grad` where the state's had it
    (detached leaves sharing the state's storage, so `torch.save` still writes shared bytes once)."""
    return [
        t.detach().requires_grad_(True) if m.requires_grad else t for t, m in zip(flat.tensors, flat.metas)
    ]


def tensor_index(state: Any, which: Which = "sync") -> dict[Path, torch.Tensor]:
    """The tensors a state holds, by path: where a receiver writes in place."""
    leaf = _Finder()
    _walk_state(state, (), which, leaf)
    return leaf.found


class _Finder:
    """`tensor_index`'s leaf: each tensor object by path (written in place, it keeps its identity)."""

    def __init__(self) -> None:
        self.found: dict[Path, torch.Tensor] = {}

    def __call__(self, tensor: torch.Tensor, path: Path) -> TensorSlot:
        check_tensor(tensor, path)
        self.found[path] = tensor
        return TensorSlot(-1)

    def many(self, tensors: list[torch.Tensor], paths: list[Path]) -> tuple[TensorSlot, ...]:
        return tuple(self(t, p) for t, p in zip(tensors, paths))


class Leaf(Protocol):
    """What a walk calls for every tensor it meets (`many`: for a module's state dict at once)."""

    def __call__(self, tensor: torch.Tensor, path: Path) -> TensorSlot: ...

    def many(self, tensors: list[torch.Tensor], paths: list[Path]) -> tuple[TensorSlot, ...]: ...


def _walk_state(
    state: Any, path: Path, which: Which, leaf: Leaf, sds: dict[Path, Any] | None = None
) -> StateNode:
    fields = {
        name: _walk(getattr(state, name), (*path, name), which, leaf, sds)
        for name in _fields_of(state, which)
    }
    return StateNode(qualname=type(state).__qualname__, fields=fields)


def _walk(value: Any, path: Path, which: Which, leaf: Leaf, sds: dict[Path, Any] | None = None) -> Any:
    kind = kind_of(value)
    if kind == Kind.TENSOR:
        return leaf(value, path)
    if kind == Kind.DICT:
        keys = tuple(value.keys())
        tensor = torch.Tensor
        children = tuple(  # a state dict is mostly tensors: those skip the dispatch
            leaf(v, (*path, k)) if type(v) is tensor else _walk(v, (*path, k), which, leaf)
            for k, v in value.items()
        )
        return ContainerNode(kind, type(value), keys, children)
    if kind == Kind.LIST or kind == Kind.TUPLE:
        if all(type(v) in _ATOMIC for v in value):
            return ContainerNode(kind, type(value), (), tuple(value), atomic=True)
        children = tuple(_walk(v, (*path, i), which, leaf) for i, v in enumerate(value))
        return ContainerNode(kind, type(value), (), children)
    if kind == Kind.STATE:
        return _walk_state(value, path, which, leaf, sds)
    if kind == Kind.MODULE:
        found = sds.get(path) if sds is not None else None
        if found is None:
            found = module_state(value, path)
            if sds is not None:  # the caller keeps what the walk took (for the schema)
                sds[path] = found
        if isinstance(found, ModuleWalk):  # a plain module tree: its tensors at once
            tensors = found.tensors()
            inner = ContainerNode(Kind.DICT, OrderedDict, found.keys, leaf.many(tensors, found.paths(path)))
        else:
            inner = _walk(found, path, which, leaf)
        return StatefulNode(kind=kind, inner=inner, type_name=type(value).__qualname__)
    if kind in STATE_DICT:  # an optimizer or another stateful object
        try:
            sd = value.state_dict()
        except Exception as exc:
            msg = f"{path_str(path)}.state_dict() raised {type(exc).__name__}: {exc}"
            raise TypeError(msg) from exc
        return StatefulNode(kind=kind, inner=_walk(sd, path, which, leaf), type_name=type(value).__qualname__)
    if kind == Kind.RNG:
        return _rng_node(value, path, leaf)
    check_object(value, path)
    return value


_ATOMIC = frozenset({int, float, bool, str, bytes, complex, type(None)})


def module_state(module: torch.nn.Module, path: Path) -> dict[str, Any] | ModuleWalk:
    """What a walk takes from the module at `path`: the kept walk of a plain module tree, else its
    canonical state dict (a `TypeError` names the field when its ``state_dict()`` raises)."""
    walk = kept_walk(module)
    if walk is not None:
        return walk
    try:
        return canonical_state_dict(module)
    except Exception as exc:
        msg = f"{path_str(path)}.state_dict() raised {type(exc).__name__}: {exc}"
        raise TypeError(msg) from exc


def _rng_node(value: Any, path: Path, leaf: Leaf) -> RestoreNode:
    protocol = rng_kind(value)
    assert protocol is not None  # kind_of said RNG
    state = rng_state(value, protocol)
    if isinstance(state, torch.Tensor):  # a torch.Generator's byte state: a tensor of the state
        return RestoreNode(protocol, leaf(state, (*path, "state")), value.device.type)
    return RestoreNode(protocol, state)
