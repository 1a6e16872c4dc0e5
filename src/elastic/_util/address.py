"""Where a source listens for its receivers' connections: the address its peers reach gloo at.

gloo binds each process's connections to ``GLOO_SOCKET_IFNAME``'s interface when it is set, else to the
address its hostname resolves to (falling back to loopback). Peers that formed a gloo group with this
process reach it there, so that is where `TcpTransport` listens too; `listen_address` gives the rule.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import os
import socket
import struct
from typing import Any

import torch.distributed as dist

__all__ = ["listen_address"]

_SIOCGIFADDR = 0x8915


def _interface_address(name: str) -> str:
    """The IPv4 address of network interface `name`, else its first global IPv6 address.

    Raises `OSError` naming the interface when it has neither."""
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        packed = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        return socket.inet_ntoa(packed[20:24])
    with contextlib.suppress(OSError), open("/proc/net/if_inet6") as f:
        for line in f:
            fields = line.split()
            if len(fields) >= 6 and fields[5] == name and fields[3] == "00":  # scope 00: global
                return str(ipaddress.IPv6Address(bytes.fromhex(fields[0])))
    msg = (
        f"GLOO_SOCKET_IFNAME names the interface {name!r}, which has no IPv4 (nor global IPv6) address "
        "on this host; set GLOO_SOCKET_IFNAME to the interface the hosts reach each other on"
    )
    raise OSError(msg)


def _bindable(address: str) -> bool:
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind((address, 0))
    except OSError:
        return False
    return True


def _hostname_address(hostname: str) -> str | None:
    """The first address `hostname` resolves to that is not a loopback one and that this host can bind
    (gloo's rule, without its loopback fallback), or None."""
    try:
        infos = socket.getaddrinfo(hostname, None, type=socket.SOCK_STREAM)
    except OSError:
        return None
    for info in infos:
        address = str(info[4][0])
        with contextlib.suppress(ValueError):
            if ipaddress.ip_address(address.split("%")[0]).is_loopback:
                continue
        if _bindable(address):
            return address
    return None


def _store_host(group: Any) -> str | None:
    """The host of the group's TCP store (under any prefix stores), else ``MASTER_ADDR``, else None."""
    try:
        store = dist.distributed_c10d._get_process_group_store(group or dist.group.WORLD)  # type: ignore[arg-type]
        store = getattr(store, "_underlying_non_prefix_store", store)
        host = getattr(store, "host", None)
    except Exception:  # no group, or a torch without these private helpers
        host = None
    return str(host) if host else os.environ.get("MASTER_ADDR") or None


def _route_address(host: str | None) -> str:
    """The local address this host's routes use to reach `host` (no packet is sent), else loopback."""
    if host:
        with contextlib.suppress(OSError):
            info = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
            with socket.socket(info[0], socket.SOCK_DGRAM) as probe:
                probe.connect(info[4])
                return str(probe.getsockname()[0])
    return "127.0.0.1"


_found: dict[tuple[str, str | None], str | None] = {}


def listen_address(group: Any = None, *, interfaces: str | None = None) -> str:
    """The address a source listens on: the one its peers reach gloo at.

    gloo binds to ``GLOO_SOCKET_IFNAME``'s interface when it is set (the first one named), else to the
    address the hostname resolves to. So: that interface's IPv4 address (else its global IPv6 one); else
    the hostname's first address that is not a loopback one and can be bound; else (a hostname that
    resolves to a loopback address, as ``/etc/hosts`` often maps it, or not at all) the local address of
    the route to the group's store host (``MASTER_ADDR`` without a TCP store), which is where peers on
    other hosts reach this one; loopback when there is none. Looked up once per setting.

    Args:
        group: the process group whose store host the last rule uses (None: the default group).
        interfaces: what ``GLOO_SOCKET_IFNAME`` would say (None: the variable; "": no interface).

    Returns:
        An IPv4 or IPv6 address, as text.

    Raises:
        OSError: ``GLOO_SOCKET_IFNAME`` names an interface without an address here.
    """
    names = (os.environ.get("GLOO_SOCKET_IFNAME", "") if interfaces is None else interfaces).strip()
    if names:
        name = names.split(",")[0].strip()
        if ("interface", name) not in _found:  # a failure is not kept: the next plan looks again
            _found["interface", name] = _interface_address(name)
        return str(_found["interface", name])
    hostname = socket.gethostname()
    if ("hostname", hostname) not in _found:
        _found["hostname", hostname] = _hostname_address(hostname)
    found = _found["hostname", hostname]
    if found is not None:
        return found
    store = _store_host(group)
    if ("route", store) not in _found:
        _found["route", store] = _route_address(store)
    return str(_found["route", store])
