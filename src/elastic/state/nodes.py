"""The nodes of a state's skeleton, the kinds of value they stand for, and the one walk over them.

A flattened state (`elastic.state.tree.flatten`) is a skeleton of these nodes with plain values and other
objects as leaves: a `StateNode` per nested state, a `StatefulNode` per module, optimizer or other
`state_dict()` object, a `ContainerNode` per dict, list or tuple, a `RestoreNode` per random generator and
a `TensorSlot` where each tensor goes. `Kind` names what a field value is; `walk` visits a skeleton with
each node's path, named as the flattening walk names it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from enum import Enum
from typing import Any, ClassVar, Literal

import attrs
import torch

from elastic.state.config import is_elastic_state
from elastic.state.rng import rng_kind

__all__ = [
    "NODE_TYPES",
    "PLAIN",
    "STATE_DICT",
    "STRUCTURED",
    "ContainerNode",
    "Kind",
    "Path",
    "RestoreNode",
    "StateNode",
    "StatefulNode",
    "TensorSlot",
    "Which",
    "is_namedtuple_type",
    "kind_of",
    "node_kind",
    "path_str",
    "walk",
]

Which = Literal["sync", "save"]
Path = tuple[Any, ...]


class Kind(str, Enum):
    """What a field value is (`kind_of`). The values are what manifests hold and schema digests hash:
    never change one."""

    TENSOR = "tensor"
    MODULE = "module"
    OPTIMIZER = "optimizer"
    #: any other object with ``state_dict()`` / ``load_state_dict()`` (a scheduler, a `GradScaler`, ...)
    STATEFUL = "stateful"
    #: a nested `@elastic_state` instance
    STATE = "state"
    #: a random generator, restored in place (`elastic.state.rng`)
    RNG = "rng"
    DICT = "dict"
    LIST = "list"
    TUPLE = "tuple"
    OBJECT = "object"
    NONE = "none"

    def __str__(self) -> str:  # f-strings and messages show the value on every Python (3.12 changed format)
        return self.value


#: Kinds of structured values: a receiver (a sync's, a load's) loads them into its own object, which it
#: cannot build, so their kind and layout must agree across ranks and with a checkpoint.
STRUCTURED = frozenset({Kind.MODULE, Kind.OPTIMIZER, Kind.STATEFUL, Kind.STATE})
#: The structured kinds walked through their state dict (a `StatefulNode`; a nested state is a `StateNode`).
STATE_DICT = STRUCTURED - {Kind.STATE}
#: Kinds of plain values: a receiver adopts the source's value whatever kind it holds itself (a float that
#: became a 0-d tensor, `None`, a container of mixed kinds), so the schema digest does not tell them apart.
PLAIN = frozenset(Kind) - STRUCTURED


@attrs.frozen
class TensorSlot:
    """Where tensor number `index` of the flattened state goes."""

    kind: ClassVar[Kind] = Kind.TENSOR
    index: int

    def __reduce__(self) -> tuple[Any, ...]:  # pickles ~2x faster than attrs' slotted __getstate__
        return (TensorSlot, (self.index,))

    def branches(self, path: Path) -> tuple[tuple[Path, Any], ...]:
        return ()


@attrs.frozen
class StatefulNode:
    """A module, optimizer or other `state_dict()` object: `inner` is the skeleton of its state dict."""

    kind: Kind  # one of STATE_DICT
    inner: Any
    #: the object's class (qualified name): optimizers and other stateful objects must match across ranks
    type_name: str = ""

    def branches(self, path: Path) -> tuple[tuple[Path, Any], ...]:
        return ((path, self.inner),)  # the state dict's entries are named below the field itself


@attrs.frozen
class StateNode:
    """A nested `@elastic_state` instance: one skeleton per chosen field."""

    kind: ClassVar[Kind] = Kind.STATE
    qualname: str
    fields: dict[str, Any]

    def branches(self, path: Path) -> Iterator[tuple[Path, Any]]:
        return (((*path, name), child) for name, child in self.fields.items())


@attrs.frozen
class ContainerNode:
    """A dict, list or tuple (namedtuples and OrderedDicts keep their type)."""

    kind: Kind  # DICT, LIST or TUPLE
    type: type
    keys: tuple[Any, ...]
    children: tuple[Any, ...]
    #: every child is a plain scalar (a long metrics history, say): no node to walk below
    atomic: bool = False

    def branches(self, path: Path) -> Iterator[tuple[Path, Any]]:
        steps = self.keys if self.kind == Kind.DICT else range(len(self.children))
        return (((*path, step), child) for step, child in zip(steps, self.children))


@attrs.frozen
class RestoreNode:
    """An object restored in place through its own protocol (a random generator): `protocol` names it (see
    `elastic.state.rng`), `state` is plain data (a `TensorSlot` for a `torch.Generator`'s byte state),
    `device` the torch generator's device."""

    kind: ClassVar[Kind] = Kind.RNG
    protocol: str
    state: Any
    device: str = "cpu"

    def branches(self, path: Path) -> tuple[tuple[Path, Any], ...]:
        return (((*path, "state"), self.state),)


#: The node types (a skeleton's other leaves are values: plain ones, or objects pickled as they are).
NODE_TYPES = frozenset({TensorSlot, StatefulNode, StateNode, ContainerNode, RestoreNode})


def walk(node: Any, path: Path = ()) -> Iterator[tuple[Path, Any]]:
    """Every node and leaf below `node`, itself first, depth first in order, each with its path in the state
    (as `flatten` names it: a field, a dict key, a list index; a generator's tensor is ``<field>.state``)."""
    yield path, node
    if type(node) in NODE_TYPES:
        for sub, child in node.branches(path):
            yield from walk(child, sub)


def node_kind(node: Any) -> Kind:
    """The kind of the value a skeleton node stands for: `kind_of` of the value the walk met there."""
    if type(node) in NODE_TYPES:
        kind: Kind = node.kind
        return kind
    return Kind.NONE if node is None else Kind.OBJECT


def path_str(path: Path) -> str:
    """`("optimizer", "state", 0, "exp_avg")` as `optimizer.state.0.exp_avg`."""
    return ".".join(str(p) for p in path) if path else "<root>"


def is_namedtuple_type(tp: type) -> bool:
    return issubclass(tp, tuple) and hasattr(tp, "_fields") and hasattr(tp, "_make")


def _is_stateful(value: Any) -> bool:
    if isinstance(value, type):
        return False
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))


