"""The schema: what of a state must agree across ranks before anything moves.

Per synced field, its kind (`Kind`) and, for structured values, their layout: a module's (name, shape,
dtype) rows after removing wrapper prefixes, an optimizer's class and param-group layout, another stateful
object's class, a nested state's own schema. Plain values of any kind count as one (`strict_schema`): a
receiver adopts the source's value whatever kind it holds itself. `schema_digests` is the compact form every
rank sends in its election record; `scan_schema` the full one, for a message that says what differs.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import torch

from elastic.state.config import synced_fields
from elastic.state.nodes import PLAIN, Kind, Path, kind_of
from elastic.state.rng import rng_kind
from elastic.state.statedict import ModuleWalk
from elastic.state.tensors import check_tensor
from elastic.state.tree import check_object, module_state

__all__ = [
    "compatible",
    "layout_digest",
    "module_layout",
    "scan_schema",
    "schema_digests",
    "strict_schema",
]


def _digest(obj: Any) -> str:
    return hashlib.blake2b(repr(obj).encode(), digest_size=8).hexdigest()


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
        (a.name, _value_schema(getattr(state, a.name), (*path, a.name), sds, layout_of))
        for a in synced_fields(type(state))
    )
    return (type(state).__qualname__, fields)


def _value_schema(value: Any, path: Path, sds: dict[Path, Any], layout_of: LayoutOf) -> Any:
    """A field's schema: its kind's name (plain text, as digests hash it) and what of a structured value
    must match."""
    kind = kind_of(value)
    if kind == Kind.MODULE:
        found = sds.get(path)
        if found is None:
            found = sds[path] = module_state(value, path)
        return (kind.value, layout_of(path, found))
    if kind == Kind.OPTIMIZER:
        groups = tuple(
            (len(g["params"]), tuple(sorted(str(k) for k in g if k != "params"))) for g in value.param_groups
        )
        return (kind.value, type(value).__qualname__, groups)
    if kind == Kind.STATE:
        return (kind.value, _scan_state(value, path, sds, layout_of))
    if kind == Kind.STATEFUL:
        return (kind.value, type(value).__qualname__)
    if kind == Kind.RNG:
        return (kind.value, rng_kind(value))
    if kind == Kind.TENSOR:
        check_tensor(value, path)
    elif kind == Kind.OBJECT:
        check_object(value, path)
    return (kind.value,)


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
    if kind == Kind.STATE:
        qualname, fields = schema[1]
        return (Kind.STATE.value, (qualname, tuple((name, strict_schema(sch)) for name, sch in fields)))
    return schema


def compatible(a: tuple[str, str, str], b: tuple[str, str, str]) -> bool:
    """Whether two fields' (name, kind, digest) match: the same name and digest (plain fields of any kinds,
    `None` included, have the same digest; see `strict_schema`)."""
    return a[0] == b[0] and a[2] == b[2]
