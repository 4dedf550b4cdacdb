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
