"""Values kept per object, by identity, for as long as the object lives.

States are often unhashable (attrs classes with ``eq=True``), so `weakref.WeakKeyDictionary` cannot hold
them; this map keys on ``id(obj)`` and drops the entry when the object is collected. Objects that cannot be
weakly referenced (slotted classes with ``weakref_slot=False``) are refused: `set` returns False.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any, Generic, TypeVar

__all__ = ["IdentityWeakMap"]

V = TypeVar("V")


class IdentityWeakMap(Generic[V]):
    """A map from live objects (by identity) to values; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[int, tuple[Callable[[], Any], V]] = {}

    def get(self, obj: Any) -> V | None:
        """The value kept for `obj`, or None."""
        with self._lock:
            entry = self._entries.get(id(obj))
        if entry is None or entry[0]() is not obj:
            return None
        return entry[1]

    def set(self, obj: Any, value: V, *, strong: bool = False) -> bool:
        """Keep `value` for `obj` until `obj` is collected. For an object that cannot be weakly referenced,
        keep it alive with the value when `strong` (until `pop`), else keep nothing and return False."""
        key = id(obj)
        getter: Callable[[], Any]

        def gone(ref: Any) -> None:
            with self._lock:
                entry = self._entries.get(key)
                if entry is not None and entry[0] is ref:
                    del self._entries[key]

        try:
            getter = weakref.ref(obj, gone)
        except TypeError:
            if not strong:
                self.pop(obj)
                return False

            def getter(obj: Any = obj) -> Any:
                return obj

        with self._lock:
            self._entries[key] = (getter, value)
        return True

    def pop(self, obj: Any) -> None:
        """Forget `obj`."""
        with self._lock:
            entry = self._entries.get(id(obj))
            if entry is not None and entry[0]() is obj:
                del self._entries[id(obj)]

    def __contains__(self, key: int) -> bool:
        """Whether an entry is kept under ``id(obj) == key`` (for tests)."""
        with self._lock:
            return key in self._entries
