"""Checkpoints on object stores through fsspec: a real S3 protocol server (moto's, on loopback) and memory://.

The server is moto's `ThreadedMotoServer`, started once for this module on a free port of 127.0.0.1 (as
s3fs's own tests do); every call reaches it through ``storage_options`` (endpoint and test credentials).
Every test uses a bucket of its own. The values are checked with `test_golden.check` (model, Adam,
StepLR, plain and object fields, bit for bit).
"""

from __future__ import annotations

import http.server
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import elastic
import golden_state
from dist_harness import free_port, run_on_ranks
from elastic.checkpoint.storage import remote as FS
from golden_state import check
from s3_server import bucket, endpoint, s3_options

pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

__all__ = ["bucket", "endpoint"]  # the fixtures, imported from s3_server


def options(endpoint: str, **config: Any) -> dict[str, Any]:
    return s3_options(endpoint, **config)


def listing(fs: Any, prefix: str) -> list[str]:
    """Every object under `prefix` (relative names), fresh from the server."""
    fs.invalidate_cache()
    base = prefix.removeprefix("s3://").rstrip("/")
    return sorted(p[len(base) + 1 :] for p in fs.find(base))


def saved(step: int, objects: bool = True) -> golden_state.GoldenState:
    state = golden_state.build()
    state.step = step
    if not objects:
        state.point = state.ratio = None
    return state


# ---------------------------------------------------------------------------------------------------------
# Round trips


