"""Field policies: which attrs fields are synced between ranks and which are saved in checkpoints."""

from __future__ import annotations

from typing import Any

import attrs

__all__ = ["POLICY_KEY", "FieldPolicy", "field", "local", "policy_of"]

#: The attrs metadata key under which a field's policy is stored.
POLICY_KEY = "elastic"


@attrs.frozen
class FieldPolicy:
    """Where a field goes: `sync` to the other ranks, `save` into checkpoints."""

    sync: bool = True
    save: bool = True


_DEFAULT = FieldPolicy()


def field(*, sync: bool = True, save: bool = True, **attrs_kwargs: Any) -> Any:
    """An `attrs.field` that carries elastic's policy in its metadata.

    `sync=False` keeps the field out of `sync` (each rank keeps its own value); `save=False` keeps it out
    of checkpoints. Every other keyword goes to `attrs.field` unchanged.
    """
    for name, value in (("sync", sync), ("save", save)):
        if not isinstance(value, bool):
            msg = f"elastic.field({name}=...) must be True or False, got {value!r}"
            raise TypeError(msg) from None
    metadata = dict(attrs_kwargs.pop("metadata", None) or {})
    metadata[POLICY_KEY] = FieldPolicy(sync=sync, save=save)
    return attrs.field(metadata=metadata, **attrs_kwargs)


def local(**attrs_kwargs: Any) -> Any:
    """A per-rank field: never synced, never saved (`field(sync=False, save=False)`)."""
    return field(sync=False, save=False, **attrs_kwargs)


def policy_of(attribute: attrs.Attribute) -> FieldPolicy:
    """The policy of one attrs attribute; plain attrs fields are synced and saved."""
    policy = attribute.metadata.get(POLICY_KEY, _DEFAULT)
    return policy if isinstance(policy, FieldPolicy) else _DEFAULT
