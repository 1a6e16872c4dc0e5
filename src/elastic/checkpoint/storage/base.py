"""Where checkpoints live: the storage seam.

In the spirit of `torch.distributed.checkpoint`'s ``FileSystemBase``: the writer, the reader and the manifest
code never call `os`, `mmap` or `rename` themselves; they name locations through a `Storage` and ask it to
list, stat, read, map, create and remove. How a checkpoint becomes visible is the storage's business too:

- `Storage.begin` opens a `Pending` checkpoint under a root; its `create` gives a `Sink` per file;
- `Pending.seal` hands over the manifest (the last thing written), `Pending.publish` makes the checkpoint
  visible and returns its location, `Pending.discard` removes whatever a failed write left;
- `Storage.session` brackets the reads of one checkpoint (a remote storage downloads each file once);
- `Storage.explain` turns a storage's own errors into a message with the fix;
- `Storage.clean_stale` removes what writers that died left behind, `Storage.retire` deletes a published
  checkpoint so that no reader ever sees it half-deleted.

`LocalStorage` publishes atomically: every file is written into a hidden ``.tmp-<host>-<pid>-<id>``
directory inside the root and fsynced, then the directory is fsynced and renamed into place, and the root
fsynced. An object store has no rename: it writes the data objects in place and the manifest last (a
prefix without a valid manifest is invisible to `load`), and retires a checkpoint manifest first.

`elastic.checkpoint.storage.local` is the local filesystem, `elastic.checkpoint.storage.remote` fsspec's
object stores. Locations are `pathlib.Path` for the local filesystem; another storage may use its own
(URL strings).
"""

from __future__ import annotations

import abc
import logging
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO, Any

import attrs

__all__ = [
    "DEL_PREFIX",
    "Contribution",
    "FOREIGN_STALE_SECONDS",
    "TMP_PREFIX",
    "Entry",
    "Misplaced",
    "Pending",
    "Sink",
    "Storage",
    "host_tag",
]

log = logging.getLogger("elastic")

#: Prefixes of the hidden working entries inside a root: checkpoints being written, being deleted.
TMP_PREFIX = ".tmp-"
DEL_PREFIX = ".del-"
#: What another host's writer left is considered abandoned once it is this old (clock skew margin).
FOREIGN_STALE_SECONDS = 600.0


class Misplaced(Exception):
    """A checkpoint's file is not a plain file inside the checkpoint (the message says what it is)."""


@attrs.frozen
class Entry:
    """One entry directly under a root: its name, location, and whether it may hold a checkpoint."""

    name: str
    location: Any
    is_dir: bool


def host_tag() -> str:
    """This host's name as it appears in the names of temporary entries (no '-')."""
    return socket.gethostname().replace("-", "_") or "host"


class Sink(abc.ABC):
    """A new file being written (a context manager: leaving it closes the file, or aborts it on error)."""

    @abc.abstractmethod
    def write(self, view: memoryview) -> None:
        """Write all of `view` (the caller may reuse the buffer once this returns)."""

    def written(self, offset: int, length: int) -> None:  # noqa: B027 - optional hook
        """`length` bytes from `offset` are written: a hint to start writing them back (may do nothing)."""

    @abc.abstractmethod
    def sync(self) -> None:
        """Make everything written durable (fsync; an object store completes the upload)."""

    @abc.abstractmethod
    def close(self, *, ok: bool) -> None:
        """Release the file; with `ok` False, after a failure (an upload is aborted)."""

    def __enter__(self) -> Sink:
        return self

    def __exit__(self, tp: Any, value: Any, tb: Any) -> None:
        self.close(ok=tp is None)


class Pending(abc.ABC):
    """A checkpoint being written under a root; invisible to readers until `publish` returns."""

    @abc.abstractmethod
    def create(self, name: str) -> Sink:
        """A new file `name` of the checkpoint."""

    @abc.abstractmethod
    def seal(self, name: str, manifest: bytes) -> None:
        """Hand over the manifest (file `name`), written after every other file; durable and visible once
        `publish` returns."""

    @abc.abstractmethod
    def publish(self) -> Any:
        """Make the checkpoint visible under its name (see `Storage.begin`); returns its location."""

    @abc.abstractmethod
    def discard(self) -> None:
        """Remove what this pending checkpoint wrote (after a failure; never raises)."""

    def handle(self) -> Any:
        """A picklable name of this pending checkpoint, for `Storage.contribute` on other ranks (a sharded
        save has one writer per shard position writing into one checkpoint)."""
        msg = f"{type(self).__name__} cannot take files from other ranks"
        raise NotImplementedError(msg)


