"""One rank of a job: joins the process group, runs the engine, reports and serves metrics.

A plain class; the supervisor wraps it with ``ray.remote`` as a threaded actor, so that
``progress()`` answers while ``train()`` runs (the hang watchdog depends on it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import enum
import gc
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import zeroservice
from zeroservice.checkpoint.export import EXPORT_PREFIX
from zeroservice.checkpoint.storage import has_entries
from zeroservice.comm import CommLedger, bus_factor
from zeroservice.data import micro_batch
from zeroservice.host_memory import return_free_heap
from zeroservice.memory import process_status_kib
from zeroservice.tensor_parallel import mp_groups_of

from .build import build_dataset, build_model, optimizer_factory
from .flops import flops_per_token, peak_tflops
from .messages import RankChunk, RankIdle, RankProgress, RankSaved, RankSetup
from .metrics import RankMetrics
from .rank_env import allocator_settings
from .spec import JobSpec

IMPORTED_AT = time.time()
"""When this module (torch, the engine and the models with it) was imported."""

START_UP_TAGS = ("init", "state", "load", "order", "redundancy")
"""Collectives of start-up, checkpoints, the one-time launch-order agreement and the
peers' host copies (``redundancy``), not of a training step's phases."""


def _process_bytes(field: str) -> int:
    try:
        return process_status_kib(field) * 1024
    except RuntimeError:  # not Linux: no figure rather than a failed step
        return 0


def _reset_process_peak(cuda: bool) -> None:
    """The allocator's or the process's peak starts again at what is held now, so that
    a step's ``peak`` is its own: a rank process outlives its engines (a live
    re-forming), and a lifetime peak would repeat an earlier engine's in every step.
    On a CPU, ``/proc/self/clear_refs`` = 5 resets VmHWM to VmRSS (Linux)."""
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        return
    with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
        f.write("5")


class SupervisorSuperseded(RuntimeError):
    """A re-forming asked by a supervisor older than the one that settled this rank
    (see [Note: supervisor terms]). Train and save refuse such calls with an empty
    answer; a re-forming has none to give, so it raises."""


class RankPhase(enum.Enum):
    """What a rank actor is doing; inside a step the engine's own ``TrainingState`` says
    where it is (``progress``)."""

    CREATED = "created"
    BOOTSTRAP = "bootstrap"
    READY = "ready"
    TRAINING = "training"
    CHECKPOINT = "checkpoint"
    IDLE = "idle"


class Laps:
    """Seconds per named phase of one call (a rank's setup or re-forming), in order, so
    that an event can say where a resize's time went (``RankSetup.phases``)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.monotonic()

    def lap(self, phase: str) -> None:
        now = time.monotonic()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self._last
        self._last = now


def process_started_at() -> float | None:
    """The wall-clock time this process started (Linux; None elsewhere), to 10 ms: how
    long a new rank actor waited for its process before its imports began."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None
    return time.time() - age


def _warm_up() -> None:
    """Pay torch's lazy start-up costs when the actor starts, not inside a group's
    rendezvous: the first optimizer built imports torch._dynamo (seconds on a busy
    CPU), and a newcomer joining a live group would make every member wait for it."""
    torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])


class RankWorker:
    """See the module docstring."""

    def __init__(self, job_id: str, rank: int, spec_json: str, seat: tuple[str, int] | None = None):
        self.job_id, self.rank = job_id, rank
        self.seat = seat
        """(placement group id, bundle) the actor runs on, for a new supervisor."""
        self._membership: dict[str, Any] | None = None
        self._rendezvous = ""
        self.spec = JobSpec.model_validate_json(spec_json)
        self.engine: zeroservice.Engine | None = None
        self.export_prefix = ""
        """What the built model adds to the user's model's names (a checkpoint records
        it for export): ``CausalLMLoss.export_prefix`` for a transformers model."""
        self.metrics: RankMetrics | None = None
        self.step = 0
        self.tokens = 0
        self.tokens_trained = 0
        """Tokens this process trained, steps trained again included: the counter a
        scrape sees, so that it never goes back when a restart or a restore from peers
        rolls ``tokens`` (the job's position) back, which Prometheus would read as a
        counter reset and count the job's tokens again."""
        self._lock = threading.Lock()
        self._phase = RankPhase.CREATED
        self._micro_batch = 0
        self._mp_ledgers: list[CommLedger] = []
        self.metrics_collectives: dict[tuple[str, str], dict[str, float]] = {}
        self._collectives_before: dict[tuple[str, str], dict[str, float]] = {}
        """The collectives' totals at the last step: the next one's bandwidth is of what
        moved since."""
        self._collectives_of_dropped: dict[tuple[str, str], dict[str, float]] = {}
        """The totals of the engines this process dropped (a live re-forming builds a new
        engine, whose ledger starts at 0): the exported counters add them, so that
        they never go down while the process lives."""
        self._last: dict[str, Any] = {}
        self.saved_step = -1
        self._busy = threading.Lock()
        """Held by train and save: one of them at a time, and settle() waits for it."""
        self._term = 0
        """The newest supervisor term this rank settled for (see [Note: supervisor
        terms])."""
        self._failed = ""
        """How the last train or save ended if it raised (``RankIdle.failed``)."""
        self._setup: RankSetup | None = None
        self._since_save: dict[int, dict[str, Any]] = {}
        """Step reports since the last save, by step (``RankIdle.since_save``)."""
        self._saved_history: list[dict[str, Any]] = []
        """The points the last save carried (``RankIdle.saved_history``)."""
        self._newest_checkpoint: tuple[int, str] | None = None
        """(step, directory) of the newest checkpoint saved or loaded
        (``RankIdle.newest_checkpoint``)."""
        self._last_stats: dict[str, Any] = {}
        self._unreported: list[dict[str, Any]] = []
        """This chunk's step reports so far (see ``RankSetup.unreported``)."""
        self._loaded_history: list[dict[str, Any]] = []
        """The history points the loaded checkpoint carries (see ``RankSetup.history``)."""
        self._store: dist.TCPStore | None = None
        """The rendezvous this rank opened for the next group (``open_rendezvous``)."""
        self.topo: zeroservice.Topology | None = None
        """This rank's DP and MP groups (``_join``)."""
        self._left: list[tuple[float, Any]] = []
        """Groups left, kept until their timeout has passed (see ``_leave``)."""
        self._interrupted_at: float | None = None
        """When the last ``interrupt`` came: the next regroup's ``settle`` phase runs
        from then until it begins (the call in flight, a step or a save, ending)."""
        _warm_up()
        self.started = {"process": process_started_at(), "imported": IMPORTED_AT, "up": time.time()}
        """Wall-clock times of this actor's start: its process, its module imported and
        its constructor done (``address`` hands them on)."""
        # The objects of start-up (torch's and Ray's modules: about 285,000) live as
        # long as the process: frozen, the cyclic collector no longer walks them, and
        # the full collection that frees a dropped engine takes milliseconds, not 0.1 s.
        gc.freeze()

    # -- placement and bootstrap ---------------------------------------------------------
    def address(self) -> dict[str, Any]:
        import ray

        ctx = ray.get_runtime_context()
        return {
            "ip": ray.util.get_node_ip_address(),
            "node_id": ctx.get_node_id(),
            "pid": os.getpid(),
            "gpus": ray.get_gpu_ids(),
            "started": self.started,
            "allocator": allocator_settings(),
        }

    def open_rendezvous(self, host: str) -> int:
        """Open the next group's rendezvous on ``host`` (this rank's node: rank 0's)
        and return its port.

        [Note: rendezvous opened first]
        The supervisor asks rank 0 for the port before it asks any rank to join, and
        rank 0 serves the group's store from then on, so every member finds it up. A
        member that reached the store before its server waited out the store client's
        retry back-off: 0.3-0.45 s of every live grow, where rank 0 first copies and
        drops its engine while a newcomer has nothing to do before joining."""
        self._store = dist.TCPStore(
            host,
            0,
            is_master=True,
            wait_for_workers=False,
            timeout=self._group_timeout(),
        )
        return int(self._store.port)

    def _group_timeout(self) -> datetime.timedelta:
        timeouts = self.spec.timeouts
        return datetime.timedelta(seconds=max(timeouts.bootstrap_s, timeouts.step_s))

    def _rendezvous_store(self, master: str, port: int) -> dist.TCPStore:
        """The store this rank opened for ``port`` (rank 0), or a client of it."""
        store, self._store = self._store, None
        if store is not None and store.port == port:
            return store
        return dist.TCPStore(master, port, is_master=False, timeout=self._group_timeout())

    def setup(
        self,
        master: str,
        port: int,
        world: int,
        checkpoint_root: str,
        restarts: int,
        node: str,
    ) -> RankSetup:
        """Join the group (bounded by the bootstrap timeout), build the engine, load the
        newest valid checkpoint if there is one, start serving metrics."""
        self._phase = RankPhase.BOOTSTRAP
        self.root = checkpoint_root
        laps = Laps()
        self._join(master, port, world, restoring=has_entries(checkpoint_root), laps=laps)
        loaded = self._load_newest()
        laps.lap("load")
        return self._ready(world, restarts, node, loaded, laps=laps)

    def regroup(
        self,
        master: str,
        port: int,
        world: int,
        rank: int,
        checkpoint_root: str,
        restarts: int,
        node: str,
        grow: bool,
        term: int = 0,
    ) -> RankSetup:
        """Re-form the job's group at another size without leaving the process.

        See [Note: live resize] in workers/controller.py. The state to go on from is
        held in host memory: after a lost peer, the engine's last redundant copies (its
        own shards and its neighbour's, at the last refresh and the one before: see
        ``Engine.peer_snapshots``); to grow, every member alive at a step
        boundary, its state now, lent rather than copied (``snapshot_now(lend=True)``).
        A newcomer holds nothing. The new engine is
        restored from what the members hold together; when that lacks a lost rank's
        shards (no redundancy, or two neighbours lost), every rank loads the newest
        checkpoint instead, and ``RankSetup.fallback`` says why. ``term``: the calling
        supervisor's; an older one's is refused before the rank leaves its group (see
        [Note: supervisor terms])."""
        from zeroservice.checkpoint import PeersIncomplete

        with self._busy:
            if term < self._term:
                raise SupervisorSuperseded(
                    f"rank {self.rank}: a re-forming asked by supervisor term {term}, "
                    f"after term {self._term} settled this rank"
                )
            self._phase = RankPhase.BOOTSTRAP
            self._membership = None  # until the re-formed group is ready
            laps, held = Laps(), None
            if self._interrupted_at is not None:
                laps.seconds["settle"] = time.monotonic() - self._interrupted_at
                self._interrupted_at = None
            if self.engine is not None:
                if grow:  # lent, not copied: this engine is dropped below
                    held = self.engine.snapshot_now(lend=True)
                elif world > 1 or self.spec.resources.mp > 1:
                    # Several holders may stand at two steps (a refresh cut short).
                    held = self.engine.peer_snapshots()
                else:  # a lone survivor: its last copy is whole; the spare only costs
                    held = self.engine.peer_snapshot()  # memory while it re-forms
                laps.lap("snapshot")
                self._leave()
            elif dist.is_initialized():
                dist.destroy_process_group()
            laps.lap("leave")
            self.rank, self.root = rank, checkpoint_root
            self._join(master, port, world, restoring=True, laps=laps)
            assert self.engine is not None
            fallback = ""
            try:
                result = self.engine.restore_from_peers(held, release=True)
                self.step = result.step
                self.tokens = self.step * self._tokens_per_step()
                loaded: str | None = "host memory of the peers"  # the event adds the step
            except PeersIncomplete as exc:  # every rank raises it alike
                fallback = str(exc)
                self.step, self.tokens = 0, 0
                held = None  # of no use now: not beside the checkpoint's load
                return_free_heap()
                loaded = self._load_newest()
            del held
            return_free_heap()  # the copies spent
            laps.lap("restore")
            kept = [r for r in self._unreported if r["step"] <= self.step]
            self._unreported = []
            setup = self._ready(world, restarts, node, loaded, fallback, laps)
            if kept and not grow:
                chunk = RankChunk(
                    self.rank, self.step, {r["step"]: r["loss"] for r in kept}, {}, kept
                )
                setup = dataclasses.replace(setup, unreported=chunk)
            return setup

    def _leave(self) -> None:
        """Drop the engine and the group (a peer may be gone: errors are moot).

        [Note: groups left are kept]
        The old groups' objects (the world's and the topology's DP and MP groups) are
        kept until the group's timeout has passed since leaving. A collective given up
        after a lost peer (see zeroservice/interrupt.py) may still occupy one of a gloo
        group's worker threads, and destroying the group's last reference joins those
        threads: a model-parallel survivor whose partner left a tensor-parallel all-
        reduce half done blocked there, in the next ``build_topology``, until the
        re-forming timed out. By the deadline the abandoned collective has timed out
        and the group is let go without waiting."""
        self._drop_engine()
        now = time.monotonic()
        self._left = [(t, kept) for t, kept in self._left if t > now]
        if dist.is_initialized():
            world = dist.group.WORLD
            deadline = now + self._group_timeout().total_seconds() + 5.0
            self._left.append((deadline, (world, self.topo)))
            with contextlib.suppress(Exception):
                dist.destroy_process_group()

    def _drop_engine(self) -> None:
        """Close the engine and free its memory now. A closed engine sits in reference
        cycles (its hooks and threads refer back to it) that only Python's cyclic
        collector frees, which may not run for many steps while the next engine is
        built beside it: on the 267 M GPT a surviving rank's resident memory grew by
        about 1 GiB per live resize until the node's memory monitor killed the ranks.
        The collection is short because start-up's objects are frozen (``__init__``).
        Then glibc's heaps hand their free pages back (``return_free_heap``): what the
        engine had there would otherwise stay resident beside the next engine (on the
        267 M GPT about 4 GiB; on the 5 M GPT 0.5-0.7 GiB, for about 20 ms of trimming
        and as much again of faults in the next engine's build and restore)."""
        engine, self.engine = self.engine, None
        if engine is not None:
            with contextlib.suppress(Exception):
                engine.close()
        del engine
        gc.collect()
        return_free_heap()

    def _join(self, master: str, port: int, world: int, restoring: bool, laps: Laps) -> None:
        """Join the process group as ``self.rank`` and build the model and engine
        (``restoring``: without initial weights, since a load or a restore follows)."""
        spec = self.spec
        use_cuda = spec.resources.gpus_per_rank > 0 and torch.cuda.is_available()
        if use_cuda:
            torch.cuda.set_device(0)  # Ray shows each rank only its own GPU
        self.use_cuda = use_cuda
        dist.init_process_group(
            "nccl" if use_cuda else "gloo",
            store=self._rendezvous_store(master, port),
            rank=self.rank,
            world_size=world,
            timeout=self._group_timeout(),
        )
        self._rendezvous = f"{master}:{port}"
        self.topo = zeroservice.build_topology(spec.resources.mp)
        laps.lap("rendezvous")
        self._build(restoring)
        laps.lap("build")

    def _build(self, restoring: bool) -> None:
        spec, topo, use_cuda = self.spec, self.topo, self.use_cuda
        try:  # first: a data file that cannot serve is known before any model is built
            self.dataset = build_dataset(spec)
        except (FileNotFoundError, ValueError) as exc:
            # Missing, too short, of the wrong size: every start would fail alike, so
            # the job fails at once naming the field (as a configuration the engine
            # refuses), not after its restart budget.
            raise zeroservice.ConfigError(f"data.path: {exc}") from exc
        model, init = build_model(spec, topo.mp_group, restoring)
        if use_cuda and init is None:
            model.cuda()
        tp_groups = mp_groups_of(model)
        self.engine = engine = zeroservice.initialize(
            model, spec.zero_config(), optimizer_factory(spec), init=init, topology=topo
        )
        # Model-parallel collectives: the tensor-parallel layers' and the engine's own.
        engine_mp = engine.mp_ledger()
        self._mp_ledgers = [g.ledger for g in tp_groups] + ([engine_mp] if engine_mp else [])
        self.live = getattr(engine.config, "redundancy", "none") != "none"
        self.flops_per_token = flops_per_token(spec, model, engine.psi) / spec.resources.mp
        self.export_prefix = getattr(model, "export_prefix", "")

    def _tokens_per_step(self) -> int:
        spec = self.spec
        accum = spec.zero_config().gradient_accumulation_steps
        return spec.micro_batch * accum * spec.model.seq_len

    def _load_newest(self) -> str | None:
        """Load the newest valid checkpoint under the job's root, if there is one; with
        none, an engine built to be restored is built again with initial weights."""
        assert self.engine is not None
        root = self.root
        self.step = 0
        try:
            result = self.engine.load_checkpoint(root) if has_entries(root) else None
        except Exception as exc:  # every rank raises the same verdict
            if "no complete, valid checkpoint" not in str(exc):
                raise
            result = None
        if result is None:
            if self.engine.awaiting_state:
                self._drop_engine()
                self._build(restoring=False)
            return None
        self.step = int(result.client_state.get("step", result.step))
        self.tokens = int(result.client_state.get("tokens", 0))
        self._loaded_history = list(result.client_state.get("history", []))
        self._saved_history, self._since_save = self._loaded_history, {}
        self._newest_checkpoint = (self.step, str(result.path))
        return str(result.path)

    def _ready(
        self,
        world: int,
        restarts: int,
        node: str,
        loaded: str | None,
        fallback: str = "",
        laps: Laps | None = None,
    ) -> RankSetup:
        """Serve metrics under the rank's (new) identity and report the setup."""
        import ray

        engine, topo = self.engine, self.topo
        assert engine is not None
        self.peak = peak_tflops(
            torch.device("cuda", 0) if self.use_cuda else torch.device("cpu"),
            self.spec.peak_tflops,
        )
        node_ip = ray.util.get_node_ip_address()
        if self.metrics is not None:  # the old identity's endpoint; not waited for
            self.metrics.close(wait=False)
        self.metrics = RankMetrics(
            {
                "job_id": self.job_id,
                "rank": str(self.rank),
                "dp_rank": str(topo.dp_rank),
                "mp_rank": str(topo.mp_rank),
                "node": node,
            }
        )
        metrics_port = self.metrics.serve(node_ip)
        self.metrics.update(
            restarts=restarts, workers=world, step=self.step, tokens=self.tokens_trained
        )
        self._comm_start = self._comm_totals()  # start-up traffic is no step-phase's
        for key, agg in self._collectives_before.items():  # the engine before this one
            kept = self._collectives_of_dropped.setdefault(key, {"bytes": 0, "seconds": 0.0})
            kept["bytes"] += agg["bytes"]
            kept["seconds"] += agg["seconds"]
        self._collectives_before = {}
        totals = self._collectives()  # nor is it the first step's bandwidth
        self.metrics.update(collectives={k: {**c, "busbw": 0.0} for k, c in totals.items()})
        self._start_step = self.step
        self._phase = RankPhase.READY
        if laps is not None:
            laps.lap("ready")
        self._setup = RankSetup(
            rank=self.rank,
            dp_rank=topo.dp_rank,
            mp_rank=topo.mp_rank,
            start_step=self.step,
            loaded=loaded,
            metrics=f"{node_ip}:{metrics_port}",
            psi=engine.psi,
            fallback=fallback,
            history=self._loaded_history,
            phases=laps.seconds if laps is not None else {},
        )
        self._since_save = {s: r for s, r in self._since_save.items() if s <= self.step}
        self._loaded_history = []
        self._failed = ""  # a call that failed in the group this one replaces
        self._membership = {
            "group": self._rendezvous,
            "rank": self.rank,
            "world": world,
            "seat": self.seat,
        }
        return self._setup

    def membership(self) -> dict[str, Any] | None:
        """The group this rank serves in now: its rendezvous (the same for every member),
        rank, world and seat; None before it is ready in one. After a live resize an
        actor's name no longer says its rank or world: a new supervisor asks this (see
        ``RayWorkerPool.adopt``)."""
        return self._membership

    # -- training -------------------------------------------------------------------------
    def train(self, until: int, term: int = 0) -> RankChunk:
        """Optimizer steps up to ``until``; per-step loss (this rank's micro-batches).
        ``term``: the calling supervisor's (see [Note: supervisor terms])."""
        with self._call(term) as admitted:
            if not admitted:
                return RankChunk(self.rank, self.step, {})
            self._unreported = []
            chunk = self._train(until)
            self._last_stats = chunk.stats
            return chunk

    @contextlib.contextmanager
    def _call(self, term: int) -> Iterator[bool]:
        """One train or save at a time (``_busy``), remembering whether it raised;
        False (nothing to do) for a call of a supervisor older than the one this rank
        settled for.

        [Note: supervisor terms]
        A supervisor's term is 0 for a job's first and ``Succession.restarts`` for one
        that replaces a lost one: larger for each successor, since the control plane
        counts the restarts it has seen plus one. A lost supervisor's last train or
        save may still be on its way to a rank when its successor settles that rank
        (Ray orders no calls of two callers), and run after it: the rank would train
        steps that nobody receives, and the successor, having adopted the group at the
        step it found, would go on with ranks ahead of it and never see those steps
        in its history. ``settle(term)`` raises the rank's term under the same lock
        that train, save and regroup hold, so such a call either ran before the settle
        (which reports it) or is refused. A late ``regroup`` would be worse: the rank
        would drop its engine and wait out the bootstrap timeout at a rendezvous nobody
        else comes to, and the successor's group would have to restart from disk."""
        with self._busy:
            if term < self._term:
                yield False
                return
            self._failed = ""
            try:
                yield True
            except BaseException as exc:
                self._failed = f"{type(exc).__name__}: {exc}"[:500]
                raise

    def _train(self, until: int) -> RankChunk:
        engine, spec = self.engine, self.spec
        assert engine is not None, "setup first"
        accum = engine.config.gradient_accumulation_steps
        tokens_per_step = self._tokens_per_step()
        losses: dict[int, float] = {}
        steps: list[dict[str, Any]] = []
        volume_per_step, seconds = 0, 0.0
        on_cuda = torch.cuda.is_available() and engine.units[0].flat.is_cuda
        while self.step < until:
            engine.reset_memory_peaks()  # the metrics report each step's own peaks
            _reset_process_peak(on_cuda)
            t0 = time.perf_counter()
            volume0 = engine.comm_ledger().volume_elements()
            total = 0.0
            self._phase = RankPhase.TRAINING
            for m in range(accum):
                self._micro_batch = m
                x, y = micro_batch(
                    self.dataset,
                    self.step,
                    m,
                    spec.micro_batch,
                    self.topo.dp_rank,
                    self.topo.dp,
                    accum,
                )
                device = engine.units[0].flat.device
                loss = engine(x.to(device), y.to(device))
                engine.backward(loss)
                total += loss.item() / accum
                if self.live and m == accum - 1:  # before the step's host copy is taken
                    total = self._agree_loss(total)
                report = engine.step()
            seconds = time.perf_counter() - t0
            volume_per_step = engine.comm_ledger().volume_elements() - volume0
            self.step += 1
            self.tokens += tokens_per_step
            self.tokens_trained += tokens_per_step
            peak = self._publish(total, seconds, tokens_per_step, report.loss_scale)
            losses[self.step] = total
            steps.append(
                {
                    "step": self.step,
                    "loss": total,
                    "grad_norm": report.grad_norm,
                    "loss_scale": report.loss_scale,
                    "lr": spec.optimizer.lr * report.lr_factor,
                    "seconds": seconds,
                    "tokens": tokens_per_step,
                    "peak_bytes": peak,
                }
            )
            self._unreported.append(steps[-1])
            self._since_save[self.step] = steps[-1]
            if self.live:  # the slowest rank's seconds, the largest peak (this rank's if lost)
                steps[-1]["seconds"], steps[-1]["peak_bytes"] = self._agree_most(seconds, peak)
        self._phase = RankPhase.IDLE
        return RankChunk(
            rank=self.rank,
            step=self.step,
            losses=losses,
            stats={
                "ledger": engine.memory_ledger().as_dict(),
                "comm_volume_per_step": volume_per_step,
                "tokens_per_second": tokens_per_step / seconds if seconds else 0.0,
            },
            steps=steps,
        )

    def _agree_loss(self, loss: float) -> float:
        """The step's loss over every replica, agreed before the optimizer step (and so
        before the step's host copy): a rank that restores a step from the copies has
        the step's loss too, and after a live shrink any survivor can report a step whose
        chunk never reached the supervisor (see ``RankSetup.unreported``)."""
        group = self.topo.dp_group
        total = torch.tensor([loss], dtype=torch.float64)
        dist.all_reduce(total, group=group)
        return total.item() / dist.get_world_size(group)

    def _agree_most(self, seconds: float, peak: int) -> tuple[float, int]:
        """The slowest rank's step seconds and the largest memory peak."""
        most = torch.tensor([seconds, float(peak)], dtype=torch.float64)
        dist.all_reduce(most, op=dist.ReduceOp.MAX, group=self.topo.dp_group)
        return most[0].item(), int(most[1].item())

    def _publish(self, loss: float, seconds: float, tokens: int, loss_scale: float) -> int:
        """Update the rank's metrics after a step; returns its memory peak (bytes)."""
        assert self.engine is not None and self.metrics is not None
        ledger = self.engine.memory_ledger()
        tflops = tokens * self.flops_per_token / seconds / 1e12 if seconds > 0 else 0.0
        if torch.cuda.is_available() and self.engine.units[0].flat.is_cuda:
            allocated = torch.cuda.memory_allocated()
            peak = torch.cuda.max_memory_allocated()
        else:
            allocated, peak = _process_bytes("VmRSS"), _process_bytes("VmHWM")
        memory = {
            "params": ledger.params,
            "grads": ledger.grads,
            "master": ledger.master,
            "optimizer": ledger.optimizer_states + ledger.optimizer_other,
            "activations": ledger.activations_peak,
            "comm_buffers": ledger.comm_buffers,
            "gathered": ledger.gathered_peak,
            "allocated": allocated,
            "peak": peak,
        }
        self.metrics.step_seconds.observe(seconds)
        self.metrics_collectives = self._collectives()
        self.metrics.update(
            memory=memory,
            expected=ledger.expected_padded,
            model_states=ledger.model_states,
            collectives=self.metrics_collectives,
            tflops=tflops,
            mfu=tflops / self.peak if self.peak else None,
            loss=loss,
            loss_scale=loss_scale,
            step=self.step,
            tokens=self.tokens_trained,
        )
        busbw = {f"{op}/{group}": c["busbw"] for (op, group), c in self.metrics_collectives.items()}
        self._last = {
            "memory": memory,
            "loss": loss,
            "seconds": seconds,
            "tflops": tflops,
            "busbw": busbw,
            "phases": self._phases(),
        }
        return int(peak)

    def _collectives(self) -> dict[tuple[str, str], dict[str, float]]:
        """Per (op, group): payload bytes and seconds this process moved so far (the
        counters: the engines it dropped included), and the bus bandwidth of the
        collectives since the last call (the last step's; 0 for an op the step did not
        issue). The bus bytes are summed per ledger entry, each with its own group's
        factor: one op may run over groups of two sizes (hpZ's node group beside the
        whole group, two-hop qgZ)."""
        assert self.engine is not None
        out: dict[tuple[str, str], dict[str, float]] = {}
        sources = [("dp", self.engine.comm_ledger())] + [("mp", led) for led in self._mp_ledgers]
        for group, ledger in sources:
            for stats in ledger.entries.values():
                agg = out.setdefault((stats.op, group), {"bytes": 0, "seconds": 0.0, "bus": 0.0})
                agg["bytes"] += stats.payload_bytes
                agg["seconds"] += stats.seconds
                agg["bus"] += stats.payload_bytes * bus_factor(stats.op, stats.world_size)
        before, self._collectives_before = self._collectives_before, out
        exported: dict[tuple[str, str], dict[str, float]] = {}
        for key in out.keys() | self._collectives_of_dropped.keys():
            agg = out.get(key, {"bytes": 0, "seconds": 0.0, "bus": 0.0})
            was = before.get(key, {"bytes": 0, "seconds": 0.0, "bus": 0.0})
            if agg["bytes"] < was["bytes"]:  # a ledger started afresh: all of it is new
                was = {"bytes": 0, "seconds": 0.0, "bus": 0.0}
            seconds = agg["seconds"] - was["seconds"]
            kept = self._collectives_of_dropped.get(key, {"bytes": 0, "seconds": 0.0})
            exported[key] = {
                "bytes": kept["bytes"] + agg["bytes"],
                "seconds": kept["seconds"] + agg["seconds"],
                "busbw": (agg["bus"] - was["bus"]) / seconds if seconds > 0 else 0.0,
            }
        return exported

    def _comm_totals(self) -> dict[tuple[str, str, str], tuple[int, float, int, int]]:
        """Per (group, op, tag): payload bytes, seconds, calls, world size so far."""
        assert self.engine is not None
        out = {}
        sources = [("dp", self.engine.comm_ledger())] + [("mp", led) for led in self._mp_ledgers]
        for group, ledger in sources:
            for s in ledger.entries.values():
                key = (group, s.op, s.tag)
                b, sec, n, _ = out.get(key, (0, 0.0, 0, 0))
                out[key] = (b + s.payload_bytes, sec + s.seconds, n + s.calls, s.world_size)
        return out

    def _phases(self) -> dict[str, dict[str, float]]:
        """The collectives of the training steps since this group started, per
        step-phase (``op/tag``; ``mp:`` for the model-parallel group): start-up
        traffic (the initial broadcast, checkpoint gathers) is left out. Each with
        its bytes, seconds, calls, steps and nccl-tests bus bandwidth."""
        steps = self.step - self._start_step
        out: dict[str, dict[str, float]] = {}
        for (group, op, tag), (b, sec, n, world) in self._comm_totals().items():
            if tag in START_UP_TAGS:
                continue
            b0, sec0, n0, _ = self._comm_start.get((group, op, tag), (0, 0.0, 0, 0))
            b, sec, n = b - b0, sec - sec0, n - n0
            if n <= 0:
                continue
            bw = b / sec * bus_factor(op, world) if sec > 0 else 0.0
            name = f"{op}/{tag}" if group == "dp" else f"mp:{op}/{tag}"
            out[name] = {"bytes": b, "seconds": sec, "calls": n, "steps": steps, "busbw": bw}
        return out

    # -- checkpoints ----------------------------------------------------------------------
    def save(
        self, keep: int, history: list[dict[str, Any]] | None = None, term: int = 0
    ) -> RankSaved:
        """Save on every rank; a save that failed (a full disk) is reported, not
        raised: training goes on from the previous checkpoint's safety net. ``term``:
        the calling supervisor's (see [Note: supervisor terms])."""
        from zeroservice.checkpoint import SaveFailed

        with self._call(term) as admitted:
            if not admitted:
                return RankSaved(None, f"refused: a call of supervisor term {term}")
            assert self.engine is not None
            self._phase = RankPhase.CHECKPOINT
            try:
                path = self.engine.save_checkpoint(
                    self.root,
                    client_state={
                        "step": self.step,
                        "tokens": self.tokens,
                        "history": history or [],
                        EXPORT_PREFIX: self.export_prefix,
                    },
                    keep=keep,
                )
            except SaveFailed as exc:
                return RankSaved(None, str(exc))
            finally:
                self._phase = RankPhase.IDLE
            self.saved_step = self.step
            self._newest_checkpoint = (self.step, str(path))
            self._saved_history = list(history or [])
            self._since_save = {s: r for s, r in self._since_save.items() if s > self.step}
            return RankSaved(str(path))

    def interrupt(self, lost: list[int]) -> None:
        """Give up the group's collectives: the supervisor has killed the ``lost`` ranks
        and the group will re-form without them. Answered while ``train`` runs (threaded
        actor); that call then raises at its next or current wait instead of waiting for
        the group's timeout. See [Note: interrupting a collective] in
        zeroservice/interrupt.py. Its engine is only closed afterwards (``regroup``)."""
        self._interrupted_at = time.monotonic()
        engine = self.engine
        if engine is not None:
            engine.interrupt(f"rank(s) {lost} lost")

    def settle(self, term: int = 0) -> RankIdle:
        """Wait until the call in flight (a train or save a lost supervisor asked for)
        is over; what a new supervisor needs to adopt this rank. From now on calls of
        supervisors older than ``term`` are refused (see [Note: supervisor terms])."""
        with self._busy:
            self._term = max(self._term, term)
            assert self._setup is not None, "never set up"
            reports = [self._since_save[s] for s in sorted(self._since_save)]
            losses = {r["step"]: r["loss"] for r in reports}
            since_save = RankChunk(self.rank, self.step, losses, self._last_stats, reports)
            return RankIdle(
                self.progress(),
                self._setup,
                since_save,
                self._saved_history,
                self._failed,
                self._newest_checkpoint,
            )

    # -- watchdog and stats --------------------------------------------------------------
    def progress(self) -> RankProgress:
        """Answered while ``train`` runs (threaded actor). See workers/watchdog.py."""
        launched, last = 0, ""
        if self.engine is not None:
            for ledger in [self.engine.comm_ledger(), *self._mp_ledgers]:
                launched += ledger.launched
            last = self.engine.comm_ledger().last_launched
            if self._mp_ledgers and self._mp_ledgers[0].launched:
                mp_last = self._mp_ledgers[0].last_launched
                last = f"{last} (mp: {mp_last})" if last else f"mp {mp_last}"
        return RankProgress(self.step, self._describe_phase(), launched, last, self.saved_step)

    def _describe_phase(self) -> str:
        """The rank's phase; while training, the engine's state and the micro-batch
        (``reducing, micro-batch 0``: inside a backward that reduces)."""
        if self._phase is RankPhase.TRAINING and self.engine is not None:
            return f"{self.engine.state.value}, micro-batch {self._micro_batch}"
        return self._phase.value

    def stats(self) -> dict[str, Any]:
        return dict(self._last, step=self.step, rank=self.rank)

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None
        if self.metrics is not None:
            self.metrics.close()
        if dist.is_initialized():
            dist.destroy_process_group()
