"""Checkpoints: collective `save` and `load`, and the `Stateful` protocol methods."""

from __future__ import annotations

from typing import Any

import torch

from ._decorator import config_of, is_elastic_state, saved_fields
from ._tree import kind_of

__all__ = ["load_method", "load_state_dict_method", "save_method", "state_dict_method"]


def save_method(self: Any, path: Any, **kwargs: Any) -> Any:
    """Write a checkpoint of this state under `path` (collective); see `elastic.save`."""
    raise NotImplementedError("elastic.save is not implemented yet")


def load_method(self: Any, path: Any, **kwargs: Any) -> Any:
    """Restore the most tenured state in the group from memory or `path` (collective); see `elastic.load`."""
    raise NotImplementedError("elastic.load is not implemented yet")


def state_dict_method(self: Any) -> dict[str, Any]:
    """The saved fields as a state dict (torch's `Stateful` protocol, usable with DCP)."""
    config_of(self, "state_dict()")
    out: dict[str, Any] = {}
    for attribute in saved_fields(type(self)):
        value = getattr(self, attribute.name)
        kind = kind_of(value)
        out[attribute.name] = value.state_dict() if kind in ("module", "optimizer", "stateful", "state") else value
    return out


def load_state_dict_method(self: Any, state_dict: dict[str, Any]) -> None:
    """Restore the saved fields from `state_dict` (torch's `Stateful` protocol); tensors in place."""
    config_of(self, "load_state_dict()")
    names = [a.name for a in saved_fields(type(self))]
    for name in names:
        if name not in state_dict:
            continue
        new = state_dict[name]
        current = getattr(self, name)
        kind = kind_of(current)
        if kind in ("module", "optimizer", "stateful") or is_elastic_state(current):
            current.load_state_dict(new)
        elif (
            kind == "tensor"
            and isinstance(new, torch.Tensor)
            and new.shape == current.shape
            and new.dtype == current.dtype
        ):
            with torch.no_grad():
                current.copy_(new)
        else:
            object.__setattr__(self, name, new)


def save(state: Any, path: Any, **kwargs: Any) -> Any:
    """Write a checkpoint of the most tenured state under `path` (collective)."""
    raise NotImplementedError("elastic.save is not implemented yet")


def load(state: Any, path: Any, **kwargs: Any) -> Any:
    """Restore the most tenured state in the group, from memory or from `path` (collective)."""
    raise NotImplementedError("elastic.load is not implemented yet")


class LoadReport:
    """Placeholder until checkpoints land."""
