"""Asynchronous save: snapshot to host memory now, write in the background.

Training goes on while the files are written. The background threads may not use
the process group (training owns it), so they agree through the filesystem the
checkpoint lives on anyway: each rank writes its file and then a small report
(atomically); rank 0's thread waits for every report of this save, writes the
manifest (the commit point) and prunes. The next save, and ``engine.close()``, wait
for the previous one first.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

from .files import CheckpointError, atomic_write_bytes
from .manifest import MANIFEST, step_dir_name, write_manifest
from .save import (
    assemble,
    check_savable,
    manifest_header,
    per_element_kinds,
    prune,
    rng_state,
    snapshot_items,
    write_items,
)
from .state import ShardedState


class SaveHandle:
    """A save in progress; ``wait()`` returns its directory or raises what went wrong."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def start(self, target) -> SaveHandle:
        def run() -> None:
            try:
                target()
            except BaseException as exc:  # reported by wait()
                self.error = exc

        self._thread = threading.Thread(target=run, name="zeroservice-save", daemon=True)
        self._thread.start()
        return self

    def done(self) -> bool:
        return self._thread is None or not self._thread.is_alive()

    def wait(self) -> Path:
        if self._thread is not None:
            self._thread.join()
        if self.error is not None:
            raise CheckpointError(f"{self.directory}: background save failed: {self.error}")
        return self.directory


def save_in_background(
    state: ShardedState,
    root: str | Path,
    client_state: dict[str, Any] | None,
    keep: int,
    sequence: int,
    timeout_s: float = 600.0,
) -> SaveHandle:
    """Snapshot this rank's state and write it on a thread. ``sequence`` numbers the
    engine's saves (the same on every rank) so reports of an older attempt are ignored."""
    check_savable(state, keep)
    directory = Path(root) / step_dir_name(state.counters.global_steps)
    rank, world = state.rank, state.world
    directory.mkdir(parents=True, exist_ok=True)
    if rank == 0:
        (directory / MANIFEST).unlink(missing_ok=True)
    kinds, scalars = per_element_kinds(state)
    items = snapshot_items(state, kinds, copy=True)
    header = manifest_header(state, kinds, scalars, client_state) if rank == 0 else None
    rng = rng_state()
    name = f"rank-{rank:05d}.bin"

    def report_path(r: int) -> Path:
        return directory / f"rank-{r:05d}.report-{sequence}.json"

    def write() -> None:
        segments = write_items(directory / name, items)
        items.clear()  # the snapshot's memory goes back as soon as it is on disk
        report = {
            "file": name,
            "bytes": (directory / name).stat().st_size,
            "segments": segments,
            "rng": rng,
        }
        atomic_write_bytes(report_path(rank), json.dumps(report).encode())
        if rank != 0:
            return
        deadline = time.monotonic() + timeout_s
        while not all(report_path(r).is_file() for r in range(world)):
            if time.monotonic() > deadline:
                missing = [r for r in range(world) if not report_path(r).is_file()]
                raise CheckpointError(f"ranks {missing} did not finish within {timeout_s} s")
            time.sleep(0.05)
        reports = [json.loads(report_path(r).read_text()) for r in range(world)]
        assert header is not None
        write_manifest(directory, assemble(header, reports))
        for r in range(world):
            report_path(r).unlink(missing_ok=True)
        prune(Path(root), keep)

    return SaveHandle(directory).start(write)
