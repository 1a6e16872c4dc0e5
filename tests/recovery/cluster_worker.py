"""One worker on a simulated host (tests/netns.py): ``python cluster_worker.py RDZV OUT TIMEOUT``.

Trains a toy replicated state under `elastic.run`; after every step it appends a JSON line (generation,
size, rank, step) to ``OUT/<host>.jsonl`` for the test to follow; at the end the final step, values and
world sizes. Done once the world sizes went through ``$ELASTIC_TEST_PLAN`` (default ``3,2,3``: 3, then
smaller, then 3 again) and 30 steps came after that; ``$ELASTIC_TEST_FIRST`` workers form the first
generation (default 3). Every step adds step+1 to ``w``: ``w == step * (step + 1) / 2`` at the end says
that every step was applied exactly once (none lost, none twice).
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
    sizes: list[int] = attrs.field(factory=list)
    back_at: int = -1  # the step at which the world was whole again after being smaller


def main() -> None:
    rdzv, out, timeout = sys.argv[1], Path(sys.argv[2]), float(sys.argv[3])
    host = os.environ["ELASTIC_TEST_HOST"]
    level = logging.DEBUG if os.environ.get("ELASTIC_TEST_DEBUG") else logging.INFO
    logging.basicConfig(level=level, format=f"[{host}] %(relativeCreated)d %(message)s", stream=sys.stderr)
    torch.set_num_threads(1)
    lines = (out / f"{host}.jsonl").open("a", buffering=1)

    plan = [int(x) for x in os.environ.get("ELASTIC_TEST_PLAN", "3,2,3").split(",")]
    first = int(os.environ.get("ELASTIC_TEST_FIRST", "3"))
    least = int(os.environ.get("ELASTIC_TEST_MIN", "2"))

    def train(s: Toy, world: Any) -> dict[str, Any]:
        if not s.sizes or s.sizes[-1] != world.size:
            s.sizes.append(world.size)
            if s.back_at < 0 and s.sizes[-len(plan) :] == plan:
                s.back_at = s.step
        while not (s.back_at >= 0 and s.step >= s.back_at + 30):
            world.check()
            g = torch.full((4,), float(s.step + 1))
            dist.all_reduce(g)
            s.w.add_(g / world.size)
            s.step += 1
            line = {"g": world.generation, "size": world.size, "step": s.step, "t": time.time()}
            lines.write(json.dumps(line) + "\n")
            time.sleep(0.05)
        return {"step": s.step, "w": s.w.tolist(), "sizes": s.sizes}

    result = elastic.run(
        train, Toy(w=torch.zeros(4)), rdzv=rdzv, min_workers=least, first_workers=first, timeout=timeout
    )
    lines.write(json.dumps({"final": result}) + "\n")


if __name__ == "__main__":
    main()
