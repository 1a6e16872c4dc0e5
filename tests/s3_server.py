"""An S3 protocol server on loopback for the tests (moto's `ThreadedMotoServer`, as s3fs's own tests use):
`start_server` gives its endpoint, `s3_options` the storage options that reach it, `new_bucket` a bucket.
Import the pytest fixtures `endpoint` and `bucket` from here into a test module."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from dist_harness import free_port


def s3_options(endpoint: str, **config: Any) -> dict[str, Any]:
    """fsspec storage options for the server at `endpoint` (test credentials, short timeouts)."""
    retries = config.pop("retries", {"max_attempts": 2, "mode": "standard"})
    return {
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"endpoint_url": endpoint},
        "config_kwargs": {"connect_timeout": 2, "read_timeout": 10, "retries": retries, **config},
        "skip_instance_cache": True,
    }


@pytest.fixture(scope="module")
def endpoint() -> Iterator[str]:
    """The URL of a server started for the module (skips without moto)."""
    moto_server = pytest.importorskip("moto.server")
    port = free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()


@pytest.fixture
def bucket(endpoint: str) -> Iterator[tuple[str, dict[str, Any], Any]]:
    """A fresh bucket: its URL, the storage options, and an s3fs filesystem for looking inside."""
    s3fs = pytest.importorskip("s3fs")
    opts = s3_options(endpoint)
    fs = s3fs.S3FileSystem(**opts)
    name = f"b{uuid.uuid4().hex[:12]}"
    fs.mkdir(name)
    yield f"s3://{name}", opts, fs
