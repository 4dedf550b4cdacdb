"""An interrupted wait leaves nothing of the abandoned collective alive once it ends (see
[Note: a failed call holds nothing] in zeroservice/serial.py), and an interrupted forward
ends at the next module (see [Note: a forward given up] in zeroservice/interrupt.py)."""

from __future__ import annotations

import contextlib
import gc
import threading
import time
import weakref
from collections.abc import Callable

import pytest
import torch
from torch import nn

import zeroservice
from zeroservice.config import ZeroConfig
from zeroservice.interrupt import CommInterrupted, Interrupt
from zeroservice.launch import run_local


def _abandoned_call(fails: bool) -> tuple[weakref.ref, threading.Event, threading.Event]:
    """A collective stand-in that holds a buffer, blocks until released, then fails
    (as a transfer from a dead peer does) or returns; its waiter is interrupted."""
    interrupt = Interrupt()
    started, release, ended = threading.Event(), threading.Event(), threading.Event()
    buffer = torch.zeros(1024)
    probe = weakref.ref(buffer)

    def transfer(held: torch.Tensor = buffer) -> None:
        try:
            started.set()
            release.wait(30)
            if fails:
                raise RuntimeError("Connection reset by peer")
        finally:
            ended.set()

    def train() -> None:
        with contextlib.suppress(CommInterrupted):
            interrupt.run(transfer)

    training = threading.Thread(target=train)
    training.start()
    assert started.wait(30)
    interrupt.fire("rank 1 lost")
    training.join(30)
    interrupt.close()  # as Engine.close(): the waiter is left, never joined
    return probe, release, ended


@pytest.mark.parametrize("fails", [True, False], ids=["fails", "returns"])
def test_an_abandoned_collective_frees_its_buffers_when_it_ends(fails):
    gc.collect()
    gc.disable()  # reference counting alone must free it: no full collection runs
    try:
        probe, release, ended = _abandoned_call(fails)
        assert probe() is not None  # still in flight: its buffer is in use
        release.set()
        assert ended.wait(30)
        for _ in range(100):  # the waiter thread finishes the call and drops it
            if probe() is None:
                break
            time.sleep(0.05)
        assert probe() is None
    finally:
        gc.enable()


class _FiresMidway(nn.Module):
    """Fires its engine's interrupt from inside the forward, as the supervisor's call
    does from another thread while a survivor computes."""

    def __init__(self) -> None:
        super().__init__()
        self.fire: Callable[[], None] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fire is not None:
            self.fire()
        return x


def _interrupted_forward(stage: int) -> dict:
    torch.manual_seed(0)
    layers = [nn.Linear(8, 8), _FiresMidway(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1)]
    model = nn.Sequential(*layers)
    ran: list[int] = []
    for i, m in enumerate(model):
        m.register_forward_hook(lambda *_, i=i: ran.append(i))
    engine = zeroservice.initialize(
        model, ZeroConfig(stage=stage), optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1)
    )
    x = torch.randn(4, 8)
    engine.backward(engine(x).sum())  # a step as usual first
    engine.step()
    trained = list(ran)
    ran.clear()
    model[1].fire = lambda: engine.interrupt("rank(s) [1] lost")
    try:
        engine(x)
        outcome = "finished"
    except CommInterrupted as exc:
        outcome = str(exc)
    interrupted = list(ran)
    engine.close()
    model[1].fire = None
    ran.clear()
    if stage < 3:  # closed: the hooks are gone, the module runs whole
        model(x)
    return {"trained": trained, "interrupted": interrupted, "outcome": outcome, "after": ran}


def _interrupted_forwards(stages: list[int]) -> list[dict]:
    return [_interrupted_forward(stage) for stage in stages]


def test_an_interrupted_forward_ends_at_the_next_module():
    stages = [0, 2, 3]
    for stage, r in zip(stages, run_local(_interrupted_forwards, 1, stages)[0], strict=True):
        assert r["trained"] == [0, 1, 2, 3, 4], (stage, r)
        # The next module with parameters never ran: no rest of a forward for a step
        # that will not be taken.
        assert r["interrupted"] == [0, 1], (stage, r)
        assert r["outcome"] == "step abandoned: rank(s) [1] lost", (stage, r)
        assert r["after"] == ([0, 1, 2, 3, 4] if stage < 3 else []), (stage, r)