def test_import_elastic_imports_no_remote_backend() -> None:
    code = (
        "import sys, elastic; print(sorted(m for m in sys.modules if m.split('.')[0] in ('fsspec', 's3fs')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"


def test_s3_round_trip_is_bit_identical(bucket: tuple[str, dict[str, Any], Any]) -> None:
    url, opts, fs = bucket
    root = f"{url}/run"
    path = elastic.save(saved(1234), root, storage_options=opts)
    assert path == f"{root}/ckpt-000000001234" and isinstance(path, str)
    assert listing(fs, root) == [
        "ckpt-000000001234/manifest.json",
        "ckpt-000000001234/objects.pkl",
        "ckpt-000000001234/state.pt",
    ]  # no marker left, nothing else
    state = golden_state.fresh()
    report = elastic.load(state, root, trusted=True, storage_options=opts)
    assert (report.source, report.tenure, report.path, report.saved_world_size) == (
        "checkpoint",
        1234,
        path,
        1,
    )
    check(state, objects=True)
    again = golden_state.fresh()  # a checkpoint's own URL loads too
    assert elastic.load(again, path, trusted=True, storage_options=opts).path == path
    check(again, objects=True)


def test_trusted_is_required_for_objects(bucket: tuple[str, dict[str, Any], Any]) -> None:
    url, opts, _ = bucket
    elastic.save(saved(5), url, storage_options=opts)
    state = golden_state.fresh()
    with pytest.raises(elastic.UntrustedCheckpointError, match=r"'point', 'ratio'.*trusted=True"):
        elastic.load(state, url, storage_options=opts)
    assert state.step == 0
    elastic.save(saved(6, objects=False), url, storage_options=opts)
    plain = golden_state.fresh(with_objects=False)
    assert elastic.load(plain, url, storage_options=opts).tenure == 6  # plain data needs no trust
    check(plain, objects=False, step=6)


def test_memory_url_round_trip_and_async_save() -> None:
    root = f"memory://elastic-test-{uuid.uuid4().hex[:8]}/run"
    handle = elastic.save(saved(7), root, blocking=False)
    assert isinstance(handle, elastic.SaveHandle)
    assert handle.wait() == f"{root}/ckpt-000000000007"
    state = golden_state.fresh()
    report = elastic.load(state, root, trusted=True)
    assert report.path == f"{root}/ckpt-000000000007" and report.tenure == 7
    check(state, objects=True, step=7)


def test_async_save_to_s3(bucket: tuple[str, dict[str, Any], Any]) -> None:
    url, opts, _ = bucket
    state = saved(1)
    handle = elastic.save(state, url, blocking=False, storage_options=opts)
    state.step = 2  # training goes on while the upload runs: the snapshot is what was saved
    assert handle.wait() == f"{url}/ckpt-000000000001"
    fresh = golden_state.fresh()
    assert elastic.load(fresh, url, trusted=True, storage_options=opts).tenure == 1
    check(fresh, objects=True, step=1)


def test_storage_options_are_for_urls(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"storage_options=\.\.\.\) applies to URLs"):
        elastic.save(saved(1), tmp_path, storage_options={"anon": True})
    with pytest.raises(TypeError, match=r"must be a dict of fsspec options"):
        elastic.load(golden_state.fresh(), "memory://x", storage_options="anon")  # type: ignore[arg-type]
    assert elastic.save(saved(1), f"file://{tmp_path}") == tmp_path / "ckpt-000000000001"  # local writer


# ---------------------------------------------------------------------------------------------------------
# Retention and leftovers


def test_retention_keeps_the_most_tenured(bucket: tuple[str, dict[str, Any], Any]) -> None:
    url, opts, fs = bucket
    for step in (1, 2, 3, 4):
        elastic.save(saved(step, objects=False), url, keep=2, storage_options=opts)
    names = {n.split("/")[0] for n in listing(fs, url)}
    assert names == {"ckpt-000000000003", "ckpt-000000000004"}


def test_retention_deletes_the_manifest_first(
    bucket: tuple[str, dict[str, Any], Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    url, opts, fs = bucket
    for step in (1, 2):
        elastic.save(saved(step, objects=False), url, keep=None, storage_options=opts)

    def broken(self: Any, location: Any) -> None:
        raise OSError("the connection dropped")

    monkeypatch.setattr(FS.FsspecStorage, "_rm_tree", broken)
    elastic.save(saved(3, objects=False), url, keep=2, storage_options=opts)
    objects = listing(fs, url)
    # checkpoint 1 lost its manifest (invisible to load) but its data stayed, with the .del- marker
    assert "ckpt-000000000001/state.pt" in objects and "ckpt-000000000001/manifest.json" not in objects
    assert any(n.startswith(".del-ckpt-000000000001-") for n in objects)
    state = golden_state.fresh(with_objects=False)
    assert elastic.load(state, url, storage_options=opts).tenure == 3
    monkeypatch.undo()
    elastic.save(saved(4, objects=False), url, keep=None, storage_options=opts)  # cleans what is left
    assert {n.split("/")[0] for n in listing(fs, url)} == {f"ckpt-00000000000{i}" for i in (2, 3, 4)}


_CHILD = """
import sys
sys.path.insert(0, {tests!r})
import torch, elastic, golden_state
state = golden_state.build()
state.step = 2
state.ema = torch.randn(16 * 2**20 // 8, dtype=torch.float64)  # 16 MiB: the upload takes a while
elastic.save(state, {url!r}, keep=None, storage_options={opts!r})
"""


def test_a_killed_writer_leaves_nothing_load_uses(bucket: tuple[str, dict[str, Any], Any]) -> None:
    url, opts, fs = bucket
    elastic.save(saved(1), url, storage_options=opts)
    code = textwrap.dedent(_CHILD).format(tests=str(Path(__file__).parents[1]), url=url, opts=opts)
    env = {**os.environ, "ELASTIC_FAULT": "0:rename:die"}  # every data object is up, the manifest is not
    subprocess.run([sys.executable, "-c", code], env=env, timeout=90, check=False)
    objects = listing(fs, url)
    assert "ckpt-000000000002/state.pt" in objects and "ckpt-000000000002/manifest.json" not in objects
    assert any(n.startswith(".tmp-") for n in objects)
    state = golden_state.fresh()
    assert elastic.load(state, url, trusted=True, storage_options=opts).tenure == 1

    # SIGKILL at a moment during the upload: what it leaves is invisible, or a complete checkpoint
    child = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 60
        while not any(n.startswith(".tmp-") and n not in objects for n in listing(fs, url)):
            assert time.monotonic() < deadline and child.poll() is None, "the writer never started"
            time.sleep(0.05)
        time.sleep(0.2)
        child.send_signal(signal.SIGKILL)
    finally:
        child.wait(timeout=30)
    state = golden_state.fresh()
    assert elastic.load(state, url, trusted=True, storage_options=opts).tenure in (1, 2)
    elastic.save(saved(3), url, keep=None, storage_options=opts)  # removes the dead writers' leftovers
    objects = listing(fs, url)
    assert not [n for n in objects if n.startswith(".")]
    prefixes = {n.split("/")[0] for n in objects}
    assert all(f"{p}/manifest.json" in objects for p in prefixes), objects
    assert "ckpt-000000000001" in prefixes and "ckpt-000000000003" in prefixes


# ---------------------------------------------------------------------------------------------------------
# Damage


def test_corrupt_and_truncated_objects_fall_back(bucket: tuple[str, dict[str, Any], Any]) -> None:
    url, opts, fs = bucket
    for step in (1, 2, 3):
        elastic.save(saved(step), url, keep=None, storage_options=opts)
    base = url.removeprefix("s3://")
    data = bytearray(fs.cat_file(f"{base}/ckpt-000000000003/state.pt"))
    data[len(data) // 2] ^= 0xFF
    fs.pipe_file(f"{base}/ckpt-000000000003/state.pt", bytes(data))
    fs.pipe_file(
        f"{base}/ckpt-000000000002/objects.pkl", fs.cat_file(f"{base}/ckpt-000000000002/objects.pkl")[:-3]
    )
    state = golden_state.fresh()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = elastic.load(state, url, trusted=True, storage_options=opts)
    texts = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert report.tenure == 1 and report.path == f"{url}/ckpt-000000000001"
    check(state, objects=True, step=1)
    assert any(f"{url}/ckpt-000000000003/state.pt" in t and "checksum mismatch" in t for t in texts), texts
    assert any(f"{url}/ckpt-000000000002/objects.pkl" in t and "truncated" in t for t in texts), texts
    with pytest.raises(elastic.CheckpointCorruptError, match=r"ckpt-000000000003/state\.pt"):
        elastic.load(golden_state.fresh(), f"{url}/ckpt-000000000003", trusted=True, storage_options=opts)


# ---------------------------------------------------------------------------------------------------------
# Errors


def test_a_missing_bucket_is_an_error_never_created(endpoint: str) -> None:
    import s3fs

    opts = options(endpoint)
    url = f"s3://missing-{uuid.uuid4().hex[:8]}/run"
    with pytest.raises(elastic.CheckpointError, match=rf"{url}.*does not exist; create it first"):
        elastic.save(saved(1), url, storage_options=opts)
    with pytest.raises(elastic.CheckpointError, match=rf"cannot list {url}.*does not exist; create it"):
        elastic.load(golden_state.fresh(), url, storage_options=opts)
    assert not s3fs.S3FileSystem(**opts).exists(url.removeprefix("s3://").split("/")[0])


def test_wrong_credentials(bucket: tuple[str, dict[str, Any], Any], monkeypatch: pytest.MonkeyPatch) -> None:
    from moto import settings

    url, opts, _ = bucket
    elastic.save(saved(1), url, storage_options=opts)
    monkeypatch.setattr(settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)  # the server checks keys from now on
    bad = {**opts, "key": "AKIAWRONGWRONGWRONG1", "secret": "wrong"}
    with pytest.raises(elastic.CheckpointError, match=rf"{url}.*Access denied: check the credentials"):
        elastic.save(saved(2), url, storage_options=bad)
    with pytest.raises(elastic.CheckpointError, match=rf"{url}.*Access denied: check the credentials"):
        elastic.load(golden_state.fresh(), url, storage_options=bad)
    monkeypatch.undo()
    assert elastic.load(golden_state.fresh(), url, trusted=True, storage_options=opts).tenure == 1


def test_unreachable_endpoint_fails_fast() -> None:
    opts = options(f"http://127.0.0.1:{free_port()}")  # nothing listens there
    url = "s3://bucket/run"  # the connect timeout (2 s) and 2 attempts bound it; pytest's timeout guards
    with pytest.raises(elastic.CheckpointError, match=rf"{url}.*endpoint cannot be reached.*endpoint_url"):
        elastic.save(saved(1), url, storage_options=opts)
    with pytest.raises(elastic.CheckpointError, match=r"endpoint cannot be reached"):
        elastic.load(golden_state.fresh(), url, storage_options=opts)


class _SlowDown(http.server.BaseHTTPRequestHandler):
    """An S3 endpoint that throttles every request."""

    def _answer(self) -> None:
        body = b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>"
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)
        self.send_response(503)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _answer

    def log_message(self, *args: Any) -> None:
        pass


def test_throttled_requests_fail_after_the_backends_retries() -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _SlowDown)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        opts = options(f"http://127.0.0.1:{server.server_address[1]}")
        with pytest.raises(elastic.CheckpointError, match=r"s3://bucket/run.*throttling or failing requests"):
            elastic.save(saved(1), "s3://bucket/run", storage_options=opts)
    finally:
        server.shutdown()
        server.server_close()


# ---------------------------------------------------------------------------------------------------------
# A group: scope="node" with per-node prefixes, and errors on every rank


def _group_body(rank: int, world: int, url: str, opts: dict[str, Any]) -> dict[str, Any]:
    import golden_state

    os.environ["GROUP_RANK"] = str(rank)  # one node per rank
    out: dict[str, Any] = {}
    state = golden_state.build()
    state.step = 10 + rank  # rank 1 is ahead: rank 0's node syncs before writing
    out["node"] = elastic.save(state, f"{url}/node{rank}", scope="node", storage_options=opts, timeout=60)
    del os.environ["GROUP_RANK"]
    fresh = golden_state.fresh()
    report = elastic.load(fresh, f"{url}/node{rank}", trusted=True, storage_options=opts, timeout=60)
    out["loaded"] = (report.tenure, report.path, fresh.step)
    try:
        elastic.save(state, "s3://missing-group/run", storage_options=opts, timeout=60)
    except elastic.CheckpointError as exc:
        out["error"] = str(exc)
    return out


def test_scope_node_per_node_prefixes_and_errors_on_every_rank(
    bucket: tuple[str, dict[str, Any], Any],
) -> None:
    url, opts, fs = bucket
    results = run_on_ranks(_group_body, 2, args=(url, opts), timeout=110)
    for rank, r in enumerate(results):
        assert r["node"] == f"{url}/node{rank}/ckpt-000000000011"
        assert r["loaded"] == (11, f"{url}/node0/ckpt-000000000011", 11)  # rank 0 read it, then synced
        assert "on rank 0 (the writer)" in r["error"] and "'missing-group' does not exist" in r["error"]
    assert {n.split("/")[0] for n in listing(fs, url)} == {"node0", "node1"}


def test_torch_tensors_survive_as_written(bucket: tuple[str, dict[str, Any], Any]) -> None:
    url, opts, _ = bucket
    state = saved(3)
    state.ema = torch.randn(3 * 2**20 // 8 + 5, dtype=torch.float64)  # more than one checksum chunk
    elastic.save(state, url, storage_options=opts)
    fresh = golden_state.fresh()
    before = fresh.ema.data_ptr()
    elastic.load(fresh, url, trusted=True, storage_options=opts)
    assert torch.equal(fresh.ema, state.ema) and fresh.ema.data_ptr() != before  # new shape: a new tensor


def test_leftovers_of_other_hosts_go_once_stale() -> None:
    pytest.importorskip("fsspec")
    from elastic.checkpoint.storage.base import FOREIGN_STALE_SECONDS, host_tag
    from elastic.checkpoint.storage.locate import locate

    storage, root = locate(f"memory://elastic-test-{uuid.uuid4().hex[:8]}/run", None, "save")
    assert isinstance(storage, FS.FsspecStorage)
    fs = storage.fs
    base = storage._p(root)
    alive = f".tmp-ckpt-8-{host_tag()}-{os.getppid()}-0000beef"  # a live process of this host may write
    foreign = ".tmp-ckpt-9-otherhost-12-0000beef"
    for marker, target in ((foreign, "ckpt-9"), (alive, "ckpt-8")):
        fs.pipe_file(f"{base}/{marker}", target.encode())
        fs.pipe_file(f"{base}/{target}/state.pt", b"partial")
    fs.pipe_file(f"{base}/.del-ckpt-1-0000beef", b"ckpt-1")  # a retention that died half-way
    fs.pipe_file(f"{base}/ckpt-1/state.pt", b"old")
    storage.clean_stale(root, time.time())
    assert sorted(e.name for e in storage.entries(root)) == sorted([foreign, alive, "ckpt-8", "ckpt-9"])
    storage.clean_stale(root, time.time() + 2 * FOREIGN_STALE_SECONDS)
    assert sorted(e.name for e in storage.entries(root)) == sorted([alive, "ckpt-8"])


def test_errors_are_explained_with_their_fix() -> None:
    import errno

    storage = FS.FsspecStorage(fs=None, protocol="s3")
    explain = storage.explain
    assert "does not exist" in str(explain(FS.MissingBucket("s3://b: the bucket 'b' does not exist")))
    assert "point TMPDIR to a disk" in str(explain(OSError(errno.ENOSPC, "No space left on device")))
    assert "check the credentials" in str(explain(PermissionError("InvalidAccessKeyId")))

    class EndpointConnectionError(Exception):  # botocore's, by name: no import of botocore needed
        pass

    assert "endpoint_url" in str(explain(EndpointConnectionError("Could not connect")))
    assert "throttling or failing" in str(explain(OSError("SlowDown: Please reduce your request rate")))
    assert "throttling or failing" in str(explain(OSError("InternalError: please retry")))
    assert explain(ValueError("not the store's")) is None


def test_writers_starting_together_claim_different_names() -> None:
    pytest.importorskip("fsspec")
    from elastic.checkpoint.storage.locate import locate

    storage, root = locate(f"memory://elastic-test-{uuid.uuid4().hex[:8]}/run", None, "save")
    assert isinstance(storage, FS.FsspecStorage)
    barrier = threading.Barrier(3)
    claimed: list[str] = []

    def writer() -> None:
        barrier.wait()
        claimed.append(storage.begin(root, "ckpt-000000000005").prefix)

    threads = [threading.Thread(target=writer) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert sorted(claimed) == [f"{root}/ckpt-000000000005{s}" for s in ("", ".1", ".2")]
