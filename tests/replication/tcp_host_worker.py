"""One rank on a simulated host (tests/netns.py): ``python tcp_host_worker.py RANK MASTER OUT``.

Two ranks, one per host, each in its own network and pid namespace: `elastic.sync` with the default
transport moves rank 0's module and Adam state to rank 1 (cross-memory reads and the shared-memory ring
cannot reach another host, so the TCP transport carries it). Writes ``OUT/<rank>.json``: whether the values
are rank 0's, bit for bit, in place, how many streams the TCP transport served or read, the address the
source listened on and the warnings logged.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import attrs
import torch
import torch.distributed as dist

import elastic
import elastic.replication.transport.tcp as tcp


@elastic.elastic_state(tenure="step")
@attrs.define
class Trainer:
    step: int
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer


def trained(steps: int) -> Trainer:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(512, 512) for _ in range(4)))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(steps):
        optimizer.zero_grad()
        model(torch.randn(8, 512)).pow(2).mean().backward()
        optimizer.step()
    return Trainer(step=steps, model=model, optimizer=optimizer)


def values(state: Trainer) -> list[list[float]]:
    sd = state.optimizer.state_dict()["state"]
    tensors = list(state.model.state_dict().values())
    tensors += [v for k in sorted(sd) for _, v in sorted(sd[k].items()) if torch.is_tensor(v)]
    return [[*t.reshape(-1)[:64].tolist(), float(t.double().sum())] for t in tensors]


def main() -> None:
    rank, master, out = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
    host, port = master.rsplit(":", 1)
    os.environ.update(MASTER_ADDR=host, MASTER_PORT=port)
    warnings: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                warnings.append(record.getMessage())

    logging.getLogger("elastic").addHandler(Keep())
    counts = {"served": 0, "streams": 0}
    listened: list[Any] = []
    real_serving, real_stream = tcp._run_serving, tcp._receive_stream

    def serving(*args: Any, **kwargs: Any) -> None:
        counts["served"] += 1
        listened.append(args[4].address)
        real_serving(*args, **kwargs)

    def stream(*args: Any, **kwargs: Any) -> None:
        counts["streams"] += 1
        real_stream(*args, **kwargs)

    tcp._run_serving = serving  # type: ignore[assignment]
    tcp._receive_stream = stream  # type: ignore[assignment]
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60))
    try:
        state = trained(2 if rank == 0 else 0)
        before = [p.data_ptr() for p in state.model.parameters()]
        report = elastic.sync(state, timeout=30)
        result = {
            "src": report.src,
            "bytes": report.tensor_bytes,
            "equal": values(state) == values(trained(2)),
            "in place": [p.data_ptr() for p in state.model.parameters()] == before,
            "listen": listened[0][0] if listened else None,
            "warnings": warnings,
            **counts,
        }
        (out / f"{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
