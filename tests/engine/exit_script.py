"""A rank of a 2-rank stage-2 job with ring collectives that returns without close().

Run as ``python -m tests.engine.exit_script RANK WORLD PORT``; the exit code is the test.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch import nn

import zeroservice


def main(rank: int, world: int, port: int) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
    config = {"stage": 2, "collectives": "ring", "bucket_elements": 1024}
    engine = zeroservice.initialize(model, config, optimizer=lambda ps: torch.optim.SGD(ps, 0.1))
    for step in range(3):
        x = torch.randn(4, 32, generator=torch.Generator().manual_seed(step * world + rank))
        engine.backward(engine(x).square().mean())
        engine.step()


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:4]))
