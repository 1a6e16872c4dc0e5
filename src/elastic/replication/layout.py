"""What a sync derives from a state's tensors, kept while they keep their layout.

Every sync walks the state (`elastic.state.tree.flatten`): that is how it finds the tensors, and a sync
must see a
replaced parameter or a new optimizer state at once. What it then derives from those tensors (their
metadata with the aliases among them, a digest of that metadata, the metadata encoded for the payload)
depends only on `Flat.signature()`: where each tensor sits, its shape, strides, dtype, device and
`requires_grad`. A state that syncs every few steps keeps the same signature, so the derived values are
kept per state (by identity, dropped with the state) and reused while the signature is equal, and
transports can recognise the metadata lists they saw before by identity.

The metadata digest is the same on every rank whose tensors sit alike: a receiver whose digest is the one
the source sends neither decodes the source's metadata nor places its tensors, it writes into its own
tensors, in order.
"""

from __future__ import annotations

import hashlib
from typing import Any

import attrs
import cloudpickle

from elastic._util.weakmap import IdentityWeakMap
from elastic.state.tensors import TensorMeta, carriers
from elastic.state.tree import Flat

__all__ = ["Layout", "decode_metas", "encode_metas", "layout_of"]


@attrs.define(eq=False)
class Layout:
    """The values derived from one signature of a state's tensors."""

    signature: tuple[Any, ...]
    metas: list[TensorMeta]
    #: the carriers (tensors whose bytes travel) and their metadata, as stable lists
    moving: list[int]
    moving_metas: list[TensorMeta]
    #: a digest of `metas`: equal on ranks whose tensors sit alike
    digest: str
    _encoded: bytes | None = None

    def encoded(self) -> bytes:
        """`metas` as the sync payload carries them (`encode_metas`), encoded once per layout."""
        if self._encoded is None:
            self._encoded = encode_metas(self.metas)
        return self._encoded


def encode_metas(metas: list[TensorMeta]) -> bytes:
    """Tensor metadata as columns of plain values, pickled (~20x faster than one object per tensor). The
    paths (which may hold any dict key of the user's) are pickled apart, so a receiver that cannot unpickle
    one still reads the shapes and dtypes (`decode_metas(..., paths=False)`) and takes part."""
    if not metas:
        return cloudpickle.dumps(((), b""))
    paths, *rest = zip(*metas)
    return cloudpickle.dumps((tuple(tuple(column) for column in rest), cloudpickle.dumps(paths)))


def decode_metas(data: bytes, *, paths: bool = True) -> list[TensorMeta]:
    """The inverse of `encode_metas`; without `paths`, each tensor's path is its index."""
    rest, packed = cloudpickle.loads(data)
    if not rest:
        return []
    names = cloudpickle.loads(packed) if paths else [(i,) for i in range(len(rest[0]))]
    return [TensorMeta(*row) for row in zip(names, *rest)]


def metas_digest(metas: list[TensorMeta]) -> str:
    """A digest of the metadata's values (paths, shapes, dtypes, devices, strides, grads, aliases)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(repr([tuple(m) for m in metas]).encode())
    return h.hexdigest()


_kept: IdentityWeakMap[Layout] = IdentityWeakMap()


def layout_of(state: Any, flat: Flat) -> Layout:
    """The layout of `flat` (a walk of `state`): the one kept for `state` when the signature is unchanged
    (then `flat` takes its metadata), else a new one, kept for next time."""
    signature = flat.signature()
    kept = _kept.get(state)
    if kept is not None and kept.signature == signature:
        flat.use_metas(kept.metas)
        return kept
    metas = flat.metas
    moving = carriers(metas)
    layout = Layout(signature, metas, moving, [metas[i] for i in moving], metas_digest(metas))
    _kept.set(state, layout)
    return layout
