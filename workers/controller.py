"""The supervisor's control loop as a state machine that can be stepped.

[Note: supervised job]
Each ``step()`` does the work of the current state and moves to the next, returning
(previous, next); ``run()`` steps until a terminal state. The states (workers/
job_states.py) and the allowed moves (workers.state.TRANSITIONS):

    queued    → starting
    starting  place the largest group of min_dp..max_dp replicas that fits now and
    resizing  start its ranks (each loads the newest valid checkpoint, resharded to
              the new N_d) → running; nothing fits → failed; a start that fails
              counts a restart → resizing (or failed, the budget spent)
    running   one chunk: train up to the next checkpoint boundary while the watchdog
              polls every rank, then every rank saves → running (next chunk) |
              succeeded (all steps) | resizing (capacity returned: at a checkpoint
              boundary, grow up to max_dp) | resizing (a lost worker or a stall:
              counts a restart; down to min_dp) | failed (a training error, the
              restart budget spent, a loss that is not finite: see [Note: a
              diverged job]) | cancelled. A save that failed (a full disk)
              is an event and the job goes on: running, the next save tries again
              (after the last step, the save alone, up to FINAL_SAVE_TRIES times)

[Note: live resize]
With ``engine.redundancy: host-copy`` a lost or stalled rank does not restart the
job: its process is killed, the others' calls end (their collectives fail), and the
same rank actors re-form a smaller group (a fresh rendezvous) and restore the training
state from host memory: each rank's last copy of its own shards and its neighbour's
(zeroservice/redundancy.py). At most ``redundancy_interval`` steps are trained again
and no file is read. When the survivors lack a lost rank's shards
(two neighbours lost at once) every rank loads the newest checkpoint instead, still in
place; when a survivor does not come back or the re-formed group fails to start, the
job restarts from the checkpoint as before. Either way the event says which. Growth is
live too: while the group is below max_dp the chunks are one step long; free room on
the cluster is taken at once as vacant seats beside the lost ranks' own, a newcomer's
actor is started on every usable vacant seat while the group trains, and at the first
step boundary where newcomers are up they join and the others hand them their shards
(copied at that boundary, so nothing is trained again). A re-forming rank builds its
new engine without initial weights (``zeroservice.RESTORED``; the state arrives from
the peers or the checkpoint), and a group of one keeps no host copy. With model
parallelism a replica is whole or gone: a lost rank's MP partners are stopped with it,
the group re-forms at one replica fewer, and each MP slice restores over its own DP
group, the slices agreeing on one step first; growth seats whole replicas, the ``mp``
newcomers of each in one bundle (one node), as placement does.

    running   lost / stalled, live → resizing (``Regrouping``): drop the lost
              ranks, re-form → running | resizing (restart from the checkpoint)
    running   room to grow, live → resizing (``Regrouping``, grow) → running

Every move passes ``check_transition`` and then the callbacks (the job record's
status is one); every restart, resize, placement and checkpoint is an event.
The ranks are reached only through a WorkerPool/WorkerGroup (workers/worker_group.py),
so the unit tests step the machine with in-process ranks.
"""

from __future__ import annotations

import enum
import math
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .history import step_points
from .job_record import JobRecord
from .job_states import (
    Cancelled,
    Failed,
    Queued,
    Regrouping,
    Resizing,
    Running,
    Starting,
    State,
    Succeeded,
    replacing_supervisor,
)
from .messages import RankChunk, RankIdle, RankProgress, RankSetup, Succession
from .spec import JobSpec
from .state import check_transition
from .tracking import NoTracking, Tracking
from .watchdog import diagnose
from .worker_group import (
    GroupStartFailed,
    RankDied,
    RankError,
    WorkerGroup,
    WorkerPool,
    describe_rank,
)

Callback = Callable[[State, State], None]
FINAL_SAVE_TRIES = 3
"""How often the checkpoint after the last step is tried before the job fails."""
SETTLE_S = 10.0
"""How long the survivors of a lost rank get to end their failed call (their
collectives fail as soon as the lost rank's connections close)."""


class Interruption(enum.Enum):
    """Why a call on the ranks did not finish on every rank."""

    CANCELLED = "cancelled"
    LOST = "worker_lost"
    STALLED = "stalled"
    ERROR = "training_error"
    REFUSED = "config_error"
    """A rank's engine raised ConfigError in a call: every retry would fail alike."""


