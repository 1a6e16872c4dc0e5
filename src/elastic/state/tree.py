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
import operator
import random
import sys
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any, Literal, NamedTuple, Protocol

import attrs
import torch

from elastic.state.config import config_of, is_elastic_state, saved_fields, synced_fields
from elastic.state.statedict import ModuleWalk, canonical_state_dict, kept_walk, load_module

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
    "RestoreNode",
    "canonical_state_dict",
    "RNG_KINDS",
    "as_nodes",
    "carriers",
    "from_nodes",
    "metas_of",
    "staged",
    "staging_buffer",
    "staging_fits",
    "to_save",
    "copy_state",
    "fill_aliases",
    "path_str",
    "receive_targets",
    "layout_digest",
    "module_layout",
    "scan_schema",
    "schema_digests",
    "schema_of",
    "strict_schema",
    "tensor_index",
]

Which = Literal["sync", "save"]
Path = tuple[Any, ...]

#: Kinds a field value can have (`kind_of`); the structured ones count in the schema digest.
KINDS = (
    "tensor",
    "module",
    "optimizer",
    "stateful",
    "state",
    "rng",
    "dict",
    "list",
    "tuple",
    "object",
    "none",
)
#: Kinds of plain values: a receiver adopts the source's value whatever kind it holds itself (a float that
#: became a 0-d tensor, `None`, a container of mixed kinds), so the schema digest does not tell them apart.
#: The other kinds (modules, optimizers, other `state_dict()` objects, nested states) are structured: a
#: receiver loads its values into its own object, so their kind and layout must agree across ranks.
PLAIN = frozenset({"tensor", "rng", "dict", "list", "tuple", "object", "none"})


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
    #: the object's class (qualified name): optimizers and other stateful objects must match across ranks
    type_name: str = ""


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
class RestoreNode:
    """An object restored in place through its own protocol (a random generator): `kind` names the
    protocol, `state` is plain data (a `TensorSlot` for a `torch.Generator`'s byte state), `device` the
    torch generator's device."""

    kind: str
    state: Any
    device: str = "cpu"


class TensorMeta(NamedTuple):
    """What a receiver needs to place a tensor it does not have: path, shape, dtype, device type, strides
    and `requires_grad`; `alias` is the index of the tensor whose storage this one shares on the source
    (-1: none) and `offset` its storage offset relative to that tensor's, in elements. A named tuple:
    one is built per tensor per sync, ~10x faster than a frozen attrs class."""

    path: Path
    shape: tuple[int, ...]
    dtype: torch.dtype
    device_type: str
    stride: tuple[int, ...] | None = None
    requires_grad: bool = False
    alias: int = -1
    offset: int = 0

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
            self._metas = _metas_of(self.paths, self.tensors, self.grads)
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


def _metas_of(paths: list[Path], tensors: list[torch.Tensor], grads: list[bool]) -> list[TensorMeta]:
    metas = []
    storages: dict[tuple[str, int], list[int]] = {}
    for i, (path, t, grad) in enumerate(zip(paths, tensors, grads)):
        device = "cpu" if t.is_cpu else t.device.type
        metas.append(TensorMeta(path, tuple(t.shape), t.dtype, device, t.stride(), grad, -1, 0))
        if t.numel():
            storages.setdefault((device, t.untyped_storage().data_ptr()), []).append(i)
    for members in storages.values():
        if len(members) > 1:
            _link_aliases(tensors, metas, members)
    return metas


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
    if rng_kind(value) is not None:
        return "rng"
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


def rng_kind(value: Any) -> str | None:
    """The restore protocol of a random generator (`None` for anything else); numpy is never imported."""
    if isinstance(value, torch.Generator):
        return "torch.Generator"
    if isinstance(value, random.Random):
        return None if isinstance(value, random.SystemRandom) else "random.Random"
    np = sys.modules.get("numpy")
    if np is not None and type(value).__module__.startswith("numpy"):
        if isinstance(value, np.random.RandomState):
            return "numpy.RandomState"
        if isinstance(value, np.random.Generator):
            return "numpy.Generator"
    return None


def check_object(value: Any, path: Path) -> None:
    """Reject objects that must not be broadcast as they are (rank-specific by design), with the fix."""
    if isinstance(value, torch.utils.data.DistributedSampler):
        msg = (
            f"field {path_str(path)} holds a torch DistributedSampler, which is rank-specific by design "
            f"(its rank={value.rank} would reach every rank, and every rank would read the same shard); "
            "mark the field elastic.local(), or use elastic.ElasticSampler, whose position is synced"
        )
        raise TypeError(msg)


