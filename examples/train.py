"""Elastic data-parallel training that survives a killed worker, bit for bit.

A small MLP learns a fixed random linear map from synthetic data generated from a seed and the step, so
no download is needed and every run is reproducible. Workers start from different random weights; at
start `elastic.load` gives every worker the most tenured state in the group (memory or checkpoint); every
`--save-every` steps `elastic.save` writes an atomic checkpoint.

    python -m torch.distributed.run --standalone --nproc-per-node=2 --max-restarts=1 \\
        examples/train.py --steps 60 --save-every 20 --fail-at 25

`--fail-at STEP` makes one worker die at that step on the first attempt (torchrun restarts the group,
which resumes from the last checkpoint). `--ckpt` may contain `{node}` (torchrun's GROUP_RANK) for
node-local disks: checkpoints are then written with `scope="node"`, by the most tenured worker of every
node into that node's directory; or `{rank}`: `scope="rank"`, every worker writes its own directory.
`--fail-wipe` makes the dying worker delete its own directory first: the machine that replaces it starts
with an empty disk.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import shutil
import sys
from typing import Any, Literal

import attrs
import torch
import torch.distributed as dist

import elastic

log = logging.getLogger("train")


def rescale_lr(state: TrainState, report: elastic.SyncReport) -> None:
    """Linear LR scaling: keep the learning rate proportional to the number of workers."""
    if report.world_size != state.world_size:
        scale = report.world_size / state.world_size
        for group in state.optimizer.param_groups:
            group["lr"] *= scale
        log.info(
            "world size %d -> %d: learning rate x%.3g (now %.4g)",
            state.world_size,
            report.world_size,
            scale,
            state.optimizer.param_groups[0]["lr"],
        )
        state.world_size = report.world_size


@elastic.elastic_state(tenure=lambda s: s.step, on_sync=rescale_lr)
@attrs.define
class TrainState:
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    step: int = 0
    epoch: int = 0
    samples: int = 0
    world_size: int = 1  # the world size the learning rate is scaled for
    history: list = attrs.field(factory=list)  # the loss of every step


IN, OUT, BATCH, STEPS_PER_EPOCH = 16, 4, 32, 10


def make_state(seed: int, world_size: int) -> TrainState:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(IN, 64), torch.nn.Tanh(), torch.nn.Linear(64, OUT))
    optimizer = torch.optim.Adam(model.parameters(), lr=5e-3 * world_size)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=50, gamma=0.5)
    return TrainState(model, optimizer, scheduler, world_size=world_size)


def fingerprint(model: torch.nn.Module) -> str:
    """A short digest of the weights, to show in the log which state a worker holds."""
    digest = hashlib.sha256()
    for tensor in model.state_dict().values():
        digest.update(bytes(tensor.detach().contiguous().reshape(-1).view(torch.uint8).tolist()))
    return digest.hexdigest()[:8]


def batch(step: int, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This worker's shard of the global batch of `step` (the same data whatever the restarts)."""
    target = torch.Generator().manual_seed(1234)
    w = torch.randn(IN, OUT, generator=target)
    g = torch.Generator().manual_seed(10_000 + step)
    x = torch.randn(BATCH, IN, generator=g)
    y = x @ w + 0.01 * torch.randn(BATCH, OUT, generator=g)
    return x[rank::world_size], y[rank::world_size]


