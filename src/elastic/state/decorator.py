"""`@elastic_state`: the class decorator, which checks its arguments and attaches the state's methods."""

from __future__ import annotations

import inspect
import types
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import attrs

from elastic.state.config import CONFIG_ATTR, METHODS, StateConfig
from elastic.state.fields import policy_of

__all__ = ["elastic_state"]

C = TypeVar("C", bound=type)

_MISSING: Any = object()


def elastic_state(
    *args: Any,
    tenure: Callable[[Any], Any] | str = _MISSING,
    on_sync: Callable[[Any, Any], Any] | None = None,
) -> Callable[[C], C]:
    """Make an attrs class an elastic training state (a class decorator, always called with keywords).

    Put it outermost, above ``@attrs.define`` / ``@attrs.frozen`` (frozen and slotted classes work); on a
    plain annotated class it applies ``attrs.define`` itself. It adds the methods ``sync``, ``save``,
    ``load`` (the functions `elastic.sync`, `elastic.save`, `elastic.load` without their ``state``
    argument), and ``state_dict`` / ``load_state_dict``, so that an instance is a torch ``Stateful``
    (usable with ``torch.distributed.checkpoint``), unless the class defines them itself.

    ```python
    @elastic.elastic_state(tenure=lambda s: s.step)  # or tenure="step"
    @attrs.define
    class TrainState:
        model: torch.nn.Module
        optimizer: torch.optim.Optimizer
        step: int = 0
    ```

    Args:
        tenure: how up to date a state is: a callable ``tenure(state) -> orderable | None`` (an int, a
            tuple such as ``(epoch, step)``, a string) or the name of a field. The most tenured state
            wins every election; ties go to the lowest rank; None means "I hold no state" and is the
            least tenured value.
        on_sync: ``on_sync(state, report)`` runs on every rank after each successful ``sync`` or
            ``load`` (rescale the learning rate for a new world size, re-shard the data, ...); `report`
            is the `SyncReport` or `LoadReport`.

    Returns:
        The class decorator.

    Raises:
        TypeError: at decoration time: a positional argument, no ``tenure``, a ``tenure`` that is neither
            callable nor a field name of the class, an ``on_sync`` that is not callable with two
            arguments, or something other than a class decorated.

    Warns:
        UserWarning: once at decoration, when the tenure reads an ``elastic.local()`` field or the class
            cannot use the fast path of `elastic.sync`.
    """
    if args:
        msg = (
            f"elastic_state takes keyword arguments only, got positional {args[0]!r}; "
            "write @elastic_state(tenure=lambda s: s.step) or @elastic_state(tenure='step')"
        )
        raise TypeError(msg) from None
    if tenure is _MISSING:
        msg = "elastic_state() needs tenure=: a callable state -> orderable, or a field name such as 'step'"
        raise TypeError(msg) from None
    if not (callable(tenure) or isinstance(tenure, str)):
        msg = (
            f"elastic_state(tenure=...) must be a callable or a field name, got {type(tenure).__name__} "
            f"{tenure!r}; write tenure=lambda s: s.step or tenure='step'"
        )
        raise TypeError(msg) from None
    if callable(tenure) and not isinstance(tenure, str):
        _check_arity(tenure, "tenure", 1)
    if on_sync is not None:
        if not callable(on_sync):
            msg = f"elastic_state(on_sync=...) must be callable as on_sync(state, report), got {on_sync!r}"
            raise TypeError(msg) from None
        _check_arity(on_sync, "on_sync", 2)

    def wrap(cls: C) -> C:
        return _build(cls, tenure, on_sync)

    return wrap


def _check_arity(fn: Callable[..., Any], name: str, n: int) -> None:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # builtins and C callables: nothing to check
    try:
        sig.bind(*range(n))
    except TypeError:
        call = "tenure(state)" if n == 1 else "on_sync(state, report)"
        msg = f"elastic_state({name}=...) must accept {n} positional argument(s) as {call}; got {fn!r}{sig}"
        raise TypeError(msg) from None


