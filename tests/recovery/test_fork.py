"""Forked children do not hold their parent's TCP connections (`elastic.recovery.fork`).

The unit checks run in fresh interpreters (the at-fork hook stays registered for the life of a process,
so it is never installed in pytest's): a parent connects, installs the hook or not, forks, and is
SIGKILLed; the test's listener sees EOF at once only if the child dropped the connection. The last check
is the real scenario: ``DataLoader(num_workers=2)`` in every worker of ``elastic.spawn(...,
restart="worker")``, one worker SIGKILLed mid-epoch while its loader workers live on.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

import elastic
from elastic._util.procs import running

pytestmark = pytest.mark.skipif(not Path("/proc/self/fd").exists(), reason="Linux: forks, reads /proc")

ENV = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
HANG_GUARD = 10.0  # seconds: the child sleeps far longer, so no EOF within it means the child holds it


def python(code: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout, env=ENV
    )


def kill(pid: int, marker: bytes) -> None:
    """SIGKILL `pid` if it still runs and its command line holds `marker` (never a reused pid's process)."""
    with contextlib.suppress(OSError):
        if running(pid) and marker in (Path("/proc") / str(pid) / "cmdline").read_bytes():
            os.kill(pid, signal.SIGKILL)


# --------------------------------------------------------------------------------------------------------
# A SIGKILLed parent's connection closes while its forked child lives

PARENT = """
import multiprocessing, os, signal, socket, sys, time
from elastic.recovery import fork as _fork

conn = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
if sys.argv[2] == "1":
    _fork.install()
    _fork.install()  # idempotent: one hook
child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(60,), daemon=False)
child.start()
conn.sendall(f"{child.pid}\\n".encode())
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.parametrize("installed", [True, False])
def test_a_killed_parents_connection_closes_while_its_forked_child_lives(installed: bool) -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.settimeout(60)
        port = server.getsockname()[1]
        parent = subprocess.Popen(
            [sys.executable, "-c", PARENT, str(port), "1" if installed else "0"],
            env=ENV,
            stderr=subprocess.PIPE,
            text=True,
        )
        child = None
        try:
            conn, _ = server.accept()
            with conn:
                conn.settimeout(HANG_GUARD if installed else 1.0)
                got = b""
                while b"\n" not in got:
                    got += conn.recv(64)
                child = int(got.split(b"\n")[0])
                assert parent.wait(timeout=60) == -signal.SIGKILL, (
                    parent.stderr.read() if parent.stderr else ""
                )
                try:
                    eof = conn.recv(64) == b""
                except TimeoutError:
                    eof = False
                assert running(child)  # the child still lives: only the parent's death closed it
                assert eof is installed
        finally:
            if parent.poll() is None:
                parent.kill()
            parent.wait()
            if parent.stderr:
                parent.stderr.close()
            if child is not None:
                kill(child, b"_fork.install()")


# --------------------------------------------------------------------------------------------------------
# What the child keeps: standard streams, AF_UNIX sockets, pipes, UDP, files; the parent keeps everything

KINDS = """
import json, multiprocessing, os, socket, stat, sys
from elastic.recovery import fork as _fork

tcp = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
listener = socket.create_server(("127.0.0.1", 0))
tcp6 = None
if socket.has_ipv6:
    try:
        tcp6 = socket.create_server(("::1", 0), family=socket.AF_INET6)
    except OSError:
        pass
udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
unix_parent, unix_child = socket.socketpair()
read_end, write_end = os.pipe()
file = open(sys.executable, "rb")
before = _fork.tcp_fds()
_fork.install()


def kind(fd):
    mode = os.fstat(fd).st_mode
    return "socket" if stat.S_ISSOCK(mode) else "chr" if stat.S_ISCHR(mode) else "fifo" if stat.S_ISFIFO(
        mode
    ) else "file" if stat.S_ISREG(mode) else "other"


def child():
    out = {name: kind(s.fileno()) for name, s in (("tcp", tcp), ("listener", listener), ("udp", udp))}
    out["tcp6"] = kind(tcp6.fileno()) if tcp6 else None
    out["file"] = kind(file.fileno())
    out["tcp_fds"] = _fork.tcp_fds()
    try:
        tcp.send(b"from the child")
        out["send"] = "sent"
    except OSError as exc:
        out["send"] = type(exc).__name__
    os.write(write_end, b"pipe works")
    unix_child.sendall(json.dumps(out).encode() + b"\\n")


p = multiprocessing.get_context("fork").Process(target=child)
p.start()
p.join(30)
seen = json.loads(unix_parent.makefile().readline())
seen["pipe"] = os.read(read_end, 64).decode()
seen["exitcode"] = p.exitcode
seen["before"] = before
seen["parent_tcp_fds"] = _fork.tcp_fds()
tcp.sendall(b"the parent's connection still works")
tcp.close()
with socket.create_connection(listener.getsockname()), listener.accept()[0]:
    seen["parent_listener"] = "accepts"
print(json.dumps(seen))
"""


def test_the_child_releases_tcp_sockets_only_and_the_parent_keeps_its_own() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.settimeout(60)
        proc = subprocess.Popen(
            [sys.executable, "-c", KINDS, str(server.getsockname()[1])],
            env=ENV,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            conn, _ = server.accept()
            with conn:
                conn.settimeout(60)
                received = b""
                while chunk := conn.recv(4096):
                    received += chunk
            out, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert proc.returncode == 0, err
    seen = json.loads(out)
    assert received == b"the parent's connection still works"  # the child's send went nowhere
    assert seen["exitcode"] == 0
    # the child: TCP sockets (connected and listening, IPv4 and IPv6) became /dev/null; the rest stayed
    assert seen["tcp"] == seen["listener"] == "chr"
    assert seen["tcp6"] in ("chr", None)
    assert seen["tcp_fds"] == []
    assert seen["send"] == "OSError"  # ENOTSOCK: a stale socket object fails, it reaches nothing
    assert seen["udp"] == "socket"
    assert seen["file"] == "file"
    assert seen["pipe"] == "pipe works"  # and the AF_UNIX pair carried this report
    # the parent: unchanged
    assert len(seen["before"]) >= 2 and seen["parent_tcp_fds"] == seen["before"]
    assert seen["parent_listener"] == "accepts"


DATALOADER = """
import json, socket
import torch
from torch.utils.data import DataLoader, Dataset
from elastic.recovery import fork as _fork

listener = socket.create_server(("127.0.0.1", 0))
conn = socket.create_connection(listener.getsockname())
_fork.install()


class Probe(Dataset):
    def __len__(self):
        return 12

    def __getitem__(self, i):
        return torch.tensor([i, len(_fork.tcp_fds())])


for persistent in (False, True):
    loader = DataLoader(
        Probe(), batch_size=3, num_workers=2, multiprocessing_context="fork", persistent_workers=persistent
    )
    epochs = [torch.cat(list(loader)).tolist() for _ in range(2)]
    print(json.dumps({"epochs": epochs, "parent": len(_fork.tcp_fds())}))
"""


def test_a_dataloader_with_workers_works_and_its_workers_hold_no_tcp_socket() -> None:
    proc = python(DATALOADER)
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(lines) == 2
    for seen in lines:
        assert seen["parent"] == 2  # the listener and the connection: the parent keeps them
        for epoch in seen["epochs"]:
            assert [i for i, _ in epoch] == list(range(12))
            assert [n for _, n in epoch] == [0] * 12  # no TCP socket in any loader worker


# --------------------------------------------------------------------------------------------------------
# The real scenario: a worker SIGKILLed while its DataLoader workers live

KILL_AT = 8


@elastic.elastic_state(tenure=lambda s: s.step)
@attrs.define
class Trained:
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    step: int = 0
    killed: bool = False


def note_loader_worker(root: str, slot: int, loader: int, _worker_id: int) -> None:
    """worker_init_fn: each DataLoader worker leaves its pid."""
    (Path(root) / f"loader-{slot}-{loader}-{os.getpid()}").touch()


def loader_pids(root: str, slot: int, loader: int) -> list[int]:
    return sorted(int(p.name.rsplit("-", 1)[1]) for p in Path(root).glob(f"loader-{slot}-{loader}-*"))


def trainer(root: str) -> None:
    slot = int(os.environ["ELASTIC_SLOT"])
    doomed = slot == 2
    if doomed:  # its loader workers outlive it far longer than torch's 5 s parent check
        import torch.utils.data._utils.worker as loader_worker

        loader_worker.MP_STATUS_CHECK_INTERVAL = 600.0
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    state = Trained(model, torch.optim.SGD(model.parameters(), lr=0.01))
    data = TensorDataset(torch.randn(256, 4), torch.randn(256, 1))
    rec: dict[str, Any] = {"after_kill": None}
    loaders = iter(range(1_000_000))

    def train(s: Trained, world: Any) -> None:
        start = s.step
        while not (s.killed and s.step >= KILL_AT + 5):
            n = next(loaders)
            init = functools.partial(note_loader_worker, root, slot, n)
            loader = DataLoader(
                data, batch_size=8, num_workers=2, multiprocessing_context="fork", worker_init_fn=init
            )
            for x, y in loader:
                world.check()
                if not s.killed and s.step >= KILL_AT and s.step - start >= 3 and world.size == 3:
                    s.killed = True
                    if doomed:
                        while len(loader_pids(root, slot, n)) < 2:
                            time.sleep(0.01)
                        (Path(root) / "doomed-loader").write_text(str(n))
                        os.kill(os.getpid(), signal.SIGKILL)
                s.optimizer.zero_grad()
                torch.nn.functional.mse_loss(s.model(x), y).backward()
                for p in s.model.parameters():
                    dist.all_reduce(p.grad)
                s.optimizer.step()
                s.step += 1
                if s.killed and rec["after_kill"] is None:  # the first step completed after the kill
                    pids = loader_pids(root, 2, int((Path(root) / "doomed-loader").read_text()))
                    rec["after_kill"] = {"size": world.size, "alive": [running(p) for p in pids]}
                if s.killed and s.step >= KILL_AT + 5:
                    break
                time.sleep(0.01)

    elastic.run(train, state, timeout=300)
    (Path(root) / f"survivor-{slot}.json").write_text(json.dumps(rec))
    if slot == 0:  # both survivors looked: end the orphans, which hold the killed worker's output pipes
        for pid in loader_pids(root, 2, int((Path(root) / "doomed-loader").read_text())):
            kill(pid, b"_worker_main")


def test_survivors_go_on_while_a_killed_workers_dataloader_workers_live(tmp_path: Path) -> None:
    """Without the hook the survivors would wait for the killed worker's loader workers (here 600 s) or for
    gloo's timeout (300 s): spawn's deadline (a hang guard) would end the run first."""
    try:
        with pytest.raises(elastic.WorkerError, match="slot 2 exited with signal SIGKILL"):
            elastic.spawn(trainer, 3, args=(str(tmp_path),), restart="worker", timeout=90)
    finally:
        for path in tmp_path.glob("loader-2-*"):  # the killed worker's, which outlive it
            kill(int(path.name.rsplit("-", 1)[1]), b"_worker_main")
    for slot in (0, 1):
        after = json.loads((tmp_path / f"survivor-{slot}.json").read_text())["after_kill"]
        assert after["size"] == 2
        assert after["alive"] == [True, True]  # the survivors did not wait for them
