"""The worker group on Ray: one placement group per attempt, one rank actor per rank
(see [Note: placement]), Ray's errors turned into the controller's typed ones.

Rank actors and placement groups are detached and named after the job and the
attempt, so that they outlive a supervisor that dies: its replacement adopts them
(``RayWorkerPool.adopt``) or removes them (``reap``) before placing a new group.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.placement_group import PlacementGroup, placement_group_table
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from zeroservice.checkpoint.storage import is_uri

from .messages import RankProgress, RankSetup
from .placement import (
    Placement,
    grow_placement_name,
    is_job_placement,
    place,
    replicas_available,
)
from .rank_actor import RankActor
from .rank_env import actor_env
from .spec import JobSpec
from .worker_group import GroupStartFailed, RankDied, RankError, refused_by_engine

NAMESPACE = "zeroservice"


def rank_name(job_id: str, attempt: str, rank: int, world: int) -> str:
    return f"zeroservice-rank-{job_id}-{attempt}-{rank}-of-{world}"


def _job_ranks(job_id: str) -> dict[str, dict[int, tuple[str, int]]]:
    """The job's named rank actors: attempt -> rank -> (name, world)."""
    prefix = f"zeroservice-rank-{job_id}-"
    out: dict[str, dict[int, tuple[str, int]]] = {}
    for entry in ray.util.list_named_actors(all_namespaces=True):
        name = entry["name"]
        if entry["namespace"] != NAMESPACE or not name.startswith(prefix):
            continue
        attempt, rank, _, world = name[len(prefix) :].rsplit("-", 3)
        if "-" in attempt:  # another job whose id begins with this one's
            continue
        out.setdefault(attempt, {})[int(rank)] = (name, int(world))
    return out


def _job_placements(job_id: str) -> dict[str, Placement]:
    """The job's placement groups not removed (its own and those taken for a grow, see
    ``RayWorkerPool.extend``), by id; a placement's dp is its count of bundles."""
    out = {}
    for pg_id, info in placement_group_table().items():
        if is_job_placement(job_id, info.get("name", "")) and info.get("state") != "REMOVED":
            group = PlacementGroup(ray.PlacementGroupID.from_hex(pg_id))
            out[pg_id] = Placement(group, len(info.get("bundles", {})))
    return out


def reap(job_id: str) -> int:
    """Kill every rank actor of the job and remove its placement groups (what a lost
    supervisor left); returns the actors killed."""
    killed = 0
    for ranks in _job_ranks(job_id).values():
        for name, _ in ranks.values():
            with contextlib.suppress(Exception):
                ray.kill(ray.get_actor(name, namespace=NAMESPACE), no_restart=True)
                killed += 1
    for placement in _job_placements(job_id).values():
        placement.remove()
    return killed


def short(exc: BaseException | None, limit: int = 600) -> str:
    """The last lines of an error that matter (Ray wraps the rank's traceback)."""
    if exc is None:
        return ""
    text = str(exc).strip().splitlines()
    tail = [line for line in text if line.strip()][-3:] if text else []
    out = " | ".join(tail) or type(exc).__name__
    return out[-limit:]


@dataclass(frozen=True, eq=False)
class Seat:
    """Where one rank actor runs: a bundle of one of the group's placements. A bundle
    holds a replica, so it has ``mp`` seats (compared and hashed by identity)."""

    placement: Placement
    bundle: int


def whole_replicas(seats: list[Seat], mp: int) -> list[list[Seat]]:
    """``seats`` grouped by bundle, keeping the bundles with ``mp`` of them (a replica
    is seated whole, on one node), ``mp`` seats each, in order."""
    by_bundle: dict[tuple[int, int], list[Seat]] = {}
    for seat in seats:
        by_bundle.setdefault((id(seat.placement), seat.bundle), []).append(seat)
    return [group[:mp] for group in by_bundle.values() if len(group) >= mp]


