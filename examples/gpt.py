"""A small GPT trained the way nanoGPT's `train.py` trains one, under `elastic.run`: a worker is killed
mid-step and rejoins.

The training loop is the one nanoGPT users know (our own code): AdamW with two parameter groups (weight
decay on matrices and embeddings, none on biases and LayerNorm gains), gradient accumulation (DDP's
all-reduce only on the last micro-batch), a learning rate with linear warmup and cosine decay, gradient
clipping, an evaluation every `EVAL_INTERVAL` steps, a checkpoint after each evaluation, optional
`torch.compile`, DistributedDataParallel. The data are synthetic tokens (a fixed random Markov chain over
64 symbols), so it runs anywhere on CPU in seconds: 2 layers, 32 channels, a context of 16 tokens.

What elastic changes (docs/porting.md goes through it line by line):
- the training state is one `@elastic_state` class: model, optimizer, an `elastic.ElasticSampler` (the
  data's progress), `step` (the tenure) and `best_val_loss` (a float that becomes a tensor);
- `train(state, world)` is called by `elastic.run` once per generation and must be re-entrant: DDP, the
  DataLoader and the compiled model's wrapper are built inside it, everything else comes from the state;
- `world.check()` once per optimizer step, `state.sampler.advance()` once per optimizer step;
- evaluation and `elastic.save` run on **every** rank: both are collective (the evaluation all-reduces
  its loss so every rank takes the same decision; `save` elects its writer itself). Only logging is
  done by rank 0.

By default three workers start under `elastic.spawn(restart="worker", max_restarts=1)`; with
`--kill-at STEP` the last one kills itself (SIGKILL) in the middle of that step's accumulation. The two
survivors regroup and redo that step (the library cleared their partial gradients), the killed slot is
restarted, joins at the next `world.check()` and receives the state. Every slot prints a closing line
with its final step, validation loss and a digest of its weights; this script checks they agree.

    python examples/gpt.py [--workers 3] [--steps 40] [--kill-at 15] [--compile] [--ckpt out-gpt]
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import logging
import math
import os
import signal
import sys
import time
from collections.abc import Iterator
from typing import Any, cast

import attrs
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset

import elastic

log = logging.getLogger("gpt")

# The model (nanoGPT's n_layer, n_head, n_embd, block_size, vocab_size).
LAYERS, HEADS, EMBD, BLOCK, VOCAB = 2, 2, 32, 16, 64
# The data: synthetic tokens, one split to train on, one to evaluate.
TRAIN_TOKENS, VAL_TOKENS = 512, 256
# Optimisation. A worker's optimizer step takes ACCUMULATION micro-batches of MICRO_BATCH windows.
MICRO_BATCH, ACCUMULATION = 4, 2
LEARNING_RATE, MIN_LR, WARMUP = 3e-3, 3e-4, 5
WEIGHT_DECAY, BETAS, GRAD_CLIP = 0.1, (0.9, 0.95), 1.0
EVAL_INTERVAL, LOG_INTERVAL = 10, 5
KEEP = 3  # checkpoints kept
HOLD_CHECKS = 600  # at the end, how many world.check() calls (0.1 s apart) to wait for a missing worker


# --- data ------------------------------------------------------------------------------------------------


def synthetic_tokens(n: int, seed: int) -> torch.Tensor:
    """`n` tokens of a fixed random "language": every token is followed by one of 4 likely successors."""
    language = torch.Generator().manual_seed(1234)  # the same language for both splits
    successors = torch.randint(VOCAB, (VOCAB, 4), generator=language).tolist()
    choices = torch.randint(4, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
    tokens = [0]
    for choice in choices[1:]:
        tokens.append(successors[tokens[-1]][choice])
    return torch.tensor(tokens)


class Windows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Windows of BLOCK tokens (inputs) and the same shifted by one (targets), starting every `stride`."""

    def __init__(self, tokens: torch.Tensor, stride: int = 1) -> None:
        self.tokens, self.stride = tokens, stride

    def __len__(self) -> int:
        return (len(self.tokens) - BLOCK - 1) // self.stride + 1

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.tokens[i * self.stride : i * self.stride + BLOCK + 1]
        return chunk[:-1], chunk[1:]