def check_tensor(tensor: torch.Tensor, path: Path) -> None:
    """Reject tensors that cannot be transferred, with the fix."""
    if type(tensor) is torch.Tensor and not (
        tensor.is_meta or tensor.layout != torch.strided or tensor.is_quantized
    ):
        return  # the common case, without building the path's text
    where = path_str(path)
    if type(tensor) is not torch.Tensor and not (
        type(tensor) is torch.nn.Parameter and type(tensor.detach()) is torch.Tensor
    ):
        msg = (
            f"tensor {where} is a {type(tensor).__module__}.{type(tensor).__qualname__}, a tensor subclass "
            "(DTensor, FakeTensor, ...); elastic moves plain dense tensors only: store its local or full "
            "value (dtensor.full_tensor() or .to_local()) as a plain torch.Tensor instead"
        )
        raise TypeError(msg) from None
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


def _span(shape: tuple[int, ...], stride: tuple[int, ...]) -> int:
    """How many elements of storage a tensor reaches, from its first to its last (1 for a scalar)."""
    return 1 + sum((n - 1) * abs(st) for n, st in zip(shape, stride))


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _link_aliases(tensors: list[torch.Tensor], metas: list[TensorMeta], members: list[int]) -> None:
    """Among tensors sharing one storage, make each that lies inside a dense tensor of the same dtype an
    alias of it (its bytes then travel once, and receivers rebuild it as a view)."""
    order = sorted(members, key=lambda i: (-_span(metas[i].shape, metas[i].stride or ()), i))
    carriers: list[tuple[int, int, int]] = []  # (index, first element, span) of dense tensors
    for i in order:
        m = metas[i]
        start, span = int(tensors[i].storage_offset()), _span(m.shape, m.stride or ())
        home = next(
            (
                c
                for c, c_start, c_span in carriers
                if metas[c].dtype == m.dtype and c_start <= start and start + span <= c_start + c_span
            ),
            None,
        )
        if home is not None:
            metas[i] = m._replace(alias=home, offset=start - int(tensors[home].storage_offset()))
        elif span == _numel(m.shape):
            carriers.append((i, start, span))


def metas_of(paths: list[Path], tensors: list[torch.Tensor], devices: list[str]) -> list[TensorMeta]:
    """The metadata of tensors read back from a checkpoint (`torch.load` keeps storage sharing, strides and
    `requires_grad`), with the aliases among them linked as `flatten` links a live state's."""
    metas = [
        TensorMeta(p, tuple(t.shape), t.dtype, d, t.stride(), t.requires_grad, -1, 0)
        for p, t, d in zip(paths, tensors, devices)
    ]
    storages: dict[int, list[int]] = {}
    for i, t in enumerate(tensors):
        if t.numel():
            storages.setdefault(t.untyped_storage().data_ptr(), []).append(i)
    for members in storages.values():
        if len(members) > 1:
            _link_aliases(tensors, metas, members)
    return metas


def to_save(flat: Flat) -> list[torch.Tensor]:
    """The tensors a checkpoint stores: the flattened ones, with `requires_grad` where the state's had it
    (detached leaves sharing the state's storage, so `torch.save` still writes shared bytes once)."""
    return [
        t.detach().requires_grad_(True) if m.requires_grad else t for t, m in zip(flat.tensors, flat.metas)
    ]


def staged(
    tensors: list[torch.Tensor], metas: list[TensorMeta], buffer: Callable[[int], torch.Tensor]
) -> list[torch.Tensor]:
    """Copies of `tensors` for a background write: `buffer(i)` gives a buffer shaped like carrier `i`
    (see `staging_buffer`); aliases become views of their carrier's copy, so the bytes are staged and
    written once and sharing survives."""
    out: list[Any] = [None] * len(tensors)
    for i in carriers(metas):
        buf = buffer(i)
        buf.copy_(tensors[i].detach(), non_blocking=buf.is_pinned())
        out[i] = buf
    for i, m in enumerate(metas):
        if m.alias >= 0:
            out[i] = _as_view(out[m.alias], m._replace(requires_grad=False))
    return [t.detach().requires_grad_(True) if m.requires_grad else t for t, m in zip(out, metas)]


def staging_fits(buf: torch.Tensor | None, meta: TensorMeta, pin: bool) -> bool:
    """Whether a staging buffer kept from the last async save can hold carrier `meta` again."""
    return (
        buf is not None
        and tuple(buf.shape) == meta.shape
        and buf.dtype == meta.dtype
        and buf.stride() == _layout(meta)
        and buf.is_pinned() == pin
    )


