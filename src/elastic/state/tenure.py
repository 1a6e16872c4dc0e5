"""Tenures: how they compare, how the group elects the greatest, how checkpoints are ordered and saved.

One set of rules serves `sync`'s election, `load`'s choice of checkpoint, `save`'s writer and the order
`scan` (hence retention) gives the checkpoints under a root:

- `None` is the least tenure ("I hold no state"); ties go to the lowest rank (the first candidate).
- Two tenures compare when they are of one type, or both numbers (`int` and `float`, not `bool`); then
  Python's ``>`` decides. Anything else, and NaN anywhere, is a `TenureError`.
- `order_key` extends that order to a total one over saveable tenures, so that a listing of checkpoints
  of different types still sorts; wherever `greater` can compare, `order_key` agrees with it.
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from elastic._util.errors import TenureError
from elastic._util.words import ranks_str

if TYPE_CHECKING:
    from elastic.state.config import StateConfig
    from elastic.state.lineage import Lineage

__all__ = [
    "Incomparable",
    "as_saveable",
    "check_saveable",
    "current",
    "elect",
    "exceeds",
    "greater",
    "has_nan",
    "is_saveable",
    "order_key",
]


class Incomparable(Exception):
    """Two tenures that cannot be ordered (raised by `greater`; callers say which values, and where)."""


def current(state: Any, config: StateConfig, line: Lineage) -> Any:
    """The tenure of `state` now: `None` when its lineage is torn, else what its tenure callable says."""
    return None if line.torn else config.tenure(state)


def is_number(x: Any) -> bool:
    """A real number: `int`, `float`, numpy integers and floats (a `bool` is not a number here)."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and type(x).__name__ != "bool_"


def has_nan(value: Any) -> bool:
    """Whether `value` is NaN, or a tuple holding NaN, or any value unequal to itself."""
    if isinstance(value, float):
        return math.isnan(value)
    if isinstance(value, tuple):
        return any(has_nan(v) for v in value)
    try:
        return bool(value != value)
    except Exception:
        return False


def greater(a: Any, b: Any) -> bool:
    """Whether tenure `a` is strictly greater than `b` (`None` least); `Incomparable` otherwise."""
    if a is None:
        return False
    if b is None:
        return True
    if type(a) is not type(b) and not (is_number(a) and is_number(b)):
        raise Incomparable
    try:
        return bool(a > b)
    except TypeError:
        raise Incomparable from None


def elect(tenures: Sequence[Any], op: str = "sync") -> int:
    """The rank of the maximum tenure (`None` least, ties to the lowest rank), or `TenureError`."""
    nan = [r for r, t in enumerate(tenures) if t is not None and has_nan(t)]
    if nan:
        msg = (
            f"{op}: tenure is NaN on {ranks_str(nan)} ({tenures[nan[0]]!r}); NaN cannot be ordered. "
            "Return a number, string or tuple that grows as training advances (the step, for instance)"
        )
        raise TenureError(msg) from None
    best = 0
    for rank in range(1, len(tenures)):
        a, b = tenures[best], tenures[rank]
        try:
            if greater(b, a):
                best = rank
        except Incomparable:
            msg = (
                f"{op}: tenures cannot be compared: rank {best} has {a!r} ({type(a).__name__}) and rank "
                f"{rank} has {b!r} ({type(b).__name__}); the tenure callable must return values of one "
                "orderable type on every rank"
            )
            raise TenureError(msg) from None
    return best


def exceeds(a: Any, b: Any, what_a: str, what_b: str, op: str) -> bool:
    """`greater(a, b)`, or a `TenureError` naming `what_a` and `what_b` (checkpoints or ranks' states)."""
    try:
        return greater(a, b)
    except Incomparable:
        msg = (
            f"{op}: the tenure {a!r} of {what_a} cannot be compared with the tenure {b!r} of {what_b}; "
            "tenures must be of one orderable type (remove checkpoints of another run from the directory, "
            "or make the tenure callable return the same type as before)"
        )
        raise TenureError(msg) from None


def order_key(value: Any) -> tuple[Any, ...]:
    """A total order over saveable tenures that agrees with `greater` wherever `greater` can compare."""
    if value is None:
        return (0,)
    if isinstance(value, (bool, int, float)):
        return (1, value)
    if isinstance(value, str):
        return (2, value)
    if isinstance(value, tuple):
        return (3, tuple(order_key(v) for v in value))
    return (4, repr(value))


def is_saveable(value: Any) -> bool:
    """Whether a manifest can hold `value`: a number (not NaN), string, `None` or a nested tuple of those."""
    if value is None or isinstance(value, (bool, int, str)):
        return True
    if isinstance(value, float):
        return not math.isnan(value)
    if isinstance(value, tuple):
        return all(is_saveable(v) for v in value)
    return False


def as_saveable(value: Any) -> Any:
    """`value` with integer-like numbers (numpy integers, anything with `__index__`) as `int` and numpy
    floating scalars as `float`, inside tuples too: what a manifest stores for them."""
    if isinstance(value, tuple):
        return tuple(as_saveable(v) for v in value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    try:
        return operator.index(value)
    except TypeError:
        pass
    if type(value).__module__ == "numpy" and hasattr(value, "__float__"):
        return float(value)
    return value


def check_saveable(value: Any, op: str = "save") -> None:
    """A `TypeError` unless `value` is a number, string, `None` or a (nested) tuple of those."""
    if not is_saveable(value):
        msg = (
            f"{op}: the tenure {value!r} ({type(value).__name__}) cannot be stored in a checkpoint manifest; "
            "a saved tenure must be an int, float (not NaN), str, None or a (nested) tuple of those: "
            "return e.g. int(step) or (epoch, step) from the tenure callable"
        )
        raise TypeError(msg) from None
