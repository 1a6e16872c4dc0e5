"""Separate hosts on one machine, as a real cluster has them: a network namespace per host behind a
bridge, every process in its own pid namespace too (``unshare --pid --fork``), so that `elastic.run`'s
same-host liveness shortcut cannot apply and only heartbeats judge liveness. Root only (CI is root).

`Hosts(n)` makes hosts 0..n-1 (10.<net>.0.<k+1>/24); `popen(k, argv)` starts a process on host k (its
gloo bound to the host's interface); `cut(k)` unplugs host k from the bridge, a silent cut: its packets
and those sent to it are dropped, nobody gets a reset; `heal(k)` plugs it back. Only ``ip`` is needed.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from typing import Any


def why_not() -> str | None:
    """Why namespaced hosts cannot be made here (None: they can)."""
    if not sys.platform.startswith("linux"):
        return "network namespaces are Linux's"
    if os.geteuid() != 0:
        return "making network namespaces needs root (CI runs as root)"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed"
    name = f"elchk{os.getpid() % 100000}"
    probe = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"`ip netns add` failed: {probe.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


class Hosts:
    """`n` hosts behind one bridge; a context manager that removes them (and kills their processes)."""

    def __init__(self, n: int) -> None:
        tag = os.getpid() % 10000
        self.net = 10 + tag % 200
        self.bridge = f"elb{tag}"
        self.names = [f"el{tag}h{k}" for k in range(n)]
        self.ports = [f"el{tag}p{k}" for k in range(n)]  # the bridge's side of each host's cable
        self.procs: list[subprocess.Popen[Any]] = []
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("link", "set", self.bridge, "up")
        for k, (ns, port) in enumerate(zip(self.names, self.ports)):
            _ip("netns", "add", ns)
            _ip("link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("link", "set", port, "master", self.bridge)
            _ip("link", "set", port, "up")
            _ip("-n", ns, "addr", "add", f"{self.address(k)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")

    def address(self, k: int) -> str:
        return f"10.{self.net}.0.{k + 1}"

    def popen(self, k: int, argv: Sequence[str], env: dict[str, str] | None = None, **kw: Any) -> Any:
        """Start `argv` on host k, in a pid namespace of its own."""
        full = {**os.environ, **(env or {}), "GLOO_SOCKET_IFNAME": "eth0"}
        cmd = ["ip", "netns", "exec", self.names[k], "unshare", "--pid", "--fork", "--kill-child", *argv]
        proc = subprocess.Popen(cmd, env=full, **kw)
        self.procs.append(proc)
        return proc

    def cut(self, k: int) -> None:
        """Unplug host k: a silent cut (no resets, nothing arrives either way)."""
        _ip("link", "set", self.ports[k], "nomaster")

    def heal(self, k: int) -> None:
        _ip("link", "set", self.ports[k], "master", self.bridge)

    def __enter__(self) -> Hosts:
        return self

    def __exit__(self, *exc: object) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            with contextlib.suppress(Exception):
                proc.wait(timeout=10)
        for ns in self.names:
            subprocess.run(["ip", "netns", "pids", ns], capture_output=True)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        for port in self.ports:
            subprocess.run(["ip", "link", "del", port], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