def staging_buffer(meta: TensorMeta, pin: bool) -> torch.Tensor:
    """A CPU buffer for carrier `meta`, with its strides where they are dense (channels_last kept)."""
    return torch.empty_strided(meta.shape, _layout(meta), dtype=meta.dtype, pin_memory=pin)


def _layout(meta: TensorMeta) -> tuple[int, ...]:
    if meta.stride is not None and _numel(meta.shape) > 1 and _dense(meta.shape, meta.stride):
        return meta.stride
    out, n = [], 1
    for d in reversed(meta.shape):
        out.append(n)
        n *= max(d, 1)
    return tuple(reversed(out))


def carriers(metas: list[TensorMeta]) -> list[int]:
    """The indices of the tensors whose bytes travel (the others are views of one of them)."""
    return [i for i, m in enumerate(metas) if m.alias < 0]


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
    if kind == "tensor":
        return leaf(value, path)
    if kind == "module":
        found = sds.get(path) if sds is not None else None
        if found is None:
            found = module_state(value, path)
            if sds is not None:  # the caller keeps what the walk took (for the schema)
                sds[path] = found
        if isinstance(found, ModuleWalk):  # a plain module tree: its tensors at once
            tensors = found.tensors()
            inner = ContainerNode("dict", OrderedDict, found.keys, leaf.many(tensors, found.paths(path)))
            return StatefulNode(kind=kind, inner=inner, type_name=type(value).__qualname__)
        inner = _walk(found, path, which, leaf)
        return StatefulNode(kind=kind, inner=inner, type_name=type(value).__qualname__)
    if kind in ("optimizer", "stateful"):
        try:
            sd = value.state_dict()
        except Exception as exc:
            msg = f"{path_str(path)}.state_dict() raised {type(exc).__name__}: {exc}"
            raise TypeError(msg) from exc
        return StatefulNode(kind=kind, inner=_walk(sd, path, which, leaf), type_name=type(value).__qualname__)
    if kind == "state":
        return _walk_state(value, path, which, leaf, sds)
    if kind == "dict":
        keys = tuple(value.keys())
        tensor = torch.Tensor
        children = tuple(  # a state dict is mostly tensors: those skip the dispatch
            leaf(v, (*path, k)) if type(v) is tensor else _walk(v, (*path, k), which, leaf)
            for k, v in value.items()
        )
        return ContainerNode("dict", type(value), keys, children)
    if kind in ("list", "tuple"):
        if all(type(v) in _ATOMIC for v in value):
            return ContainerNode(kind, type(value), (), tuple(value), atomic=True)
        children = tuple(_walk(v, (*path, i), which, leaf) for i, v in enumerate(value))
        return ContainerNode(kind, type(value), (), children)
    if kind == "rng":
        return _rng_node(value, path, leaf)
    check_object(value, path)
    return value


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