#: The kinds of values of exactly these types, most of a state's values (being builtins, they can be
#: nothing else: no state_dict(), no elastic config); the checks of `kind_of` decide for any other type.
_EXACT: dict[type, Kind] = {
    type(None): Kind.NONE,
    torch.Tensor: Kind.TENSOR,
    dict: Kind.DICT,
    OrderedDict: Kind.DICT,
    list: Kind.LIST,
    tuple: Kind.TUPLE,
    **dict.fromkeys((bool, int, float, complex, str, bytes), Kind.OBJECT),
}


def kind_of(value: Any) -> Kind:
    """The kind of a field value, as the walk, the schema digest and a checkpoint's manifest see it."""
    exact = _EXACT.get(type(value))
    if exact is not None:
        return exact
    if isinstance(value, torch.Tensor):  # a Parameter, a tensor subclass (which the walk refuses)
        return Kind.TENSOR
    if isinstance(value, torch.nn.Module):
        return Kind.MODULE
    if isinstance(value, torch.optim.Optimizer):
        return Kind.OPTIMIZER
    if is_elastic_state(value):
        return Kind.STATE
    if rng_kind(value) is not None:
        return Kind.RNG
    if _is_stateful(value):
        return Kind.STATEFUL
    if isinstance(value, tuple) and is_namedtuple_type(type(value)):
        return Kind.TUPLE
    return Kind.OBJECT  # subclasses of dict and list included (a defaultdict is pickled as it is)
