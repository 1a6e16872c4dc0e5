"""One worker on a simulated host (tests/netns.py) for the asymmetric-partition tests:
``python partition_worker.py RDZV OUT TIMEOUT JOIN_TIMEOUT``.

Trains a toy replicated state under `elastic.run` (``min_workers=2``, ``first_workers=4``); after every
step it appends a JSON line (generation, size, rank, step, members' hosts) to ``OUT/<host>.jsonl``. Every
rank returns at the same step once the file ``OUT/stop`` exists (an all-reduced flag) and the world has 4
members, or any size when ``OUT/stop`` says ``any``; the final line holds the result. An `ElasticError`
out of `run` is written as ``{"error": text}`` and the worker exits with 3.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import attrs
import torch
import torch.distributed as dist

import elastic


@elastic.elastic_state(tenure=lambda s: s.step)
@attrs.define
class Toy:
    w: torch.Tensor
    step: int = 0


def main() -> None:
    rdzv, out = sys.argv[1], Path(sys.argv[2])
    timeout, join_timeout = float(sys.argv[3]), float(sys.argv[4])
    host = os.environ["ELASTIC_TEST_HOST"]
    logging.basicConfig(level=logging.INFO, format=f"[{host}] %(asctime)s %(message)s", stream=sys.stderr)
    torch.set_num_threads(1)
    lines = (out / f"{host}.jsonl").open("a", buffering=1)
    stop = out / "stop"

    def train(s: Toy, world: Any) -> dict[str, Any]:
        while True:
            world.check()
            flag = torch.tensor([0.0])
            if stop.exists() and (world.size == 4 or stop.read_text().strip() == "any"):
                flag[0] = 1.0
            g = torch.cat([torch.full((4,), float(s.step + 1)), flag])
            dist.all_reduce(g)
            if g[4] > 0:
                return {"step": s.step, "w": s.w.tolist(), "size": world.size}
            s.w.add_(g[:4] / world.size)
            s.step += 1
            record = {"g": world.generation, "size": world.size, "rank": world.rank, "step": s.step}
            lines.write(json.dumps(record) + "\n")
            time.sleep(0.05)

    try:
        result = elastic.run(
            train,
            Toy(w=torch.zeros(4)),
            rdzv=rdzv,
            min_workers=2,
            first_workers=4,
            timeout=timeout,
            join_timeout=join_timeout,
        )
    except elastic.ElasticError as exc:
        lines.write(json.dumps({"error": str(exc)}) + "\n")
        sys.exit(3)
    lines.write(json.dumps({"final": result}) + "\n")


if __name__ == "__main__":
    main()
