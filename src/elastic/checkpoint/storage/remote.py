"""Checkpoints on object stores and other fsspec filesystems (``s3://``, ``gs://``, ``az://``, ``memory://``).

fsspec and its backends (s3fs, gcsfs, adlfs) are the optional extra ``elastic-state[remote]``; they are
imported when a URL is first used, never by ``import elastic``.

Object stores have no rename, so a checkpoint is published manifest-last: its data objects are uploaded
under their final prefix first, its manifest (which lists every object's size and checksums and carries its
own digest) last; a prefix without a valid manifest is invisible to `load`. Before the first data object, a
small marker ``.tmp-<name>-<host>-<pid>-<id>`` claiming the prefix is written into the root, and removed
once the manifest is in; writers that start together settle on different names through their markers. The
next `save` removes the prefix of a marker whose writer is gone (on this host: its process has exited;
from another host: the marker is older than ten minutes). Retention writes a
``.del-<name>-<id>`` marker, deletes the manifest first, then the data, then the marker.

Files travel through a local spool directory (``tempfile``'s, so ``TMPDIR`` chooses the disk): each file is
written there by the same checksumming writer as a local checkpoint and then uploaded by the backend's own
``put_file`` (s3fs: a multipart upload with concurrent parts); a read downloads each file once with
``get_file`` (s3fs: concurrent ranged reads) and then memory-maps it like a local checkpoint, so the state
never has a whole extra copy in memory and the checksums are verified over the memory map. The spool holds
at most one checkpoint's files at a time, and is removed when the save or the read ends.

Transient errors are retried by the backend (botocore's retry settings, which ``storage_options`` can set);
errors that remain are explained with their fix (`FsspecStorage.explain`).
"""

from __future__ import annotations

import datetime as dt
import errno
import logging
import os
import posixpath
import re
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, suppress
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
from elastic.checkpoint.storage.local import LOCAL, LocalFile

__all__ = ["FsspecStorage", "MissingBucket", "is_url", "open_fsspec"]

log = logging.getLogger("elastic")

_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
#: Protocols whose first path component is a bucket (a container) that must exist.
_BUCKETED = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oss", "r2"})
#: Manifest file name (the layout's; repeated here because this module knows nothing else of the layout).
_MANIFEST = "manifest.json"


#: Exception class names (anywhere in the MRO) of an endpoint that cannot be reached (botocore, aiohttp).
_UNREACHABLE = frozenset(
    {"EndpointConnectionError", "ConnectTimeoutError", "ConnectionError", "ClientConnectorError"}
)
#: Words (lower case) of a throttled or failing request that the backend's retries did not get through.
_FAILING = ("slowdown", "throttl", "503", "service unavailable", "500", "internal")


_NO_SPACE = frozenset({errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)})


class MissingBucket(FileNotFoundError):
    """The bucket (container) of a URL does not exist; elastic never creates one."""


def is_url(path: str) -> str | None:
    """The protocol of `path` if it is a URL (``s3://...``), else None."""
    m = _URL.match(path)
    return m.group(1).lower() if m else None


def open_fsspec(url: str, storage_options: dict[str, Any] | None) -> FsspecStorage:
    """The fsspec filesystem for `url` (fsspec imported here, lazily), as a `Storage`."""
    try:
        import fsspec  # the optional extra, imported on first use
    except ImportError:
        msg = (
            f"{url}: checkpoints on URLs need fsspec and the backend of the URL's protocol; install them "
            "with: pip install 'elastic-state[remote]' (s3fs; add gcsfs for gs://, adlfs for az://)"
        )
        raise ImportError(msg) from None
    protocol = is_url(url) or "file"
    options = dict(storage_options or {})
    if protocol in ("s3", "s3a"):
        # bounded waits, so that an unreachable endpoint fails within minutes, not hours; retries stay
        # botocore's own (its defaults, or what storage_options says)
        config = dict(options.get("config_kwargs") or {})
        config.setdefault("connect_timeout", 10)
        config.setdefault("read_timeout", 60)
        options["config_kwargs"] = config
    options.setdefault("use_listings_cache", False)  # listings must be fresh: other writers change them
    try:
        fs = fsspec.filesystem(protocol, **options)
    except ImportError as exc:
        msg = (
            f"{url}: the fsspec backend for {protocol}:// is not installed ({exc}); install it "
            "(pip install 'elastic-state[remote]' has s3fs; gcsfs for gs://, adlfs for az://)"
        )
        raise ImportError(msg) from None
    return FsspecStorage(fs, protocol)


def _strip(url: str) -> str:
    return url.rstrip("/")


