"""The per-class configuration `@elastic_state` attaches, and which fields `sync` and checkpoints see."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import attrs

from elastic.state.fields import policy_of

__all__ = [
    "CONFIG_ATTR",
    "METHODS",
    "attached",
    "StateConfig",
    "config_of",
    "is_elastic_state",
    "saved_fields",
    "synced_fields",
]

#: The class attribute holding a decorated class's `StateConfig`.
CONFIG_ATTR = "__elastic_state__"

#: The methods `@elastic_state` adds to a class that does not define them itself, by name. Each layer
#: registers its own with `attached` (``sync`` in replication, ``save``/``load``/``state_dict``/
#: ``load_state_dict`` in checkpoint), so that the state layer knows none of the layers above it.
METHODS: dict[str, Callable[..., Any]] = {}

F = TypeVar("F", bound=Callable[..., Any])


def attached(name: str) -> Callable[[F], F]:
    """Register the decorated function as the method `name` of every elastic state class."""

    def register(fn: F) -> F:
        METHODS[name] = fn
        return fn

    return register


@attrs.frozen
class StateConfig:
    """What `@elastic_state(...)` was given, checked."""

    tenure: Callable[[Any], Any]
    tenure_field: str | None
    on_sync: Callable[[Any, Any], Any] | None


def is_elastic_state(obj: Any) -> bool:
    """Whether `obj` is an instance of an `@elastic_state` class."""
    return isinstance(getattr(type(obj), CONFIG_ATTR, None), StateConfig) and not isinstance(obj, type)


def config_of(state: Any, what: str = "this call") -> StateConfig:
    """The `StateConfig` of a state instance, or a `TypeError` that says how to fix the call."""
    config = getattr(type(state), CONFIG_ATTR, None)
    if not isinstance(config, StateConfig) or isinstance(state, type):
        msg = (
            f"{what} needs an instance of an @elastic_state class, got {type(state).__qualname__} "
            f"{_short(state)}; decorate the class with @elastic_state(tenure=...) and pass an instance"
        )
        raise TypeError(msg) from None
    return config


def _short(obj: Any) -> str:
    text = repr(obj)
    return text if len(text) <= 80 else text[:77] + "..."


def synced_fields(cls: type) -> list[attrs.Attribute]:
    """The attrs fields of `cls` that `sync` moves, in definition order."""
    return [a for a in attrs.fields(cls) if policy_of(a).sync]


def saved_fields(cls: type) -> list[attrs.Attribute]:
    """The attrs fields of `cls` that checkpoints hold, in definition order."""
    return [a for a in attrs.fields(cls) if policy_of(a).save]
