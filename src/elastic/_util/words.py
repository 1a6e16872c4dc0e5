"""Words for error messages shared by every layer."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["ranks_str"]


def ranks_str(ranks: Sequence[int]) -> str:
    """`[0, 2]` as `ranks 0, 2`, `[1]` as `rank 1`."""
    ranks = list(ranks)
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)
