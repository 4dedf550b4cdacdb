"""Asynchronous save: snapshot to host memory now, write in the background.

Training goes on while the files are written. The background threads may not use
the process group (training owns it), so they agree through the storage the
checkpoint lives on anyway (a filesystem or an object store): each rank writes its
file and then a small report (atomically); rank 0's thread waits for every report of
this save, writes the manifest (the commit point) and prunes. The next save, and
``engine.close()``, wait for the previous one first.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

from .files import CheckpointError, atomic_write_bytes
from .manifest import MANIFEST, step_dir_name, write_manifest
from .save import (
    assemble,
    check_savable,
    committed_files,
    manifest_header,
    per_element_kinds,
    prune,
    rank_file_name,
    remove_replaced,
    rng_state,
    snapshot_items,
    write_items,
)
from .state import ShardedState
from .storage import Location, Where, location, storage_for


class SaveHandle:
    """A save in progress; ``wait()`` returns its directory or raises what went wrong."""

    def __init__(self, directory: Location):
        self.directory = directory
        self.error: BaseException | None = None
        self.failure_reported = False
        """``wait()`` raised the failure: the engine does not raise it again at its next
        save (which would then never be written)."""
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

    def wait(self) -> Location:
        if self._thread is not None:
            self._thread.join()
        if self.error is not None:
            self.failure_reported = True
            raise CheckpointError(f"{self.directory}: background save failed: {self.error}")
        return self.directory


def save_in_background(
    state: ShardedState,
    root: Where,
    client_state: dict[str, Any] | None,
    keep: int,
    sequence: int,
    timeout_s: float = 600.0,
) -> SaveHandle:
    """Snapshot this rank's state and write it on a thread. ``sequence`` numbers the
    engine's saves (the same on every rank) so reports of an older attempt are ignored."""
    check_savable(state, keep, client_state)
    root = location(root)
    store = storage_for(root)
    directory = root / step_dir_name(state.counters.global_steps)
    rank, world = state.rank, state.world
    store.make_dirs(directory)
    kinds, scalars = per_element_kinds(state)
    items = snapshot_items(state, kinds, copy=True)
    header = manifest_header(state, kinds, scalars, client_state) if rank == 0 else None
    rng = rng_state()
    # A step saved again keeps its committed checkpoint until the new one commits
    # (see [Note: failed save] in save.py).
    name = rank_file_name(directory, rank)

    def report_path(r: int) -> Location:
        return directory / f"rank-{r:05d}.report-{sequence}.json"

    def write() -> None:
        try:
            segments = write_items(directory / name, items)
        except OSError as exc:
            # Said in this rank's report, so that rank 0 stops waiting for it at once and
            # fails the save naming it (else it waited out ``timeout_s``, and with it the
            # engine's next save).
            said = {"error": f"rank {rank}: {exc.strerror or exc}"}
            atomic_write_bytes(report_path(rank), json.dumps(said).encode())
            raise
        finally:
            items.clear()  # the snapshot's memory goes back as soon as it is on disk
        report = {
            "file": name,
            "bytes": store.size(directory / name),
            "segments": segments,
            "rng": rng,
        }
        atomic_write_bytes(report_path(rank), json.dumps(report).encode())
        if rank != 0:
            return
        deadline = time.monotonic() + timeout_s
        while not all(store.is_file(report_path(r)) for r in range(world)):
            if time.monotonic() > deadline:
                missing = [r for r in range(world) if not store.is_file(report_path(r))]
                raise CheckpointError(f"ranks {missing} did not finish within {timeout_s} s")
            time.sleep(store.poll_s)
        reports = [json.loads(store.read_bytes(report_path(r))) for r in range(world)]
        failed = [r["error"] for r in reports if "error" in r]
        if failed:
            for r in range(world):
                store.remove(report_path(r))
            if store.is_file(directory / MANIFEST):  # the committed checkpoint stays whole
                for r in reports:
                    if "file" in r:
                        store.remove(directory / r["file"])
            raise CheckpointError(f"not committed: {'; '.join(failed)}")
        assert header is not None
        replaced = committed_files(directory)
        write_manifest(directory, assemble(header, reports))
        for r in range(world):
            store.remove(report_path(r))
        remove_replaced(directory, replaced, reports)
        prune(root, keep, directory)

    return SaveHandle(directory).start(write)
