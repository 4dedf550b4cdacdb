"""Recovery from a lost rank: today's restart from the checkpoint against the live
resize from host memory (see [Note: live resize] in workers/controller.py).

A local Ray cluster (``ray.cluster_utils.Cluster``: a head without CPUs and two nodes,
one replica each) runs the same job in each mode: a GPT at stage 2, dp 2 (min_dp 1),
fp32 AdamW, a checkpoint every 5 steps; "live" adds ``engine.redundancy: host-copy``
(K = 1). ``--model small``: 4 layers, dim 256, vocabulary 8192, 128 tokens × 4
samples per rank (5.3 M parameters); ``--model large``: 9 layers, dim 1536 (267 M
parameters, 50×), 32 tokens × 1 sample per rank so that a step stays short on CPUs.
Each mode first trains without faults (the baseline rate), then a seeded rank's
process is SIGKILLed every ``--every`` seconds, ``--kills`` times; then a node is
removed and added back.

Measured per kill, from outside (the ranks' own Prometheus endpoints, polled every
50 ms): seconds from the SIGKILL to the first step completed by a group without the
killed process (and, of those, the seconds the job's event gives for re-forming the
group: the live path's ``placed/regrouped``), and the steps trained again (the step
reached before the kill minus the step the new group resumed from). Goodput: useful
samples per second over the faulty phase (each step counted at the data-parallel
degree it was trained at: a step at dp 1 is half a step at dp 2) / the fault-free
rate; ``goodput_steps`` counts steps alone. ``--mp 2``: the job is model-parallel
(two ranks per replica, one replica per node), so a kill takes its replica's two ranks
out and a join brings two back. Join: seconds from the
node's return (``add_node``) to the first step at dp 2, and the same from the moment
Ray reports the new node alive (its raylet's start is not the job's doing); the JSON's
``join`` breaks it down (node alive, growing, re-formed, first step).

``--host-allocator`` sets the job's ``resources.host_allocator`` (unset: ``huge``,
the ranks' large host blocks in transparent huge pages; ``inherit`` leaves them to the
node's environment).

    python -m benchmarks.recovery [--model small|large] [--kills 10] [--every 12]
                                  [--modes restart live] [--mp 1|2]
                                  [--host-allocator huge|mapped|inherit]

Prints the table and writes JSON to benchmarks/results/recovery-<model>[-mp2].json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results"
MODELS: dict[str, tuple[dict[str, int], int]] = {
    "small": ({"n_layer": 4, "n_head": 4, "dim": 256, "vocab_size": 8192, "seq_len": 128}, 4),
    "large": ({"n_layer": 9, "n_head": 12, "dim": 1536, "vocab_size": 8192, "seq_len": 32}, 1),
}
"""Name: (the GPT's config, the micro-batch)."""


def _scrape_step(endpoint: str) -> int | None:
    try:
        with urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=0.5) as r:
            text = r.read().decode()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("zeroservice_step{"):
            return int(float(line.rsplit(" ", 1)[1]))
    return None


def _age(stamp: str, since: float) -> float:
    """Seconds from ``since`` (epoch) to an event's UTC ``time``."""
    from datetime import datetime, timezone

    when = datetime.fromisoformat(stamp.replace("Z", "+00:00"))
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return when.timestamp() - since


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[k]


def _alive_nodes() -> set[str]:
    import ray

    return {n["NodeID"] for n in ray.nodes() if n.get("Alive")}


def _wait_new_node(before: set[str], since: float, timeout: float = 120.0) -> float:
    """Seconds from ``since`` (monotonic) until Ray reports a node alive that was not
    before (the node's own start: its raylet and registration, none of the job's doing)."""
    while time.monotonic() - since < timeout:
        if _alive_nodes() - before:
            return time.monotonic() - since
        time.sleep(0.05)
    raise TimeoutError(f"no new node alive within {timeout} s")