class FsspecStorage(Storage):
    """Checkpoints under fsspec URLs; locations are URL strings (``s3://bucket/prefix/ckpt-...``)."""

    in_place = True

    def __init__(self, fs: Any, protocol: str) -> None:
        self.fs = fs
        self.protocol = protocol
        self._lock = threading.Lock()
        self._spool: str | None = None
        self._spooled: dict[str, str] = {}
        self._fetching: dict[str, threading.Lock] = {}

    # Names

    def _p(self, location: Any) -> str:
        return str(self.fs._strip_protocol(str(location)))

    def join(self, location: Any, name: str) -> str:
        return f"{_strip(str(location))}/{name}"

    def name(self, location: Any) -> str:
        return posixpath.basename(_strip(str(location)))

    def result(self, location: Any) -> str:
        return str(location)

    def _bucket(self, location: Any) -> str | None:
        if self.protocol not in _BUCKETED:
            return None
        return self._p(location).strip("/").split("/", 1)[0] or None

    def check_bucket(self, location: Any) -> None:
        """`MissingBucket` unless the bucket of `location` exists (a bucket is never created)."""
        bucket = self._bucket(location)
        if bucket is None:
            return
        try:
            self.fs.ls(bucket, detail=False)
        except FileNotFoundError:
            msg = (
                f"{location}: the bucket {bucket!r} does not exist; create it first (elastic never creates "
                "buckets), or fix the URL"
            )
            raise MissingBucket(msg) from None

    # Reading

    def exists(self, location: Any) -> bool:
        return bool(self.fs.exists(self._p(location)))

    def entries(self, root: Any) -> list[Entry]:
        try:
            infos = self.fs.ls(self._p(root), detail=True)
        except FileNotFoundError:
            self.check_bucket(root)
            return []
        me = self._p(root).strip("/")
        out = []
        for info in infos:
            path = str(info["name"]).rstrip("/")
            if path.strip("/") == me:
                continue
            name = posixpath.basename(path)
            out.append(Entry(name=name, location=self.join(root, name), is_dir=info["type"] == "directory"))
        return sorted(out, key=lambda e: e.name)

    def _info(self, location: Any) -> dict[str, Any]:
        info: dict[str, Any] = self.fs.info(self._p(location))
        return info

    def size(self, location: Any) -> int:
        info = self._info(location)
        if info["type"] != "file":
            raise IsADirectoryError(f"{location} is not an object")
        return int(info["size"])

    def file_size(self, directory: Any, name: str) -> int:
        info = self._info(self.join(directory, name))
        if info["type"] != "file":
            raise Misplaced("is not a regular file")
        return int(info["size"])

    def read_bytes(self, location: Any, limit: int) -> bytes:
        data: bytes = self.fs.cat_file(self._p(location), start=0, end=limit)  # one ranged GET
        return data

    def open_read(self, location: Any) -> IO[bytes]:
        local = self._spooled.get(str(location))
        if local is not None:
            return open(local, "rb")
        f: IO[bytes] = self.fs.open(self._p(location), "rb")
        return f

    @contextmanager
    def session(self, directory: Any) -> Iterator[None]:
        """Reads of `directory` inside the block download each file once, into a spool removed after."""
        spool = tempfile.mkdtemp(prefix="elastic-read-")
        with self._lock:
            self._spool, self._spooled, self._fetching = spool, {}, {}
        try:
            yield
        finally:
            with self._lock:
                self._spool, self._spooled, self._fetching = None, {}, {}
            shutil.rmtree(spool, ignore_errors=True)

    def local_path(self, location: Any) -> str | None:
        """Inside a `session`: the file downloaded into the spool (once, however many threads ask)."""
        key = str(location)
        with self._lock:
            if self._spool is None:
                return None
            spool = self._spool
            done = self._spooled.get(key)
            if done is not None:
                return done
            fetching = self._fetching.setdefault(key, threading.Lock())
        with fetching:
            with self._lock:
                done = self._spooled.get(key)
            if done is not None:
                return done
            local = os.path.join(spool, uuid.uuid4().hex)
            self.fs.get_file(self._p(location), local)
            with self._lock:
                self._spooled[key] = local
            return local

    @contextmanager
    def mapped(self, location: Any) -> Iterator[memoryview | None]:
        local = self.local_path(location)
        if local is None:
            yield None
            return
        with LOCAL.mapped(local) as view:
            yield view

    # Writing

    def make_root(self, root: Any) -> None:
        self.check_bucket(root)

    def clean_stale(self, root: Any, started: float) -> None:
        try:
            infos = self.fs.ls(self._p(root), detail=True)
        except (FileNotFoundError, NotADirectoryError):
            return
        host, pid = host_tag(), os.getpid()
        for info in infos:
            name = posixpath.basename(str(info["name"]).rstrip("/"))
            if info["type"] != "file" or not name.startswith((TMP_PREFIX, DEL_PREFIX)):
                continue
            marker = self.join(root, name)
            if name.startswith(TMP_PREFIX):
                with _in_use_lock:
                    if marker in _in_use:
                        continue
                parts = name[len(TMP_PREFIX) :].rsplit("-", 3)
                if len(parts) == 4 and parts[1] == host and parts[2].isdigit():
                    owner = int(parts[2])
                    stale = owner == pid or not running(owner)
                else:
                    stale = _mtime(info) < started - FOREIGN_STALE_SECONDS
                if not stale:
                    continue
            self._clean_marker(root, marker, writer=name.startswith(TMP_PREFIX))

    def _clean_marker(self, root: Any, marker: str, *, writer: bool) -> None:
        try:
            target = self.fs.cat_file(self._p(marker)).decode()
        except FileNotFoundError:
            return
        except Exception as exc:
            log.warning("save: cannot read the marker %s: %s", marker, exc)
            return
        if target and "/" not in target and not target.startswith("."):
            prefix = self.join(root, target)
            # a writer's prefix is removed unless its manifest made it (the checkpoint is then complete)
            if not (writer and self.exists(self.join(prefix, _MANIFEST))):
                log.info("save: removing abandoned %s", prefix)
                self._rm_tree(prefix)
        self._rm(marker)

    def _rm_tree(self, location: Any) -> None:
        with suppress(FileNotFoundError):
            self.fs.rm(self._p(location), recursive=True)

    def _rm(self, location: Any) -> None:
        with suppress(FileNotFoundError):
            self.fs.rm_file(self._p(location))

    def begin(self, root: Any, base: str) -> FsspecPending:
        """Claim a free name `base`, `base.1`, ... with a marker ``.tmp-<name>-<host>-<pid>-<id>``.

        Writers that start together (``scope="node"`` leaders sharing one URL) may pick the same name:
        after writing its marker each lists the root again, and of several markers claiming one name the
        one that sorts first keeps it; the others withdraw and claim the next free name."""
        tag = f"{host_tag()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        while True:
            names = [e.name for e in self.entries(root)]
            taken = set(names) | {claim for n in names if (claim := _claimed(n)) is not None}
            n = 0
            while (base if n == 0 else f"{base}.{n}") in taken:
                n += 1
            name = base if n == 0 else f"{base}.{n}"
            mine = f"{TMP_PREFIX}{name}-{tag}"
            marker = self.join(root, mine)
            with _in_use_lock:
                _in_use.add(marker)
            try:
                self.fs.pipe_file(self._p(marker), name.encode())
                rivals = sorted(n for n in (e.name for e in self.entries(root)) if _claimed(n) == name)
                if not rivals or rivals[0] == mine:
                    return FsspecPending(self, self.join(root, name), marker)
                self._rm(marker)  # another writer claimed this name first: take the next one
            except BaseException:
                with _in_use_lock:
                    _in_use.discard(marker)
                raise
            with _in_use_lock:
                _in_use.discard(marker)

    def contribute(self, handle: Any) -> FsspecContribution:
        return FsspecContribution(self, str(handle))

    def retire(self, location: Any) -> None:
        root = posixpath.dirname(_strip(str(location)))
        marker = self.join(root, f"{DEL_PREFIX}{self.name(location)}-{uuid.uuid4().hex[:8]}")
        try:
            self.fs.pipe_file(self._p(marker), self.name(location).encode())
            self._rm(self.join(location, _MANIFEST))  # invisible to load from here on
            self._rm_tree(location)
            self._rm(marker)
        except Exception as exc:
            log.warning("save: could not remove old checkpoint %s: %s", location, exc)

    # Errors

    def explain(self, exc: BaseException) -> str | None:
        """What went wrong talking to the store, and the fix; None if `exc` is not a storage error."""
        text = f"{type(exc).__name__}: {exc}"
        if getattr(exc, "errno", None) in _NO_SPACE:
            return (
                f"{text}. The local spool ({tempfile.gettempdir()}) that files pass through on their way to "
                "the store is full: free space there, or point TMPDIR to a disk with room for one checkpoint"
            )
        names = {c.__name__ for c in type(exc).__mro__}
        lowered = text.lower()
        if isinstance(exc, MissingBucket):
            return str(exc)
        if isinstance(exc, PermissionError) or any(
            k in text for k in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "Forbidden")
        ):
            return (
                f"{text}. Access denied: check the credentials (storage_options key=/secret=/token=, or the "
                "environment and instance profile) and the bucket's permissions"
            )
        if names & _UNREACHABLE:
            return (
                f"{text}. The storage endpoint cannot be reached: check the URL and the endpoint "
                "(storage_options client_kwargs={'endpoint_url': ...}), and the network"
            )
        if any(k in lowered for k in _FAILING):
            return (
                f"{text}. The store is throttling or failing requests (still failing after the backend's "
                "retries): retry later, save less often, or raise the retries in storage_options "
                "(config_kwargs={'retries': {'max_attempts': ...}} for s3)"
            )
        if isinstance(exc, OSError):
            return f"{text}. The store refused the request; check the URL, the credentials and the bucket"
        return None


