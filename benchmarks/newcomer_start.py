"""How soon a rank actor is up on a node that has just joined, and what Ray's preloading
of modules changes.

A join's first figures (docs/benchmarks.md, "where a join's time goes") are Ray's:
the node starting, then a worker process for the newcomer's actor, then that process
importing torch and the engine and building its first optimizer (torch._dynamo's
import). This measures them alone, on a ``SimulatedCluster`` with nothing training
beside it: a node is added and at once an actor is asked for on it that starts as a
rank actor does (``workers.rank`` imported, ``_warm_up``), then the node is removed
again; ``--repeats`` times per variant, each variant in a fresh cluster (a process of
its own, since Ray reads its settings when its processes start):

* ``env``: an actor that imports ``workers.rank`` and warms up as a rank does, with a
  runtime environment of the rank's variables (``actor_env``), as rank actors were
  created before [Note: rank settings in process] (rank_env.py): Ray starts a worker
  process for it;
* ``actor``: the rank actor itself (``RankActor``, no runtime environment: it sets the
  variables in its own process), so a worker Ray started with the node can take it;
* ``+preload``: Ray's ``preload_python_modules`` (``RAY_preload_python_modules``) names
  torch, torch._dynamo and ``workers.rank``, so each worker Ray starts imports them
  before it takes a task (``actor+preload`` runs with ``host_allocator: inherit``, since
  a preloaded torch cannot take the huge-page setting any more).

Times are from ``add_node`` to the worker process's start, to the actor's imports done,
and to its constructor done (wall clock, one machine).

    python -m benchmarks.newcomer_start --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.output import write_result

VARIANTS = ("env", "env+preload", "actor", "actor+preload")
PRELOAD = "torch,torch._dynamo,workers.rank"


def _one_variant(variant: str, repeats: int) -> list[dict[str, float]]:
    """In this process: a fresh simulated cluster, ``repeats`` joins."""
    import ray

    from workers.cluster import SimulatedCluster
    from workers.rank_actor import RankActor
    from workers.rank_env import actor_env
    from workers.spec import JobSpec

    @ray.remote
    class Newcomer:
        def __init__(self) -> None:
            began = time.time()
            import workers.rank as rank

            imported = time.time()
            rank._warm_up()
            self.figures = {
                "process": rank.process_started_at() or began,
                "imported": imported,
                "up": time.time(),
            }

        def figures_(self) -> dict:
            return self.figures

    def start() -> tuple[dict[str, float], Any]:
        """A newcomer asked for at once: the wall-clock times of its start, and its handle."""
        if variant.startswith("env"):
            newcomer = Newcomer.options(num_cpus=1, runtime_env={"env_vars": actor_env()}).remote()
            return ray.get(newcomer.figures_.remote(), timeout=120), newcomer
        allocator = "inherit" if variant.endswith("+preload") else None
        resources = {"host_allocator": allocator}
        spec = JobSpec.model_validate({"name": "newcomer", "resources": resources})
        actor = ray.remote(RankActor).options(num_cpus=1)
        rank = actor.remote(actor_env(allocator), "newcomer", 0, spec.model_dump_json())
        started = ray.get(rank.address.remote(), timeout=120)["started"]
        return {**started, "process": started["process"] or started["imported"]}, rank

    trials = []
    with SimulatedCluster(nodes=0, cpus_per_node=1) as cluster:
        time.sleep(3.0)  # the head settled
        for _ in range(repeats):
            added = time.time()
            node = cluster.add_node(1, wait=False)
            f, actor = start()
            trials.append(
                {
                    "process_s": f["process"] - added,
                    "imported_s": f["imported"] - added,
                    "up_s": f["up"] - added,
                }
            )
            ray.kill(actor)
            cluster.remove_node(node)
            time.sleep(2.0)
    return trials


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--one", choices=VARIANTS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error("--repeats: at least 1")
    if args.one:
        print(json.dumps(_one_variant(args.one, args.repeats)))
        return
    root = Path(__file__).resolve().parent.parent
    results: dict[str, list[dict]] = {}
    for variant in args.variants:
        env = {k: v for k, v in os.environ.items() if k != "RAY_preload_python_modules"}
        if variant.endswith("+preload"):
            env["RAY_preload_python_modules"] = PRELOAD
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
        run = subprocess.run(
            [sys.executable, "-m", "benchmarks.newcomer_start", "--one", variant]
            + ["--repeats", str(args.repeats)],
            cwd=root,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        if run.returncode != 0:
            raise SystemExit(f"{variant}: exited {run.returncode}\n{run.stderr[-3000:]}")
        results[variant] = json.loads(run.stdout.strip().splitlines()[-1])

    print(f"\nadd_node -> a rank-like actor up, {args.repeats} joins each (seconds, median)")
    print(f"{'variant':<15} {'process':>8} {'imported':>9} {'up':>6}  each up")
    for variant, trials in results.items():
        med = {
            k: statistics.median(t[k] for t in trials) for k in ("process_s", "imported_s", "up_s")
        }
        each = ", ".join(f"{t['up_s']:.2f}" for t in trials)
        print(
            f"{variant:<15} {med['process_s']:>8.2f} {med['imported_s']:>9.2f} "
            f"{med['up_s']:>6.2f}  {each}"
        )
    write_result(args.out, "newcomer-start", {"repeats": args.repeats, "results": results})


if __name__ == "__main__":
    main()
