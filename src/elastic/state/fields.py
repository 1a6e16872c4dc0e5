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
    """An ``attrs.field`` that carries elastic's policy in its metadata.

    Plain attrs fields are synced and saved; this sets either off. A field with ``sync=False`` that is
    saved is restored by `elastic.load` on the reading rank only (it is not broadcast).

    Args:
        sync: False keeps the field out of `elastic.sync` (each rank keeps its own value).
        save: False keeps the field out of checkpoints.
        **attrs_kwargs: passed to ``attrs.field`` unchanged (``default=``, ``factory=``, ``metadata=``
            is merged, ...).

    Returns:
        The attrs field, to assign in the class body.

    Raises:
        TypeError: `sync` or `save` is not a bool.
    """
    for name, value in (("sync", sync), ("save", save)):
        if not isinstance(value, bool):
            msg = f"elastic.field({name}=...) must be True or False, got {value!r}"
            raise TypeError(msg) from None
    metadata = dict(attrs_kwargs.pop("metadata", None) or {})
    metadata[POLICY_KEY] = FieldPolicy(sync=sync, save=save)
    return attrs.field(metadata=metadata, **attrs_kwargs)


def local(**attrs_kwargs: Any) -> Any:
    """A per-rank field: never synced, never saved (``field(sync=False, save=False)``).

    For values that belong to one rank (a rank-specific sampler, a scratch cache, a file handle).

    Args:
        **attrs_kwargs: passed to ``attrs.field`` unchanged.

    Returns:
        The attrs field, to assign in the class body.
    """
    return field(sync=False, save=False, **attrs_kwargs)


def policy_of(attribute: attrs.Attribute) -> FieldPolicy:
    """The policy of one attrs attribute; plain attrs fields are synced and saved."""
    policy = attribute.metadata.get(POLICY_KEY, _DEFAULT)
    return policy if isinstance(policy, FieldPolicy) else _DEFAULT