def _mtime(info: dict[str, Any]) -> float:
    """An object's modification time in seconds since the epoch (now when the listing lacks one)."""
    for key in ("LastModified", "mtime", "last_modified", "created", "updated"):
        value = info.get(key)
        if isinstance(value, dt.datetime):
            if value.tzinfo is None:
                value = value.replace(tzinfo=dt.timezone.utc)
            return value.timestamp()
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            try:
                return dt.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
            except ValueError:
                continue
    return time.time()


def _claimed(name: str) -> str | None:
    """The checkpoint name a writer's marker ``.tmp-<name>-<host>-<pid>-<id>`` claims (None if not one)."""
    if not name.startswith(TMP_PREFIX):
        return None
    parts = name[len(TMP_PREFIX) :].rsplit("-", 3)
    return parts[0] if len(parts) == 4 and parts[0] else None


_in_use_lock = threading.Lock()
_in_use: set[str] = set()  # markers of writes this process is doing right now


class SpoolFile(LocalFile):
    """A file written to the local spool, uploaded in one `put_file` when synced."""

    def __init__(self, storage: FsspecStorage, local: str, remote: str) -> None:
        super().__init__(local)
        self._storage = storage
        self._local = local
        self._remote = remote

    def written(self, offset: int, length: int) -> None:
        pass  # the spool is not meant to reach the disk: no writeback

    def sync(self) -> None:
        self._storage.fs.put_file(self._local, self._storage._p(self._remote))

    def close(self, *, ok: bool) -> None:
        super().close(ok=ok)
        with suppress(OSError):
            os.unlink(self._local)


