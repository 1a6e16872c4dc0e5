"""Checkpoint manifests, directory names, tenures as JSON, and finding the checkpoints under a root.

The manifest (``manifest.json``) is the source of truth about a checkpoint: its format version, class,
fields, tenure (as JSON and as repr), world size, creation time, library versions, and the size and
checksums of every file. It carries a digest of its own content, so a damaged manifest is recognised
as such. Validating a manifest reads only the manifest and the files' sizes: it is cheap, and it is what
`load` does on every rank before the group decides which checkpoint to read.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import posixpath
import re
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import attrs

from elastic.checkpoint.codec import CONTENT, MANIFEST, OBJECTS
from elastic.checkpoint.content import HASH, TREE_KEY
from elastic.checkpoint.storage.base import Misplaced, Storage
from elastic.state.tenure import order_key

__all__ = [
    "DCP_LAYOUT",
    "DCP_METADATA",
    "FORMAT",
    "FORMAT_VERSION",
    "Candidate",
    "InvalidCheckpoint",
    "build_manifest",
    "dir_name",
    "is_checkpoint_dir",
    "manifest_bytes",
    "scan",
    "tenure_from_json",
    "tenure_to_json",
    "validate",
]

log = logging.getLogger("elastic")

FORMAT = "elastic-state"
FORMAT_VERSION = 1
#: Prefix of checkpoint directory names (the manifest decides; the name only helps listings sort).
PREFIX = "ckpt-"
#: The manifest's ``layout`` of a sharded checkpoint (`elastic.checkpoint.dcp`), and DCP's metadata file.
DCP_LAYOUT = "dcp"
DCP_METADATA = ".metadata"
#: A manifest larger than this is not one we wrote.
MAX_MANIFEST = 64 * 2**20


class InvalidCheckpoint(Exception):
    """A checkpoint directory that is incomplete, damaged or not in a format this version reads."""


# ---------------------------------------------------------------------------------------------------------
# Tenures


def tenure_to_json(value: Any) -> Any:
    """A saveable tenure as JSON: tuples as lists, non-finite floats as ``{"float": "inf"}``."""
    if isinstance(value, tuple):
        return [tenure_to_json(v) for v in value]
    if isinstance(value, float) and math.isinf(value):
        return {"float": "inf" if value > 0 else "-inf"}
    for tp in (bool, int, float, str):  # plain types, no subclasses (an IntEnum is stored as its int)
        if isinstance(value, tp):
            return tp(value)
    if value is None:
        return None
    raise TypeError(f"tenure {value!r} is not JSON-able")


def tenure_from_json(data: Any) -> Any:
    if isinstance(data, list):
        return tuple(tenure_from_json(v) for v in data)
    if isinstance(data, dict):
        if set(data) == {"float"} and data["float"] in ("inf", "-inf"):
            return float(data["float"])
        raise ValueError(f"unknown tenure encoding {data!r}")
    if data is None or isinstance(data, (bool, int, float, str)):
        if isinstance(data, float) and math.isnan(data):
            raise ValueError("NaN tenure")
        return data
    raise ValueError(f"unknown tenure encoding {data!r}")


_SAFE_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


def _name_part(value: Any) -> str | None:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return f"{value:012d}"
    if isinstance(value, float) and math.isfinite(value) and 0 <= value < 1e12:
        return f"{value:019.6f}"
    return None


def dir_name(tenure: Any) -> str:
    """The directory name for a checkpoint of `tenure`: zero-padded so that listings sort by tenure.

    Non-negative ints (and floats) are padded to 12 digits, tuples of them joined by ``-``; a short safe
    string is used as it is; anything else gets a digest of its repr (then only the manifest orders it).
    """
    part = _name_part(tenure)
    if part is None and isinstance(tenure, tuple) and tenure:
        parts = [_name_part(v) for v in tenure]
        if all(p is not None for p in parts):
            part = "-".join(p for p in parts if p is not None)
    if part is None and isinstance(tenure, str) and _SAFE_NAME.match(tenure) and not tenure.startswith("."):
        part = f"s-{tenure}"
    if part is None:
        part = "h-" + hashlib.blake2b(repr(tenure).encode(), digest_size=6).hexdigest()
    return PREFIX + part


# ---------------------------------------------------------------------------------------------------------
# Manifest


def _digest_of(manifest: dict[str, Any]) -> str:
    body = {k: v for k, v in manifest.items() if k != "digest"}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.new(HASH, text.encode()).hexdigest()


def build_manifest(info: dict[str, Any], files: Iterable[Any]) -> dict[str, Any]:
    """The manifest of a checkpoint: `info` (class, fields, tenure, ...) plus the file records and digest."""
    manifest = {"format": FORMAT, "version": FORMAT_VERSION, **info}
    manifest["files"] = {f.name: f.to_json() for f in files}
    manifest["digest"] = _digest_of(manifest)
    return manifest


def manifest_bytes(manifest: dict[str, Any]) -> bytes:
    return (json.dumps(manifest, indent=1, sort_keys=False, allow_nan=False) + "\n").encode()


@attrs.frozen
class Candidate:
    """A complete-looking checkpoint: where it is and what its manifest says (files not yet verified)."""

    path: Any  # a `Path`, or the storage's own location (a URL)
    tenure: Any
    created_ns: int
    world_size: int
    manifest: dict[str, Any] = attrs.field(eq=False, repr=False)

    @property
    def order(self) -> tuple[Any, ...]:
        name = self.path.name if isinstance(self.path, Path) else posixpath.basename(str(self.path))
        return (order_key(self.tenure), self.created_ns, name)


def is_checkpoint_dir(path: Any, storage: Storage) -> bool:
    """Whether `path` is one checkpoint directory (it has a manifest) rather than a root of several."""
    return storage.exists(storage.join(path, MANIFEST))


def _bad(path: Any, what: str) -> InvalidCheckpoint:
    return InvalidCheckpoint(f"{path}: {what}")


def _inside(name: Any) -> bool:
    """Whether `name` is a plain file name (no separators, no '..', not absolute)."""
    return (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and "/" not in name
        and "\\" not in name
        and "\x00" not in name
        and not os.path.isabs(name)
        and os.path.basename(name) == name
    )


def _size(storage: Storage, path: Any, missing: str, directory: Any = None) -> int:
    """The size of the file at `path` (of checkpoint file `path`'s name in `directory`, checked to be a
    plain file inside it), or `InvalidCheckpoint` saying `missing` (absent) or why it cannot be used."""
    try:
        if directory is None:
            return storage.size(path)
        return storage.file_size(directory, storage.name(path))
    except FileNotFoundError:
        raise _bad(path, missing) from None
    except Misplaced as exc:
        raise _bad(path, str(exc)) from None
    except OSError as exc:
        raise _bad(path, f"cannot be read ({exc})") from exc


def validate(directory: Any, storage: Storage) -> Candidate:
    """Read and check one checkpoint's manifest (and its files' sizes); `InvalidCheckpoint` otherwise."""
    mpath = storage.join(directory, MANIFEST)
    size = _size(storage, mpath, "missing: the checkpoint is incomplete")
    if size > MAX_MANIFEST:
        raise _bad(mpath, f"is {size} bytes, too large to be a manifest")
    try:
        raw = storage.read_bytes(mpath, MAX_MANIFEST + 1)
        manifest = json.loads(raw.decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise _bad(mpath, f"is not valid JSON ({type(exc).__name__}: {exc})") from exc
    if not isinstance(manifest, dict):
        raise _bad(mpath, "is not a JSON object")
    if manifest.get("format") != FORMAT:
        raise _bad(mpath, f"is not an {FORMAT} manifest (format {manifest.get('format')!r})")
    version = manifest.get("version")
    if version != FORMAT_VERSION:
        raise _bad(
            mpath,
            f"has format version {version!r}; this version of elastic-state reads version {FORMAT_VERSION} "
            "(upgrade elastic-state to read newer checkpoints)",
        )
    if manifest.get("digest") != _digest_of(manifest):
        raise _bad(mpath, "does not match its own digest: the manifest is damaged")
    if raw != manifest_bytes(manifest):  # whitespace or key order changed: not the bytes that were written
        raise _bad(mpath, "is not byte for byte the manifest that was written: the manifest is damaged")
    try:
        tenure = tenure_from_json(manifest.get("tenure"))
    except ValueError as exc:
        raise _bad(mpath, f"has an unreadable tenure ({exc})") from exc
    created, world = manifest.get("created_ns"), manifest.get("world_size")
    fields, objects = manifest.get("fields"), manifest.get("objects")
    if not (isinstance(created, int) and isinstance(world, int) and world >= 1):
        raise _bad(mpath, "lacks created_ns or world_size")
    if not (isinstance(fields, list) and all(_is_field(f) for f in fields)):
        raise _bad(mpath, "has a malformed field list")
    if not (isinstance(objects, list) and all(isinstance(o, dict) for o in objects)):
        raise _bad(mpath, "has a malformed object list")
    files = manifest.get("files")
    # a sharded checkpoint is in DCP's layout: its metadata file instead of the content file
    main = DCP_METADATA if manifest.get("layout") == DCP_LAYOUT else CONTENT
    if not isinstance(files, dict) or main not in files:
        raise _bad(mpath, f"lists no {main}")
    if bool(objects) != (OBJECTS in files):
        raise _bad(mpath, f"lists objects but no {OBJECTS} (or the reverse)")
    for name, rec in files.items():
        if not _inside(name) or name == MANIFEST:
            raise _bad(mpath, f"lists the file {name!r}, which is not a plain name inside the checkpoint")
        if not (
            isinstance(rec, dict)
            and isinstance(rec.get("size"), int)
            and rec["size"] >= 0
            and isinstance(rec.get("chunk"), int)
            and rec["chunk"] > 0
            and isinstance(rec.get(TREE_KEY), str)
            and len(rec[TREE_KEY]) == 64
        ):
            raise _bad(mpath, f"has a malformed record for {name}")
        fpath = storage.join(directory, name)
        fsize = _size(storage, fpath, "is missing: the checkpoint is incomplete", directory)
        if fsize != rec["size"]:
            raise _bad(fpath, f"is {fsize} bytes, the manifest says {rec['size']}: truncated or altered")
    return Candidate(path=directory, tenure=tenure, created_ns=created, world_size=world, manifest=manifest)


def _is_field(f: Any) -> bool:
    return isinstance(f, dict) and isinstance(f.get("name"), str) and isinstance(f.get("kind"), str)


def scan(root: Any, *, storage: Storage, warn: bool = True, op: str = "load") -> list[Candidate]:
    """The valid checkpoints directly under `root`, most tenured first (manifests only, no checksums).

    Hidden entries (temporary and doomed directories start with '.') are skipped. A directory that looks
    like a checkpoint but fails validation is skipped with a warning naming the file (when `warn`).
    A missing `root` holds no checkpoints.
    """
    found: list[Candidate] = []
    for entry in storage.entries(root):
        if entry.name.startswith(".") or not entry.is_dir:
            continue
        directory = entry.location
        if not is_checkpoint_dir(directory, storage) and (
            storage.in_place or not entry.name.startswith(PREFIX)
        ):
            continue  # not ours, or (written in place, manifest last) not complete yet
        try:
            found.append(validate(directory, storage))
        except InvalidCheckpoint as exc:
            if warn:
                skipped(op, str(exc))
    found.sort(key=lambda c: c.order, reverse=True)
    return found


def skipped(op: str, reason: str) -> None:
    """Warn (Python warning and log line) that a checkpoint is skipped, naming the file."""
    text = f"{op}: skipping checkpoint: {reason}"
    log.warning("%s", text)
    warnings.warn(text, RuntimeWarning, stacklevel=4)