TRAIN = Windows(synthetic_tokens(TRAIN_TOKENS, seed=0))
VAL = Windows(synthetic_tokens(VAL_TOKENS, seed=1), stride=BLOCK)


# --- model -----------------------------------------------------------------------------------------------


class SelfAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(EMBD, 3 * EMBD)
        self.proj = nn.Linear(EMBD, EMBD)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, HEADS, c // HEADS).transpose(1, 2) for z in self.qkv(x).split(EMBD, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # no mask buffer: nothing to sync
        out: torch.Tensor = self.proj(y.transpose(1, 2).reshape(b, t, c))
        return out


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(EMBD), SelfAttention()
        self.ln2 = nn.LayerNorm(EMBD)
        self.mlp = nn.Sequential(nn.Linear(EMBD, 4 * EMBD), nn.GELU(), nn.Linear(4 * EMBD, EMBD))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        out: torch.Tensor = x + self.mlp(self.ln2(x))
        return out


class GPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, EMBD)
        self.positions = nn.Embedding(BLOCK, EMBD)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln = nn.LayerNorm(EMBD)
        self.head = nn.Linear(EMBD, VOCAB, bias=False)
        self.head.weight = self.tokens.weight  # tied, as in GPT-2: the sync keeps them tied
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The mean cross-entropy of predicting `targets` from `idx` (both batch x time)."""
        x = self.tokens(idx) + self.positions(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.view(-1, VOCAB), targets.reshape(-1))


def make_optimizer(model: nn.Module) -> torch.optim.AdamW:
    """AdamW with weight decay on every parameter of 2 or more dimensions, none on biases and gains."""
    params = [p for p in model.parameters() if p.requires_grad]  # the tied weight once
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": WEIGHT_DECAY},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=LEARNING_RATE, betas=BETAS)


def learning_rate(step: int, steps: int) -> float:
    """Linear warmup over WARMUP steps, then cosine decay to MIN_LR at `steps`."""
    if step < WARMUP:
        return LEARNING_RATE * (step + 1) / (WARMUP + 1)
    progress = min(1.0, (step - WARMUP) / max(1, steps - WARMUP))
    return MIN_LR + 0.5 * (1.0 + math.cos(math.pi * progress)) * (LEARNING_RATE - MIN_LR)


# --- the elastic state -----------------------------------------------------------------------------------


@elastic.elastic_state(tenure="step")
@attrs.define
class TrainState:
    model: GPT
    optimizer: torch.optim.AdamW
    sampler: elastic.ElasticSampler  # the data's progress: epoch and samples consumed
    step: int = 0  # optimizer steps done: the tenure, the most tenured state wins
    best_val_loss: float | torch.Tensor = math.inf  # a float at first, then the evaluation's tensor
    world_sizes: list[int] = attrs.field(factory=list)  # how many workers took each step

    @classmethod
    def fresh(cls) -> TrainState:
        model = GPT()
        # With drop_last every step takes a full batch, so an epoch never ends inside an accumulation.
        sampler = elastic.ElasticSampler(TRAIN, batch_size=MICRO_BATCH * ACCUMULATION, drop_last=True)
        return cls(model, make_optimizer(model), sampler)


def micro_batches(sampler: elastic.ElasticSampler) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's micro-batches for the current world, epoch after epoch."""
    while True:
        yield from DataLoader(TRAIN, batch_size=MICRO_BATCH, sampler=sampler)
        sampler.set_epoch(sampler.epoch + 1)  # every rank ends the epoch at the same optimizer step


