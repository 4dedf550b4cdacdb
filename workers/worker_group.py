"""What the supervisor's controller needs of the ranks, as an interface with two
implementations: Ray actors (workers/ray_group.py) and plain objects on threads of
this process (``InProcessPool`` below), which the controller's unit tests drive with
scripted ranks: kill one, freeze one, let capacity come and go, all without Ray.

A *pool* places and starts groups; a *group* is one attempt's ranks. A group runs one
call on every rank at a time (``begin``, then ``wait`` until every rank answered) and
answers the watchdog's questions (``progress``, ``dead``) meanwhile.
"""

from __future__ import annotations

import contextlib
import threading
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from zeroservice.config import ConfigError

from .messages import RankProgress, RankSetup


class RankDied(Exception):
    """The rank's process is gone (killed, its node removed)."""

    def __init__(self, rank: int, message: str = ""):
        super().__init__(message or f"rank {rank} died")
        self.rank, self.message = rank, message


class RankError(Exception):
    """The rank's call raised; the rank itself may still be alive. ``refused``: the
    engine's ConfigError (stage 3 refusing a forward whose ranks read different
    experts, say): the job's configuration does not suit its model."""

    def __init__(self, rank: int, message: str, refused: bool = False):
        super().__init__(message)
        self.rank, self.message, self.refused = rank, message, refused


class GroupStartFailed(Exception):
    """The ranks could not all join the group within the bootstrap timeout, or a rank's
    set-up raised. ``refused``: a rank's engine refused the job's configuration for its
    model (``zeroservice.ConfigError``, such as a ``stage3_leaf_modules`` name no module
    has): every start would fail alike, so the job fails at once."""

    def __init__(self, message: str, refused: bool = False):
        super().__init__(message)
        self.message, self.refused = message, refused


def refused_by_engine(errors: list[BaseException]) -> bool:
    """A rank's set-up or call raised the engine's ConfigError (Ray's task error is also
    an instance of the error it carries; a RankError has it as its cause)."""
    return any(isinstance(e, ConfigError) or isinstance(e.__cause__, ConfigError) for e in errors)


class Placement(Protocol):
    dp: int

    def remove(self) -> None: ...


class WorkerGroup(Protocol):
    dp: int
    world: int
    setups: list[RankSetup]
    addresses: list[dict[str, Any]]
    """Per rank: ip, node_id, pid, gpus (and, from a rank actor, ``started``)."""
    newcomer_starts: list[dict[str, Any]]
    """Each newcomer seated since the last regroup: its rank and where its start went
    (``ray_group.start_figures``; only the rank in process). The controller empties it."""

    def begin(self, method: str, *args: Any) -> None:
        """Start ``method(*args)`` on every rank (the previous call must be over)."""

    def wait(self, timeout: float) -> dict[int, Any]:
        """The ranks whose call finished within ``timeout`` (each reported once): the
        result, or a ``RankDied`` / ``RankError`` instance. A failed call ends the wait
        at once: the others' calls may be blocked on the failed rank until they are
        interrupted, and a lost rank must be known the moment it is lost (the recovery
        time is counted from the kill)."""

    def progress(self, ranks: list[int], timeout: float) -> dict[int, RankProgress | None]:
        """Each rank's progress; None for a rank that did not answer in time."""

    def dead(self) -> list[int]:
        """Ranks whose process is gone."""

    def stats(self) -> dict[int, dict[str, Any]]:
        """Recent per-rank stats; {} when they are not to be had now."""

    def shutdown(self, clean: bool) -> None:
        """Stop every rank (``clean``: let them close first) and free the placement."""

    def drop(self, ranks: list[int], settle_s: float) -> bool:
        """Remove lost ranks (their processes killed), interrupt the others' collectives
        (``RankWorker.interrupt``: a transfer from a peer killed mid-message would wait
        for the group's timeout) and wait up to ``settle_s`` for their calls to end;
        False when one does not. The others are renumbered in
        order; each lost rank's seat becomes a vacancy."""

    def vacancies(self) -> int:
        """Seats of this group's own placements that could take a rank again now."""

    def regroup(self, restarts: int, grow: bool, term: int = 0) -> list[RankSetup]:
        """Every member re-forms the group at its current size and restores the state
        (see [Note: live resize]); raises GroupStartFailed. ``term``: the supervisor's
        (see [Note: supervisor terms] in workers/rank.py)."""


