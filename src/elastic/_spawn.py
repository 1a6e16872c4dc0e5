"""`elastic.spawn`: run a function on N local workers, from a script or a notebook."""

from __future__ import annotations

from typing import Any

__all__ = ["spawn"]


def spawn(fn: Any, nprocs: int = 2, **kwargs: Any) -> list[Any]:
    """Run `fn` on `nprocs` local workers with their process group initialised."""
    raise NotImplementedError("elastic.spawn is not implemented yet")
