"""Forked children do not hold their parent's connections.

A process that `elastic.run` trains in forks helpers: DataLoader workers (``fork`` is the default start
method on Linux up to Python 3.13), and whatever else the user's code starts with ``multiprocessing`` or
``os.fork``. A forked child inherits every file descriptor of its parent, gloo's TCP connections to the
peers and the store client's connection included. When the training process is SIGKILLed, the kernel
closes only its own references: the connections stay open in the children, so the survivors, blocked in a
collective with the dead worker, see no EOF until the children exit too (a DataLoader worker checks its
parent every 5 s, `torch.utils.data._utils.MP_STATUS_CHECK_INTERVAL`). Recovery then takes 5 s instead of
a few milliseconds.

`install` registers an at-fork hook (`os.register_at_fork`, ``after_in_child``) that, in every child forked
from then on, releases the inherited TCP sockets:

- What: every file descriptor above 2 that is an ``AF_INET`` or ``AF_INET6`` ``SOCK_STREAM`` socket,
  connected or listening. It is found by listing ``/proc/self/fd`` (``/dev/fd`` elsewhere), `os.fstat`
  (``S_ISSOCK``), and the socket's family and type (``getsockopt``), read through a `socket.socket` that
  is detached again, never closed. Left alone: standard streams (fds 0-2, whatever they are), ``AF_UNIX``
  sockets, pipes, UDP sockets, files: ``multiprocessing`` talks to its children over pipes and ``AF_UNIX``
  sockets, and torch shares tensors' file descriptors over ``AF_UNIX`` sockets.
- How: the descriptor is replaced, with ``dup2``, by one on ``/dev/null`` (close-on-exec), rather than
  closed. Releasing it drops only the child's reference to the connection (the open file description,
  shared with the parent, lives on in the parent; nothing is shut down, so the parent's connection is
  untouched). Keeping the number occupied means an object of the parent's that the child still holds (a
  Python `socket.socket`, gloo's pairs, the store client) can never act on a descriptor that the child
  opened later under the same number: it reads EOF, its socket calls fail (``ENOTSOCK``), and closing it
  closes the placeholder.
- Why it is safe: the children of a training process never use their parent's gloo and store connections
  (their threads did not survive the fork; bytes written to a connection by two processes would interleave
  anyway). A child that must talk over TCP opens its own connection; one that expects to keep using a TCP
  socket its parent made before forking (rare: a pre-forking server) cannot once `run` was called.
- It never raises in the child (a failure is logged at debug level and the fd is left as it was), and it
  costs one ``fstat`` per descriptor plus a few ``getsockopt`` per socket (0.3 ms for 200 descriptors
  here), so a DataLoader forking several workers does not notice it.

Which forks run it: ``os.fork`` and everything built on it in Python (``multiprocessing``'s ``fork``
context, and therefore DataLoader workers, whose default it is on Linux), and `subprocess` with a
``preexec_fn`` (there a TCP socket in ``pass_fds`` arrives as ``/dev/null``). Where the child execs a new
program the hook is not needed: ``subprocess`` closes all descriptors but ``pass_fds`` (``close_fds=True``),
``multiprocessing``'s ``spawn`` and ``forkserver`` start fresh interpreters the same way. That matters,
because only the store client's socket is close-on-exec: gloo's pairs and listener are not (checked on
torch 2.13), so a child forked by C code (which runs no Python at-fork hook) holds them, across an exec
too; the hook cannot reach those.

Why an at-fork hook rather than killing the dead worker's children: `elastic.spawn` could kill a dead
worker's process group, but under torchrun (the multi-machine setup) nobody on the survivors' side can,
and a child's parent-death signal (``PR_SET_PDEATHSIG``) would kill user processes that may have reasons
to outlive a step, and fires when the forking *thread* exits. Releasing the descriptors in the child
makes the kernel deliver EOF to the peers the moment the training process dies, whoever started it, and
changes nothing else about the children.
"""

from __future__ import annotations

import logging
import os
import socket
import stat
import threading

__all__ = ["install"]

log = logging.getLogger("elastic")

_TCP_FAMILIES = (socket.AF_INET, socket.AF_INET6)
_lock = threading.Lock()
_installed = False


def install() -> None:
    """Make every child forked from now on release the TCP sockets it inherits (idempotent).

    See the module docstring for what is released and why. Does nothing where `os.register_at_fork` does
    not exist (Windows, which does not fork).
    """
    global _installed
    with _lock:
        if _installed or not hasattr(os, "register_at_fork"):
            return
        os.register_at_fork(after_in_child=_release_inherited_connections)
        _installed = True


def _fd_dir() -> str | None:
    for path in ("/proc/self/fd", "/dev/fd"):
        if os.path.isdir(path):
            return path
    return None


def _is_tcp(fd: int) -> bool:
    """Whether `fd` is an AF_INET/AF_INET6 stream socket; the descriptor is never closed."""
    if not stat.S_ISSOCK(os.fstat(fd).st_mode):
        return False
    sock = socket.socket(fileno=fd)
    try:
        return sock.family in _TCP_FAMILIES and sock.type == socket.SOCK_STREAM
    finally:
        sock.detach()


def tcp_fds() -> list[int]:
    """This process's descriptors above 2 that are TCP sockets (AF_INET/AF_INET6 stream).

    Returns:
        The descriptors, in increasing order; empty where no descriptor directory can be listed.
    """
    where = _fd_dir()
    if where is None:
        return []
    found = []
    for name in os.listdir(where):
        fd = int(name)
        if fd <= 2:
            continue
        try:
            if _is_tcp(fd):
                found.append(fd)
        except Exception:  # the listing's own descriptor, closed since; a socket getsockopt cannot read
            continue
    return sorted(found)


def _release_inherited_connections() -> None:
    """At-fork hook, in the child: replace each inherited TCP socket by /dev/null. Never raises."""
    try:
        fds = tcp_fds()
        if not fds:
            return
        try:
            null = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
        except OSError:  # no /dev/null: close them, the fd numbers may be reused
            null = -1
        try:
            for fd in fds:
                try:
                    if null >= 0:
                        os.dup2(null, fd, inheritable=False)
                    else:
                        os.close(fd)
                except OSError:
                    log.debug("forked child %d: could not release fd %d", os.getpid(), fd, exc_info=True)
        finally:
            if null >= 0:
                os.close(null)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("forked child %d released %d inherited TCP sockets: %s", os.getpid(), len(fds), fds)
    except Exception:
        log.debug("forked child %d: releasing inherited TCP sockets failed", os.getpid(), exc_info=True)