class Contribution(abc.ABC):
    """Files another rank adds to a pending checkpoint (`Storage.contribute`); the pending checkpoint's
    owner seals and publishes it once every contributor has synced its files."""

    @abc.abstractmethod
    def create(self, name: str) -> Sink:
        """A new file `name` of the checkpoint."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release what the contribution holds locally (a spool directory)."""


class Storage(abc.ABC):
    """The operations the checkpoint writer and reader need from the place checkpoints are kept."""

    #: Whether checkpoints are written under their final name (manifest last), so that a name without a
    #: manifest is one being written (or abandoned), not a damaged checkpoint worth a warning.
    in_place: bool = False

    # Names

    @abc.abstractmethod
    def join(self, location: Any, name: str) -> Any:
        """The location of `name` inside `location`."""

    @abc.abstractmethod
    def name(self, location: Any) -> str:
        """The last component of `location`."""

    def show(self, location: Any) -> str:
        """`location` as messages name it."""
        return str(location)

    def result(self, location: Any) -> Any:
        """`location` as `save` returns it and `LoadReport.path` holds it."""
        return location

    # Reading

    @abc.abstractmethod
    def exists(self, location: Any) -> bool:
        """Whether anything (a file, a directory, a prefix; a dangling link counts) is at `location`."""

    @abc.abstractmethod
    def entries(self, root: Any) -> list[Entry]:
        """The entries directly under `root`, sorted by name; none when `root` does not exist."""

    @abc.abstractmethod
    def size(self, location: Any) -> int:
        """The size of the file at `location` (`FileNotFoundError`, or `OSError` if it cannot be read)."""

    @abc.abstractmethod
    def file_size(self, directory: Any, name: str) -> int:
        """The size of the checkpoint file `name` in `directory`: `Misplaced` unless it is a plain file
        inside it, `FileNotFoundError` if absent, `OSError` if it cannot be read."""

    @abc.abstractmethod
    def read_bytes(self, location: Any, limit: int) -> bytes:
        """At most `limit` bytes from the start of the file at `location`."""

    @abc.abstractmethod
    def open_read(self, location: Any) -> IO[bytes]:
        """The file at `location` opened for reading (a binary file object, seekable)."""

    def local_path(self, location: Any) -> str | None:
        """A local file name for `location` that can be memory-mapped (`torch.load(mmap=True)`), or None."""
        return None

    @contextmanager
    def mapped(self, location: Any) -> Iterator[memoryview | None]:
        """The file's bytes as a read-only memory map (None where the storage cannot map files, or for an
        empty file); the view is released when the block ends."""
        yield None

    @contextmanager
    def session(self, directory: Any) -> Iterator[None]:
        """Bracket the reads of one checkpoint `directory` (the local filesystem needs nothing)."""
        yield

    def explain(self, exc: BaseException) -> str | None:
        """`exc` (raised by this storage) with the fix, or None to leave it to the caller."""
        return None

    # Writing

    @abc.abstractmethod
    def make_root(self, root: Any) -> None:
        """Create `root` (and its parents) if needed; an error if it cannot hold checkpoints."""

    @abc.abstractmethod
    def clean_stale(self, root: Any, started: float) -> None:
        """Remove what dead writers left under `root` (partial checkpoints, half-deleted ones)."""

    @abc.abstractmethod
    def begin(self, root: Any, base: str) -> Pending:
        """Start writing a new checkpoint under `root`, to be named `base` (or `base.1`, ... if taken)."""

    @abc.abstractmethod
    def retire(self, location: Any) -> None:
        """Delete the published checkpoint at `location` so that no reader sees it half-deleted (logs,
        never raises, when it cannot)."""

    def contribute(self, handle: Any) -> Contribution:
        """Write files into the pending checkpoint named `handle` (`Pending.handle`, from another rank)."""
        msg = f"{type(self).__name__} cannot take files from other ranks"
        raise NotImplementedError(msg)

    def settle(self, root: Any) -> None:  # noqa: B027 - optional hook
        """Make the removals under `root` durable (may do nothing)."""