@torch.no_grad()
def evaluate(model: nn.Module, world: elastic.World) -> torch.Tensor:
    """The mean validation loss, the same on every rank. Collective: each rank evaluates its share of the
    windows and one all-reduce adds them up."""
    model.eval()
    mine = list(range(world.rank, len(VAL), world.size))
    with world.busy("eval"):  # a long evaluation (a first compile for eval mode) is progress, not a hang
        x, y = (torch.stack(t) for t in zip(*(VAL[i] for i in mine)))
        total = torch.stack([model(x, y) * y.numel(), torch.tensor(float(y.numel()))])
    model.train()
    dist.all_reduce(total, group=world.group)
    return total[0] / total[1]


def fingerprint(model: nn.Module) -> str:
    digest = hashlib.sha256()
    for t in model.state_dict().values():
        digest.update(bytes(t.detach().cpu().flatten().view(torch.uint8).tolist()))  # no NumPy needed
    return digest.hexdigest()[:8]


@attrs.define
class Options:
    steps: int
    kill_at: int | None
    workers: int
    ckpt: str
    compile: bool


def evaluate_and_save(state: TrainState, model: nn.Module, world: elastic.World, opts: Options) -> float:
    """nanoGPT's evaluation block, on every rank: both the evaluation and the save are collective."""
    val = evaluate(model, world)
    if val < state.best_val_loss:  # the same decision on every rank: val was all-reduced
        state.best_val_loss = val
    saved = f", saved {elastic.save(state, opts.ckpt, keep=KEEP)}" if state.step > 0 else ""
    if world.rank == 0:  # logging is the only thing rank 0 does alone
        log.info("step %d: val loss %.4f (best %.4f)%s", state.step, val, state.best_val_loss, saved)
    return float(val)


def train(state: TrainState, world: elastic.World, model: nn.Module, opts: Options) -> dict[str, Any]:
    """One generation: `elastic.run` calls it again after every membership change, with the state as the
    most tenured worker left it. Objects bound to the group (DDP, the loader) are built here."""
    slot, life = int(os.environ["ELASTIC_SLOT"]), int(os.environ["ELASTIC_SLOT_RESTARTS"])
    stale = sum(p.grad is not None for p in state.model.parameters())
    log.info(
        "generation %d starts at step %d as rank %d of %d (slot %d, life %d), weights %s, %s",
        world.generation,
        state.step,
        world.rank,
        world.size,
        slot,
        life,
        fingerprint(state.model),
        f"gradients left on {stale} parameters" if stale else "no gradients left",
    )
    kill_at = opts.kill_at if slot == opts.workers - 1 and life == 0 else None  # the demo's failure
    ddp = DistributedDataParallel(model)  # its buckets and its group belong to this generation
    batches = micro_batches(state.sampler)
    first = True
    while state.step < opts.steps:
        world.check()  # collective: a newcomer or a departure ends the generation here, on every rank
        if state.step % EVAL_INTERVAL == 0:
            evaluate_and_save(state, model, world, opts)
        lr = learning_rate(state.step, opts.steps)
        for group in state.optimizer.param_groups:
            group["lr"] = lr
        # A generation's first step may compile (a newcomer's does; a new world may recompile): progress.
        with world.busy("compile") if opts.compile and first else contextlib.nullcontext():
            for micro in range(ACCUMULATION):
                x, y = next(batches)
                last = micro == ACCUMULATION - 1
                with contextlib.nullcontext() if last else ddp.no_sync():  # all-reduce on the last only
                    loss = ddp(x, y) / ACCUMULATION
                    loss.backward()
                if kill_at is not None and state.step >= kill_at and world.size == opts.workers:
                    log.info("step %d: killing this worker (SIGKILL) mid-accumulation", state.step)
                    sys.stdout.flush()
                    os.kill(os.getpid(), signal.SIGKILL)
        first = False
        torch.nn.utils.clip_grad_norm_(state.model.parameters(), GRAD_CLIP)
        state.optimizer.step()
        state.optimizer.zero_grad(set_to_none=True)  # as nanoGPT: at the end of the step
        state.sampler.advance()  # once per optimizer step, on every rank
        state.world_sizes.append(world.size)
        state.step += 1
        if world.rank == 0 and state.step % LOG_INTERVAL == 0:
            log.info(
                "step %d: train loss %.4f, lr %.2e, %d workers",
                state.step,
                loss.item() * ACCUMULATION,
                lr,
                world.size,
            )
    # A real job would finish now. The demo waits for a killed worker's replacement, so that every slot
    # prints the same closing line: its arrival ends this generation at a check(), and every worker runs
    # `train` again from here. The count is the same on every rank (no clocks: ranks must agree).
    for _ in range(HOLD_CHECKS):
        if world.size >= opts.workers:
            break
        world.check()
        time.sleep(0.1)
    val = evaluate_and_save(state, model, world, opts)
    elastic.verify(state)  # collective: DivergenceError if any two workers differ
    adam_steps = sorted({int(s["step"]) for s in state.optimizer.state.values()})
    digest = fingerprint(state.model)
    log.info("done: step %d, val loss %.6f, weights %s", state.step, val, digest)
    return {
        "slot": slot,
        "life": life,
        "step": state.step,
        "optimizer_steps": adam_steps,
        "world_sizes": state.world_sizes,
        "sampler": state.sampler.state_dict(),
        "val_loss": val,
        "weights": digest,
    }