class WorkerPool(Protocol):
    def available(self) -> int:
        """Replicas the free resources could hold now (besides the job's own group)."""

    def place(
        self, lowest: int, highest: int, wait_s: float, cancel: threading.Event | None = None
    ) -> Placement | None:
        """The largest placement of ``lowest..highest`` replicas possible now; waiting
        for room ends when ``cancel`` is set."""

    def start(self, placement: Placement, restarts: int) -> WorkerGroup:
        """Ranks on the placement, joined and set up; raises GroupStartFailed (having
        removed what it started)."""

    def reserve(self, group: Any, count: int) -> None:
        """Take free room for up to ``count`` more replicas (beside the group's vacant
        seats) as vacant seats of ``group``: their newcomers start while the group
        trains (``vacancies``), so that growing into new room waits for no start."""

    def extend(self, group: Any, count: int, wait_s: float) -> int:
        """Up to ``count`` new ranks appended to ``group``, not yet set up: on its
        vacancies first, then on a new placement; returns how many."""

    def adopt(self) -> WorkerGroup | None:
        """The group a lost supervisor left running (addresses known, setups not yet),
        or None after removing whatever it left."""

    def free(self) -> str:
        """The free resources, in words, for a message."""


# -- in-process ---------------------------------------------------------------------------


@dataclass
class LocalPlacement:
    dp: int
    pool: InProcessPool
    released: bool = False

    def remove(self) -> None:
        self.pool.release(self)


