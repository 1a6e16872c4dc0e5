"""The rendezvous store: a torch `TCPStore` that outlives the workers.

`serve` runs the server (in `elastic.spawn(restart="worker")`'s caller, or `python -m elastic.store` for
many machines); every worker `connect`s to it as a client. Addresses are ``"host:port"``, given to
`elastic.run(rdzv=...)` or in the ``ELASTIC_RDZV`` environment variable.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch.distributed as dist

from elastic._util.errors import ElasticError

__all__ = [
    "RDZV_ENV",
    "client",
    "connect",
    "connect_first",
    "format_address",
    "parse_address",
    "parse_addresses",
    "probe",
    "serve",
]

RDZV_ENV = "ELASTIC_RDZV"


def parse_address(rdzv: str | None) -> tuple[str, int]:
    """``(host, port)`` of ``"host:port"``, or of ``$ELASTIC_RDZV`` when `rdzv` is None.

    IPv6 hosts are written in brackets (``"[::1]:29400"``). ElasticError when neither is given or the
    address is malformed.
    """
    source = "rdzv"
    if rdzv is None:
        rdzv = os.environ.get(RDZV_ENV)
        source = f"${RDZV_ENV}"
        if not rdzv:
            msg = (
                f"elastic: no rendezvous address: pass rdzv='host:port' or set the environment variable "
                f"{RDZV_ENV}=host:port (a store served by `python -m elastic.store --port P` or by "
                f"elastic.spawn(..., restart='worker'))"
            )
            raise ElasticError(msg)
    text = rdzv.strip()
    host, sep, port_text = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        msg = (
            f"elastic: rendezvous address {source}={rdzv!r} is not 'host:port' with a port in 1..65535; "
            f"write it like '127.0.0.1:29400'"
        )
        raise ElasticError(msg)
    return host, int(port_text)


def parse_addresses(rdzv: str | None) -> list[tuple[str, int]]:
    """The ``(host, port)`` of each address of a comma-separated list (``"h1:29400,h2:29400"``: a store and
    its standbys, tried in order), or of ``$ELASTIC_RDZV`` when `rdzv` is None. ElasticError as in
    `parse_address`, naming the malformed one."""
    if rdzv is None:
        rdzv = os.environ.get(RDZV_ENV)
        if not rdzv:
            return [parse_address(None)]  # raises, saying how to give one
    parts = [part for part in rdzv.split(",") if part.strip()]
    if not parts:
        return [parse_address(rdzv)]
    return [parse_address(part) for part in parts]


def connect_first(
    addresses: list[tuple[str, int]], *, timeout: timedelta, attempt: timedelta | None = None
) -> tuple[dist.Store, tuple[str, int]]:
    """A client of the first store of `addresses` that answers, and its address; each is given `attempt`
    (default `timeout`) to answer, and the client's operations are bounded by `timeout`. ElasticError
    naming every address when none answers."""
    errors = []
    for host, port in addresses:
        try:
            return client(host, port, timeout=timeout, attempt=attempt), (host, port)
        except (RuntimeError, OSError) as exc:
            errors.append(f"{format_address(host, port)}: {str(exc).splitlines()[0] if str(exc) else exc}")
    listed = ", ".join(format_address(h, p) for h, p in addresses)
    seconds = (attempt or timeout).total_seconds()
    msg = (
        f"elastic: cannot reach any rendezvous store of [{listed}] within {seconds:g} s each "
        f"({'; '.join(errors)}); start one with `python -m elastic.store --port P` or check {RDZV_ENV}"
    )
    raise ElasticError(msg)


def client(host: str, port: int, *, timeout: timedelta, attempt: timedelta | None = None) -> dist.TCPStore:
    """A client of the store at `host`:`port`, the errors left as they are (`connect` names the address).

    Args:
        host: the store's host name or address.
        port: the store's port.
        timeout: bounds the client's operations (and its connect, without `attempt`).
        attempt: bounds the connect, after a `probe` (a store that went away: refused at once).

    Returns:
        The client.

    Raises:
        OSError: the probe found nothing there.
        RuntimeError: torch's client could not connect (``DistNetworkError``).
    """
    if attempt is not None:
        probe(host, port, attempt)
    store = dist.TCPStore(host, port, is_master=False, timeout=attempt or timeout, wait_for_workers=False)
    if attempt is not None:
        store.set_timeout(timeout)
    return store


def probe(host: str, port: int, timeout: timedelta) -> None:
    """Check that something accepts a TCP connection at `host`:`port` (then close it).

    A quick look before a `TCPStore` client is made for a store that went away: torch's client retries a
    refused connection after a random 0.4-1 s, whatever its timeout, so a participant that tried while the
    store was down would find its restart (and re-seed it) up to a second late, past the newcomers' wait.

    Args:
        host: the store's host name or address.
        port: the store's port.
        timeout: how long the connect may take.

    Raises:
        OSError: nothing accepts there now (``ConnectionRefusedError`` at once for a closed port), or the
            connect took longer than `timeout`.
    """
    with socket.create_connection((host, port), timeout=max(timeout.total_seconds(), 0.001)):
        pass


def format_address(host: str, port: int) -> str:
    """``"host:port"`` (IPv6 hosts in brackets), the inverse of `parse_address`."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def connect(host: str, port: int, *, timeout: timedelta) -> dist.Store:
    """A client of the store at `host`:`port`; ElasticError naming the address when it is not reachable
    within `timeout` (every later operation is bounded by `timeout` too)."""
    try:
        return dist.TCPStore(host, port, is_master=False, timeout=timeout, wait_for_workers=False)
    except (RuntimeError, OSError) as exc:
        msg = (
            f"elastic: cannot reach the rendezvous store at {format_address(host, port)} within "
            f"{timeout.total_seconds():g} s ({exc}); start it with `python -m elastic.store --host {host} "
            f"--port {port}` or check {RDZV_ENV}"
        )
        raise ElasticError(msg) from exc


def serve(host: str, port: int, *, timeout: timedelta) -> dist.TCPStore:
    """Serve a store on `host`:`port` in this process (port 0: a free port, read it from ``.port``).

    The server lives as long as the returned object; `timeout` bounds the operations of its own client.
    """
    try:
        return dist.TCPStore(host, port, is_master=True, timeout=timeout, wait_for_workers=False)
    except (RuntimeError, OSError) as exc:
        msg = (
            f"elastic: cannot serve a rendezvous store on {format_address(host, port)} ({exc}); choose a "
            f"free port (or 0 for any) and an address of this machine"
        )
        raise ElasticError(msg) from exc
