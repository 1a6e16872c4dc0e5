"""The local filesystem as a checkpoint `Storage`: atomic publication by fsync and rename.

`LocalStorage` writes every file into a hidden ``.tmp-<host>-<pid>-<id>`` directory inside the root and
fsyncs it, then fsyncs the directory, renames it into place and fsyncs the root.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import shutil
import sys
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from elastic._util.procs import running
from elastic.checkpoint.storage.base import (
    DEL_PREFIX,
    FOREIGN_STALE_SECONDS,
    TMP_PREFIX,
    Contribution,
    Entry,
    Misplaced,
    Pending,
    Sink,
    Storage,
    host_tag,
)

__all__ = ["LOCAL", "LocalFile", "LocalPending", "LocalStorage", "fsync_dir"]

log = logging.getLogger("elastic")

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

    def close(self, *, ok: bool) -> None:
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

    def handle(self) -> str:
        return os.fspath(self.tmp)

    def _release(self) -> None:
        with _in_use_lock:
            _in_use.discard(str(self.tmp))


class LocalContribution(Contribution):
    """Files written into another rank's pending directory (its owner fsyncs the directory when it seals)."""

    def __init__(self, directory: Path) -> None:
        if not directory.is_dir():
            msg = (
                f"the checkpoint being written at {directory} is not visible on this host: every rank of a "
                "sharded save writes its pieces into one directory, so the path must be on a filesystem "
                "every rank shares (or an fsspec URL)"
            )
            raise FileNotFoundError(msg)
        self.directory = directory

    def create(self, name: str) -> Sink:
        return LocalFile(self.directory / name)


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

    def contribute(self, handle: Any) -> LocalContribution:
        return LocalContribution(Path(handle))

    def settle(self, root: Any) -> None:
        fsync_dir(root)


#: The local filesystem (stateless; shared).
LOCAL = LocalStorage()