class _JoinWatch:
    """Polls Ray's state every 50 ms while a node joins: when every placement group
    bundle sits on a live node (the lost seat placed again) and when a rank actor that
    did not exist before is alive (its constructor, torch's warm-up included, done)."""

    def __init__(self) -> None:
        import ray._private.state as ray_state

        self._state = ray_state
        self._actors_before = self._rank_actors()
        self.seen: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _rank_actors(self) -> set[str]:
        return {
            a["ActorID"]
            for a in self._state.actors().values()
            if a.get("ActorClassName", "").endswith("RankActor") and a.get("State") == "ALIVE"
        }

    def _seats_placed(self) -> bool:
        from ray.util import placement_group_table

        alive = _alive_nodes()
        tables = [t for t in placement_group_table().values() if t.get("state") != "REMOVED"]
        return bool(tables) and all(
            t.get("state") == "CREATED" and set(t.get("bundles_to_node_id", {}).values()) <= alive
            for t in tables
        )

    def _poll(self) -> None:
        while not self._stop.is_set():
            now = time.monotonic() - self._since
            if "seat_placed_s" not in self.seen and self._seats_placed():
                self.seen["seat_placed_s"] = now
            if "newcomer_up_s" not in self.seen and self._rank_actors() - self._actors_before:
                self.seen["newcomer_up_s"] = now
            time.sleep(0.05)

    def start(self, since: float) -> None:
        self._since = since
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _join_breakdown(
    events: list[dict[str, Any]], joined_at: float, t_node: float, t_join: float
) -> dict[str, Any]:
    """Where a join's seconds go, from the node's ``add_node``: the node alive in Ray,
    the supervisor growing (its newcomer's actor is up), the re-formed group's event
    (its phases, and where the newcomer's start went: ``ray_group.start_figures``),
    and its first step. ``from_node_s``: the same join counted from the node alive."""
    grew = [
        _age(e["time"], joined_at)
        for e in events
        if e["reason"] == "capacity_returned" and _age(e["time"], joined_at) > 0
    ]
    formed = [
        (_age(e["time"], joined_at), e.get("seconds"), e.get("phases"), e.get("newcomers"))
        for e in events
        if e["reason"] == "regrouped" and _age(e["time"], joined_at) > 0
    ]
    return {
        "phases": formed[-1][2] if formed else None,
        "newcomers": formed[-1][3] if formed else None,
        "node_alive_s": t_node,
        "growing_s": grew[0] if grew else None,
        "regrouped_s": formed[-1][0] if formed else None,
        "regroup_s": formed[-1][1] if formed else None,
        "first_step_s": t_join,
        "from_node_s": t_join - t_node,
    }


