"""Checkpoint cost against bare torch: `elastic.save`/`elastic.load` vs `torch.save`/`torch.load`.

A ~256 MiB state (an MLP plus Adam's two moments). Every round runs each variant once, interleaved, and the
table reports medians over rounds and the ratios to bare torch measured in the same run:

- save: `elastic.save(state, root)` (writer election, checksums, fsync, atomic rename, retention) vs
  `torch.save({"model": ..., "optimizer": ..., "step": ...}, file)` (no fsync: torch does not sync), and for
  reference vs `torch.save` followed by `os.fsync`;
- load: `elastic.load(state, root)` (manifest scan, checksum verification, in-place apply) vs
  `torch.load(file, weights_only=True)` plus `model.load_state_dict` and `optimizer.load_state_dict`;
- async: how long `elastic.save(state, root, blocking=False)` blocks the caller, against a blocking save;
- s3 (``--section s3``, needs the ``dev`` extra): `elastic.save`/`elastic.load` of the same state to an S3
  server on loopback (moto's `ThreadedMotoServer`, in this process) against s3fs `put_file`/`get_file` of
  one file of the same bytes (the bare `torch.save` file), interleaved in the same run.

Before each timed call the disk is synced (untimed), so that no call pays for another's writeback. CPU
seconds (all threads of this process) are printed too: on a shared machine wall times depend on how many
cores are idle, and elastic's checksums run on a second core while the first writes or copies.

Run: ``python benchmarks/bench_checkpoint.py [--rounds 7] [--mib 256] [--dir DIR] [--section all|local|s3]``.
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
    parser.add_argument("--section", choices=("all", "local", "s3"), default="all")
    args = parser.parse_args()
    if args.section in ("all", "local"):
        local_section(args)
    if args.section in ("all", "s3"):
        s3_section(args)


def local_section(args: argparse.Namespace) -> None:
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


def s3_section(args: argparse.Namespace) -> None:
    """elastic.save/load to a loopback S3 server vs s3fs put_file/get_file of one file of the same bytes."""
    try:
        import s3fs
        from moto.server import ThreadedMotoServer
    except ImportError:
        print("\ns3: skipped (install the dev extra: fsspec, s3fs, moto[server])")
        return
    import logging
    import socket

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        opts = {
            "key": "bench",
            "secret": "bench",
            "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{port}"},
        }
        fs = s3fs.S3FileSystem(**opts, skip_instance_cache=True)
        fs.mkdir("bench")
        load_before = " / ".join(f"{x:.1f}" for x in os.getloadavg())
        state = build(args.mib)
        with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
            bare_file = Path(tmp) / "bare.pt"
            back_file = Path(tmp) / "back.pt"
            torch.save(
                {"model": state.model.state_dict(), "optimizer": state.optimizer.state_dict()}, bare_file
            )
            size = bare_file.stat().st_size

            def put() -> None:
                fs.put_file(str(bare_file), "bench/bare/state.pt")

            def get() -> None:
                fs.get_file("bench/bare/state.pt", str(back_file))

            def our_save() -> None:
                state.step += 1
                elastic.save(state, "s3://bench/ckpt", keep=2, storage_options=opts)

            def our_load() -> None:
                steps = state.step
                state.step = 0
                report = elastic.load(state, "s3://bench/ckpt", storage_options=opts)
                assert report.source == "checkpoint", report
                state.step = steps

            times: dict[str, list[tuple[float, float]]] = {k: [] for k in ("put", "save", "get", "load")}
            for _ in range(args.rounds + 1):  # the first round warms caches and is dropped
                times["put"].append(timed(put))
                times["save"].append(timed(our_save))
                times["get"].append(timed(get))
                times["load"].append(timed(our_load))
            med = {k: statistics.median(w for w, _ in v[1:]) for k, v in times.items()}
            cpu = {k: statistics.median(c for _, c in v[1:]) for k, v in times.items()}
    finally:
        server.stop()
    print()
    print(
        f"s3 (moto server on loopback): {size / 2**20:.0f} MiB; {args.rounds} interleaved rounds, medians; "
        f"load average before {load_before}"
    )
    print()
    print("| operation | elastic | s3fs | ratio | target | CPU s elastic / s3fs |")
    print("|---|---:|---:|---:|---:|---:|")
    for label, ours, theirs in (
        ("save to s3:// vs s3fs `put_file`", "save", "put"),
        ("load from s3:// (verified, in place) vs s3fs `get_file`", "load", "get"),
    ):
        print(
            f"| {label} | {med[ours]:.3f} s | {med[theirs]:.3f} s | {med[ours] / med[theirs]:.2f}x | <= 1.3x "
            f"| {cpu[ours]:.3f} / {cpu[theirs]:.3f} |"
        )


if __name__ == "__main__":
    main()
