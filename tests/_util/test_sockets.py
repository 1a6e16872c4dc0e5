"""`Sockets`: the TCP connections opened since it was made are shut down; older ones, the kept addresses'
and listening sockets stay usable. `connections` reads the kernel's tables."""

from __future__ import annotations

import socket
import sys

import pytest

from elastic._util.sockets import Sockets, _address, connections

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc (Linux)")


def _listener() -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(8)
    return s


def _pair(listener: socket.socket) -> tuple[socket.socket, socket.socket]:
    client = socket.create_connection(listener.getsockname())
    server, _ = listener.accept()
    return client, server


def test_addresses_of_the_kernel_tables() -> None:
    assert _address("0100007F:1F90") == ("127.0.0.1", 8080)
    assert _address("0000000000000000FFFF00000100007F:1F90") == ("127.0.0.1", 8080)  # v4-mapped
    assert _address("00000000000000000000000001000000:0016") == ("::1", 22)
    listener = _listener()
    client, server = _pair(listener)
    try:
        found = connections()
        inode = {
            s: int(os_link.removeprefix("socket:[").removesuffix("]"))
            for s, os_link in ((s, _link(s)) for s in (listener, client, server))
        }
        assert found[inode[listener]] is None  # listening
        assert found[inode[client]] == listener.getsockname()
        assert found[inode[server]] == client.getsockname()
    finally:
        for s in (client, server, listener):
            s.close()


def _link(s: socket.socket) -> str:
    import os

    return os.readlink(f"/proc/self/fd/{s.fileno()}")


def test_only_connections_opened_since_and_not_to_kept_addresses_are_shut_down() -> None:
    one, two = _listener(), _listener()
    old_client, old_server = _pair(one)
    sockets = Sockets(keep=[("localhost", two.getsockname()[1])])
    new_client, new_server = _pair(one)  # both ends opened since: shut down
    kept_client, kept_server = _pair(two)  # to a kept address: stays; its accepted end does not
    three = _listener()  # listening: stays
    everything = [one, two, three, old_client, old_server, new_client, new_server, kept_client, kept_server]
    try:
        assert sockets.shutdown() == 3
        old_client.sendall(b"x")
        assert old_server.recv(1) == b"x"  # older than `sockets`: untouched
        assert new_client.recv(1) == b"" and new_server.recv(1) == b""  # shut down both ways
        with pytest.raises(OSError):
            new_client.sendall(b"y")
        late_client, late_server = _pair(three)  # the listener still accepts
        everything += [late_client, late_server]
        assert sockets.shutdown() == 2  # and what opened since the first call
    finally:
        for s in everything:
            s.close()
