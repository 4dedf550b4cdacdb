"""Scripted ranks for the controller's unit tests: they train instantly, keep their
"checkpoints" in a shared script, and die, freeze or fail where the test says."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from workers.messages import RankChunk, RankIdle, RankProgress, RankSaved, RankSetup
from workers.worker_group import InProcessPool, RankDied
from zeroservice.config import ConfigError


@dataclass
class Script:
    """What every rank of every attempt shares: the newest saved step (the disk) and
    the faults to inject, keyed by (attempt, rank, step)."""

    saved: int = 0
    saved_history: list[dict[str, Any]] = field(default_factory=list)
    """The history points the newest save carries."""
    kill: set[tuple[int, int, int]] = field(default_factory=set)
    freeze: set[tuple[int, int, int]] = field(default_factory=set)
    error: set[tuple[int, int, int]] = field(default_factory=set)
    stuck: set[tuple[int, int, int]] = field(default_factory=set)
    """Where a rank waits on a collective until it is interrupted (a transfer from a peer
    killed mid-message: see zeroservice/interrupt.py), then raises."""
    die_after_commit: set[tuple[int, int, int]] = field(default_factory=set)
    """(attempt, rank, step) of a save that commits, then loses that rank before it
    answers (the save's report is lost with it)."""
    nan: dict[tuple[int, int], float] = field(default_factory=dict)
    """(rank, step): a loss that is not finite there (a diverging job)."""
    full_disk: set[int] = field(default_factory=set)
    """Steps whose save fails (ENOSPC) on every rank."""
    fail_setup: set[int] = field(default_factory=set)
    """Attempts whose rank 0 fails to join the group."""
    refuse_setup: set[int] = field(default_factory=set)
    """Attempts whose ranks' engines refuse the configuration (ConfigError)."""
    refuse_step: set[tuple[int, int, int]] = field(default_factory=set)
    """Where a rank's engine refuses a forward (ConfigError: ranks read different experts)."""
    on_kill: Any = None
    on_save: Any = None
    """Called with the step saved (by rank 0)."""
    release: threading.Event = field(default_factory=threading.Event)
    """Set when a group is shut down: frozen and waiting ranks return."""
    trained: list[tuple[int, int, int]] = field(default_factory=list)
    """(attempt, rank, step) of every step trained."""
    redundancy: int = 2
    """K: a rank's host copy (see [Note: live resize]) is refreshed every K steps."""
    peers_incomplete: bool = False
    """The survivors' copies lack a lost rank's shards: regroup falls back on the disk."""
    fail_regroup: bool = False
    lost_copy: int = 0
    """The last killed rank's copy step: its neighbour holds that copy."""
    living: dict[int, ScriptedRank] = field(default_factory=dict)
    """The rank objects not closed, by id: what a regroup's members hold together."""


class ScriptedRank:
    def __init__(self, script: Script, rank: int, world: int, attempt: int):
        self.script, self.rank, self.world, self.attempt = script, rank, world, attempt
        self.step = 0
        self.phase = "created"
        self.frozen = False
        self.saved_step = -1
        self.since_save: dict[int, float] = {}
        """Losses of the steps trained since its last save (``RankIdle.since_save``)."""
        self.saved_history: list[dict[str, Any]] = []
        self.newest: tuple[int, str] | None = None
        """(step, path) of the newest checkpoint it saved or loaded."""
        self.copied = 0
        """The step of this rank's last host copy."""
        self.interrupted = threading.Event()
        self.failed = ""
        """How its last train ended if it raised (``RankIdle.failed``)."""
        self.term = 0
        """The newest supervisor term it settled for: older calls are refused."""
        script.living[id(self)] = self

    def setup(self, *args: Any) -> RankSetup:
        if self.attempt in self.script.fail_setup and self.rank == 0:
            raise RuntimeError("the rendezvous timed out")
        if self.attempt in self.script.refuse_setup:
            raise ConfigError("stage3_leaf_modules: 'MoE' names no module with parameters")
        self.step = self.script.saved
        self.saved_history, self.since_save = list(self.script.saved_history), {}
        loaded = f"step-{self.step:08d}" if self.step else None
        self.newest = (self.step, loaded) if loaded else None
        self.phase = "ready"
        self.setup_info = RankSetup(
            self.rank,
            self.rank,
            0,
            self.step,
            loaded,
            f"127.0.0.1:{9000 + self.rank}",
            history=list(self.script.saved_history),
        )
        return self.setup_info

    def train(self, until: int, term: int = 0) -> RankChunk:
        if term < self.term:  # a lost supervisor's call, after its successor settled
            return RankChunk(self.rank, self.step, {})
        self.unreported: dict[int, float] = {}
        self.failed = ""
        try:
            chunk = self._train(until)
        except Exception as exc:
            self.failed = f"{type(exc).__name__}: {exc}"
            raise
        self.since_save.update(chunk.losses)
        return chunk

    def regroup(self, world: int, rank: int, restarts: int, grow: bool, term: int = 0) -> RankSetup:
        """As RankWorker.regroup: the members restore the step their copies share (to
        grow: the step they all stand at), or the newest checkpoint."""
        if term < self.term:
            raise RuntimeError(f"a re-forming of supervisor term {term} after term {self.term}")
        if self.script.fail_regroup:
            raise RuntimeError("the rendezvous timed out")
        others = list(self.script.living.values())
        self.rank, self.world = rank, world
        fallback = ""
        if grow:
            self.step = max(r.step for r in others)
        elif self.script.peers_incomplete:
            fallback = "no copy of old rank 1's shards"
            self.step = self.script.saved
        else:
            self.step = min([r.copied for r in others] + [self.script.lost_copy])
        self.copied = self.step
        loaded = f"step-{self.step:08d}" if fallback else f"host memory at step {self.step}"
        if fallback:
            self.newest = (self.step, loaded)
        kept = {s: x for s, x in getattr(self, "unreported", {}).items() if s <= self.step}
        self.unreported = {}
        steps = [{"step": s, "loss": x, "seconds": 0.1, "tokens": 64} for s, x in kept.items()]
        chunk = RankChunk(rank, self.step, kept, {}, steps) if kept and not grow else None
        self.setup_info = RankSetup(
            rank,
            rank,
            0,
            self.step,
            loaded,
            f"127.0.0.1:{9000 + rank}",
            fallback=fallback,
            unreported=chunk,
            phases={"rendezvous": 0.1 * (rank + 1), "restore": 0.2},  # the last rank slowest
        )
        return self.setup_info

    def settle(self, term: int = 0) -> RankIdle:
        self.term = max(self.term, term)
        steps = [
            {"step": s, "loss": x, "seconds": 0.1, "tokens": 64}
            for s, x in sorted(self.since_save.items())
        ]
        since_save = RankChunk(self.rank, self.step, dict(self.since_save), {}, steps)
        return RankIdle(
            self.progress(),
            self.setup_info,
            since_save,
            self.saved_history,
            self.failed,
            self.newest,
        )

    def _train(self, until: int) -> RankChunk:
        losses = {}
        while self.step < until:
            where = (self.attempt, self.rank, self.step + 1)
            if where in self.script.kill:
                self.script.lost_copy = self.copied
                if self.script.on_kill:
                    self.script.on_kill()
                raise RankDied(self.rank, "the actor died unexpectedly")
            if where in self.script.error:
                raise ValueError(f"loss is nan at step {self.step + 1}")
            if where in self.script.refuse_step:
                raise ConfigError("stage 3: this forward read experts.1.w on some ranks only")
            if where in self.script.stuck:
                self.script.stuck.discard(where)  # once: after the regroup it trains on
                self.phase = "training, micro-batch 0"
                while not self.interrupted.wait(0.02):
                    if self.script.release.is_set():  # the group was shut down
                        return RankChunk(self.rank, self.step, losses)
                raise RuntimeError("collective abandoned: " + self.reason)
            if where in self.script.freeze:
                self.frozen = True
                self.script.release.wait()
                return RankChunk(self.rank, self.step, losses)
            self.step += 1
            if self.step % self.script.redundancy == 0:
                self.copied = self.step
            self.script.trained.append(where)
            loss = self.script.nan.get((self.rank, self.step), 1.0 / self.step)
            losses[self.step] = self.unreported[self.step] = loss
        self.phase = "idle"
        steps = [
            {"step": s, "loss": loss, "seconds": 0.1, "tokens": 64} for s, loss in losses.items()
        ]
        return RankChunk(self.rank, self.step, losses, {"tokens_per_second": 1.0}, steps)

    def save(
        self, keep: int, history: list[dict[str, Any]] | None = None, term: int = 0
    ) -> RankSaved:
        if term < self.term:
            return RankSaved(None, f"refused: a call of supervisor term {term}")
        path = f"/ckpt/step-{self.step:08d}"
        if self.step in self.script.full_disk:
            return RankSaved(None, f"{path}: save failed: rank 1: ENOSPC: No space left on device")
        committed = (self.attempt, self.rank, self.step) in self.script.die_after_commit
        if self.rank == 0 or committed:
            self.script.saved = self.step
            self.script.saved_history = list(history or [])
            if self.script.on_save and self.rank == 0:
                self.script.on_save(self.step)
        if committed:
            if self.script.on_kill:
                self.script.on_kill()
            raise RankDied(self.rank, "the actor died unexpectedly")
        self.saved_step = self.step
        self.newest = (self.step, path)
        self.saved_history = list(history or [])
        self.since_save = {}
        return RankSaved(path)

    def progress(self) -> RankProgress:
        if self.frozen:
            self.script.release.wait()
        return RankProgress(self.step, self.phase, self.step, "", self.saved_step)

    def stats(self) -> dict[str, Any]:
        return {"rank": self.rank, "step": self.step}

    def interrupt(self, lost: list[int]) -> None:
        self.reason = f"rank(s) {lost} lost"
        self.interrupted.set()

    def close(self) -> None:
        self.script.living.pop(id(self), None)
        self.script.release.set()


def scripted_pool(script: Script, capacity: int, mp: int = 1) -> InProcessPool:
    return InProcessPool(
        lambda rank, world, attempt: ScriptedRank(script, rank, world, attempt), capacity, mp
    )
