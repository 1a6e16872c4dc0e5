"""Random generators restored in place: the protocol a generator speaks, its state as plain data, and
setting that state back (into a new generator when the receiver holds none of that kind).

numpy is never imported here unless a state holds a numpy generator (it is not a dependency of elastic).
"""

from __future__ import annotations

import random
import sys
from typing import Any

import torch

__all__ = ["RNG_KINDS", "restore_rng", "rng_kind", "rng_state"]

#: The generator protocols a skeleton (and a checkpoint) may name.
RNG_KINDS = frozenset({"torch.Generator", "random.Random", "numpy.RandomState", "numpy.Generator"})
#: The numpy bit generators a numpy Generator may use.
_BIT_GENERATORS = frozenset({"PCG64", "PCG64DXSM", "MT19937", "Philox", "SFC64"})


def rng_kind(value: Any) -> str | None:
    """The restore protocol of a random generator (`None` for anything else)."""
    if isinstance(value, torch.Generator):
        return "torch.Generator"
    if isinstance(value, random.Random):
        return None if isinstance(value, random.SystemRandom) else "random.Random"
    np = sys.modules.get("numpy")
    if np is not None and type(value).__module__.startswith("numpy"):
        if isinstance(value, np.random.RandomState):
            return "numpy.RandomState"
        if isinstance(value, np.random.Generator):
            return "numpy.Generator"
    return None


def rng_state(value: Any, protocol: str) -> Any:
    """The state of generator `value` (of `protocol`): a byte tensor for a `torch.Generator`, else plain
    data (numpy arrays as lists of ints)."""
    if protocol == "torch.Generator":
        return value.get_state()
    if protocol == "random.Random":
        return value.getstate()
    if protocol == "numpy.RandomState":
        return _plain_state(value.get_state(legacy=False))
    return _plain_state(value.bit_generator.state)


def _plain_state(value: Any) -> Any:
    """numpy arrays in a generator state as lists of ints (plain data), recursively."""
    if isinstance(value, dict):
        return {k: _plain_state(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(_plain_state(v) for v in value)
    if type(value).__module__ == "numpy":
        return value.tolist()
    return value


def restore_rng(protocol: str, state: Any, device: str, current: Any) -> Any:
    """Set `state` (as `rng_state` gave it) into `current` in place, or into a new generator when `current`
    is not one of `protocol`; returns the generator. Raises `TypeError` for a numpy state naming an unknown
    bit generator."""
    if rng_kind(current) != protocol:
        current = _new_rng(protocol, state, device)
    if protocol == "torch.Generator":
        current.set_state(state.to("cpu"))
    elif protocol == "random.Random":
        current.setstate(state)
    elif protocol == "numpy.RandomState":
        current.set_state(state)
    else:
        current.bit_generator.state = state
    return current


def _new_rng(protocol: str, state: Any, device: str) -> Any:
    if protocol == "torch.Generator":
        device = "cuda" if device == "cuda" and torch.cuda.is_available() else device
        return torch.Generator(device=device)
    if protocol == "random.Random":
        return random.Random()
    import numpy as np  # the source held a numpy generator: numpy is there

    if protocol == "numpy.RandomState":
        return np.random.RandomState()
    name = state.get("bit_generator") if isinstance(state, dict) else None
    if name not in _BIT_GENERATORS:
        known = sorted(_BIT_GENERATORS)
        msg = f"a numpy Generator state names the bit generator {name!r}; expected one of {known}"
        raise TypeError(msg)
    return np.random.Generator(getattr(np.random, name)())