def worker(opts: Options) -> dict[str, Any] | None:
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    slot = int(os.environ["ELASTIC_SLOT"])
    torch.manual_seed(1337 + slot)  # every worker draws its own weights: the election decides
    state = TrainState.fresh()
    log.info("slot %d: initial weights %s", slot, fingerprint(state.model))
    # Compiled once per process; the wrapper shares the state's parameters (names lose `_orig_mod.`).
    model = cast(nn.Module, torch.compile(state.model)) if opts.compile else state.model
    # `timeout` bounds every collective: it must exceed the longest one rank waits for another, e.g.
    # while a peer compiles its first step.
    result: dict[str, Any] | None = elastic.run(
        lambda s, w: train(s, w, model, opts),
        state,
        ckpt=opts.ckpt,
        first_workers=opts.workers,
        timeout=120 if opts.compile else 30,
    )
    return result


def parse(argv: list[str] | None = None) -> Options:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument(
        "--kill-at", type=int, default=15, help="the last worker dies in this step (<0: never)"
    )
    parser.add_argument("--compile", action="store_true", help="torch.compile the model")
    parser.add_argument("--ckpt", default="out-gpt", help="checkpoint root (a run resumes from it)")
    args = parser.parse_args(argv)
    kill_at = args.kill_at if args.kill_at >= 0 else None
    return Options(args.steps, kill_at, args.workers, args.ckpt, args.compile)


def runs(sizes: list[int]) -> str:
    """[3, 3, 2, 3] -> "3x2 2x1 3x1": the world size of each step, run-length encoded."""
    out: list[list[int]] = []
    for n in sizes:
        if out and out[-1][0] == n:
            out[-1][1] += 1
        else:
            out.append([n, 1])
    return " ".join(f"{n}x{k}" for n, k in out)


def main(argv: list[str] | None = None) -> int:
    opts = parse(argv)
    started = time.monotonic()
    results = elastic.spawn(worker, opts.workers, args=(opts,), restart="worker", max_restarts=1, timeout=600)
    for r in results:
        if r is None:
            print("a slot left without a result")
            return 1
        print(
            f"slot {r['slot']} (life {r['life']}): step {r['step']}, "
            f"optimizer steps {'/'.join(map(str, r['optimizer_steps']))}, "
            f"world sizes {runs(r['world_sizes'])}, sampler {r['sampler']}, val loss {r['val_loss']:.6f}, "
            f"weights {r['weights']}"
        )
    agreed = {(r["step"], r["weights"], r["val_loss"]) for r in results}
    elapsed = time.monotonic() - started
    if len(agreed) != 1:
        print(f"finished in {elapsed:.1f} s; the slots DIFFER: {sorted(agreed)}")
        return 1
    step, weights, val = agreed.pop()
    print(f"finished in {elapsed:.1f} s: step {step}, val loss {val:.6f}, weights {weights} on every slot")
    return 0


if __name__ == "__main__":
    sys.exit(main())
