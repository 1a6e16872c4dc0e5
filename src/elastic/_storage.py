"""Where checkpoints live: the storage seam, and the local filesystem as its first implementation.

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

Locations are `pathlib.Path` for the local filesystem; another storage may use its own (URL strings).
"""

from __future__ import annotations

import abc
import ctypes
import errno
import logging
import mmap
import os
import shutil
import socket
import sys
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import attrs

from ._procs import running

__all__ = [
    "DEL_PREFIX",
    "FOREIGN_STALE_SECONDS",
    "LOCAL",
    "TMP_PREFIX",
    "Entry",
    "LocalStorage",
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
    def close(self, ok: bool) -> None:
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

    def settle(self, root: Any) -> None:  # noqa: B027 - optional hook
        """Make the removals under `root` durable (may do nothing)."""


# ---------------------------------------------------------------------------------------------------------
# The local filesystem


_sync_range: Any = None


def _start_writeback(fd: int, offset: int, length: int) -> None:
    """Ask the kernel to start writing `length` bytes at `offset` to disk now (Linux; a no-op elsewhere)."""
    global _sync_range
    if _sync_range is None:
        _sync_range = False
        if sys.platform.startswith("linux"):
            try:
                fn = ctypes.CDLL(None, use_errno=True).sync_file_range
                fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
                fn.restype = ctypes.c_int
                _sync_range = fn
            except (OSError, AttributeError):
                pass
    if _sync_range:
        _sync_range(fd, offset, length, 2)  # SYNC_FILE_RANGE_WRITE: start writeback, do not wait


def _write_all(fd: int, view: memoryview) -> None:
    while view.nbytes:
        n = os.write(fd, view)
        view = view[n:]


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """fsync a directory, so that entries created or renamed in it are durable (no-op where unsupported)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on directories
    finally:
        os.close(fd)


class LocalFile(Sink):
    """A new local file written with `os.write` on a raw descriptor (no buffering, no copies)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)

    def write(self, view: memoryview) -> None:
        _write_all(self._fd, view)

    def written(self, offset: int, length: int) -> None:
        _start_writeback(self._fd, offset, length)

    def sync(self) -> None:
        os.fsync(self._fd)

    def close(self, ok: bool) -> None:
        os.close(self._fd)


_in_use_lock = threading.Lock()
_in_use: set[str] = set()  # temporary directories this process is writing right now


class LocalPending(Pending):
    """A checkpoint written into a hidden temporary directory of the root, published by one rename."""

    def __init__(self, root: Path, base: str) -> None:
        self.root = root
        self.base = base
        self.tmp = root / f"{TMP_PREFIX}{host_tag()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        os.mkdir(self.tmp)
        with _in_use_lock:
            _in_use.add(str(self.tmp))

    def create(self, name: str) -> Sink:
        return LocalFile(self.tmp / name)

    def seal(self, name: str, manifest: bytes) -> None:
        with LocalFile(self.tmp / name) as sink:
            sink.write(memoryview(manifest))
            sink.sync()
        fsync_dir(self.tmp)

    def publish(self) -> Path:
        base = self.base
        try:
            n = 0
            while True:
                target = self.root / (base if n == 0 else f"{base}.{n}")
                if not os.path.lexists(target):
                    try:
                        os.rename(self.tmp, target)
                        break
                    except OSError as exc:
                        if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                            raise
                n += 1
            fsync_dir(self.root)
            return target
        finally:
            self._release()

    def discard(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)
        self._release()

    def _release(self) -> None:
        with _in_use_lock:
            _in_use.discard(str(self.tmp))


class LocalStorage(Storage):
    """Checkpoints in local (or network-mounted) directories."""

    def join(self, location: Any, name: str) -> Path:
        return Path(location) / name

    def name(self, location: Any) -> str:
        return Path(location).name

    def result(self, location: Any) -> Path:
        return Path(location)

    def exists(self, location: Any) -> bool:
        return os.path.lexists(location)

    def entries(self, root: Any) -> list[Entry]:
        try:
            found = sorted(os.scandir(root), key=lambda e: e.name)
        except (FileNotFoundError, NotADirectoryError):
            return []
        out = []
        for entry in found:
            try:
                is_dir = entry.is_dir()
            except OSError:
                is_dir = False
            out.append(Entry(name=entry.name, location=Path(entry.path), is_dir=is_dir))
        return out

    def size(self, location: Any) -> int:
        return os.stat(location).st_size

    def file_size(self, directory: Any, name: str) -> int:
        fpath = Path(directory) / name
        if os.path.dirname(os.path.realpath(fpath)) != os.path.realpath(directory):
            raise Misplaced("resolves outside the checkpoint directory")
        st = os.stat(fpath)
        if not os.path.isfile(fpath):
            raise Misplaced("is not a regular file")
        return st.st_size

    def read_bytes(self, location: Any, limit: int) -> bytes:
        with open(location, "rb") as f:
            return f.read(limit)

    def open_read(self, location: Any) -> IO[bytes]:
        return open(location, "rb")

    def local_path(self, location: Any) -> str | None:
        return os.fspath(location)

    @contextmanager
    def mapped(self, location: Any) -> Iterator[memoryview | None]:
        with open(location, "rb") as f:
            if os.fstat(f.fileno()).st_size == 0:
                yield None
                return
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
                view = memoryview(mapped)
                try:
                    yield view
                finally:
                    view.release()

    def make_root(self, root: Any) -> None:
        Path(root).mkdir(parents=True, exist_ok=True)

    def clean_stale(self, root: Any, started: float) -> None:
        try:
            entries = list(os.scandir(root))
        except OSError:
            return
        host, pid = host_tag(), os.getpid()
        for entry in entries:
            name = entry.name
            stale = False
            if name.startswith(DEL_PREFIX):
                stale = True
            elif name.startswith(TMP_PREFIX):
                parts = name[len(TMP_PREFIX) :].rsplit("-", 2)
                with _in_use_lock:
                    busy = entry.path in _in_use
                if busy:
                    continue
                if len(parts) == 3 and parts[0] == host and parts[1].isdigit():
                    owner = int(parts[1])
                    stale = owner == pid or not running(owner)
                else:
                    try:
                        stale = entry.stat(follow_symlinks=False).st_mtime < started - FOREIGN_STALE_SECONDS
                    except OSError:
                        stale = False
            if stale:
                log.info("save: removing abandoned %s", entry.path)
                shutil.rmtree(entry.path, ignore_errors=True)

    def begin(self, root: Any, base: str) -> LocalPending:
        return LocalPending(Path(root), base)

    def retire(self, location: Any) -> None:
        """Renamed out of sight at once (a crash never leaves a half-deleted checkpoint visible), then
        removed by a background thread (what it leaves is cleaned by the next save)."""
        path = Path(location)
        doomed = path.parent / f"{DEL_PREFIX}{path.name}-{uuid.uuid4().hex[:8]}"
        try:
            os.rename(path, doomed)
        except OSError as exc:
            log.warning("save: could not remove old checkpoint %s: %s", path, exc)
            return
        threading.Thread(
            target=shutil.rmtree, args=(doomed, True), name="elastic-retention", daemon=True
        ).start()

    def settle(self, root: Any) -> None:
        fsync_dir(root)


#: The local filesystem (stateless; shared).
LOCAL = LocalStorage()
