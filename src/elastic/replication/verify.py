"""`elastic.verify`: check that replicas which should be identical are, and name what differs."""

from __future__ import annotations

import ctypes
import hashlib
import logging
import types
import zlib
from collections import OrderedDict
from datetime import timedelta
from typing import Any

import attrs
import cloudpickle
import torch

from elastic._util.errors import DivergenceError, SyncError
from elastic._util.timeouts import as_timedelta
from elastic._util.words import ranks_str
from elastic.replication.collective import Collective, raise_first
from elastic.replication.sharded import group_layout
from elastic.state.config import config_of
from elastic.state.nodes import (
    ContainerNode,
    Kind,
    RestoreNode,
    StatefulNode,
    StateNode,
    TensorSlot,
    path_str,
)
from elastic.state.shards import is_sharded, mesh_of, pieces, plain_leaves, sharded_state_dict
from elastic.state.tree import flatten

__all__ = ["digests", "verify"]

log = logging.getLogger("elastic")


def _tensor_digest(t: torch.Tensor) -> str:
    """dtype, shape and a CRC-32 of the bytes: 4 GB/s here (a cryptographic hash is 1-2 GB/s), and any
    difference confined to 4 bytes is caught with certainty; replicas are not adversaries."""
    c = t.detach().to("cpu").contiguous()
    n = c.numel() * c.element_size()
    crc = zlib.crc32(memoryview((ctypes.c_char * n).from_address(c.data_ptr()))) if n else 0
    return f"{t.dtype}{tuple(t.shape)}:{crc:08x}"


_SCALARS = (bool, int, float, complex, type(None))


def _feed(h: Any, node: Any, seen: dict[int, tuple[int, Any]] | None = None) -> None:
    """Hash a skeleton node by value: what Python's `==` calls equal hashes equal in any process.

    Tensor slots are compared by path elsewhere; dict order (not `OrderedDict` order), set order and hash
    seeds do not matter; bytes and strings are streamed into the hash; tensors and numpy arrays inside
    objects are hashed by content; other objects by their reduction (class, arguments, state), recursively.
    """
    if seen is None:
        seen = {}
    tp = type(node)
    if tp in _SCALARS:
        h.update(f"{tp.__name__}:{node!r};".encode())
    elif tp is str:
        data = node.encode("utf-8", "surrogatepass")
        h.update(b"s%d:" % len(data))
        h.update(data)
    elif tp in (bytes, bytearray, memoryview):
        data = memoryview(node).cast("B")
        h.update(b"b%d:" % data.nbytes)
        h.update(data)
    elif tp is TensorSlot:
        h.update(b"T;")  # the tensor's bytes are compared under its own path
    elif tp is StateNode:
        h.update(f"S{node.qualname}{{".encode())
        for name, child in node.fields.items():
            h.update(name.encode() + b"=")
            _feed(h, child, seen)
        h.update(b"}")
    elif tp is StatefulNode:
        h.update(f"M{node.kind.value}(".encode())
        _feed(h, node.inner, seen)
        h.update(b")")
    elif tp is RestoreNode:
        h.update(f"R{node.protocol}(".encode())
        _feed(h, node.state, seen)
        h.update(b")")
    elif tp is ContainerNode:
        h.update(f"C{node.kind.value}{node.type.__module__}.{node.type.__qualname__}[".encode())
        if node.kind == Kind.DICT:
            _feed_items(h, zip(node.keys, node.children), node.type is dict, seen)
        else:
            for child in node.children:
                _feed(h, child, seen)
                h.update(b",")
        h.update(b"]")
    elif id(node) in seen:
        h.update(b"@%d;" % seen[id(node)][0])  # a cycle or a shared object: its first position
    else:
        seen[id(node)] = (len(seen), node)  # holding `node` keeps its id from being reused meanwhile
        _feed_object(h, node, seen)


def _feed_items(h: Any, items: Any, unordered: bool, seen: dict[int, tuple[int, Any]]) -> None:
    if not unordered:
        for k, v in items:
            _feed(h, k, seen)
            h.update(b":")
            _feed(h, v, seen)
            h.update(b",")
        return
    parts = []
    for k, v in items:
        sub = hashlib.blake2b(digest_size=12)
        _feed(sub, k, seen)
        sub.update(b":")
        _feed(sub, v, seen)
        parts.append(sub.digest())
    for part in sorted(parts):
        h.update(part)


def _feed_object(h: Any, node: Any, seen: dict[int, tuple[int, Any]]) -> None:
    tp = type(node)
    if isinstance(node, torch.Tensor):
        h.update(f"tensor{node.dtype}{tuple(node.shape)}{node.requires_grad}:".encode())
        h.update(_tensor_digest(node).encode())
    elif tp.__module__ == "numpy" and hasattr(node, "tobytes") and hasattr(node, "dtype"):
        h.update(f"np{node.dtype}{getattr(node, 'shape', ())}:".encode())
        h.update(node.tobytes())
    elif tp in (list, tuple):
        h.update(f"{tp.__name__}[".encode())
        for x in node:
            _feed(h, x, seen)
            h.update(b",")
        h.update(b"]")
    elif tp in (dict, OrderedDict) or (isinstance(node, dict) and tp.__module__ == "collections"):
        h.update(f"{tp.__qualname__}{{".encode())
        _feed_items(h, node.items(), tp is not OrderedDict, seen)
        h.update(b"}")
    elif isinstance(node, (set, frozenset)):
        parts = sorted(_digest_of(x) for x in node)
        h.update((f"{tp.__name__}{{" + ",".join(parts) + "}").encode())
    elif isinstance(node, (type, types.FunctionType, types.BuiltinFunctionType, types.ModuleType)):
        name = f"{getattr(node, '__module__', '')}.{getattr(node, '__qualname__', node.__name__)}"
        if "<" in name or (isinstance(node, types.FunctionType) and node.__closure__):
            h.update(b"P")  # a lambda or a closure: its code and captured values
            h.update(cloudpickle.dumps(node))
        else:
            h.update(f"N{name};".encode())
    else:
        try:
            reduced = node.__reduce_ex__(4)
        except Exception:
            reduced = None
        if not isinstance(reduced, tuple):
            h.update(b"P")
            h.update(cloudpickle.dumps(node))
            return
        h.update(f"O{tp.__module__}.{tp.__qualname__}(".encode())
        for part in reduced[1:3]:
            _feed(h, part, seen)
            h.update(b";")
        for part in reduced[3:5]:
            if part is not None:
                _feed(h, list(part), seen)
        h.update(b")")


