"""`elastic.init_process_group`: a torchrun-safe start of the default process group."""

from __future__ import annotations

from typing import Any

__all__ = ["init_process_group"]


def init_process_group(backend: str | None = None, *, timeout: Any = None) -> None:
    """Start the default process group from torchrun's (or env://) variables."""
    raise NotImplementedError("elastic.init_process_group is not implemented yet")