def train_step(state: TrainState, rank: int, world_size: int) -> float:
    x, y = batch(state.step, rank, world_size)
    state.optimizer.zero_grad()
    loss = torch.nn.functional.mse_loss(state.model(x), y)
    loss.backward()
    for p in state.model.parameters():  # data parallel: average the gradients
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad /= world_size
    state.optimizer.step()
    state.scheduler.step()
    global_loss = loss.detach().clone()
    dist.all_reduce(global_loss)
    state.step += 1
    state.samples += BATCH
    state.epoch = state.step // STEPS_PER_EPOCH
    state.history.append(round(global_loss.item() / world_size, 6))
    return state.history[-1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--save-every", type=int, default=20)
    p.add_argument("--ckpt", default="ckpt/", help="checkpoint root; may contain {rank} or {node}")
    p.add_argument("--fail-at", type=int, default=None, help="one worker dies at this step (first attempt)")
    p.add_argument("--fail-rank", type=int, default=None, help="which worker dies (default: the last)")
    p.add_argument("--fail-wipe", action="store_true", help="the dying worker deletes its node's --ckpt")
    p.add_argument("--keep", type=int, default=3)
    p.add_argument("--timeout", type=float, default=300, help="seconds any collective may wait for a peer")
    p.add_argument("--out", default=None, help="save the final state here (rank 0; every rank with {rank})")
    args = p.parse_args(argv)
    node_local = "{rank}" in args.ckpt or "{node}" in args.ckpt
    if args.fail_wipe and not node_local:
        p.error("--fail-wipe deletes a node-local checkpoint directory: --ckpt needs {rank} or {node}")

    elastic.init_process_group(timeout=args.timeout)  # torchrun-safe: never torch's directly
    rank, world_size = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    fmt = f"[rank {rank}] %(message)s"
    logging.basicConfig(level=logging.INFO, format=fmt, stream=sys.stdout, force=True)
    ckpt = args.ckpt.format(rank=rank, node=os.environ.get("GROUP_RANK", "0"))
    scope: Literal["rank", "node", "global"] = (
        "rank" if "{rank}" in args.ckpt else "node" if "{node}" in args.ckpt else "global"
    )

    # Every worker starts from its own random initialisation: the election decides what they train.
    state = make_state(seed=1000 * attempt + rank, world_size=world_size)
    own = fingerprint(state.model)
    report = elastic.load(state, ckpt)
    log.info(
        "attempt %d: elected rank %d, resuming from %s at tenure %s (step %d, world size %d); "
        "weights %s -> %s",
        attempt,
        report.src,
        report.source if report.path is None else f"checkpoint {report.path}",
        report.tenure,
        state.step,
        world_size,
        own,
        fingerprint(state.model),
    )
    fail_rank = world_size - 1 if args.fail_rank is None else args.fail_rank
    while state.step < args.steps:
        if args.fail_at is not None and state.step == args.fail_at and attempt == 0 and rank == fail_rank:
            if args.fail_wipe:  # a replaced machine: its successor finds an empty disk
                shutil.rmtree(ckpt, ignore_errors=True)
                log.info("injected failure: deleted %s", ckpt)
            log.info("injected failure: dying at step %d", state.step)
            sys.stdout.flush()
            os._exit(1)
        try:
            train_step(state, rank, world_size)
            if state.step % args.save_every == 0 or state.step == args.steps:
                path = elastic.save(state, ckpt, keep=args.keep, scope=scope)
                log.info("step %d: checkpoint %s", state.step, path)
        except (RuntimeError, elastic.ElasticError) as exc:
            reason = str(exc).splitlines()[0][:160]
            log.info(
                "a peer failed at step %d (%s); exiting so that torchrun restarts the group",
                state.step,
                reason,
            )
            sys.stdout.flush()
            os._exit(1)
    loss = state.history[-1] if state.history else float("nan")
    log.info("done: step %d, final loss %.6f, weights %s", state.step, loss, fingerprint(state.model))
    if args.out and (rank == 0 or "{rank}" in args.out):
        final = {
            "model": state.model.state_dict(),
            "optimizer": state.optimizer.state_dict(),
            "scheduler": state.scheduler.state_dict(),
            "step": state.step,
            "epoch": state.epoch,
            "samples": state.samples,
            "world_size": state.world_size,
            "history": state.history,
        }
        torch.save(final, args.out.format(rank=rank))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    # Leave without interpreter teardown: with gloo, torch sometimes aborts there ("terminate called
    # without an active exception") when one of gloo's threads drops the last reference to a tensor after
    # Python began shutting down (described in the abandoned fix pytorch/pytorch#179291), and torchrun would
    # count a finished run as failed.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
