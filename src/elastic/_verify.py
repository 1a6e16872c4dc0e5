"""`elastic.verify`: check that replicas which should be identical are."""

from __future__ import annotations

from typing import Any

__all__ = ["verify"]


def verify(state: Any, *, group: Any = None) -> None:
    """Raise `DivergenceError` naming every field whose content differs across ranks (collective)."""
    raise NotImplementedError("elastic.verify is not implemented yet")
