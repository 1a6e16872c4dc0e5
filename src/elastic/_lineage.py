"""Lineage: the id of the last successful sync or load a state took part in, and whether it is torn.

Kept outside the instance (a weak registry) so that frozen and slotted classes need no extra slot and a
copied or pickled state never carries a lineage it did not earn.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

import attrs

__all__ = ["Lineage", "lineage", "set_lineage"]


@attrs.frozen
class Lineage:
    token: str | None = None
    torn: bool = False


_FRESH = Lineage()
_lock = threading.Lock()
_registry: dict[int, tuple[Callable[[], Any], Lineage]] = {}


def lineage(state: Any) -> Lineage:
    """The lineage of `state` (fresh for a state that never synced)."""
    with _lock:
        entry = _registry.get(id(state))
    if entry is None or entry[0]() is not state:
        return _FRESH
    return entry[1]


def set_lineage(state: Any, *, token: str | None, torn: bool) -> None:
    """Record the lineage of `state`.

    A state that cannot be weakly referenced (a slotted class with `weakref_slot=False`) never gets a
    token, so it always takes the full sync; its torn mark is kept with a strong reference.
    """
    key = id(state)
    getter: Callable[[], Any]

    def gone(ref: Any) -> None:
        _drop(key, ref)

    try:
        getter = weakref.ref(state, gone)
    except TypeError:
        token = None
        if not torn:
            with _lock:
                _registry.pop(key, None)
            return

        def getter(state: Any = state) -> Any:
            return state

    with _lock:
        _registry[key] = (getter, Lineage(token=token, torn=torn))


def _drop(key: int, ref: Any) -> None:
    with _lock:
        entry = _registry.get(key)
        if entry is not None and entry[0] is ref:
            del _registry[key]
