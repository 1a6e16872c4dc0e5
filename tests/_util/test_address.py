"""Where a TCP transport's source listens: ``GLOO_SOCKET_IFNAME``'s interface, else the hostname's address
(not a loopback one, and one this host can bind), else the route to the store's host."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

import pytest

import elastic._util.address as address


@pytest.fixture(autouse=True)
def _fresh(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(address, "_found", {})
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    yield


def _local_ipv4() -> str | None:
    """A non-loopback IPv4 address of this host (None: it has none)."""
    for _, name in socket.if_nameindex():
        try:
            found = address._interface_address(name)
        except OSError:
            continue
        if ":" not in found and not found.startswith("127."):
            return found
    return None


def test_gloo_socket_ifname_names_the_interface(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    assert address.listen_address() == "127.0.0.1"
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", " lo , elnosuch0")  # gloo's list: the first one
    assert address.listen_address() == "127.0.0.1"
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "elnosuch0")
    with pytest.raises(
        OSError, match="GLOO_SOCKET_IFNAME names the interface 'elnosuch0', which has no IPv4"
    ):
        address.listen_address()


def test_the_hostname_address_when_it_is_not_loopback_and_can_be_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    local = _local_ipv4()
    if local is None:
        pytest.skip("this host has no non-loopback IPv4 address")
    resolved: dict[str, list[str]] = {
        "elhost-a": ["127.0.1.1", "203.0.113.9", local],  # loopback, not this host's, this host's
        "elhost-b": ["127.0.1.1"],
    }
    real = socket.getaddrinfo

    def fake(host: Any, *args: Any, **kwargs: Any) -> Any:
        if host in resolved:
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, 0)) for a in resolved[host]]
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", fake)
    monkeypatch.setattr(socket, "gethostname", lambda: "elhost-a")
    assert address.listen_address() == local
    # a hostname that resolves to loopback only: the route to the store's host
    monkeypatch.setattr(socket, "gethostname", lambda: "elhost-b")
    monkeypatch.setattr(address, "_store_host", lambda group: local)
    assert address.listen_address() == local
    monkeypatch.setattr(address, "_store_host", lambda group: "127.0.0.1")
    assert address.listen_address() == "127.0.0.1"
    monkeypatch.setattr(address, "_store_host", lambda group: None)  # no store, no MASTER_ADDR
    assert address.listen_address() == "127.0.0.1"


def test_the_store_host_is_found_under_prefix_stores_or_in_master_addr(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("MASTER_ADDR", "10.11.12.13")
    assert address._store_host(None) == "10.11.12.13"  # no group here
    monkeypatch.delenv("MASTER_ADDR")
    assert address._store_host(None) is None
    assert address._route_address(None) == "127.0.0.1"
    assert address._route_address("127.0.0.1") == "127.0.0.1"