@dataclass
class Interrupted:
    why: Interruption
    message: str = ""
    ranks: list[int] = field(default_factory=list)


class JobController:
    """See [Note: supervised job]."""

    def __init__(
        self,
        spec: JobSpec,
        pool: WorkerPool,
        record: JobRecord,
        cancel: threading.Event | None = None,
        succession: Succession | None = None,
        tracker: Tracking | None = None,
    ):
        self.spec, self.pool, self.record = spec, pool, record
        self.tracker: Tracking = tracker or NoTracking()
        """Experiment tracking (workers/tracking.py): per-step points, checkpoints, the
        run's end."""
        self.cancel = cancel or threading.Event()
        self.cancel_reason = "cancelled by request"
        self.state: State = Queued() if succession is None else replacing_supervisor(succession)
        self._new_group: WorkerGroup | None = None
        """A group started in the current step, not yet held by a state."""
        self.callbacks: list[Callback] = [self._record_status, self._end_tracking]
        self.term = 0 if succession is None else succession.restarts
        """Sent with every train, save and settle: the ranks refuse calls of an older
        supervisor once a newer one settled them (see [Note: supervisor terms] in
        workers/rank.py)."""
        self.reported_save = 0 if succession is None else succession.reported_save
        """The step of the newest save recorded as ``checkpoint/saved``, here or (a
        supervisor that replaces a lost one) in the control plane's store: a newer one
        found is reported (``_stand_at``)."""
        if succession is not None:  # a machine that begins elsewhere (a replaced supervisor)
            record.restarts = succession.restarts
            first = self.state
            record.set_status(first.kind, first.reason, first.message)

    # -- stepping ---------------------------------------------------------------------
    def step(self) -> tuple[State, State]:
        previous = self.state
        self._new_group = None
        try:
            following = self._next(previous)
        except Exception:
            self._teardown(previous, clean=False)
            if self._new_group is not None:
                self._new_group.shutdown(clean=False)
            following = Failed(reason="internal_error", message=traceback.format_exc(limit=8))
        check_transition(previous.kind, following.kind)
        self.state = following
        for callback in self.callbacks:
            callback(previous, following)
        return previous, following

    def run(self) -> State:
        while not self.state.is_terminal:
            self.step()
        return self.state

    def request_cancel(self, reason: str) -> None:
        self.cancel_reason = reason
        self.cancel.set()

    @property
    def group(self) -> WorkerGroup | None:
        return self.state.group if isinstance(self.state, Running | Regrouping) else None

    @property
    def live(self) -> bool:
        """Resizes keep the rank actors and restore from host memory (see [Note: live
        resize]); otherwise every resize restarts from the checkpoint."""
        redundancy = getattr(self.spec.zero_config(), "redundancy", "none")
        return redundancy != "none"

    def _next(self, state: State) -> State:
        if isinstance(state, Queued):
            res = self.spec.resources
            return Starting(message=f"asking Ray for {res.lowest_dp}-{res.highest_dp} replicas")
        if isinstance(state, Resizing) and state.adopt:
            adopted = self._adopt()
            if adopted is not None:
                return adopted
        if isinstance(state, Starting | Resizing):
            return self._place()
        if isinstance(state, Regrouping):
            return self._regroup(state)
        if isinstance(state, Running):
            return self._chunk(state)
        raise AssertionError(f"no step from {state}")

    def _record_status(self, previous: State, following: State) -> None:
        self.record.set_status(following.kind, following.reason, following.message)

    def _end_tracking(self, previous: State, following: State) -> None:
        if following.is_terminal:
            self.tracker.close(str(following.kind))

    def _teardown(self, state: State, clean: bool) -> None:
        if isinstance(state, Running | Regrouping):
            state.group.shutdown(clean)

    # -- starting and resizing ----------------------------------------------------------
    def _place(self) -> State:
        spec, res = self.spec, self.spec.resources
        if self.cancel.is_set():
            return self._cancelled()
        placement = self.pool.place(
            res.lowest_dp, res.highest_dp, spec.timeouts.bootstrap_s, self.cancel
        )
        if self.cancel.is_set():  # asked while it waited for room: the cancel wins
            if placement is not None:
                placement.remove()
            return self._cancelled()
        if placement is None:
            from .placement import bundle

            return Failed(
                reason="insufficient_resources",
                message=f"no room for {res.lowest_dp} replica(s) of {bundle(res)} each within "
                f"{spec.timeouts.bootstrap_s:g} s (free now: {self.pool.free()})",
            )
        try:
            group = self._pending(self.pool.start(placement, self.record.restarts))
        except GroupStartFailed as failure:
            return self._cancelled() if self.cancel.is_set() else self._start_failed(failure)
        if self.cancel.is_set():
            group.shutdown(clean=False)
            return self._cancelled()
        return self._started(group)

    def _pending(self, group: WorkerGroup) -> WorkerGroup:
        """A group started within this step: torn down with the step's state if the
        step raises before a state holds it (see ``step``)."""
        self._new_group = group
        return group

    def _adopt(self) -> State | None:
        """Go on with the ranks a lost supervisor left, once the call it made is over;
        None (the group torn down) when there are none or they do not settle."""
        group = self.pool.adopt()
        if group is None:
            return None
        self._pending(group)
        stop, idle = self._watch(group, "settle", self.term)
        steps = {i.progress.step for i in idle if i is not None}
        broken = [(r, i.failed) for r, i in enumerate(idle) if i is not None and i.failed]
        if stop is not None or len(steps) != 1 or broken:
            group.shutdown(clean=False)
            if broken and not self.cancel.is_set():
                rank, why = broken[0]
                self.record.event(
                    "resize",
                    "adoption_refused",
                    f"the lost supervisor's last call failed on {self._describer(group)(rank)}"
                    f" ({why}): its group cannot go on; restarting from the newest checkpoint",
                    ranks=[r for r, _ in broken],
                )
            return self._cancelled() if self.cancel.is_set() else None
        group.setups = [i.setup for i in idle]
        (step,) = steps
        saved = idle[0].progress.saved_step
        self._note_size(group.dp)
        found = [i.newest_checkpoint for i in idle if i.newest_checkpoint is not None]
        self._stand_at(
            max(saved, group.setups[0].start_step),
            max(found) if found else None,
            "before its supervisor was lost; found by its ranks",
        )
        self._recover_history(idle, group.dp)
        mp = self.spec.resources.mp
        self.record.event(
            "placed",
            "adopted",
            f"{group.world} running ranks (dp {group.dp} × mp {mp}) at step {step}",
            ranks=[
                {"rank": r, "node": f"{a['ip']}/{a['node_id'][:8]}", "gpus": a["gpus"]}
                for r, a in enumerate(group.addresses)
            ],
        )
        unsaved = step > self.record.step  # trained, not yet saved: save before going on
        return Running(
            group=group, step=step, message=f"dp {group.dp} × mp {mp}", save_first=unsaved
        )

    def _recover_history(self, idle: list[RankIdle], dp: int) -> None:
        """The steps a lost supervisor may have held without the control plane having
        polled them: those its last save carried, then the ranks' reports since (each
        step is kept once, so those already stored are harmless)."""
        saved = {p["step"]: p for i in idle for p in i.saved_history}
        self.record.add_points([saved[s] for s in sorted(saved)])
        chunks = [i.since_save for i in idle if i.since_save.steps]
        if chunks:
            self.record.add_chunk(chunks, {})
            self._add_points(chunks, dp)

    def _note_size(self, dp: int) -> None:
        previous = self.record.dp
        with self.record.lock:
            self.record.dp = dp
        self.record.keep_ranks(dp * self.spec.resources.mp)
        if previous and previous != dp:
            self.record.event(
                "resize",
                "shrunk" if dp < previous else "grown",
                f"data-parallel degree {previous} -> {dp}",
                dp_from=previous,
            )

    def _started(self, group: WorkerGroup) -> State:
        mp = self.spec.resources.mp
        self._note_size(group.dp)  # only a group that started changes the job's size
        first = group.setups[0]
        self._carried(first.history)
        self._loaded(first)
        origin = (
            f"checkpoint {first.loaded} at step {first.start_step}" if first.loaded else "scratch"
        )
        self.record.event(
            "placed",
            "started",
            f"{group.world} ranks (dp {group.dp} × mp {mp}) from {origin}",
            from_checkpoint=first.loaded,
            ranks=[
                {"rank": r, "node": f"{a['ip']}/{a['node_id'][:8]}", "gpus": a["gpus"]}
                for r, a in enumerate(group.addresses)
            ],
        )
        return Running(group=group, step=first.start_step, message=f"dp {group.dp} × mp {mp}")

    def _start_failed(self, failure: GroupStartFailed) -> State:
        """A start the ranks' engines refused (a configuration its model cannot take)
        fails the job at once; any other failed start is a restart."""
        if failure.refused:
            return Failed(reason="config_error", message=failure.message)
        return self._restart("bootstrap_failed", failure.message)

    def _restart(self, reason: str, message: str, ranks: list[int] | None = None) -> State:
        """A restart from the newest checkpoint; failed when the budget is spent."""
        with self.record.lock:
            self.record.restarts += 1
            restarts = self.record.restarts
        self.record.event("restart", reason, message, ranks=ranks or [], restarts=restarts)
        if restarts > self.spec.max_restarts:
            budget = self.spec.max_restarts
            return Failed(reason=reason, message=f"{message} (restart budget of {budget} spent)")
        return Resizing(reason=reason, message=f"restarting from the newest checkpoint: {message}")

    def _loaded(self, first: RankSetup) -> None:
        """The ranks stand at the checkpoint they loaded."""
        self._stand_at(
            first.start_step,
            (first.start_step, first.loaded) if first.loaded else None,
            "before its group or supervisor was lost; found when loaded",
        )

    def _stand_at(self, step: int, found: tuple[int, str] | None, how: str) -> None:
        """The job's step is ``step``; ``found``, a checkpoint (step, directory) the ranks
        saved or loaded, is reported when its ``checkpoint/saved`` event never reached
        the control plane: the ranks commit a save together, and a rank lost after the
        commit but before every rank answered interrupts the save call; a supervisor
        lost after the commit takes the event it had not handed on with it (the
        control plane tells its successor the newest save it stored,
        ``Succession.reported_save``)."""
        if found is not None and found[0] <= self.reported_save:
            found = None  # reported already
        with self.record.lock:  # the step and its event in one poll, or neither
            self.record.step = step
            if found is not None:
                self.record.event(
                    "checkpoint",
                    "saved",
                    f"step {found[0]}: {found[1]} (committed {how})",
                    path=found[1],
                    found=True,
                )
        if found is not None:
            self.reported_save = found[0]
            self.tracker.checkpoint(*found)

    def _cancelled(self) -> State:
        return Cancelled(message=self.cancel_reason)

    # -- running: one chunk -----------------------------------------------------------------
    def _chunk(self, state: Running) -> State:
        spec, group, step = self.spec, state.group, state.step
        if state.save_first or (not state.failed_saves and self._unsaved_boundary(step)):
            return self._save(state, step)
        if step >= spec.steps and not state.failed_saves:
            return self._succeeded(group)
        if step < spec.steps:
            interval = spec.checkpoint.interval_steps
            target = min(spec.steps, (step // interval + 1) * interval)
            if self.live and group.dp < spec.resources.highest_dp:
                more = self._room_to_grow(group)
                if more > 0:
                    return self._grow_in_place(group, more, step)
                target = step + 1  # look for room again at the next step boundary
            t0 = time.monotonic()
            stop, chunks = self._watch(group, "train", target, self.term)
            if stop is not None:
                return self._interrupted(group, stop)
            self.record.add_chunk(chunks, group.stats())
            self._add_points(chunks, group.dp)
            self._progress_line(step, target, time.monotonic() - t0)
            diverged = _first_non_finite(chunks)
            if diverged is not None:
                return self._diverged(group, *diverged)
            step = target
            if step % interval and step < spec.steps:  # a one-step chunk between saves
                return Running(
                    group=group, step=step, message=state.message, failed_saves=state.failed_saves
                )
        return self._save(state, step)

    def _unsaved_boundary(self, step: int) -> bool:
        """The ranks stand at a checkpoint boundary (or the last step) whose save was
        never reported: a live resize restored that step from the peers' memory after
        a rank was lost in (or just after) its save, or after the last chunk's train.
        The save is made again before anything else, so that a job succeeds only with
        its final checkpoint saved and reported (see [Note: supervised job])."""
        spec = self.spec
        boundary = step % spec.checkpoint.interval_steps == 0 or step >= spec.steps
        return step > self.reported_save and boundary

    def _save(self, state: Running, step: int) -> State:
        """Every rank saves. A failed save (a full disk) is an event, not a failure: the
        next chunk's save tries again; after the last step it is tried again up to
        ``FINAL_SAVE_TRIES`` times. See [Note: failed save]."""
        spec, group = self.spec, state.group
        carried = self.record.unstored(step)
        stop, saves = self._watch(group, "save", spec.checkpoint.keep, carried, self.term)
        if stop is not None:
            return self._interrupted(group, stop)
        failed = [s.error for s in saves if s.error]
        if failed:
            self.record.event("checkpoint", "save_failed", f"step {step}: {failed[0]}", step=step)
            tries = state.failed_saves + 1
            if step >= spec.steps and tries >= FINAL_SAVE_TRIES:
                group.shutdown(clean=False)
                return Failed(
                    reason="checkpoint_failed",
                    message=f"the final checkpoint failed {tries} times: {failed[0]}",
                )
            return Running(group=group, step=step, message=state.message, failed_saves=tries)
        path = saves[0].path
        with self.record.lock:  # the step and its event in one poll, or neither
            self.record.step = step
            self.record.event("checkpoint", "saved", f"step {step}: {path}", path=path)
        self.reported_save = step
        if path is not None:
            self.tracker.checkpoint(step, path)
        if step >= spec.steps:
            return self._succeeded(group)
        more = self._room_to_grow(group)
        if more > 0 and self.live:
            return self._grow_in_place(group, more, step)
        if more > 0:
            group.shutdown(clean=False)
            return Resizing(
                reason="capacity_returned",
                message=f"room for {more} more replica(s): growing from the checkpoint",
            )
        return Running(group=group, step=step, message=state.message)

    def _diverged(self, group: WorkerGroup, step: int, loss: float) -> State:
        """A loss that is not finite: see [Note: a diverged job]."""
        group.shutdown(clean=False)
        newest = (
            f"the newest checkpoint, step {self.reported_save}, is from before it"
            if self.reported_save
            else "no checkpoint was saved"
        )
        return Failed(
            reason="diverged",
            message=f"the loss is {loss} at step {step}: training diverged and the chunk "
            f"was not saved; {newest}. Lower optimizer.lr, or set engine.gradient_clipping",
        )

    def _succeeded(self, group: WorkerGroup) -> State:
        group.shutdown(clean=True)
        return Succeeded(message=f"{self.spec.steps} steps")

    def _grow_in_place(self, group: WorkerGroup, more: int, step: int) -> Regrouping:
        return Regrouping(
            group=group,
            grow=more,
            step=step,
            reason="capacity_returned",
            message=f"room for {more} more replica(s): growing in place at step {step}",
        )

    def _room_to_grow(self, group: WorkerGroup) -> int:
        highest = self.spec.resources.highest_dp
        if group.dp >= highest:
            return 0
        if not self.live:
            return min(highest - group.dp, self.pool.available())
        # Live: free room becomes vacant seats now, and the group grows at the first
        # step boundary where their newcomers are up (see [Note: live resize]).
        self.pool.reserve(group, highest - group.dp)
        return min(highest - group.dp, group.vacancies())

    def _progress_line(self, step: int, target: int, seconds: float) -> None:
        spec = self.spec
        accum = spec.zero_config().gradient_accumulation_steps
        dp = self.record.dp
        tokens = (target - step) * spec.micro_batch * accum * spec.model.seq_len * dp
        rate = tokens / seconds if seconds > 0 else 0.0
        loss = self.record.loss_at(target)
        shown = "-" if loss is None else f"{loss:.4f}"
        self.record.line(f"step {target}/{spec.steps} loss {shown} {rate:,.0f} tokens/s dp {dp}")

    def _carried(self, points: list[dict[str, Any]]) -> None:
        """The points a loaded checkpoint carries: the control plane keeps each step
        once, so those it has are harmless, and those a lost supervisor held are back."""
        if points:
            self.record.add_points(points)

    def _add_points(self, chunks: list[RankChunk], dp: int) -> None:
        """The chunk's per-step history, kept and sent to experiment tracking."""
        points = step_points(chunks, self.spec.resources.mp, dp)
        self.record.add_points(points)
        self.tracker.steps(points)

    def _interrupted(self, group: WorkerGroup, stop: Interrupted) -> State:
        lost = stop.why in (Interruption.LOST, Interruption.STALLED)
        mp = self.spec.resources.mp
        replicas = sorted({r // mp for r in stop.ranks})
        if lost and self.live and group.dp - len(replicas) >= 1:
            restarted = self._restart(stop.why.value, stop.message, ranks=stop.ranks)
            if isinstance(restarted, Failed):
                group.shutdown(clean=False)
                return restarted
            leaving = self._whole_replicas(stop.ranks, group.world)
            without = (
                f"rank(s) {leaving}" if mp == 1 else f"replica(s) {replicas} (ranks {leaving})"
            )
            return Regrouping(
                group=group,
                lost=leaving,
                reason=stop.why.value,
                message=f"re-forming without {without}: {stop.message}",
            )
        group.shutdown(clean=False)
        if stop.why is Interruption.CANCELLED:
            return self._cancelled()
        if stop.why in (Interruption.ERROR, Interruption.REFUSED):
            return Failed(reason=stop.why.value, message=stop.message)
        return self._restart(stop.why.value, stop.message, ranks=stop.ranks)

    def _whole_replicas(self, ranks: list[int], world: int) -> list[int]:
        """``ranks`` with their MP partners: a replica is whole or gone."""
        mp = self.spec.resources.mp
        replicas = {r // mp for r in ranks}
        return [r for r in range(world) if r // mp in replicas]

    # -- live resize ---------------------------------------------------------------------
    def _regroup(self, state: Regrouping) -> State:
        """See [Note: live resize]."""
        spec, group = self.spec, state.group
        if self.cancel.is_set():
            group.shutdown(clean=False)
            return self._cancelled()
        before = group.dp
        t0 = time.monotonic()
        if state.lost and not group.drop(state.lost, SETTLE_S):
            survivors = [r for r in range(group.world) if r not in state.lost]
            seen = group.progress(survivors, 2.0)
            where = "; ".join(
                f"rank {r}: {p.phase}, last {p.last_collective or 'none'}"
                for r, p in seen.items()
                if p is not None
            )
            group.shutdown(clean=False)
            message = (
                f"a surviving rank did not end its call in {SETTLE_S:g} s "
                f"({where or 'no answer'}): restarting from the newest checkpoint"
            )
            # The status stays "resizing": without this event the message would be lost.
            self.record.event("resize", "regroup_failed", message)
            return Resizing(reason=state.reason, message=message)
        late = self._whole_replicas(group.dead(), group.world) if state.lost else []
        if late and not group.drop(late, SETTLE_S):
            group.shutdown(clean=False)
            return self._restart(state.reason, f"rank(s) {late} lost while re-forming")
        if state.lost and group.dp < spec.resources.lowest_dp:
            group.shutdown(clean=False)
            message = (
                f"{group.dp} replica(s) left, fewer than min_dp "
                f"{spec.resources.lowest_dp}: restarting from the newest checkpoint"
            )
            self.record.event("resize", "below_min_dp", message)  # the status stays resizing
            return Resizing(reason=state.reason, message=message)
        if state.grow:
            added = self.pool.extend(group, state.grow, spec.timeouts.bootstrap_s)
            if not added:  # the room went before we took it
                return Running(group=group, step=state.step, message=state.message)
        try:
            setups = group.regroup(self.record.restarts, not state.lost, self.term)
        except GroupStartFailed as failure:
            group.shutdown(clean=False)
            return self._cancelled() if self.cancel.is_set() else self._start_failed(failure)
        if self.cancel.is_set():
            group.shutdown(clean=False)
            return self._cancelled()
        group.setups = setups
        first = setups[0]
        seconds = time.monotonic() - t0
        self._carried(first.history)
        if first.unreported is not None:  # steps whose chunk was lost with the rank
            self.record.add_chunk([first.unreported], {})
            self._add_points([first.unreported], before)
        self._note_size(group.dp)
        if first.fallback:
            loaded = f"checkpoint {first.loaded}" if first.loaded else "scratch (no checkpoint yet)"
            origin = f"{loaded} (the peers' memory lacked: {first.fallback})"
        else:
            origin = first.loaded or "scratch"
        if first.fallback:
            self._loaded(first)
        self.record.event(
            "placed",
            "regrouped",
            f"{group.world} ranks (dp {before} -> {group.dp}) in place from {origin} at step "
            f"{first.start_step} in {seconds:.2f} s",
            from_checkpoint=first.loaded if first.fallback else None,
            from_peers=not first.fallback,
            seconds=seconds,
            **_slowest_phases(setups),
            newcomers=group.newcomer_starts,
            ranks=[
                {"rank": r, "node": f"{a['ip']}/{a['node_id'][:8]}", "gpus": a["gpus"]}
                for r, a in enumerate(group.addresses)
            ],
        )
        group.newcomer_starts = []
        mp = spec.resources.mp
        return Running(group=group, step=first.start_step, message=f"dp {group.dp} × mp {mp}")

    # -- watching a call on every rank ---------------------------------------------------
    def _watch(
        self, group: WorkerGroup, method: str, *args: Any
    ) -> tuple[Interrupted | None, list]:
        """Wait for ``method`` on every rank, polling progress. See [Note: watchdog]."""
        timeout = self.spec.timeouts.step_s
        poll = max(0.2, min(2.0, timeout / 4))
        group.begin(method, *args)
        results: list[Any] = [None] * group.world
        pending = set(range(group.world))
        last_change = dict.fromkeys(pending, time.monotonic())
        previous: dict[int, tuple] = {}
        last_seen: dict[int, RankProgress] = {}
        while pending:
            if self.cancel.is_set():
                return Interrupted(Interruption.CANCELLED), results
            replies = sorted(group.wait(poll).items())
            died = [(r, a) for r, a in replies if isinstance(a, RankDied)]
            if died:  # every rank lost with it (a node of several), not the first alone
                lost = sorted({r for r, _ in died} | set(group.dead()))
                return self._lost(group, lost, died[0][1].message), results
            for rank, answer in replies:
                pending.discard(rank)
                if isinstance(answer, RankError):
                    dead = group.dead()
                    if dead:
                        return self._lost(group, dead, answer.message), results
                    why = Interruption.REFUSED if answer.refused else Interruption.ERROR
                    return Interrupted(why, f"rank {rank}: {answer.message}", [rank]), results
                results[rank] = answer
            if not pending:
                break
            waiting = sorted(pending)
            answers = group.progress(waiting, min(2.0, timeout))
            now = time.monotonic()
            for r, p in answers.items():
                if p is not None:
                    last_seen[r] = p
                    if previous.get(r) != p.key:
                        previous[r], last_change[r] = p.key, now
            if any(now - last_change[r] > timeout for r in waiting):
                dead = group.dead()
                if dead:
                    return self._lost(group, dead, ""), results
                stall = diagnose(answers, last_seen, timeout, describe=self._describer(group))
                return Interrupted(Interruption.STALLED, stall.message, stall.stalled), results
        return None, results

    def _describer(self, group: WorkerGroup) -> Callable[[int], str]:
        mp = self.spec.resources.mp
        return lambda r: describe_rank(r, mp, group.addresses[r] if group.addresses else None)

    def _lost(self, group: WorkerGroup, ranks: list[int], detail: str) -> Interrupted:
        names = ", ".join(self._describer(group)(r) for r in ranks)
        return Interrupted(
            Interruption.LOST, f"lost {names}" + (f": {detail}" if detail else ""), ranks
        )


def _first_non_finite(chunks: list[RankChunk]) -> tuple[int, float] | None:
    """The first step whose loss on some rank is NaN or infinite, and that loss.

    [Note: a diverged job]
    A loss that is NaN or infinite has already reached the weights: its gradients are
    averaged into every replica's. Such a job would otherwise train on to its last step,
    saving checkpoints of NaN weights that a restart would resume from, and succeed.
    So the supervisor reads every rank's losses after each chunk (nothing is added to
    the step: a rank stopping on its own would leave its peers in a collective), and a
    chunk with a non-finite loss fails the job as ``diverged`` before its save: the
    newest checkpoint is from before it. With fp16 a step whose gradients overflow is
    skipped by the loss scaler; a non-finite loss (the forward itself) is not a
    scaling matter and fails the job too, as Megatron-LM's loss check does."""
    found = [
        (step, loss)
        for chunk in chunks
        for step, loss in chunk.losses.items()
        if not math.isfinite(loss)
    ]
    return min(found) if found else None


def _slowest_phases(setups: list[RankSetup]) -> dict[str, Any]:
    """The phases (seconds each) of the rank whose re-forming took longest: where a
    resize's time went, for its event."""
    slowest = max(setups, key=lambda s: sum(s.phases.values()))
    return {
        "slowest_rank": slowest.rank,
        "phases": {k: round(v, 4) for k, v in slowest.phases.items()},
    }
