"""Applying a skeleton: where incoming tensors go, and the skeleton and its tensors put back into a state.

`receive_targets` chooses, per incoming tensor, the receiver's own tensor at the same path (written in
place) or a new one; `apply_fields` then puts the skeleton back, keeping the receiver's own objects
(modules, optimizers, containers, generators, tensors written in place) wherever it can.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from elastic.state.config import is_elastic_state
from elastic.state.nodes import (
    ContainerNode,
    Kind,
    Path,
    RestoreNode,
    StatefulNode,
    StateNode,
    TensorSlot,
    Which,
    is_namedtuple_type,
    kind_of,
    path_str,
    walk,
)
from elastic.state.rng import restore_rng
from elastic.state.statedict import load_module
from elastic.state.tensors import TensorMeta, allocate, as_view
from elastic.state.tree import tensor_index

__all__ = ["apply_fields", "fill_aliases", "materialize", "receive_targets"]


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
            targets[i] = allocate(meta, device_for(meta))
    for i in aliases:
        meta = metas[i]
        carrier = targets[meta.alias]
        if carrier.stride() == metas[meta.alias].stride:
            targets[i] = as_view(carrier, meta)
        else:  # the carrier is the receiver's own tensor in another layout: a copy, filled afterwards
            targets[i] = allocate(meta, device_for(meta))
    return targets, in_place


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
        view = as_view(carrier, meta._replace(requires_grad=False))
        if (
            target.untyped_storage().data_ptr() == view.untyped_storage().data_ptr()
            and target.storage_offset() == view.storage_offset()
            and target.stride() == view.stride()
        ):
            continue  # already the same memory
        with torch.no_grad():
            target.detach().copy_(view.to(target.device))


def apply_fields(
    state: Any, node: StateNode, tensors: list[torch.Tensor], in_place: list[bool], path: Path = ()
) -> None:
    """Write every field of `node` into `state` (frozen classes included)."""
    for name, child in node.fields.items():
        current = getattr(state, name)
        value = materialize(child, current, tensors, in_place, (*path, name))
        if value is not current:
            object.__setattr__(state, name, value)


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
        state = tensors[node.state.index] if isinstance(node.state, TensorSlot) else node.state
        return restore_rng(node.protocol, state, node.device, current)
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
        if node.kind == Kind.MODULE and _written_in_place(node.inner, in_place):
            return current  # every parameter and buffer was written in place
        sd = materialize(node.inner, None, tensors, in_place, path)
        if node.kind == Kind.MODULE:
            load_module(current, sd)
        else:
            current.load_state_dict(sd)
        return current
    if isinstance(node, ContainerNode):
        if node.kind == Kind.DICT:
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
        else:
            same: Any = current if type(current) is node.type else None
            seq: Any = same if same is not None and len(same) == len(node.children) else None
            items = [
                materialize(c, seq[i] if seq is not None else None, tensors, in_place, (*path, i))
                for i, c in enumerate(node.children)
            ]
        if node.kind == Kind.LIST:
            if type(current) is list:
                current[:] = items
                return current
            return items
        return _rebuild_tuple(node.type, items)
    return node


def _written_in_place(node: Any, in_place: list[bool]) -> bool:
    """Whether every leaf below a module's state-dict node is a tensor that was written in place."""
    return all(
        in_place[n.index] if type(n) is TensorSlot else type(n) is ContainerNode for _, n in walk(node)
    )


def _rebuild_tuple(tp: Any, items: list[Any]) -> Any:
    if tp is tuple:
        return tuple(items)
    return tp._make(items) if is_namedtuple_type(tp) else tp(items)
