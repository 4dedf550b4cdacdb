"""Polling helpers shared by the tests that drive services and clusters."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def wait_for(
    predicate: Callable[[], Any],
    timeout: float,
    what: str,
    explain: Callable[[], Any] | None = None,
    interval: float = 0.2,
) -> Any:
    """The first truthy value of ``predicate()`` within ``timeout`` seconds; otherwise an
    AssertionError naming ``what`` (and ``explain()``, the state worth seeing then)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    detail = f": {explain()}" if explain is not None else ""
    raise AssertionError(f"timed out waiting for {what}{detail}")
