"""Model factories that tell on themselves, for the tests of where tenant code runs."""

from __future__ import annotations

import os
import time
from pathlib import Path

from tests.workers.jobs import tiny_model


def recorded(path: str, dim: int = 16):
    """The tiny factory model, after writing the id of the process that built it."""
    Path(path).write_text(str(os.getpid()))
    return tiny_model(dim)


def slow(seconds: float):
    time.sleep(seconds)
    return tiny_model()


def hungry(gib: float):
    """Holds ``gib`` of touched host memory while building."""
    hold = bytearray(int(gib * 2**30))
    for i in range(0, len(hold), 4096):
        hold[i] = 1
    time.sleep(5)
    return tiny_model()


def diverging(after: int):
    """The tiny model whose loss turns NaN at its ``after``-th training forward (and so
    do its gradients, and every weight they reach)."""
    import torch

    model = tiny_model()
    plain = model.forward
    calls = [0]

    def forward(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = plain(x, y)
        if torch.is_grad_enabled():
            calls[0] += 1
            if calls[0] >= after:
                loss = loss * float("nan")
        return loss

    model.forward = forward
    return model
