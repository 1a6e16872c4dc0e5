"""What one `save` or `load` call asked for, checked once and passed down as one value.

`save` and `load` turn their public arguments into a `SaveOptions` / `LoadOptions` (the storage and root
that `path` names, resolved once by `locate`, and the checked options); the writer and the reader take that
value instead of each re-listing the parameters. Every field is required: an internal caller that forgets
the storage gets a `TypeError`, never the local disk by default. The group and the timeout are not here:
they make the call's `Collective` right away.
"""

from __future__ import annotations

import os
from typing import Any, Literal

import attrs

from elastic.checkpoint.storage.base import Storage
from elastic.checkpoint.storage.locate import locate

__all__ = ["LoadOptions", "SaveOptions", "Scope"]

Scope = Literal["global", "node", "rank"]


def _check_bool(value: Any, name: str, op: str) -> None:
    if not isinstance(value, bool):
        msg = f"{op}({name}=...) must be True or False, got {value!r}"
        raise TypeError(msg)


@attrs.frozen(kw_only=True)
class SaveOptions:
    """One `save` call: where it writes (`storage`, `root`), how many checkpoints it keeps (`keep`, None for
    all), whether it returns at once (`blocking` False: tensors staged, written in the background) and who
    writes (`scope`)."""

    storage: Storage
    root: Any
    keep: int | None
    blocking: bool
    scope: Scope

    @classmethod
    def of(
        cls,
        path: str | os.PathLike[str],
        *,
        keep: Any,
        blocking: Any,
        scope: Any,
        storage_options: Any,
    ) -> SaveOptions:
        """The options of ``save(state, path, keep=..., ...)``; `TypeError`/`ValueError` if bad."""
        storage, root = locate(path, storage_options, "save")
        if keep is not None and (not isinstance(keep, int) or isinstance(keep, bool) or keep < 1):
            msg = f"save(keep=...) must be a positive int (or None to keep every checkpoint), got {keep!r}"
            raise ValueError(msg)
        _check_bool(blocking, "blocking", "save")
        if scope not in ("global", "node", "rank"):
            msg = f"save(scope=...) must be 'global', 'node' or 'rank', got {scope!r}"
            raise ValueError(msg)
        return cls(storage=storage, root=root, keep=keep, blocking=blocking, scope=scope)


@attrs.frozen(kw_only=True)
class LoadOptions:
    """One `load` call: where it looks (`storage`, `root`: a root of checkpoints or one checkpoint),
    whether pickled objects may be loaded (`trusted`) and whether the fields must match (`strict`)."""

    storage: Storage
    root: Any
    trusted: bool
    strict: bool

    @classmethod
    def of(
        cls, path: str | os.PathLike[str], *, trusted: Any, strict: Any, storage_options: Any
    ) -> LoadOptions:
        """The options of ``load(state, path, trusted=..., ...)``; `TypeError`/`ValueError` if bad."""
        storage, root = locate(path, storage_options, "load")
        _check_bool(trusted, "trusted", "load")
        _check_bool(strict, "strict", "load")
        return cls(storage=storage, root=root, trusted=trusted, strict=strict)