def _plain_state(value: Any) -> Any:
    """numpy arrays in a generator state as lists of ints (plain data), recursively."""
    if isinstance(value, dict):
        return {k: _plain_state(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(_plain_state(v) for v in value)
    if type(value).__module__ == "numpy":
        return value.tolist()
    return value


def _rng_node(value: Any, path: Path, leaf: Leaf) -> RestoreNode:
    kind = rng_kind(value)
    assert kind is not None  # kind_of said "rng"
    if kind == "torch.Generator":
        return RestoreNode(kind, leaf(value.get_state(), (*path, "state")), value.device.type)
    if kind == "random.Random":
        return RestoreNode(kind, value.getstate())
    if kind == "numpy.RandomState":
        return RestoreNode(kind, _plain_state(value.get_state(legacy=False)))
    return RestoreNode(kind, _plain_state(value.bit_generator.state))


def as_nodes(value: Any) -> Any:
    """Plain data (a generator's state: nested tuples, lists, dicts of numbers) as skeleton containers, so a
    checkpoint's skeleton codec stores it as it stores any container."""
    if isinstance(value, ContainerNode):
        return value
    if type(value) is tuple or type(value) is list:
        kind = "tuple" if type(value) is tuple else "list"
        return ContainerNode(kind, type(value), (), tuple(as_nodes(v) for v in value))
    if type(value) is dict:
        keys = tuple(value)
        return ContainerNode("dict", dict, keys, tuple(as_nodes(value[k]) for k in keys))
    return value


def from_nodes(node: Any) -> Any:
    """The inverse of `as_nodes`."""
    if isinstance(node, ContainerNode):
        items = [from_nodes(c) for c in node.children]
        if node.kind == "dict":
            return dict(zip(node.keys, items))
        return tuple(items) if node.kind == "tuple" else items
    return node


#: The generator kinds a checkpoint may name (and the numpy bit generators a numpy Generator may use).
RNG_KINDS = frozenset({"torch.Generator", "random.Random", "numpy.RandomState", "numpy.Generator"})
_BIT_GENERATORS = frozenset({"PCG64", "PCG64DXSM", "MT19937", "Philox", "SFC64"})


def _restore(node: RestoreNode, current: Any, tensors: list[torch.Tensor]) -> Any:
    """Set a generator's state in place (a new generator when the receiver has none of that kind)."""
    if rng_kind(current) != node.kind:
        current = _new_rng(node)
    if node.kind == "torch.Generator":
        assert isinstance(node.state, TensorSlot)
        current.set_state(tensors[node.state.index].to("cpu"))
    elif node.kind == "random.Random":
        current.setstate(node.state)
    elif node.kind == "numpy.RandomState":
        current.set_state(node.state)
    else:
        current.bit_generator.state = node.state
    return current


def _new_rng(node: RestoreNode) -> Any:
    if node.kind == "torch.Generator":
        device = "cuda" if node.device == "cuda" and torch.cuda.is_available() else node.device
        return torch.Generator(device=device)
    if node.kind == "random.Random":
        return random.Random()
    import numpy as np  # the source held a numpy generator: numpy is there (not a dependency of elastic)

    if node.kind == "numpy.RandomState":
        return np.random.RandomState()
    name = node.state.get("bit_generator") if isinstance(node.state, dict) else None
    if name not in _BIT_GENERATORS:
        known = sorted(_BIT_GENERATORS)
        msg = f"a numpy Generator state names the bit generator {name!r}; expected one of {known}"
        raise TypeError(msg)
    return np.random.Generator(getattr(np.random, name)())


_ATOMIC = frozenset({int, float, bool, str, bytes, complex, type(None)})


def slots_in(node: Any) -> Iterator[int]:
    """The tensor indices below a skeleton node."""
    if isinstance(node, TensorSlot):
        yield node.index
    elif isinstance(node, StatefulNode):
        yield from slots_in(node.inner)
    elif isinstance(node, RestoreNode):
        yield from slots_in(node.state)
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
    if isinstance(node, RestoreNode):
        return _restore(node, current, tensors)
    if isinstance(node, StateNode):
        if not is_elastic_state(current) or type(current).__qualname__ != node.qualname:
            found = type(current).__qualname__
            msg = f"{path_str(path)}: expected a nested {node.qualname} state, found {found}"
            raise TypeError(msg)
        apply_fields(current, node, tensors, in_place, path)
        return current
    if isinstance(node, StatefulNode):
        if kind_of(current) != node.kind:
            msg = (
                f"{path_str(path)}: the source holds a {node.kind} here and this rank a "
                f"{type(current).__qualname__}; a receiver loads a {node.kind}'s state into its own "
                f"{node.kind} but cannot build one: construct it on every rank"
            )
            raise TypeError(msg)
        if (
            node.kind == "module"
            and _only_tensors(node.inner)
            and all(in_place[i] for i in slots_in(node.inner))
        ):
            return current  # every parameter and buffer was written in place
        sd = materialize(node.inner, None, tensors, in_place, path)
        if node.kind == "module":
            load_module(current, sd)
        else:
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
    written in place; otherwise a new tensor allocated from the metadata on
    `device_for(meta)` (an ordinary tensor with the source's strides and `requires_grad`, also under
    `torch.inference_mode()`). An alias the receiver lacks becomes a view of its carrier's target, so
    storage shared on the source is shared here; `fill_aliases` completes the rest once the carriers
    hold their bytes. Returns the targets and which of them are in place."""
    if index is None:
        index = tensor_index(state, which)
    targets: list[Any] = [None] * len(metas)
    in_place = [False] * len(metas)
    aliases = []
    for i, meta in enumerate(metas):
        mine = index.get(meta.path)
        fits = (
            mine is not None
            and tuple(mine.shape) == meta.shape
            and mine.dtype == meta.dtype
            and (any_device or mine.device.type == meta.device_type)
        )
        if fits:
            targets[i] = mine
            in_place[i] = True
        elif meta.alias >= 0:
            aliases.append(i)
        else:
            targets[i] = _allocate(meta, device_for(meta))
    for i in aliases:
        meta = metas[i]
        carrier = targets[meta.alias]
        if carrier.stride() == metas[meta.alias].stride:
            targets[i] = _as_view(carrier, meta)
        else:  # the carrier is the receiver's own tensor in another layout: a copy, filled afterwards
            targets[i] = _allocate(meta, device_for(meta))
    return targets, in_place


def _as_view(carrier: torch.Tensor, meta: TensorMeta) -> torch.Tensor:
    assert meta.stride is not None  # aliases are found from strides
    with torch.inference_mode(False):
        view = carrier.detach().as_strided(meta.shape, meta.stride, carrier.storage_offset() + meta.offset)
        if meta.requires_grad:
            view.requires_grad_(True)
    return view


def _dense(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """Whether a layout covers its storage exactly once (contiguous, channels_last, any permutation)."""
    expected = 1
    for n, st in sorted(((n, st) for n, st in zip(shape, stride) if n != 1), key=lambda p: p[1]):
        if st != expected:
            return False
        expected *= n
    return True


def _allocate(meta: TensorMeta, device: torch.device) -> torch.Tensor:
    with torch.inference_mode(False):
        if meta.stride is not None and _numel(meta.shape) > 1 and _dense(meta.shape, meta.stride):
            t = torch.empty_strided(meta.shape, meta.stride, dtype=meta.dtype, device=device)
        else:
            t = torch.empty(meta.shape, dtype=meta.dtype, device=device)
        if meta.requires_grad:
            t.requires_grad_(True)
    return t


def fill_aliases(targets: list[torch.Tensor], metas: list[TensorMeta]) -> None:
    """After the carriers hold their bytes: give every alias target that is not already a view of its
    carrier the carrier's values (the receiver's own untied tensors, another layout)."""
    for i, meta in enumerate(metas):
        if meta.alias < 0:
            continue
        target, carrier, cmeta = targets[i], targets[meta.alias], metas[meta.alias]
        if carrier.stride() != cmeta.stride:
            assert cmeta.stride is not None
            with torch.no_grad():
                carrier = torch.empty_strided(
                    cmeta.shape, cmeta.stride, dtype=carrier.dtype, device=carrier.device
                ).copy_(carrier)
        view = _as_view(carrier, meta._replace(requires_grad=False))
        if (
            target.untyped_storage().data_ptr() == view.untyped_storage().data_ptr()
            and target.storage_offset() == view.storage_offset()
            and target.stride() == view.stride()
        ):
            continue  # already the same memory
        with torch.no_grad():
            target.detach().copy_(view.to(target.device))


def copy_state(src: Any, dst: Any, which: Which = "sync") -> list[bool]:
    """Make `dst` hold `src`'s `which` fields as a sync would, without communication (in place where it
    can). Returns which tensors were written in place. Used for local round trips and tests."""
    flat = flatten(src, which)
    targets, in_place = receive_targets(dst, flat.metas, which, lambda m: torch.device(m.device_type))
    with torch.no_grad(), torch.inference_mode(False):
        for i in carriers(flat.metas):
            targets[i].detach().copy_(flat.tensors[i])
        fill_aliases(targets, flat.metas)
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


def schema_of(state: Any) -> tuple[str, tuple[tuple[str, Any], ...]]:
    """The class's qualified name and, per synced field, its kind (and module layout after removing
    wrapper prefixes, optimizer class and param-group layout); see `scan_schema`."""
    config_of(state)
    return scan_schema(state)[0]


def scan_schema(
    state: Any, sds: dict[Path, Any] | None = None
) -> tuple[tuple[str, tuple[tuple[str, Any], ...]], dict[Path, Any]]:
    """The schema of `state` in full (module layouts as (name, shape, dtype) rows, for messages that say
    what differs), and the module state dicts it used, by path: those in `sds` (taken by a `flatten`) or
    taken now. Raises `TypeError` for a field that can never be synced (a DistributedSampler, a tensor
    subclass), so every rank learns before anything moves."""
    taken: dict[Path, Any] = {} if sds is None else sds
    return _scan_state(state, (), taken, module_layout), taken


#: A module layout's row: name, shape, dtype.
Row = tuple[str, tuple[int, ...], str]
#: What a schema holds for a module: (path, its state dict or kept walk) -> its layout, or its digest.
LayoutOf = Callable[[Path, Any], Any]


def module_layout(path: Path, sd: dict[str, Any] | ModuleWalk) -> tuple[Row, ...]:
    """A module's (name, shape, dtype) rows, from its canonical state dict or its kept walk."""
    items = zip(sd.keys, sd.live()) if isinstance(sd, ModuleWalk) else sd.items()
    layout = []
    for k, v in items:
        if isinstance(v, torch.Tensor):
            check_tensor(v.detach(), (*path, k))
            layout.append((k, tuple(v.shape), str(v.dtype)))
    return tuple(layout)