class InProcessGroup:
    """Rank objects (RankWorker's methods: setup, train, save, progress, stats, close,
    interrupt; ``regroup(world, rank, restarts, grow)``) called on threads. A rank signals its own
    death by raising ``RankDied``; from then on every call to it raises the same."""

    def __init__(self, ranks: list[Any], placement: LocalPlacement, mp: int):
        self.ranks, self.placement, self.mp = ranks, placement, mp
        self.dp, self.world = placement.dp, len(ranks)
        self.vacant = 0
        """Replicas of the placement whose rank was dropped (refilled first)."""
        self.setups: list[RankSetup] = []
        self.addresses = [
            {"ip": "127.0.0.1", "node_id": f"local{r // mp:04d}", "pid": 0, "gpus": []}
            for r in range(self.world)
        ]
        self._gone: set[int] = set()
        self._calls = ThreadPoolExecutor(self.world, thread_name_prefix="rank")
        self._asks = ThreadPoolExecutor(self.world, thread_name_prefix="rank-ask")
        self.extra: list[LocalPlacement] = []
        """Placements taken to grow."""
        self.newcomer_starts: list[dict[str, Any]] = []
        self._asking: dict[int, Future] = {}
        """Per rank, the progress question still unanswered: a frozen rank is asked once."""
        self._pending: dict[Future, int] = {}

    def _invoke(self, rank: int, method: str, *args: Any) -> Any:
        if rank in self._gone:
            raise RankDied(rank, f"rank {rank} is gone")
        try:
            return getattr(self.ranks[rank], method)(*args)
        except RankDied:
            self._gone.add(rank)
            raise
        except Exception as exc:
            refused = refused_by_engine([exc])
            raise RankError(rank, f"{type(exc).__name__}: {exc}", refused) from exc

    def begin(self, method: str, *args: Any) -> None:
        assert not self._pending, "a call is still running"
        self._pending = {
            self._calls.submit(self._invoke, r, method, *args): r for r in range(self.world)
        }

    def wait(self, timeout: float) -> dict[int, Any]:
        done, _ = wait_futures(list(self._pending), timeout=timeout, return_when=FIRST_EXCEPTION)
        out: dict[int, Any] = {}
        for future in done:
            rank = self._pending.pop(future)
            exc = future.exception()
            out[rank] = exc if exc is not None else future.result()
        return out

    def progress(self, ranks: list[int], timeout: float) -> dict[int, RankProgress | None]:
        for r in ranks:
            if r not in self._asking:
                self._asking[r] = self._asks.submit(self._invoke, r, "progress")
        asks = {r: self._asking[r] for r in ranks}
        wait_futures(list(asks.values()), timeout=timeout)
        out: dict[int, RankProgress | None] = {}
        for r, f in asks.items():
            out[r] = None
            if f.done():
                del self._asking[r]
                out[r] = f.result() if f.exception() is None else None
        return out

    def dead(self) -> list[int]:
        return sorted(self._gone)

    def stats(self) -> dict[int, dict[str, Any]]:
        with contextlib.suppress(Exception):
            return {r: self._invoke(r, "stats") for r in range(self.world)}
        return {}

    def drop(self, ranks: list[int], settle_s: float) -> bool:
        lost = set(ranks)
        for r in range(self.world):
            if r not in lost:
                self.ranks[r].interrupt(sorted(lost))
        running = [f for f, r in self._pending.items() if r not in lost]
        _, late = wait_futures(running, timeout=settle_s)
        if late:
            return False
        self._pending.clear()
        self._asking.clear()
        for r in sorted(lost):
            with contextlib.suppress(Exception):
                self.ranks[r].close()
        keep = [r for r in range(self.world) if r not in lost]
        self.ranks = [self.ranks[r] for r in keep]
        self.addresses = [self.addresses[r] for r in keep]
        self._gone = {keep.index(r) for r in self._gone if r in keep}
        self.vacant += len(lost) // self.mp
        self._resize(len(keep))
        return True

    def vacancies(self) -> int:
        """The dropped seats the pool's capacity still covers (a seat whose node went
        with the lost rank is not one)."""
        pool = self.placement.pool
        with pool._lock:
            occupied = pool.used - self.vacant
            return max(0, min(self.vacant, pool.capacity - occupied))

    def regroup(self, restarts: int, grow: bool, term: int = 0) -> list[RankSetup]:
        world = self.world
        assert not self._pending, "a call is still running"
        self._pending = {
            self._calls.submit(self._invoke, r, "regroup", world, r, restarts, grow, term): r
            for r in range(world)
        }
        answers = self.wait(timeout=60)
        failed = [a for a in answers.values() if isinstance(a, Exception)]
        if failed or len(answers) < world:
            raise GroupStartFailed(
                f"re-forming {world} ranks failed: {failed or 'timed out'}",
                refused=refused_by_engine(failed),
            )
        self.setups = [answers[r] for r in range(world)]
        return self.setups

    def _resize(self, world: int) -> None:
        self.world, self.dp = world, world // self.mp
        self._calls.shutdown(wait=False)
        self._asks.shutdown(wait=False)
        self._calls = ThreadPoolExecutor(world, thread_name_prefix="rank")
        self._asks = ThreadPoolExecutor(world, thread_name_prefix="rank-ask")

    def shutdown(self, clean: bool) -> None:
        for r, rank in enumerate(self.ranks):
            if r not in self._gone:
                with contextlib.suppress(Exception):
                    rank.close()
            self._gone.add(r)
        self._calls.shutdown(wait=False, cancel_futures=True)
        self._asks.shutdown(wait=False, cancel_futures=True)
        self.placement.remove()
        for extra in self.extra:
            extra.remove()