def start_figures(created: float, address: dict[str, Any], seated: float) -> dict[str, float]:
    """Where a newcomer's start went, in seconds, from the wall-clock times its actor
    reports (``RankWorker.started``; on another node, that node's clock):

    - ``process``: from the actor's creation to its worker process starting (Ray placing
      it and starting a worker; 0 when Ray reused a worker already running);
    - ``imports``: to the actor's module imported (torch, the engine, the models);
    - ``constructor``: to its constructor done (torch's warm-up among it);
    - ``idle``: from then until the group seated it (its next step boundary).
    """
    started = address.get("started") or {}
    imported, up = started.get("imported"), started.get("up")
    if imported is None or up is None:
        return {}
    process = max(created, started.get("process") or created)
    figures = {
        "process": process - created,
        "imports": imported - process,
        "constructor": up - imported,
        "idle": seated - up,
    }
    return {k: round(max(0.0, v), 3) for k, v in figures.items()}


class RayWorkerGroup:
    """One attempt's rank actors. See workers/worker_group.py for the interface.

    A live resize (see [Note: live resize] in workers/controller.py) drops ranks,
    leaving their seats vacant for a later grow, and appends newcomers, seated on a
    vacancy or on a placement taken for them; the group frees every placement at the
    end."""

    def __init__(self, placement: Placement, actors: list[Any], mp: int = 1, root: str = ""):
        self.placement, self.actors, self.mp, self.root = placement, actors, mp, root
        self.placements = [placement]
        self.seats = [Seat(placement, r // mp) for r in range(len(actors))]
        self.vacant: list[Seat] = []
        self.spares: dict[Seat, tuple[Any, Any, float]] = {}
        """Newcomers started on vacant seats: (actor, its address() call, when created)."""
        self.newcomer_starts: list[dict[str, Any]] = []
        """Where each newcomer seated since the last regroup spent its start (rank and
        ``start_figures``), for the regroup's event."""
        self.start_actor: Callable[[Seat], Any] | None = None
        """Starts a newcomer's actor on a seat (set by the pool)."""
        self.dp, self.world = placement.dp, len(actors)
        self.setups: list[RankSetup] = []
        self.addresses: list[dict[str, Any]] = []
        self.timeout = 60.0
        """Seconds a regroup may take (the job's bootstrap timeout)."""
        self._pending: dict[Any, int] = {}

    def begin(self, method: str, *args: Any) -> None:
        assert not self._pending, "a call is still running"
        self._pending = {getattr(a, method).remote(*args): r for r, a in enumerate(self.actors)}

    def wait(self, timeout: float) -> dict[int, Any]:
        deadline = time.monotonic() + timeout
        out: dict[int, Any] = {}
        pending = list(self._pending)
        while pending:
            left = max(0.0, deadline - time.monotonic())
            ready, pending = ray.wait(pending, num_returns=1, timeout=left)
            if not ready:
                break
            failed = False
            for ref in ready:
                rank = self._pending.pop(ref)
                out[rank] = self._answer(rank, ref)
                failed = failed or isinstance(out[rank], RankDied | RankError)
            if failed:  # see WorkerGroup.wait: the others are collected as they stand
                ready, _ = (
                    ray.wait(pending, num_returns=len(pending), timeout=0) if pending else ([], [])
                )
                for ref in ready:
                    rank = self._pending.pop(ref)
                    out[rank] = self._answer(rank, ref)
                break
        return out

    @staticmethod
    def _answer(rank: int, ref: Any) -> Any:
        """A finished call's result, or the RankDied / RankError it amounts to."""
        try:
            return ray.get(ref)
        except RayActorError as exc:
            return RankDied(rank, short(exc))
        except RayTaskError as exc:
            return RankError(rank, short(exc), refused_by_engine([exc]))

    def progress(self, ranks: list[int], timeout: float) -> dict[int, RankProgress | None]:
        refs = {r: self.actors[r].progress.remote() for r in ranks}
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout)
        out: dict[int, RankProgress | None] = {}
        for r, ref in refs.items():
            try:
                out[r] = ray.get(ref) if ref in ready else None
            except Exception:
                out[r] = None
        return out

    def dead(self) -> list[int]:
        refs = {r: a.progress.remote() for r, a in enumerate(self.actors)}
        ray.wait(list(refs.values()), num_returns=len(refs), timeout=2.0)
        dead = []
        for r, ref in refs.items():
            try:
                ray.get(ref, timeout=0.01)
            except RayActorError:
                dead.append(r)
            except Exception:
                pass
        return dead

    def stats(self) -> dict[int, dict[str, Any]]:
        try:
            stats = ray.get([a.stats.remote() for a in self.actors], timeout=10)
        except Exception:
            return {}
        return dict(enumerate(stats))

    def shutdown(self, clean: bool) -> None:
        if clean:
            with contextlib.suppress(Exception):
                ray.get([a.close.remote() for a in self.actors], timeout=30)
        for actor in self.actors:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
        for actor, _, _ in self.spares.values():
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
        self.spares.clear()
        for placement in self.placements:
            placement.remove()

    # -- live resize ----------------------------------------------------------------------
    def drop(self, ranks: list[int], settle_s: float) -> bool:
        lost = set(ranks)
        here = ray.util.get_node_ip_address()
        for r in sorted(lost):  # a stopped (SIGSTOP) process is killed too
            address = self.addresses[r] if r < len(self.addresses) else {}
            if address.get("ip") == here and address.get("pid"):
                # On this machine: at once (Ray's kill waits for a stopped process first).
                with contextlib.suppress(OSError):
                    os.kill(address["pid"], signal.SIGKILL)
            with contextlib.suppress(Exception):
                ray.kill(self.actors[r], no_restart=True)
        # Answered beside a running train: it ends that call's collectives at once.
        keep = [r for r in range(self.world) if r not in lost]
        asks = [self.actors[r].interrupt.remote(sorted(lost)) for r in keep]
        running = [ref for ref, r in self._pending.items() if r not in lost]
        if running or asks:
            # Waiting for the interrupts too: none may reach the engine a regroup builds.
            ends = running + asks
            _, late = ray.wait(ends, num_returns=len(ends), timeout=settle_s)
            if late:
                return False
        self._pending.clear()
        self.vacant += [self.seats[r] for r in sorted(lost)]
        self.actors = [self.actors[r] for r in keep]
        self.seats = [self.seats[r] for r in keep]
        self.addresses = [self.addresses[r] for r in keep]
        self.world = len(keep)
        self.dp = self.world // self.mp
        return True

    def vacancies(self) -> int:
        """Vacant replicas whose ``mp`` newcomers are all up. A newcomer is started on
        every usable vacant seat as soon as it is seen, so that growing waits for no
        actor's start (the group trains meanwhile)."""
        for seat in self.usable_vacancies():
            if seat not in self.spares and self.start_actor is not None:
                actor = self.start_actor(seat)
                self.spares[seat] = (actor, actor.address.remote(), time.time())
        return len(self._ready_replicas())

    def _ready_replicas(self) -> list[list[Seat]]:
        """The seats of each vacant bundle whose ``mp`` newcomers are up (a newcomer
        that died starting is let go: its seat is tried again later)."""
        ready: list[Seat] = []
        for seat, (actor, ref, _) in list(self.spares.items()):
            done, _ = ray.wait([ref], timeout=0)
            if not done:
                continue
            try:
                ray.get(ref)
                ready.append(seat)
            except Exception:
                with contextlib.suppress(Exception):
                    ray.kill(actor, no_restart=True)
                del self.spares[seat]
        return whole_replicas(ready, self.mp)

    def take_spares(self, count: int) -> int:
        """Seat the newcomers of up to ``count`` replicas that are up; returns how many
        replicas."""
        replicas = self._ready_replicas()[:count]
        for seats in replicas:
            for seat in seats:
                actor, ref, created = self.spares.pop(seat)
                self.vacant.remove(seat)
                self.add(actor, seat, ray.get(ref), created)
        return len(replicas)

    def usable_vacancies(self) -> list[Seat]:
        """Vacant seats whose bundle sits on a live node (a seat whose node was removed
        waits until Ray places its bundle again)."""
        alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
        out = []
        for seat in self.vacant:
            try:
                table = placement_group_table(seat.placement.group)
            except Exception:
                continue
            node = table.get("bundles_to_node_id", {}).get(seat.bundle)
            if table.get("state") == "CREATED" and node in alive:
                out.append(seat)
        return out

    def add(self, actor: Any, seat: Seat, address: dict[str, Any], created: float) -> None:
        """Seat a newcomer (its actor created at ``created``, wall clock)."""
        figures = start_figures(created, address, time.time())
        self.newcomer_starts.append({"rank": len(self.actors), **figures})
        self.actors.append(actor)
        self.seats.append(seat)
        self.addresses.append(address)
        self.world = len(self.actors)
        self.dp = self.world // self.mp

    def regroup(self, restarts: int, grow: bool, term: int = 0) -> list[RankSetup]:
        timeout = self.timeout
        try:
            addresses = ray.get([a.address.remote() for a in self.actors], timeout=timeout)
            # See [Note: rendezvous opened first] in workers/rank.py.
            port = ray.get(
                self.actors[0].open_rendezvous.remote(addresses[0]["ip"]), timeout=timeout
            )
            refs = [
                a.regroup.remote(
                    addresses[0]["ip"],
                    port,
                    self.world,
                    r,
                    self.root,
                    restarts,
                    f"{addr['ip']}/{addr['node_id'][:8]}",
                    grow,
                    term,
                )
                for r, (a, addr) in enumerate(zip(self.actors, addresses, strict=True))
            ]
            setups = ray.get(refs, timeout=timeout)
        except (GetTimeoutError, RayActorError, RayTaskError) as exc:
            late = (
                f" within timeouts.bootstrap_s ({timeout:g} s)"
                if isinstance(exc, GetTimeoutError)
                else ""
            )
            raise GroupStartFailed(
                f"re-forming {self.world} ranks failed{late}: {short(exc)}",
                refused=refused_by_engine([exc]),
            ) from None
        self.addresses = addresses
        return setups


_clock = time.monotonic
"""When a reservation may be tried again (tests step it by hand)."""
RESERVE_RETRY_S = 30.0
"""How long a reservation that found no room waits before it is tried again on free
resources that did not change (see [Note: a reservation that found no room])."""


def _free_now() -> dict[str, float]:
    """The cluster's free CPUs and GPUs, rounded (memory moves at every allocation)."""
    free = ray.available_resources()
    return {k: round(float(free.get(k, 0.0)), 4) for k in ("CPU", "GPU")}


class RayWorkerPool:
    """Places and starts a job's groups on the Ray cluster this process is in."""

    def __init__(self, job_id: str, spec: JobSpec, spec_json: str, root: str):
        self.job_id, self.spec, self.spec_json, self.root = job_id, spec, spec_json, root
        self._unplaced: tuple[dict[str, float], float] | None = None
        """The free resources when a reservation last found no room, and when to try
        again anyway (see ``reserve``)."""

    def available(self) -> int:
        return replicas_available(self.spec.resources)

    def place(
        self, lowest: int, highest: int, wait_s: float, cancel: threading.Event | None = None
    ) -> Placement | None:
        return place(self.job_id, self.spec.resources, lowest, highest, wait_s, cancel=cancel)

    def free(self) -> str:
        return str(ray.available_resources())

    def adopt(self) -> RayWorkerGroup | None:
        """The group of rank actors a lost supervisor left, with its placements; None
        (having removed whatever is left) when there is none.

        Each of the job's actors is asked which group it serves in
        (``RankWorker.membership``): after a live resize the members carry names of
        several attempts, and their names no longer say their rank or world. Exactly
        one complete group (ranks 0..world-1 of one rendezvous) is adopted; the actors
        outside it (newcomers never seated, members of a group that did not form) are
        killed, and the seats no member holds are the group's vacancies."""
        names = [n for ranks in _job_ranks(self.job_id).values() for n, _ in ranks.values()]
        try:
            group = self._adopt(names) if names else None
        except Exception:
            group = None
        if group is None:
            reap(self.job_id)
        return group

    def _adopt(self, names: list[str]) -> RayWorkerGroup | None:
        timeout = self.spec.timeouts.bootstrap_s
        actors, refs = {}, {}
        for name in names:
            with contextlib.suppress(Exception):  # gone since it was listed
                actors[name] = ray.get_actor(name, namespace=NAMESPACE)
                refs[name] = actors[name].membership.remote()
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout)
        groups: dict[str, dict[int, tuple[str, dict[str, Any]]]] = {}
        for name, ref in refs.items():
            member = None
            if ref in ready:
                with contextlib.suppress(Exception):
                    member = ray.get(ref)
            if member is not None:
                groups.setdefault(member["group"], {})[member["rank"]] = (name, member)
        complete = [g for g in groups.values() if all(m["world"] == len(g) for _, m in g.values())]
        complete = [g for g in complete if sorted(g) == list(range(len(g)))]
        if len(complete) != 1 or len(complete[0]) % self.spec.resources.mp:
            return None
        (members,) = complete
        world = len(members)
        chosen = [members[r][0] for r in range(world)]
        for name in set(actors) - set(chosen):
            with contextlib.suppress(Exception):
                ray.kill(actors[name], no_restart=True)
        placements = _job_placements(self.job_id)
        seats = {
            (pg_id, b): Seat(placement, b)
            for pg_id, placement in placements.items()
            for b in range(placement.dp)
        }
        mp = self.spec.resources.mp
        keys = [tuple(members[r][1]["seat"]) for r in range(world)]
        held = [Seat(seats[k].placement, seats[k].bundle) for k in keys]
        group = self._group(held[0].placement, [actors[n] for n in chosen])
        group.placements = list(placements.values())
        group.seats = held
        group.vacant = [
            Seat(seat.placement, seat.bundle)
            for key, seat in seats.items()
            for _ in range(mp - keys.count(key))
        ]
        group.dp = world // self.spec.resources.mp
        group.addresses = ray.get([a.address.remote() for a in group.actors], timeout=timeout)
        return group

    def _group(self, placement: Placement, actors: list[Any]) -> RayWorkerGroup:
        group = RayWorkerGroup(placement, actors, self.spec.resources.mp, self.root)
        group.timeout = self.spec.timeouts.bootstrap_s
        group.start_actor = lambda seat: self._actor(
            seat, rank_name(self.job_id, uuid.uuid4().hex[:8], seat.bundle, 0), 0
        )
        return group

    def _actor(self, seat: Seat, name: str, rank: int) -> Any:
        res = self.spec.resources
        return (
            ray.remote(RankActor)
            .options(
                name=name,
                namespace=NAMESPACE,
                lifetime="detached",  # see the module docstring
                num_cpus=res.cpus_per_rank,
                num_gpus=res.gpus_per_rank,
                max_concurrency=4,
                max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=seat.placement.group,
                    placement_group_bundle_index=seat.bundle,
                ),
            )
            .remote(
                actor_env(res.host_allocator),
                self.job_id,
                rank,
                self.spec_json,
                (seat.placement.group.id.hex(), seat.bundle),
            )
        )

    def reserve(self, group: RayWorkerGroup, count: int) -> None:
        """[Note: a reservation that found no room]
        The free resources can add up to a replica without any node holding one (half
        a CPU free on each of two nodes, for a bundle of one). Trying to place it then
        waits out the placement's probe at every step of a group below max_dp (2-7 s a
        step). So after a reservation that found no room, the next one waits until the
        cluster's free resources change (a node joined, a job ended) or
        ``RESERVE_RETRY_S`` has passed."""
        mp = self.spec.resources.mp
        short = count - len(group.vacant) // mp
        if short <= 0 or self.available() < 1:
            return
        free = _free_now()
        if self._unplaced is not None:
            was, retry_at = self._unplaced
            if free == was and _clock() < retry_at:
                return
        extra = place(
            self.job_id,
            self.spec.resources,
            1,
            short,
            wait_s=2.0,
            settle_s=0.0,
            name=grow_placement_name(self.job_id, uuid.uuid4().hex[:8]),
        )
        if extra is None:
            self._unplaced = (free, _clock() + RESERVE_RETRY_S)
            return
        self._unplaced = None
        group.placements.append(extra)
        group.vacant += [Seat(extra, b) for b in range(extra.dp) for _ in range(mp)]

    def extend(self, group: RayWorkerGroup, count: int, wait_s: float) -> int:
        """Newcomers for a live grow: on the group's usable vacancies first, then on a
        placement taken for them. Their names carry a fresh attempt; a supervisor lost
        after a live resize finds the group by asking its members (see ``adopt``)."""
        attempt, mp = uuid.uuid4().hex[:8], self.spec.resources.mp
        added = group.take_spares(count)
        free = [s for s in group.usable_vacancies() if s not in group.spares]
        replicas = whole_replicas(free, mp)[: count - added]
        if added + len(replicas) < count:
            extra = place(
                self.job_id,
                self.spec.resources,
                1,
                count - added - len(replicas),
                wait_s=5.0,
                settle_s=0.0,
                name=grow_placement_name(self.job_id, attempt),
            )
            if extra is not None:
                group.placements.append(extra)
                fresh = [[Seat(extra, b) for _ in range(mp)] for b in range(extra.dp)]
                group.vacant += [seat for seats in fresh for seat in seats]
                replicas += fresh
        for seats in replicas:
            ranks = range(group.world, group.world + mp)
            created = time.time()
            actors = [
                self._actor(seat, rank_name(self.job_id, attempt, rank, 0), rank)
                for seat, rank in zip(seats, ranks, strict=True)
            ]
            try:
                addresses = ray.get([a.address.remote() for a in actors], timeout=min(wait_s, 30.0))
            except Exception:  # the replica's seats stay vacant, tried again later
                for actor in actors:
                    with contextlib.suppress(Exception):
                        ray.kill(actor, no_restart=True)
                continue
            for seat, actor, address in zip(seats, actors, addresses, strict=True):
                group.vacant.remove(seat)
                group.add(actor, seat, address, created)
            added += 1
        return added

    def start(self, placement: Placement, restarts: int) -> RayWorkerGroup:
        res = self.spec.resources
        world = placement.dp * res.mp
        attempt = uuid.uuid4().hex[:8]
        actors = [
            self._actor(Seat(placement, r // res.mp), rank_name(self.job_id, attempt, r, world), r)
            for r in range(world)
        ]
        group = self._group(placement, actors)
        try:
            self._setup(group, restarts)
        except (GetTimeoutError, RayActorError, RayTaskError) as exc:
            group.shutdown(clean=False)
            late = (
                f" within timeouts.bootstrap_s ({self.spec.timeouts.bootstrap_s:g} s)"
                if isinstance(exc, GetTimeoutError)
                else ""
            )
            raise GroupStartFailed(
                f"starting {world} ranks failed{late}: {short(exc)}",
                refused=refused_by_engine([exc]),
            ) from None
        except BaseException:
            group.shutdown(clean=False)
            raise
        return group

    def _setup(self, group: RayWorkerGroup, restarts: int) -> None:
        timeout = self.spec.timeouts.bootstrap_s
        actors = group.actors
        addresses = ray.get([a.address.remote() for a in actors], timeout=timeout)
        port = ray.get(actors[0].open_rendezvous.remote(addresses[0]["ip"]), timeout=timeout)
        if not is_uri(self.root):  # an s3:// prefix needs no directory
            Path(self.root).mkdir(parents=True, exist_ok=True)
        group.setups = ray.get(
            [
                a.setup.remote(
                    addresses[0]["ip"],
                    port,
                    group.world,
                    self.root,
                    restarts,
                    f"{addr['ip']}/{addr['node_id'][:8]}",
                )
                for a, addr in zip(actors, addresses, strict=True)
            ],
            timeout=timeout,
        )
        group.addresses = addresses