def layout_digest(path: Path, sd: dict[str, Any] | ModuleWalk) -> str:
    """The digest of a module's layout (what the compact schema holds). For a kept walk it is kept with
    the walk while its tensors keep their types, shapes, dtypes, devices and layouts (a parameter whose
    ``.data`` was replaced may have another shape): a sync with nothing to move then does no per-tensor
    work beyond reading those."""
    if not isinstance(sd, ModuleWalk):
        return _digest(module_layout(path, sd))
    objects = sd.live()
    key = (
        [type(t) for t in objects],
        [t.shape for t in objects],
        [t.dtype for t in objects],
        [t.device for t in objects],
        [t.layout for t in objects],
    )
    kept = sd.memo.get("layout digest")
    if kept is not None and kept[0] == key and kept[1] == path:
        return kept[2]
    digest = _digest(module_layout(path, sd))
    sd.memo["layout digest"] = (key, path, digest)
    return digest


def _scan_state(
    state: Any, path: Path, sds: dict[Path, Any], layout_of: LayoutOf
) -> tuple[str, tuple[tuple[str, Any], ...]]:
    fields = tuple(
        (name, _value_schema(getattr(state, name), (*path, name), sds, layout_of))
        for name in _fields_of(state, "sync")
    )
    return (type(state).__qualname__, fields)