class FsspecContribution(Contribution):
    """Objects another rank uploads under a pending checkpoint's prefix (spooled locally first)."""

    def __init__(self, storage: FsspecStorage, prefix: str) -> None:
        self.storage = storage
        self.prefix = prefix
        self.spool = tempfile.mkdtemp(prefix="elastic-write-")

    def create(self, name: str) -> Sink:
        return SpoolFile(self.storage, os.path.join(self.spool, name), self.storage.join(self.prefix, name))

    def close(self) -> None:
        shutil.rmtree(self.spool, ignore_errors=True)


class FsspecPending(Pending):
    """A checkpoint uploaded in place under its final prefix; visible once its manifest is uploaded."""

    def __init__(self, storage: FsspecStorage, prefix: str, marker: str) -> None:
        self.storage = storage
        self.prefix = prefix
        self.marker = marker
        self.spool = tempfile.mkdtemp(prefix="elastic-write-")
        self._manifest: tuple[str, bytes] | None = None

    def create(self, name: str) -> Sink:
        return SpoolFile(self.storage, os.path.join(self.spool, name), self.storage.join(self.prefix, name))

    def seal(self, name: str, manifest: bytes) -> None:
        self._manifest = (name, manifest)

    def publish(self) -> str:
        if self._manifest is None:
            msg = f"{self.prefix}: publish() before seal()"
            raise RuntimeError(msg)
        name, data = self._manifest
        self.storage.fs.pipe_file(self.storage._p(self.storage.join(self.prefix, name)), data)
        self._finish()
        return self.prefix

    def handle(self) -> str:
        return self.prefix

    def discard(self) -> None:
        try:
            self.storage._rm_tree(self.prefix)
        except Exception as exc:
            log.warning("save: could not remove the partial checkpoint %s: %s", self.prefix, exc)
        self._finish()

    def _finish(self) -> None:
        shutil.rmtree(self.spool, ignore_errors=True)
        try:
            self.storage._rm(self.marker)
        except Exception as exc:  # the next save removes it (the prefix has a manifest: kept)
            log.warning("save: could not remove the marker %s: %s", self.marker, exc)
        finally:
            with _in_use_lock:
                _in_use.discard(self.marker)
