"""Checkpoint cost against bare torch: `elastic.save`/`elastic.load` vs `torch.save`/`torch.load`.

A ~256 MiB state (an MLP plus Adam's two moments). Every round runs each variant once, interleaved, and the
table reports medians over rounds and the ratios to bare torch measured in the same run:

- save: `elastic.save(state, root)` (writer election, checksums, fsync, atomic rename, retention) vs
  `torch.save({"model": ..., "optimizer": ..., "step": ...}, file)` (no fsync: torch does not sync), and for
  reference vs `torch.save` followed by `os.fsync`;
- load: `elastic.load(state, root)` (manifest scan, checksum verification, in-place apply) vs
  `torch.load(file, weights_only=True)` plus `model.load_state_dict` and `optimizer.load_state_dict`;
- async: how long `elastic.save(state, root, blocking=False)` blocks the caller, against a blocking save.

Before each timed call the disk is synced (untimed), so that no call pays for another's writeback. CPU
seconds (all threads of this process) are printed too: on a shared machine wall times depend on how many
cores are idle, and elastic's checksums run on a second core while the first writes or copies.

Run: ``python benchmarks/bench_checkpoint.py [--rounds 7] [--mib 256] [--dir DIR]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import torch

import elastic


@elastic.elastic_state(tenure="step")
@attrs.define
class TrainState:
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    step: int = 0


def build(mib: int) -> TrainState:
    width = 1024
    per_layer = (width * width + width) * 4 * 3  # weights, bias, and Adam's two moments, fp32
    layers = max(1, round(mib * 2**20 / per_layer))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(8, width)).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return TrainState(model, optimizer, step=1)


def state_bytes(state: TrainState) -> int:
    total = sum(t.numel() * t.element_size() for t in state.model.state_dict().values())
    for per_param in state.optimizer.state.values():
        total += sum(v.numel() * v.element_size() for v in per_param.values() if isinstance(v, torch.Tensor))
    return total


def timed(fn: Callable[[], Any]) -> tuple[float, float]:
    """Wall-clock seconds and this process's CPU seconds (all threads) of one call."""
    cpu, wall = time.process_time(), time.perf_counter()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument(
        "--dir", type=str, default=None, help="where to write (default: a temporary directory)"
    )
    args = parser.parse_args()

    load_before = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    state = build(args.mib)
    size = state_bytes(state)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        bare_file = Path(tmp) / "bare.pt"
        bare_sync_file = Path(tmp) / "bare_fsync.pt"
        root = Path(tmp) / "ckpt"
        async_root = Path(tmp) / "ckpt_async"

        def bare_save() -> None:
            sd = {
                "model": state.model.state_dict(),
                "optimizer": state.optimizer.state_dict(),
                "step": state.step,
            }
            torch.save(sd, bare_file)

        def bare_save_fsync() -> None:
            sd = {
                "model": state.model.state_dict(),
                "optimizer": state.optimizer.state_dict(),
                "step": state.step,
            }
            with open(bare_sync_file, "wb") as f:
                torch.save(sd, f)
                f.flush()
                os.fsync(f.fileno())

        def bare_load() -> None:
            sd = torch.load(bare_file, weights_only=True)
            state.model.load_state_dict(sd["model"])
            state.optimizer.load_state_dict(sd["optimizer"])

        def our_save() -> None:
            state.step += 1
            elastic.save(state, root, keep=2)

        handles: list[Any] = []

        def our_async() -> None:
            state.step += 1
            handles.append(elastic.save(state, async_root, keep=2, blocking=False))

        def our_load() -> None:
            state.step = 0  # the checkpoint is more tenured than memory: it is read
            report = elastic.load(state, root)
            assert report.source == "checkpoint", report

        times: dict[str, list[tuple[float, float]]] = {
            k: [] for k in ("bare_save", "bare_fsync", "save", "async", "bare_load", "load")
        }

        def quiet(fn: Callable[[], Any]) -> tuple[float, float]:
            os.sync()  # start from a quiet disk: torch.save leaves its writeback to whoever syncs next
            return timed(fn)

        for _ in range(args.rounds + 1):  # the first round warms caches and is dropped
            times["bare_save"].append(quiet(bare_save))
            times["save"].append(quiet(our_save))
            times["bare_fsync"].append(quiet(bare_save_fsync))
            times["async"].append(quiet(our_async))
            handles.pop().wait()
            times["bare_load"].append(quiet(bare_load))
            steps = state.step
            times["load"].append(quiet(our_load))
            state.step = steps
        med = {k: statistics.median(w for w, _ in v[1:]) for k, v in times.items()}
        cpu = {k: statistics.median(c for _, c in v[1:]) for k, v in times.items()}

    print(
        f"state: {size / 2**20:.0f} MiB (model + Adam); {args.rounds} interleaved rounds, medians; "
        f"torch {torch.__version__}; {os.cpu_count()} CPUs; load average before the run {load_before}"
    )
    print()
    rows = [
        ("save (checksums, fsync, atomic rename) vs `torch.save`", "save", "bare_save", "<= 1.2x"),
        ("save vs `torch.save` + `fsync`", "save", "bare_fsync", ""),
        (
            "load (verify checksums, in place) vs `torch.load` + `load_state_dict`",
            "load",
            "bare_load",
            "<= 1.2x",
        ),
        ("`save(blocking=False)` blocks the caller vs a blocking save", "async", "save", "<= 0.25x"),
    ]
    print("| operation | elastic | bare | ratio | target | CPU s elastic / bare |")
    print("|---|---:|---:|---:|---:|---:|")
    for label, ours, theirs, target in rows:
        ratio = med[ours] / med[theirs]
        print(
            f"| {label} | {med[ours]:.3f} s | {med[theirs]:.3f} s | {ratio:.2f}x | {target} "
            f"| {cpu[ours]:.3f} / {cpu[theirs]:.3f} |"
        )


if __name__ == "__main__":
    main()
