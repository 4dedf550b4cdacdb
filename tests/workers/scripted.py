"""Scripted ranks for the controller's unit tests: they train instantly, keep their
"checkpoints" in a shared script, and die, freeze or fail where the test says."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from workers.messages import RankChunk, RankIdle, RankProgress, RankSaved, RankSetup
from workers.worker_group import InProcessPool, RankDied


@dataclass
class Script:
    """What every rank of every attempt shares: the newest saved step (the disk) and
    the faults to inject, keyed by (attempt, rank, step)."""

    saved: int = 0
    kill: set[tuple[int, int, int]] = field(default_factory=set)
    freeze: set[tuple[int, int, int]] = field(default_factory=set)
    error: set[tuple[int, int, int]] = field(default_factory=set)
    full_disk: set[int] = field(default_factory=set)
    """Steps whose save fails (ENOSPC) on every rank."""
    fail_setup: set[int] = field(default_factory=set)
    """Attempts whose rank 0 fails to join the group."""
    on_kill: Any = None
    on_save: Any = None
    """Called with the step saved (by rank 0)."""
    release: threading.Event = field(default_factory=threading.Event)
    """Set when a group is shut down: frozen and waiting ranks return."""
    trained: list[tuple[int, int, int]] = field(default_factory=list)
    """(attempt, rank, step) of every step trained."""


class ScriptedRank:
    def __init__(self, script: Script, rank: int, world: int, attempt: int):
        self.script, self.rank, self.world, self.attempt = script, rank, world, attempt
        self.step = 0
        self.phase = "created"
        self.frozen = False
        self.saved_step = -1
        self.last_chunk: RankChunk | None = None

    def setup(self, *args: Any) -> RankSetup:
        if self.attempt in self.script.fail_setup and self.rank == 0:
            raise RuntimeError("the rendezvous timed out")
        self.step = self.script.saved
        loaded = f"step-{self.step:08d}" if self.step else None
        self.phase = "ready"
        self.setup_info = RankSetup(
            self.rank, self.rank, 0, self.step, loaded, f"127.0.0.1:{9000 + self.rank}"
        )
        return self.setup_info

    def train(self, until: int) -> RankChunk:
        self.last_chunk = self._train(until)
        return self.last_chunk

    def settle(self) -> RankIdle:
        return RankIdle(self.progress(), self.setup_info, self.last_chunk)

    def _train(self, until: int) -> RankChunk:
        losses = {}
        while self.step < until:
            where = (self.attempt, self.rank, self.step + 1)
            if where in self.script.kill:
                if self.script.on_kill:
                    self.script.on_kill()
                raise RankDied(self.rank, "the actor died unexpectedly")
            if where in self.script.error:
                raise ValueError(f"loss is nan at step {self.step + 1}")
            if where in self.script.freeze:
                self.frozen = True
                self.script.release.wait()
                return RankChunk(self.rank, self.step, losses)
            self.step += 1
            self.script.trained.append(where)
            losses[self.step] = 1.0 / self.step
        self.phase = "idle"
        steps = [
            {"step": s, "loss": loss, "seconds": 0.1, "tokens": 64} for s, loss in losses.items()
        ]
        return RankChunk(self.rank, self.step, losses, {"tokens_per_second": 1.0}, steps)

    def save(self, keep: int) -> RankSaved:
        path = f"/ckpt/step-{self.step:08d}"
        if self.step in self.script.full_disk:
            return RankSaved(None, f"{path}: save failed: rank 1: ENOSPC: No space left on device")
        if self.rank == 0:
            self.script.saved = self.step
            if self.script.on_save:
                self.script.on_save(self.step)
        self.saved_step = self.step
        return RankSaved(path)

    def progress(self) -> RankProgress:
        if self.frozen:
            self.script.release.wait()
        return RankProgress(self.step, self.phase, self.step, "", self.saved_step)

    def stats(self) -> dict[str, Any]:
        return {"rank": self.rank, "step": self.step}

    def close(self) -> None:
        self.script.release.set()


def scripted_pool(script: Script, capacity: int, mp: int = 1) -> InProcessPool:
    return InProcessPool(
        lambda rank, world, attempt: ScriptedRank(script, rank, world, attempt), capacity, mp
    )