def _build(cls: Any, tenure: Callable[[Any], Any] | str, on_sync: Callable[..., Any] | None) -> Any:
    if not isinstance(cls, type):
        msg = f"@elastic_state decorates classes, got {type(cls).__name__} {cls!r}"
        raise TypeError(msg) from None
    if not attrs.has(cls):
        try:
            cls = attrs.define(cls)
        except Exception as exc:
            msg = (
                f"@elastic_state could not make {cls.__qualname__} an attrs class ({type(exc).__name__}: "
                f"{exc}); decorate it with @attrs.define yourself and fix what attrs reports"
            )
            raise TypeError(msg) from None
    names = [a.name for a in attrs.fields(cls)]
    if isinstance(tenure, str):
        if tenure not in names:
            msg = (
                f"elastic_state(tenure={tenure!r}) names no field of {cls.__qualname__}; "
                f"its fields are {names}"
            )
            raise TypeError(msg) from None
        tenure_fn: Callable[[Any], Any] = _field_getter(tenure)
        tenure_field: str | None = tenure
    else:
        tenure_fn, tenure_field = tenure, None
    _warn_without_fast_path(cls, tenure_fn, tenure_field)
    setattr(cls, CONFIG_ATTR, StateConfig(tenure=tenure_fn, tenure_field=tenure_field, on_sync=on_sync))
    for name, method in METHODS.items():
        if not hasattr(cls, name):
            _attach(cls, name, method)
    return cls


def _names_read(fn: Any) -> set[str]:
    """The attribute and global names a tenure function's code mentions (nested code included)."""
    code = getattr(fn, "__code__", None) or getattr(vars(type(fn)).get("__call__"), "__code__", None)
    names: set[str] = set()
    stack = [code] if isinstance(code, types.CodeType) else []
    while stack:
        c = stack.pop()
        names.update(c.co_names)
        stack.extend(k for k in c.co_consts if isinstance(k, types.CodeType))
    return names


def _warn_without_fast_path(cls: type, tenure: Callable[[Any], Any], tenure_field: str | None) -> None:
    """Warn (once, at decoration) about the two ways a class silently loses sync's fast path."""
    local = [a.name for a in attrs.fields(cls) if not policy_of(a).sync]
    read = {tenure_field} if tenure_field is not None else _names_read(tenure)
    stale = [name for name in local if name in read]
    if stale:
        msg = (
            f"@elastic_state on {cls.__qualname__}: the tenure reads {stale[0]!r}, a field that is never "
            "synced (elastic.local() or sync=False), so the ranks' tenures can differ after every sync: the "
            "fast path (nothing moves when the replicas are identical) never applies and the election "
            "follows rank-local values; compute the tenure from synced fields only"
        )
        warnings.warn(msg, UserWarning, stacklevel=4)
    if getattr(cls, "__weakrefoffset__", 1) == 0:
        msg = (
            f"@elastic_state on {cls.__qualname__}: its instances cannot be weakly referenced (a slotted "
            "class with weakref_slot=False), so elastic cannot remember which sync they took part in: "
            "every sync moves the whole state (no fast path); drop weakref_slot=False"
        )
        warnings.warn(msg, UserWarning, stacklevel=4)


def _field_getter(name: str) -> Callable[[Any], Any]:
    def tenure_of(state: Any) -> Any:
        return getattr(state, name)

    tenure_of.__qualname__ = f"tenure_of_{name}"
    return tenure_of


def _attach(cls: type, name: str, method: Callable[..., Any]) -> None:
    def make() -> Callable[..., Any]:
        def generated(self: Any, *args: Any, **kwargs: Any) -> Any:
            return method(self, *args, **kwargs)

        return generated

    fn = make()
    fn.__name__ = name
    fn.__qualname__ = f"{cls.__qualname__}.{name}"
    fn.__module__ = cls.__module__
    fn.__doc__ = method.__doc__
    fn.__signature__ = inspect.signature(method)  # type: ignore[attr-defined]
    fn.__wrapped__ = method  # type: ignore[attr-defined]
    setattr(cls, name, fn)