def run_mode(
    model: str,
    mode: str,
    kills: int,
    every: float,
    baseline_s: float,
    seed: int,
    mp: int = 1,
    host_allocator: str | None = None,
) -> dict:
    from workers.cluster import SimulatedCluster

    with SimulatedCluster(nodes=2, cpus_per_node=mp) as sim:
        import ray

        from workers.jobs import launch, stop
        from workers.spec import JobSpec

        engine: dict[str, Any] = {"stage": 2}
        if mode == "live":
            engine |= {"redundancy": "host-copy", "redundancy_interval": 1}
        config, micro_batch = MODELS[model]
        spec = JobSpec.model_validate(
            {
                "name": f"recovery-{mode}",
                "model": config,
                "engine": engine,
                "optimizer": {"type": "adamw", "lr": 1e-3},
                "steps": 10**7,
                "micro_batch": micro_batch,
                "resources": {
                    "dp": 2,
                    "min_dp": 1,
                    "max_dp": 2,
                    "cpus_per_rank": 1,
                    "mp": mp,
                    "host_allocator": host_allocator,
                },
                "checkpoint": {"interval_steps": 5, "keep": 2},
                "timeouts": {"bootstrap_s": 300, "step_s": 120},
                "max_restarts": 1000,
            }
        )
        rng = random.Random(seed)
        handle = launch(f"recovery-{mode}", spec, sim.workdir / "ckpt")

        def rows() -> list[dict[str, Any]]:
            return ray.get(handle.ranks.remote())

        def step_now(members: list[dict[str, Any]]) -> int:
            steps = [_scrape_step(r["metrics"]) for r in members]
            return max((s for s in steps if s is not None), default=-1)

        def wait_full(timeout: float = 300.0) -> list[dict[str, Any]]:
            """Poll until the group has all its ranks again (grown back or restarted); a
            job that never gets there ends the run, naming its last events."""
            t0 = time.monotonic()
            members = rows()
            while len(members) < 2 * mp:
                if time.monotonic() - t0 > timeout:
                    recent = [
                        f"{e['kind']}/{e['reason']}: {e['message']}"
                        for e in ray.get(handle.events.remote())[-6:]
                    ]
                    raise TimeoutError(
                        f"{mode}: {len(members)} of {2 * mp} ranks after {timeout:.0f} s; "
                        "last events:\n" + "\n".join(recent)
                    )
                time.sleep(0.05)
                members = rows()
            return members

        def wait_group(dp: int, without: int | None, timeout: float = 300.0):
            """Poll until a group of ``dp`` replicas without pid ``without`` completed a
            step past its start; returns (seconds waited, its rows)."""
            t0 = time.monotonic()
            while time.monotonic() - t0 < timeout:
                members = rows()
                fresh = len(members) >= dp * mp and all(r["pid"] != without for r in members)
                if fresh and step_now(members) > members[0]["start_step"]:
                    return time.monotonic() - t0, members
                time.sleep(0.05)
            raise TimeoutError(f"{mode}: no step at dp {dp} within {timeout} s")

        _, members = wait_group(2, None)
        while step_now(members) < 6:
            time.sleep(0.1)
        s0, t0 = step_now(members), time.monotonic()
        time.sleep(baseline_s)
        members = rows()
        rate = (step_now(members) - s0) / (time.monotonic() - t0)

        faults = []
        s_begin, t_begin = step_now(members), time.monotonic()
        for _ in range(kills):
            members = wait_full()  # growing back (live) or restarting
            victim = rng.choice(members)
            before = step_now(members)
            os.kill(victim["pid"], signal.SIGKILL)
            seconds, after = wait_group(1, victim["pid"])
            regrouped = [
                e
                for e in ray.get(handle.events.remote())
                if e["reason"] == "regrouped" and e["dp"] == len(after) // mp
            ]
            live = bool(regrouped) and mode == "live"
            faults.append(
                {
                    "seconds": seconds,
                    "regroup_s": regrouped[-1].get("seconds") if live else None,
                    "phases": regrouped[-1].get("phases") if live else None,
                    "retrained": max(0, before - after[0]["start_step"]),
                    "new_dp": len(after) // mp,
                }
            )
            print(f"{mode}: kill -> step in {seconds:.2f} s, {faults[-1]}", flush=True)
            if seconds > 3 * every / 4:  # what the job did meanwhile
                recent = ray.get(handle.events.remote())[-8:]
                faults[-1]["events"] = [
                    f"{e['kind']}/{e['reason']}: {e['message']}" for e in recent
                ]
                print("\n".join(faults[-1]["events"]), flush=True)
            time.sleep(max(0.0, every - seconds))
        members = rows()
        t_end = time.monotonic()
        # A step at dp 1 trains half the samples of one at dp 2: count samples, each step
        # at the data-parallel degree the job's history gives it. The last step is the
        # history's too (a busy rank's endpoint may not answer a scrape in time).
        dp_of = {
            s: p["dp"]
            for p in ray.get(handle.history.remote())
            for s in range(p["step"] - p.get("steps", 1) + 1, p["step"] + 1)
        }
        s_end = max(step_now(members), max(dp_of, default=-1))
        useful = s_end - s_begin
        goodput_steps = useful / (t_end - t_begin) / rate if rate > 0 else 0.0
        samples = sum(dp_of.get(s, 0) for s in range(s_begin + 1, s_end + 1))
        goodput = samples / (t_end - t_begin) / (2 * rate) if rate > 0 else 0.0

        members = wait_full()
        sim.remove_node(sim.nodes[1])
        wait_group(1, None)
        time.sleep(3.0)
        alive_before = _alive_nodes()
        watch = _JoinWatch()
        joined, joined_at = time.monotonic(), time.time()
        watch.start(joined)
        sim.add_node(num_cpus=mp, wait=False)
        t_node = _wait_new_node(alive_before, joined)
        wait_group(2, None)
        t_join = time.monotonic() - joined  # from the node's return
        watch.stop()
        events = ray.get(handle.events.remote())
        for e in events[-6:]:
            print(
                f"join +{_age(e['time'], joined_at):.2f} s: {e['kind']}/{e['reason']}: "
                f"{e['message'][:160]}",
                flush=True,
            )
        join = _join_breakdown(events, joined_at, t_node, t_join) | watch.seen
        print(f"join: {join}", flush=True)
        from workers.model_size import count_parameters

        # The whole model's (a rank's psi is its slice with MP), built without a group.
        unsplit = spec.model_copy(update={"resources": spec.resources.model_copy(update={"mp": 1})})
        params = count_parameters(unsplit)
        stop(f"recovery-{mode}")
        secs = [f["seconds"] for f in faults]
        regroup = [f["regroup_s"] for f in faults if f["regroup_s"] is not None]
        return {
            "model": model,
            "params": params,
            "mode": mode,
            "mp": mp,
            "host_allocator": spec.resources.host_allocator or "huge",
            "regroup_p50_s": statistics.median(regroup) if regroup else None,
            "steps_per_s_no_faults": rate,
            "kills": len(faults),
            "recover_p50_s": statistics.median(secs),
            "recover_p95_s": _percentile(secs, 0.95),
            "retrained_mean": statistics.mean(f["retrained"] for f in faults),
            "retrained_max": max(f["retrained"] for f in faults),
            "goodput": goodput,
            "goodput_steps": goodput_steps,
            "kill_every_s": every,
            "join_s": t_join,
            "join": join,
            "faults": faults,
            "regrouped": sum(e["reason"] == "regrouped" for e in events),
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="small")
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--every", type=float, default=12.0)
    parser.add_argument("--baseline", type=float, default=20.0)
    parser.add_argument("--modes", nargs="+", default=["restart", "live"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--mp", type=int, choices=[1, 2], default=1)
    parser.add_argument(
        "--host-allocator",
        choices=["huge", "mapped", "inherit"],
        default=None,
        help="the job's resources.host_allocator (default: unset, i.e. huge)",
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="JSON path (default: results/recovery-MODEL.json)"
    )
    args = parser.parse_args()
    results = [
        run_mode(
            args.model,
            m,
            args.kills,
            args.every,
            args.baseline,
            args.seed,
            args.mp,
            args.host_allocator,
        )
        for m in args.modes
    ]
    header = (
        "model",
        "mode",
        "kills",
        "kill→step p50 s",
        "p95 s",
        "regroup p50 s",
        "retrained mean",
        "max",
        "goodput",
        "join→step s",
        "node alive s",
        "node alive→step s",
    )
    print(" | ".join(header))
    for r in results:
        regroup = "-" if r["regroup_p50_s"] is None else f"{r['regroup_p50_s']:.2f}"
        print(
            f"{r['model']} ({r['params'] / 1e6:.1f} M, mp {r['mp']}) | {r['mode']} | "
            f"{r['kills']} | "
            f"{r['recover_p50_s']:.2f} | {r['recover_p95_s']:.2f} | {regroup} | "
            f"{r['retrained_mean']:.1f} | {r['retrained_max']} | {r['goodput']:.2f} | "
            f"{r['join_s']:.2f} | {r['join']['node_alive_s']:.2f} | "
            f"{r['join']['from_node_s']:.2f}"
        )
    suffix = f"-mp{args.mp}" if args.mp > 1 else ""
    out = args.out or RESULTS / f"recovery-{args.model}{suffix}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    config, micro_batch = MODELS[args.model]
    out.write_text(
        json.dumps({"model": config, "micro_batch": micro_batch, "results": results}, indent=1)
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
