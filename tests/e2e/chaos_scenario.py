"""The chaos scenario, run in a process of its own (``python -m``) so that its simulated
cluster shares no Ray state with other tests.

A control plane (the API service and its scheduler, on SQLite) runs one job with host
copies (``engine.redundancy: host-copy``) on a ``ray.cluster_utils.Cluster`` of a head
and two 1-CPU nodes (dp 2, min_dp 1, one replica per node). A seeded schedule injects
one fault each time the job's newest checkpoint moved ``SPACING`` steps past the
previous fault and its group is whole again: a rank's process
SIGKILLed or SIGSTOPped, a rank's node removed (and a node added back once the job
shrank), the supervisor's process SIGKILLed, the API service discarded and started
again on the same store, or the checkpoint file system filled up just before a save
(a small tmpfs, where this machine lets the test mount one). Then the job runs to its
end. Prints a JSON summary on its last line: the faults injected, the job's final
record, its per-step history from the API, its events, and the verdict of every
checkpoint left.

    python -m tests.e2e.chaos_scenario [--seed 0] [--faults 21]
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import gc
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

SPEC: dict[str, Any] = {
    "name": "chaos",
    "model": {"vocab_size": 256, "seq_len": 128, "n_layer": 2, "n_head": 4, "dim": 128},
    "engine": {"stage": 2, "redundancy": "host-copy", "redundancy_interval": 1},
    "micro_batch": 8,
    "resources": {"dp": 2, "min_dp": 1, "max_dp": 2, "cpus_per_rank": 1},
    "checkpoint": {"interval_steps": 5, "keep": 2},
    "timeouts": {"bootstrap_s": 60, "step_s": 8},
    "max_restarts": 1000,
}
KINDS = ["rank_kill", "rank_stop", "node", "supervisor", "api", "disk_full"]
SPACING = 10
"""Checkpointed steps of progress between a fault and the next one."""
LEASE_S = 3.0
"""The scheduler's lease. An API service discarded without stopping (as a crashed one
is) still holds it; the one started after it on the same data directory takes it over
at once (see [Note: a replica restarted after a crash] in api/lease.py), unless the
old one's lock on its name were still held, and then it waits for the lease to lapse:
15 s by default, 3 s here."""
STEPS_PER_FAULT = 40
"""The job's length per fault: room for the spacing and the steps a recovery takes (31
on average and 55 at most in a run on a 2-core Xeon: 21 faults by step 630 of 880).
The steps after the last fault are time spent for nothing, so the margin is kept small.
Faults stop ``STEPS_PER_FAULT`` steps before the end: where training is fast against
the scenario's fixed timeouts, the last ones may be left out (the summary lists those
injected)."""


def _mount_tmpfs(path: Path, size_mib: int) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    try:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size_mib}m", "tmpfs", str(path)],
            capture_output=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def _fill(disk: Path, leave: int = 8192) -> Path:
    """A ballast file that takes the disk's free space but ``leave`` bytes (less than a
    rank file). The ranks may save meanwhile and take some of the room counted: a write
    that meets a full disk has done what was asked, so ENOSPC ends it quietly."""
    ballast = disk / "ballast"
    try:
        with open(ballast, "wb") as f:
            f.write(b"\0" * max(0, shutil.disk_usage(disk).free - leave))
    except OSError as exc:
        if exc.errno != errno.ENOSPC:
            raise
    return ballast


def _schedule(n: int, seed: int, disk: bool) -> list[str]:
    kinds = KINDS if disk else KINDS[:-1]
    plan = [kinds[i % len(kinds)] for i in range(n)]
    random.Random(seed).shuffle(plan)
    return plan


def main(seed: int, faults: int) -> dict[str, Any]:
    from workers.cluster import SimulatedCluster

    with SimulatedCluster(nodes=2, cpus_per_node=1) as sim:
        disk = sim.workdir / "disk"
        mounted = _mount_tmpfs(disk, 24)
        try:
            return _run(sim, disk, mounted, seed, faults)
        finally:
            if mounted:
                subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def _run(sim: Any, disk: Path, mounted: bool, seed: int, faults: int) -> dict[str, Any]:
    import ray

    from api.backend import RayBackend
    from tests.api.conftest import Harness
    from tests.waiting import wait_for
    from workers.jobs import attach
    from zeroservice.checkpoint import describe

    workdir = sim.workdir
    plan = _schedule(faults, seed, mounted)
    rng = random.Random(seed + 1)
    spec = dict(SPEC, steps=STEPS_PER_FAULT * (len(plan) + 1))
    store = f"sqlite:///{workdir / 'store.db'}"
    settings = {"checkpoint_root": str(disk / "checkpoints"), "scheduler_lease_s": LEASE_S}
    injected: list[dict[str, Any]] = []
    h = Harness(store, workdir / "data", backend=RayBackend(), **settings)
    auth = h.headers(h.tenant_token("alice"))
    job_id = h.client.post("/v1/jobs", json={"spec": spec}, headers=auth).json()["id"]

    def job() -> dict[str, Any]:
        h.tick()
        return h.client.get(f"/v1/jobs/{job_id}", headers=auth).json()

    def supervisor():
        return attach(job_id)

    def events() -> list[dict[str, Any]]:
        h.tick()
        out: list[dict[str, Any]] = []
        while True:
            page = h.client.get(
                f"/v1/jobs/{job_id}/events",
                params={"after": out[-1]["id"] if out else 0, "limit": 1000},
                headers=auth,
            ).json()
            out += page
            if len(page) < 1000:
                return out

    def ranks() -> list[dict[str, Any]]:
        handle = supervisor()
        if handle is None:
            return []
        with contextlib.suppress(Exception):
            return ray.get(handle.ranks.remote(), timeout=10)
        return []

    def full_group() -> list[dict[str, Any]] | None:
        j = job()
        members = ranks()
        return members if j["status"] == "running" and len(members) == 2 else None

    def explain():
        return job(), ray.available_resources()

    mark = 0
    for kind in plan:
        mark += SPACING
        wait_for(lambda m=mark: job()["step"] >= m, 300, f"step {mark}", explain)
        members = wait_for(full_group, 300, "a full group", explain)
        mark = job()["step"]
        if mark > spec["steps"] - STEPS_PER_FAULT:
            break
        victim = rng.choice(members)
        fault: dict[str, Any] = {"kind": kind, "at_step": job()["step"]}
        if kind == "rank_kill":
            os.kill(victim["pid"], signal.SIGKILL)
        elif kind == "rank_stop":
            os.kill(victim["pid"], signal.SIGSTOP)
        elif kind == "node":
            node = next(n for n in sim.nodes if n.node_id == victim["node_id"])
            sim.remove_node(node)
            sim.nodes.remove(node)
            wait_for(lambda: job()["current_dp"] == 1, 300, "the shrink", explain)
            sim.nodes.append(sim.add_node(num_cpus=1))
        elif kind == "supervisor":
            os.kill(ray.get(supervisor().process_id.remote()), signal.SIGKILL)
        elif kind == "api":
            h.client.close()
            h.service.engine.dispose()
            del h  # a crashed process's files close, the lock on its lease's name with them
            gc.collect()
            h = Harness(store, workdir / "data", backend=RayBackend(), **settings)
            h.tick()
            fault["scheduling_at_once"] = h.service.scheduler.leader
        elif kind == "disk_full":
            ballast = _fill(disk)
            failed = sum(e["reason"] == "save_failed" for e in events())
            wait_for(
                lambda n=failed: sum(e["reason"] == "save_failed" for e in events()) > n,
                300,
                "a failed save",
                explain,
            )
            ballast.unlink()
        injected.append(fault)
        print(f"fault {len(injected)}: {fault}", file=sys.stderr, flush=True)
    done = wait_for(
        lambda: (lambda j: j if j["status"] in ("succeeded", "failed") else None)(job()),
        600,
        "the job to end",
        explain,
    )
    history: list[dict[str, Any]] = []
    after = -1
    while True:
        page = h.client.get(
            f"/v1/jobs/{job_id}/metrics",
            params={"history_after": after, "history_limit": 500},
            headers=auth,
        ).json()
        history += page["history"]
        if page.get("next_after") is None:
            break
        after = page["next_after"]
    log = events()
    root = Path(settings["checkpoint_root"])
    verdicts = {
        str(p): describe(p, verify=True)
        for p in sorted(root.rglob("step-*"))
        if (p / "manifest.json").exists()
    }
    return {
        "mounted": mounted,
        "faults": injected,
        "job": done,
        "steps": spec["steps"],
        "history": [p["step"] for p in history],
        "events": log,
        "checkpoints": verdicts,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--faults", type=int, default=21)
    args = parser.parse_args()
    started = time.monotonic()
    summary = main(args.seed, args.faults)
    summary["seconds"] = time.monotonic() - started
    print(json.dumps(summary))
