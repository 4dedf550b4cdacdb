"""Where a newcomer's start goes: the times a rank actor records of its own start, and
the figures a grow's event gives from them (see ``ray_group.start_figures``)."""

from __future__ import annotations

import subprocess
import sys
import time

from workers.rank import IMPORTED_AT, process_started_at
from workers.ray_group import start_figures


def test_start_figures_split_the_time_from_creation_to_seat():
    started = {"process": 101.5, "imported": 103.0, "up": 104.25}
    figures = start_figures(100.0, {"started": started}, 105.0)
    assert figures == {"process": 1.5, "imports": 1.5, "constructor": 1.25, "idle": 0.75}
    assert sum(figures.values()) == 5.0  # creation to seat, every second in one figure


def test_a_worker_process_started_before_the_actor_counts_no_process_time():
    # Ray may hand the actor a worker it had already started: its imports begin at the
    # actor's creation, not at the process's start.
    started = {"process": 90.0, "imported": 101.0, "up": 102.0}
    figures = start_figures(100.0, {"started": started}, 102.0)
    assert figures == {"process": 0.0, "imports": 1.0, "constructor": 1.0, "idle": 0.0}
    # Not on Linux, no process time: the same.
    assert start_figures(100.0, {"started": started | {"process": None}}, 102.0) == figures


def test_an_actor_that_reports_no_start_gives_no_figures():
    assert start_figures(100.0, {"ip": "127.0.0.1"}, 102.0) == {}


def test_process_start_is_read_to_the_clock_tick():
    assert process_started_at() is not None
    assert process_started_at() <= IMPORTED_AT <= time.time()
    code = (
        "import time; t = time.time(); from workers.rank import process_started_at; "
        "print(t - process_started_at())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    # The interpreter's own start, before its first line ran: well under a second, and
    # never negative beyond the 10 ms tick the kernel counts in.
    assert -0.02 <= float(out.stdout) < 2.0, out.stdout
