"""`elastic.verify`: check that replicas which should be identical are, and name what differs."""

from __future__ import annotations

import ctypes
import hashlib
import logging
import zlib
from datetime import timedelta
from typing import Any

import attrs
import cloudpickle
import torch

from ._collective import Collective
from ._comm import ranks_str
from ._config import config_of
from ._errors import DivergenceError, SyncError
from ._timeouts import as_timedelta
from ._tree import ContainerNode, StatefulNode, StateNode, TensorSlot, flatten, path_str

__all__ = ["digests", "verify"]

log = logging.getLogger("elastic")


def _tensor_digest(t: torch.Tensor) -> str:
    """dtype, shape and a CRC-32 of the bytes: 4 GB/s here (a cryptographic hash is 1-2 GB/s), and any
    difference confined to 4 bytes is caught with certainty; replicas are not adversaries."""
    c = t.detach().to("cpu").contiguous()
    n = c.numel() * c.element_size()
    crc = zlib.crc32(memoryview((ctypes.c_char * n).from_address(c.data_ptr()))) if n else 0
    return f"{t.dtype}{tuple(t.shape)}:{crc:08x}"


def _feed(h: Any, node: Any) -> None:
    """Hash a skeleton node canonically: set order and hash seeds do not matter, tensors are slots."""
    if isinstance(node, TensorSlot):
        h.update(b"T%d;" % node.index)
    elif isinstance(node, StateNode):
        h.update(f"S{node.qualname}{{".encode())
        for name, child in node.fields.items():
            h.update(name.encode() + b"=")
            _feed(h, child)
        h.update(b"}")
    elif isinstance(node, StatefulNode):
        h.update(f"M{node.kind}(".encode())
        _feed(h, node.inner)
        h.update(b")")
    elif isinstance(node, ContainerNode):
        h.update(f"C{node.kind}{node.type.__qualname__}[".encode())
        for key, child in zip(node.keys or range(len(node.children)), node.children):
            h.update(repr(key).encode() + b":")
            _feed(h, child)
        h.update(b"]")
    elif node is None or isinstance(node, (bool, int, float, str, bytes, complex)):
        h.update(f"{type(node).__name__}:{node!r};".encode())
    elif isinstance(node, (set, frozenset)):
        parts = sorted(_digest_of(x) for x in node)
        h.update(("set" + ",".join(parts) + ";").encode())
    else:
        h.update(b"P")
        h.update(cloudpickle.dumps(node))


def _digest_of(node: Any) -> str:
    h = hashlib.blake2b(digest_size=12)
    _feed(h, node)
    return h.hexdigest()


def digests(state: Any) -> dict[str, str]:
    """Per synced field (the non-tensor part) and per tensor path, a digest of this rank's content."""
    flat = flatten(state, "sync")
    out = {f"{name} (objects)": _digest_of(node) for name, node in flat.skeleton.fields.items()}
    for tensor, meta in zip(flat.tensors, flat.metas):
        out[path_str(meta.path)] = _tensor_digest(tensor)
    return out


@attrs.frozen
class _Row:
    digests: dict[str, str] | None
    error: str | None = None


def _digest_failure(rank: int, error: str) -> SyncError:
    return SyncError(f"verify: rank {rank} could not digest its state: {error}", phase="verify")


def verify(state: Any, *, group: Any = None, timeout: timedelta | float | None = None) -> None:
    """Check that every rank holds the same synced content (collective).

    Digests every tensor's bytes and every field's other values, gathers them in one all-gather and
    raises `DivergenceError` on every rank, naming each field or tensor path that differs and which ranks
    hold which version. Costs one pass over the state's bytes and one small collective.
    """
    config_of(state, "elastic.verify()")
    collective = Collective.of(group, as_timedelta(timeout, "verify"), "verify")
    if collective.solo:
        return
    try:
        row = _Row(digests(state))
    except Exception as exc:
        row = _Row(None, f"{type(exc).__name__}: {exc}")
    rows = collective.gather_checked(row, "verify", _digest_failure)
    tables = [r.digests or {} for r in rows]
    keys = list(dict.fromkeys(k for table in tables for k in table))  # first-seen order, linear time
    lines = []
    for key in keys:
        groups: dict[str, list[int]] = {}
        for rank, table in enumerate(tables):
            groups.setdefault(table.get(key, "missing"), []).append(rank)
        if len(groups) > 1:
            versions = " vs ".join(
                ("missing on " if d == "missing" else "") + ranks_str(rs) for d, rs in groups.items()
            )
            lines.append(f"  {key}: {versions}")
    if lines:
        msg = (
            f"verify: the replicas differ in {len(lines)} place(s):\n"
            + "\n".join(lines[:50])
            + (f"\n  ... and {len(lines) - 50} more" if len(lines) > 50 else "")
            + "\nRun elastic.sync(state, force=True) to make every rank hold the most tenured state, and "
            "look for per-rank randomness or rank-dependent updates in the training step."
        )
        raise DivergenceError(msg) from None
    log.debug("verify: %d ranks agree on %d fields and tensors", len(rows), len(keys))
