"""A rank of a 2-rank stage-2 job with ring collectives that exits: after returning
without close(), or (given FLAG) after an interrupt while its ring thread still waits
on a silent peer.

Run as ``python -m tests.engine.exit_script RANK WORLD PORT [FLAG]``, with the group's
store served on PORT by the caller; the exit code is the test. With FLAG, rank 1 stops
taking part after two steps and stays alive (as a peer killed mid-message looks on gloo:
see zeroservice/interrupt.py) until FLAG exists (at most 300 s); rank 0 is interrupted
in its third step, closes its engine and exits.

Run as ``python -m tests.engine.exit_script serve``, it forks such pairs from one warm
interpreter instead (see ``serve``).
"""

from __future__ import annotations

import datetime
import gc
import os
import signal
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


def serve(deadline_s: float = 300.0) -> None:
    """Pairs of ranks forked from this interpreter, which imported torch and the engine
    once: each line on stdin names the ports of some pairs' stores; for each port two
    children run ``main`` and then leave as any interpreter does (``SystemExit`` through
    its finalization: atexit hooks, the joins of non-daemon threads, the collection of
    what is left), and one line of every child's exit code comes back, in port order
    (a negative code is the signal that ended it; ``timeout`` a child still running at
    the deadline, then killed). A fresh interpreter per rank pays torch's import each
    time, which is what made this check slow, not the exit it checks."""
    import torch._dynamo  # noqa: F401  (the first optimizer's import, paid here once)

    # What was imported is frozen, as a rank actor freezes it: a child's final
    # collection then walks only its own objects (0.3 s instead of 1.1 s an exit here).
    gc.freeze()
    for line in sys.stdin:
        assert threading.active_count() == 1, "fork only a single-threaded server"
        ports = [int(p) for p in line.split()]
        sys.stdout.flush()
        children = []
        for port in ports:
            for rank in range(2):
                pid = os.fork()
                if pid == 0:
                    _child(rank, port)
                children.append(pid)
        deadline = time.monotonic() + deadline_s
        print(" ".join(_exit_code(pid, deadline) for pid in children), flush=True)


def _child(rank: int, port: int) -> None:
    """A forked rank: run, then exit through the interpreter's own finalization."""
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    main(rank, 2, port)
    raise SystemExit(0)


def _exit_code(pid: int, deadline: float) -> str:
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return str(os.waitstatus_to_exitcode(status))
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return "timeout"


if __name__ == "__main__":
    if sys.argv[1:] == ["serve"]:
        serve()
    else:
        main(*(int(a) for a in sys.argv[1:4]), *sys.argv[4:5])
