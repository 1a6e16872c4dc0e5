"""`StateMethods`: the base class through which type checkers see the methods `@elastic_state` adds.

mypy ignores what a class decorator returns and pyright cannot express "this class plus five methods", so
neither can learn the generated `sync`, `save`, `load`, `state_dict` and `load_state_dict` from the
decorator alone. A base class is the one way both understand, without a plugin::

    @elastic_state(tenure="step")
    @attrs.define
    class TrainState(elastic.StateMethods):
        ...

The methods are declared for type checkers only and are the public functions themselves (``state`` is
their first parameter, so it binds as ``self``): the signatures cannot drift from `elastic.sync`,
`elastic.save` (with its overloads: ``blocking=False`` returns a `SaveHandle`) and `elastic.load`. At run
time the class is empty (``__slots__ = ()``, so slotted states stay slotted) and the decorator attaches the
methods as it does on any class: inheriting changes nothing but what a type checker sees.

This module sits above the layers (it names functions of replication and checkpoint); only the package's
``__init__`` imports it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from elastic.checkpoint import saveload as _saveload
    from elastic.replication import sync as _sync

__all__ = ["StateMethods"]


class StateMethods:
    """Declares the methods `@elastic_state` adds, for type checkers; empty at run time.

    Inherit it in an `@elastic_state` class to have mypy and pyright check ``state.sync()``,
    ``state.save(...)``, ``state.load(...)``, ``state.state_dict()`` and ``state.load_state_dict(...)``.
    The decorator is still what makes the class an elastic state.
    """

    __slots__ = ()

    if TYPE_CHECKING:
        sync = _sync.sync
        save = _saveload.save
        load = _saveload.load
        state_dict = _saveload.state_dict_method
        load_state_dict = _saveload.load_state_dict_method
