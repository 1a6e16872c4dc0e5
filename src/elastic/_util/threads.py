"""torch's intra-op thread pool kept out of the way of bulk copies and communication threads."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["one_torch_thread"]


@contextmanager
def one_torch_thread() -> Iterator[None]:
    """Run tensor operations on the calling thread only, for the duration of the block.

    torch parallelises large `copy_` calls over its intra-op pool; copying out of a memory-mapped file
    that way makes the pool's threads fault pages in concurrently and spin while they wait, which costs
    several times a plain single-threaded copy (and hurts most when the cores are busy, e.g. hashing or
    running a collective on helper threads).
    """
    before = torch.get_num_threads()
    if before > 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if before > 1:
            torch.set_num_threads(before)
