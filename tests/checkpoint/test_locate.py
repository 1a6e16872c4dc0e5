"""`locate`: local paths keep the local storage, URLs get an fsspec storage, bad arguments are refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from elastic.checkpoint.storage import local as S
from elastic.checkpoint.storage import remote as FS
from elastic.checkpoint.storage.locate import locate


def test_local_paths_and_file_urls_are_local(tmp_path: Path) -> None:
    assert locate(tmp_path, None, "save") == (S.LOCAL, tmp_path)
    assert locate(str(tmp_path), None, "save") == (S.LOCAL, tmp_path)
    assert locate(f"file://{tmp_path}", None, "load") == (S.LOCAL, tmp_path)
    assert locate("relative/dir", {}, "save") == (S.LOCAL, Path("relative/dir"))  # empty options are none


def test_urls_open_fsspec() -> None:
    pytest.importorskip("fsspec")
    storage, root = locate("memory://bucket/run/", None, "save")
    assert isinstance(storage, FS.FsspecStorage) and storage.protocol == "memory"
    assert root == "memory://bucket/run" and storage.in_place
    assert storage.join(root, "ckpt-1") == "memory://bucket/run/ckpt-1"
    assert storage.name("memory://bucket/run/ckpt-1/") == "ckpt-1"
    assert FS.is_url("S3://b/x") == "s3" and FS.is_url("/plain/path") is None and FS.is_url("c:\\x") is None


def test_bad_arguments() -> None:
    with pytest.raises(TypeError, match=r"save\(path=\.\.\.\) must be a str or os\.PathLike .* got int 3"):
        locate(3, None, "save")
    with pytest.raises(TypeError, match=r"load\(storage_options=\.\.\.\) must be a dict"):
        locate("memory://x", ["anon"], "load")
    with pytest.raises(ValueError, match=r"applies to URLs .* not to the local path 'x'"):
        locate("x", {"anon": True}, "save")