def _digest_of(node: Any) -> str:
    h = hashlib.blake2b(digest_size=12)
    _feed(h, node)
    return h.hexdigest()


#: The suffix of a field's key for its non-tensor part, in `digests`.
_OBJECTS = " (objects)"


def digests(state: Any) -> dict[str, str]:
    """Per synced field (the non-tensor part) and per tensor path, a digest of this rank's content."""
    flat = flatten(state, "sync")
    out = {f"{name}{_OBJECTS}": _digest_of(node) for name, node in flat.skeleton.fields.items()}
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

    Digests every synced tensor's bytes and every field's other values, gathers the digests in one
    all-gather and compares them. Values are compared, not pickle bytes: identical generators, dicts
    with the same items in another order, or sets never differ. Costs one pass over the state's bytes
    and one small collective; without a process group it does nothing.

    In a sharded state each piece is compared within its replica set (the ranks at its shard position),
    the other fields across every rank.

    Args:
        state: an instance of an ``@elastic_state`` class.
        group: the process group (None: the default group).
        timeout: bound of the all-gather (seconds or ``timedelta``).

    Raises:
        DivergenceError: on every rank, naming each field or tensor path that differs and which ranks hold
            which version.
        SyncError: a rank could not digest its state, died, timed out or never called.
        TypeError: `state` is not an instance of an ``@elastic_state`` class.
    """
    config_of(state, "elastic.verify()")
    collective = Collective.of(group, as_timedelta(timeout, "verify"), "verify")
    if collective.solo:
        return
    if is_sharded(state):
        verify_sharded(state, collective)
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
            # a tensor path some ranks lack: they hold another kind of value there (a float, not a tensor)
            absent = "missing on " if key.endswith(_OBJECTS) else "no tensor on "
            versions = " vs ".join(
                (absent if d == "missing" else "") + ranks_str(rs) for d, rs in groups.items()
            )
            lines.append(f"  {key}: {versions}")
    if lines:
        raise _divergence(
            lines,
            "Run elastic.sync(state, force=True) to make every rank hold the most tenured state, and "
            "look for per-rank randomness or rank-dependent updates in the training step.",
        ) from None
    log.debug("verify: %d ranks agree on %d fields and tensors", len(rows), len(keys))


# ---------------------------------------------------------------------------------------------------------
# verify


@attrs.frozen
class _Digests:
    position: tuple[int, ...] | None
    pieces: dict[str, str] | None
    plain: dict[str, str] | None
    error: str | None = None


def verify_sharded(state: Any, group: Collective) -> None:
    """`verify` of a sharded state: each piece within its replica set, the other leaves on every rank."""
    comm = group.comm
    assert comm is not None
    try:
        mesh = mesh_of(state)
        layout, ranks = group_layout(comm, mesh, "verify")
        sd = sharded_state_dict(state)
        row = _Digests(
            position=layout.position[ranks[comm.rank]],
            pieces={path_str(p.path): _tensor_digest(p.local) for p in pieces(sd)},
            plain={path_str((k,)): _digest_of(v) for k, v in plain_leaves(sd).items()},
        )
    except Exception as exc:
        row = _Digests(None, None, None, f"{type(exc).__name__}: {exc}")
    rows = group.gather(row, "verify")
    raise_first(
        rows, lambda r, e: SyncError(f"verify: rank {r} could not digest its state: {e}", phase="verify")
    )
    lines: list[str] = []
    _compare([(r, row.plain or {}) for r, row in enumerate(rows)], "", lines)
    by_pos: dict[Any, list[tuple[int, dict[str, str]]]] = {}
    for r, row in enumerate(rows):
        by_pos.setdefault(row.position, []).append((r, row.pieces or {}))
    for pos, members in sorted(by_pos.items()):
        _compare(members, f" (shard position {pos})", lines)
    if lines:
        raise _divergence(
            lines,
            "Pieces are compared within their replica set, other fields on every rank. Run "
            "elastic.sync(state, force=True) to make every replica hold the most tenured version.",
        )


def _divergence(lines: list[str], fix: str) -> DivergenceError:
    """The error naming every place that differs (the first 50) and the fix."""
    msg = (
        f"verify: the replicas differ in {len(lines)} place(s):\n"
        + "\n".join(lines[:50])
        + (f"\n  ... and {len(lines) - 50} more" if len(lines) > 50 else "")
        + "\n"
        + fix
    )
    return DivergenceError(msg)


def _compare(members: list[tuple[int, dict[str, str]]], where: str, lines: list[str]) -> None:
    keys = list(dict.fromkeys(k for _, table in members for k in table))
    for key in keys:
        groups: dict[str, list[int]] = {}
        for rank, table in members:
            groups.setdefault(table.get(key, "missing"), []).append(rank)
        if len(groups) > 1:
            lines.append(f"  {key}{where}: " + " vs ".join(ranks_str(rs) for rs in groups.values()))
