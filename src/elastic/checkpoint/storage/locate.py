"""From the `path` a user passes to `save`/`load` to a storage and a root in it.

A local path (a `str` or `os.PathLike`, or a ``file://`` URL) is a directory of the local filesystem and
keeps the local writer (fsync and rename); any other URL (``s3://``, ``gs://``, ``az://``, ``memory://``,
...) is opened with fsspec, with `storage_options` passed to it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from elastic.checkpoint.storage.base import Storage
from elastic.checkpoint.storage.local import LOCAL
from elastic.checkpoint.storage.remote import is_url, open_fsspec

__all__ = ["locate"]


def locate(path: Any, storage_options: Any, op: str) -> tuple[Storage, Any]:
    """The storage and the root location `path` names; `TypeError`/`ValueError` for bad arguments."""
    if storage_options is not None and not isinstance(storage_options, dict):
        what = type(storage_options).__name__
        msg = f"{op}(storage_options=...) must be a dict of fsspec options, got {what}"
        raise TypeError(msg) from None
    if isinstance(path, str):
        protocol = is_url(path)
        if protocol == "file":
            path = path[len("file://") :]
        elif protocol is not None:
            return open_fsspec(path, storage_options), path.rstrip("/") or path
    try:
        root = Path(os.fspath(path))
    except TypeError:
        what = f"{type(path).__name__} {path!r}"
        msg = f"{op}(path=...) must be a str or os.PathLike naming a directory, or a URL, got {what}"
        raise TypeError(msg) from None
    if storage_options:
        msg = (
            f"{op}(storage_options=...) applies to URLs (s3://, gs://, memory://, ...), not to the local "
            f"path {str(root)!r}; drop it, or pass a URL"
        )
        raise ValueError(msg) from None
    return LOCAL, root
