"""The storage seam's local implementation: listing, sizes, maps, atomic publishing, retirement, leftovers."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from elastic.checkpoint import content as IO
from elastic.checkpoint.storage import local as S


def test_entries_sizes_and_reads(tmp_path: Path) -> None:
    local = S.LOCAL
    assert local.entries(tmp_path / "absent") == []
    (tmp_path / "b").mkdir()
    (tmp_path / "a").write_bytes(b"12345")
    got = local.entries(tmp_path)
    assert [(e.name, e.is_dir, e.location) for e in got] == [
        ("a", False, tmp_path / "a"),
        ("b", True, tmp_path / "b"),
    ]
    assert local.size(tmp_path / "a") == 5 and local.read_bytes(tmp_path / "a", 3) == b"123"
    assert local.exists(tmp_path / "a") and not local.exists(tmp_path / "c")
    assert local.join(tmp_path, "x") == tmp_path / "x" and local.name(tmp_path / "x") == "x"
    with local.open_read(tmp_path / "a") as f:
        assert f.read() == b"12345"
    with local.mapped(tmp_path / "a") as view:
        assert view is not None and bytes(view) == b"12345"
    (tmp_path / "empty").write_bytes(b"")
    with local.mapped(tmp_path / "empty") as view:
        assert view is None
    with pytest.raises(FileNotFoundError):
        local.size(tmp_path / "c")


def test_file_size_refuses_what_is_not_a_plain_file_inside(tmp_path: Path) -> None:
    d = tmp_path / "ckpt"
    d.mkdir()
    (tmp_path / "outside").write_bytes(b"x")
    os.symlink(tmp_path / "outside", d / "link")
    (d / "sub").mkdir()
    (d / "ok").write_bytes(b"abc")
    assert S.LOCAL.file_size(d, "ok") == 3
    with pytest.raises(S.Misplaced, match="resolves outside the checkpoint directory"):
        S.LOCAL.file_size(d, "link")
    with pytest.raises(S.Misplaced, match="is not a regular file"):
        S.LOCAL.file_size(d, "sub")
    with pytest.raises(FileNotFoundError):
        S.LOCAL.file_size(d, "absent")


def test_pending_checkpoints_publish_atomically_under_a_free_name(tmp_path: Path) -> None:
    pending = S.LOCAL.begin(tmp_path, "ckpt-1")
    hidden = [n for n in os.listdir(tmp_path) if n.startswith(S.TMP_PREFIX)]
    assert len(hidden) == 1 and f"-{os.getpid()}-" in hidden[0]
    record = IO.write_bytes(pending, "data", b"payload")
    assert record.size == 7 and record.digest == IO.tree_root([IO.ChunkSum(b"payload").digest()])
    pending.seal("manifest.json", b"{}")
    (tmp_path / "ckpt-1").mkdir()  # taken: the next free name is used
    final = pending.publish()
    assert final == tmp_path / "ckpt-1.1"
    assert sorted(os.listdir(final)) == ["data", "manifest.json"]
    assert sorted(os.listdir(tmp_path)) == ["ckpt-1", "ckpt-1.1"]
    failed = S.LOCAL.begin(tmp_path, "ckpt-2")
    IO.write_bytes(failed, "data", b"partial")
    failed.discard()
    assert sorted(os.listdir(tmp_path)) == ["ckpt-1", "ckpt-1.1"]


def test_retire_hides_at_once_and_stale_leftovers_go(tmp_path: Path) -> None:
    (tmp_path / "ckpt-1").mkdir()
    (tmp_path / "ckpt-1" / "f").write_bytes(b"x")
    S.LOCAL.retire(tmp_path / "ckpt-1")
    assert not (tmp_path / "ckpt-1").exists()  # renamed out of sight before being deleted
    busy = S.LOCAL.begin(tmp_path, "ckpt-3")  # this process is writing it: never stale
    mine = tmp_path / f"{S.TMP_PREFIX}{S.host_tag()}-{os.getpid()}-0000beef"  # this pid, not in use
    foreign = tmp_path / f"{S.TMP_PREFIX}elsewhere-1-0000beef"
    for d in (mine, foreign):
        d.mkdir()
    S.LOCAL.clean_stale(tmp_path, time.time())
    left = sorted(os.listdir(tmp_path))
    assert mine.name not in left and foreign.name in left and busy.tmp.name in left
    assert not [n for n in left if n.startswith(S.DEL_PREFIX)]
    S.LOCAL.clean_stale(tmp_path, time.time() + 2 * S.FOREIGN_STALE_SECONDS)
    assert sorted(os.listdir(tmp_path)) == [busy.tmp.name]
    busy.discard()
    assert os.listdir(tmp_path) == []


def test_hash_file_maps_local_files_and_streams_otherwise(tmp_path: Path) -> None:
    data = os.urandom(3 * 1024 + 5)
    (tmp_path / "f").write_bytes(data)
    want = IO.tree_root([IO.ChunkSum(data[i : i + 1024]).digest() for i in range(0, len(data), 1024)])
    assert IO.hash_file(S.LOCAL, tmp_path / "f", 1024) == (len(data), want)
    with open(tmp_path / "f", "rb") as f:
        assert IO.hash_stream(f, 1024) == (len(data), want)
    (tmp_path / "e").write_bytes(b"")
    assert IO.hash_file(S.LOCAL, tmp_path / "e", 1024) == (0, IO.tree_root([]))