class InProcessPool:
    """``capacity`` replicas (a test changes it to take capacity away or give it
    back); ``make_rank(rank, world, attempt)`` builds a rank object."""

    def __init__(self, make_rank: Any, capacity: int, mp: int = 1):
        self.make_rank, self.capacity, self.mp = make_rank, capacity, mp
        self.used = 0
        self.attempts = 0
        self.groups: list[InProcessGroup] = []
        self.orphan: InProcessGroup | None = None
        """A group whose supervisor was lost, for ``adopt``."""
        self._lock = threading.Lock()

    def available(self) -> int:
        with self._lock:
            return max(0, self.capacity - self.used)

    def place(
        self, lowest: int, highest: int, wait_s: float, cancel: threading.Event | None = None
    ) -> LocalPlacement | None:
        with self._lock:
            dp = min(highest, self.capacity - self.used)
            if dp < lowest:
                return None
            self.used += dp
            return LocalPlacement(dp, self)

    def release(self, placement: LocalPlacement) -> None:
        with self._lock:
            if not placement.released:
                self.used -= placement.dp
                placement.released = True

    def start(self, placement: LocalPlacement, restarts: int) -> InProcessGroup:
        world = placement.dp * self.mp
        self.attempts += 1
        ranks = [self.make_rank(r, world, self.attempts) for r in range(world)]
        group = InProcessGroup(ranks, placement, self.mp)
        group.begin("setup", "127.0.0.1", 0, world, "", restarts, "local")
        answers = group.wait(timeout=60)
        failed = [a for a in answers.values() if isinstance(a, Exception)]
        if failed or len(answers) < world:
            group.shutdown(clean=False)
            why = failed[0] if failed else "timed out"
            raise GroupStartFailed(
                f"starting {world} ranks failed: {why}", refused=refused_by_engine(failed)
            )
        group.setups = [answers[r] for r in range(world)]
        self.groups.append(group)
        return group

    def reserve(self, group: InProcessGroup, count: int) -> None:
        short = count - group.vacant
        extra = self.place(1, short, 0.0) if short > 0 else None
        if extra is not None:
            group.extra.append(extra)
            group.vacant += extra.dp

    def extend(self, group: InProcessGroup, count: int, wait_s: float) -> int:
        reuse = min(count, group.vacant)
        group.vacant -= reuse
        more = 0
        if reuse < count:
            extra = self.place(1, count - reuse, wait_s)
            if extra is not None:
                group.extra.append(extra)
                more = extra.dp
        added = reuse + more
        if added:
            self.attempts += 1
            world = group.world + added * self.mp
            new = [self.make_rank(r, world, self.attempts) for r in range(group.world, world)]
            group.ranks += new
            group.newcomer_starts += [{"rank": r} for r in range(group.world, world)]
            group.addresses += [
                {"ip": "127.0.0.1", "node_id": f"local{r // self.mp:04d}", "pid": 0, "gpus": []}
                for r in range(group.world, world)
            ]
            group._resize(world)
        return added

    def adopt(self) -> InProcessGroup | None:
        group, self.orphan = self.orphan, None
        return group

    def free(self) -> str:
        return f"{self.available()} replica(s)"


def describe_rank(rank: int, mp: int, address: dict[str, Any] | None) -> str:
    """``rank 3 (dp 1, mp 1, node 10.0.0.2/ab12cd34)``: how messages name a rank."""
    node = ""
    if address:
        node = f", node {address.get('ip')}/{str(address.get('node_id', ''))[:8]}"
    return f"rank {rank} (dp {rank // mp}, mp {rank % mp}{node})"


def rank_rows(group: WorkerGroup) -> list[dict[str, Any]]:
    """Each rank of a started group: address, pid, node, metrics endpoint (none while
    a live resize changes the members)."""
    if len(group.setups) != len(group.addresses):
        return []
    return [
        {**addr, **asdict(setup), "rank": r}
        for r, (addr, setup) in enumerate(zip(group.addresses, group.setups, strict=True))
    ]
