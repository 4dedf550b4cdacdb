"""Where a benchmark writes its JSON."""

from __future__ import annotations

import time
from pathlib import Path


def result_path(out: str | Path, stem: str) -> Path:
    """``<out>/<stem>-<YYYYmmdd-HHMMSS>.json``, its directory made if missing: each run
    keeps its own file beside the recorded ones that docs/benchmarks.md cites."""
    directory = Path(out)
    directory.mkdir(parents=True, exist_ok=True)
    return directory / f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}.json"
