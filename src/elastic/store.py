"""``python -m elastic.store --host H --port P``: serve the rendezvous store of `elastic.run` for many
machines.

Start it on one host that every machine reaches, then on every machine
``ELASTIC_RDZV=H:P torchrun --standalone --nproc-per-node=K --max-restarts=R train.py``. It logs its
address and serves until SIGTERM or SIGINT (Ctrl-C), then exits with status 0.
"""

from __future__ import annotations

import argparse
import logging
import signal
import threading
from collections.abc import Sequence
from datetime import timedelta
from types import FrameType

from elastic.recovery.store import RDZV_ENV, format_address, serve

__all__ = ["main"]

log = logging.getLogger("elastic")


def main(argv: Sequence[str] | None = None) -> int:
    """Serve until SIGTERM/SIGINT; returns the exit status (0)."""
    parser = argparse.ArgumentParser(
        prog="python -m elastic.store", description="Serve the rendezvous store of elastic.run."
    )
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on (default: all, 0.0.0.0)")
    parser.add_argument("--port", type=int, default=29400, help="port (default 29400; 0: any free port)")
    parser.add_argument(
        "--timeout", type=float, default=60.0, help="seconds bounding the server's own operations"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s elastic.store: %(message)s")
    stop = threading.Event()
    received: list[int] = []

    def on_signal(signum: int, frame: FrameType | None) -> None:
        received.append(signum)
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        server = serve(args.host, args.port, timeout=timedelta(seconds=args.timeout))
        address = format_address(args.host, server.port)
        log.info("serving the rendezvous store at %s (workers: %s=%s)", address, RDZV_ENV, address)
        while not stop.wait(0.2):
            pass
        log.info("received %s, stopping", signal.Signals(received[0]).name)
        del server
        log.info("stopped serving %s", address)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
