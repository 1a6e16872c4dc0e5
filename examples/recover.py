"""In-process recovery: a worker is killed mid-training, the others go on, a replacement joins.

Three workers train a small MLP with DistributedDataParallel under `elastic.run`, started by
`elastic.spawn(restart="worker")`, which serves the rendezvous store in this process and restarts only a
worker that dies. At step `--kill-at` worker 2 kills itself (SIGKILL). The two survivors notice at their
next all-reduce, re-form the group within about a second and go on from the step they were at, with their
weights still in memory; the replacement starts a few seconds later, joins at the survivors' next
`world.check()` and receives the state. At the end every worker prints a digest of its weights, and this
script checks that they are equal.

    python examples/recover.py [--steps 80] [--kill-at 30]
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import signal
import sys
import time
from typing import Any

import attrs
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset

import elastic

log = logging.getLogger("recover")

IN, OUT, BATCH, DATA = 16, 4, 32, 2**20


@elastic.elastic_state(tenure=lambda s: s.step)
@attrs.define
class TrainState:
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    step: int = 0
    losses: list = attrs.field(factory=list)
    sampler: Any = None  # the place for the data's progress (an elastic.ElasticSampler), synced like the rest


class Synthetic(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """`DATA` samples: an input generated from its index, its target by a fixed linear map."""

    w = torch.randn(IN, OUT, generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return DATA

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(IN, generator=torch.Generator().manual_seed(i))
        return x, x @ self.w


def make_state() -> TrainState:
    model = torch.nn.Sequential(torch.nn.Linear(IN, 64), torch.nn.Tanh(), torch.nn.Linear(64, OUT))
    sampler = elastic.ElasticSampler(Synthetic(), batch_size=BATCH)  # every sample once, whatever the world
    return TrainState(model, torch.optim.Adam(model.parameters(), lr=5e-3), sampler=sampler)


def fingerprint(model: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for t in model.state_dict().values():
        digest.update(bytes(t.detach().cpu().flatten().view(torch.uint8).tolist()))  # no NumPy needed
    return digest.hexdigest()[:8]


def train(state: TrainState, world: elastic.World, steps: int, kill_at: int) -> dict[str, Any]:
    slot = int(os.environ["ELASTIC_SLOT"])
    life = int(os.environ["ELASTIC_SLOT_RESTARTS"])
    log.info(
        "worker %d (life %d): generation %d starts at step %d as rank %d of %d, weights %s",
        slot,
        life,
        world.generation,
        state.step,
        world.rank,
        world.size,
        fingerprint(state.model),
    )
    ddp = DistributedDataParallel(state.model)  # bound to this generation's group: built in fn
    data = iter(DataLoader(Synthetic(), batch_size=BATCH, sampler=state.sampler))  # this world's share
    # Train to `steps`, and then on until the replacement is back and 10 steps were done with it. `ran` is
    # the same on every rank: all members start a generation together.
    ran = 0
    while state.step < 20 * steps and not (state.step >= steps and world.size == 3 and ran >= 10):
        world.check()  # a worker waiting to join: every rank leaves here, at the same step
        if slot == 2 and life == 0 and state.step >= kill_at and world.size == 3:
            log.info("step %d: killing this worker (SIGKILL)", state.step)
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = next(data)
        loss = F.mse_loss(ddp(x), y)
        state.optimizer.zero_grad()
        loss.backward()  # DDP's all-reduce: where the survivors notice the kill
        state.optimizer.step()
        state.sampler.advance()  # the step's samples are consumed
        state.step += 1
        ran += 1
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean)  # the loss of the whole batch, the same on every rank
        state.losses.append(round(mean.item() / world.size, 5))
        if state.step % 10 == 0:
            log.info("step %d: loss %.4f (%d workers)", state.step, state.losses[-1], world.size)
        time.sleep(0.05)  # a step of a real job takes longer than this toy's
    elastic.verify(state)  # raises DivergenceError if any two workers differ
    digest = fingerprint(state.model)
    log.info("done: step %d, final loss %.5f, weights %s", state.step, state.losses[-1], digest)
    return {"slot": slot, "life": life, "step": state.step, "weights": digest}


def worker(steps: int, kill_at: int) -> Any:
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    torch.manual_seed(int(os.environ["ELASTIC_SLOT"]))  # different initial weights: the election decides
    return elastic.run(lambda s, w: train(s, w, steps, kill_at), make_state(), timeout=30)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--kill-at", type=int, default=30)
    args = parser.parse_args()
    started = time.monotonic()
    results = elastic.spawn(
        worker, 3, args=(args.steps, args.kill_at), restart="worker", max_restarts=1, timeout=600
    )
    digests = sorted({r["weights"] for r in results})
    lives = ", ".join(f"worker {r['slot']} life {r['life']}" for r in results)
    verdict = f"equal on every worker: {digests[0]}" if len(digests) == 1 else f"DIFFER: {digests}"
    print(f"finished in {time.monotonic() - started:.1f} s at step {results[0]['step']} ({lives})")
    print(f"final weights {verdict}")
    return 0 if len(digests) == 1 else 1


if __name__ == "__main__":
    sys.exit(main())
