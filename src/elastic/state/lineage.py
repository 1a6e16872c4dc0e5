"""Lineage: the id of the last successful sync or load a state took part in, and whether it is torn.

Kept outside the instance (a weak registry) so that frozen and slotted classes need no extra slot and a
copied or pickled state never carries a lineage it did not earn.
"""

from __future__ import annotations

from typing import Any

import attrs

from elastic._util.weakmap import IdentityWeakMap

__all__ = ["Lineage", "lineage", "set_lineage"]


@attrs.frozen
class Lineage:
    token: str | None = None
    torn: bool = False


_FRESH = Lineage()
_registry: IdentityWeakMap[Lineage] = IdentityWeakMap()


def lineage(state: Any) -> Lineage:
    """The lineage of `state` (fresh for a state that never synced)."""
    found = _registry.get(state)
    return _FRESH if found is None else found


def set_lineage(state: Any, *, token: str | None, torn: bool) -> None:
    """Record the lineage of `state`.

    A state that cannot be weakly referenced (a slotted class with `weakref_slot=False`) never gets a
    token, so it always takes the full sync; its torn mark is kept with a strong reference.
    """
    if not _registry.set(state, Lineage(token=token, torn=torn)) and torn:
        _registry.set(state, Lineage(token=None, torn=True), strong=True)
