"""An interrupted wait leaves nothing of the abandoned collective alive once it ends:
see [Note: a failed call holds nothing] in zeroservice/serial.py."""

from __future__ import annotations

import contextlib
import gc
import threading
import time
import weakref

import pytest
import torch

from zeroservice.interrupt import CommInterrupted, Interrupt


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
