"""Where a benchmark writes its JSON."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any


def result_path(out: str | Path, stem: str) -> Path:
    """``<out>/<stem>-<YYYYmmdd-HHMMSS>.json``, its directory made if missing: each run
    keeps its own file beside the recorded ones that docs/benchmarks.md cites."""
    directory = Path(out)
    directory.mkdir(parents=True, exist_ok=True)
    return directory / f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}.json"


def write_result(out: str | Path, stem: str, record: Any) -> Path:
    """Write ``record`` to a fresh :func:`result_path` and say where, so every benchmark's
    last line names the file its table was saved in. Values JSON cannot hold (a path, a
    dtype) are written as their ``str``."""
    path = result_path(out, stem)
    path.write_text(json.dumps(record, indent=1, default=str))
    print(f"\nwrote {path}", flush=True)
    return path