def _value_schema(value: Any, path: Path, sds: dict[Path, Any], layout_of: LayoutOf) -> Any:
    kind = kind_of(value)
    if kind == "module":
        found = sds.get(path)
        if found is None:
            found = sds[path] = module_state(value, path)
        return ("module", layout_of(path, found))
    if kind == "optimizer":
        groups = tuple(
            (len(g["params"]), tuple(sorted(str(k) for k in g if k != "params"))) for g in value.param_groups
        )
        return ("optimizer", type(value).__qualname__, groups)
    if kind == "state":
        return ("state", _scan_state(value, path, sds, layout_of))
    if kind == "stateful":
        return ("stateful", type(value).__qualname__)
    if kind == "rng":
        return ("rng", rng_kind(value))
    if kind == "tensor":
        check_tensor(value, path)
    elif kind == "object":
        check_object(value, path)
    return (kind,)


def schema_digests(
    state: Any, sds: dict[Path, Any] | None = None, layout_of: LayoutOf = layout_digest
) -> tuple[str, tuple[tuple[str, str, str], ...]]:
    """The compact schema: the class name and, per synced field, (name, kind, digest), where the digest is
    that of `strict_schema` (a plain field's kind is not in it) and a module's layout counts by its digest
    (`layout_of`: a caller that kept the digests of unchanged layouts passes them). The module state dicts
    are those in `sds` or taken now."""
    taken: dict[Path, Any] = {} if sds is None else sds
    qualname, fields = _scan_state(state, (), taken, layout_of)
    return qualname, tuple((name, sch[0], _digest(strict_schema(sch))) for name, sch in fields)


def strict_schema(schema: Any) -> Any:
    """What of a field's schema (as `scan_schema` gives it) must agree across ranks: the schema itself for
    a structured field, one constant for a plain one (receivers adopt the source's value whatever its kind),
    a nested state's fields likewise."""
    kind = schema[0]
    if kind in PLAIN:
        return ("plain",)
    if kind == "state":
        qualname, fields = schema[1]
        return ("state", (qualname, tuple((name, strict_schema(sch)) for name, sch in fields)))
    return schema


def field_digests(state: Any) -> tuple[str, tuple[tuple[str, str, str], ...]]:
    """A compact schema: the class name and, per synced field, (name, kind, digest)."""
    config_of(state)
    return schema_digests(state)


def compatible(a: tuple[str, str, str], b: tuple[str, str, str]) -> bool:
    """Whether two fields' (name, kind, digest) match: the same name and digest (plain fields of any kinds,
    `None` included, have the same digest; see `strict_schema`)."""
    return a[0] == b[0] and a[2] == b[2]
