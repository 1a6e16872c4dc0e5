"""Two workers start with different training states; `state.sync()` elects the most tenured and gives it
to both. Run: python examples/quickstart.py"""

from __future__ import annotations

import os
import socket

import attrs
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import elastic


@elastic.elastic_state(tenure=lambda s: s.step)
@attrs.define
class TrainState(elastic.StateMethods):  # the base lets mypy and pyright see state.sync() and the rest
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    step: int = 0
    losses: list = attrs.field(factory=list)
    scratch: dict = elastic.local(factory=dict)  # per worker: never synced, never saved


def worker(rank: int, world_size: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    torch.manual_seed(rank)  # different initial weights on each worker
    model = torch.nn.Linear(4, 1)
    state = TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for _ in range(3 * rank):  # worker 1 has trained 3 steps, worker 0 none (a fresh replacement)
        loss = model(torch.randn(8, 4)).pow(2).mean()
        state.optimizer.zero_grad()
        loss.backward()
        state.optimizer.step()
        state.step += 1
        state.losses.append(round(loss.item(), 4))
    print(f"[worker {rank}] before sync: step={state.step} bias={model.bias.item():+.4f}", flush=True)
    report = state.sync()  # the same as elastic.sync(state)
    print(
        f"[worker {rank}] elected rank {report.src} (tenure {report.tenure}); after sync: step={state.step} "
        f"bias={model.bias.item():+.4f} losses={state.losses} ({report.tensor_bytes} tensor bytes moved)",
        flush=True,
    )
    dist.destroy_process_group()


def main() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(2, port), nprocs=2, join=True)


if __name__ == "__main__":
    main()
