"""A rank of a 2-rank stage-2 job with ring collectives that exits: after returning
without close(), or (given FLAG) after an interrupt while its ring thread still waits
on a silent peer.

Run as ``python -m tests.engine.exit_script RANK WORLD PORT [FLAG]``, with the group's
store served on PORT by the caller; the exit code is the test. With FLAG, rank 1 stops
taking part after two steps and stays alive (as a peer killed mid-message looks on gloo:
see zeroservice/interrupt.py) until FLAG exists (at most 300 s); rank 0 is interrupted
in its third step, closes its engine and exits.
"""

from __future__ import annotations

import datetime
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import zeroservice
from zeroservice.interrupt import CommInterrupted


def main(rank: int, world: int, port: int, flag: str | None = None) -> None:
    timeout = datetime.timedelta(seconds=300)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
    config = {"stage": 2, "collectives": "ring", "bucket_elements": 1024}
    engine = zeroservice.initialize(model, config, optimizer=lambda ps: torch.optim.SGD(ps, 0.1))
    steps = 3 if flag is None else 2
    for step in range(steps):
        _step(engine, step, rank, world)
    if flag is None:
        return
    if rank == 1:
        deadline = time.monotonic() + 300
        while not Path(flag).exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return
    threading.Timer(0.5, engine.interrupt, args=("rank 1 lost",)).start()
    try:
        _step(engine, steps, rank, world)
    except CommInterrupted:
        engine.close()
        return
    sys.exit("the step was not interrupted")


def _step(engine, step: int, rank: int, world: int) -> None:
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(step * world + rank))
    engine.backward(engine(x).square().mean())
    engine.step()


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:4]), *sys.argv[4:5])
