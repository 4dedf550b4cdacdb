"""Elastic capacity with simulated nodes (ray.cluster_utils.Cluster): removing a node
shrinks the job, adding one grows it back to max_dp. The scenario runs in a process
of its own (tests/workers/elastic_scenario.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).parents[2]


def _scenario(*args: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    out = subprocess.run(
        [sys.executable, "-m", "tests.workers.elastic_scenario", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_node_removed_shrinks_and_node_added_grows_back():
    result = _scenario()
    assert result["nodes_before"] == 2  # one replica per node
    assert result["dp_after_shrink"] == 1
    log = result["events"]
    lost = [e for e in log if e["kind"] == "restart"]
    assert [e["reason"] for e in lost] == ["worker_lost"]
    shrunk = [e for e in log if e["kind"] == "resize" and e["reason"] == "shrunk"][0]
    assert shrunk["dp"] == 1 and shrunk["dp_from"] == 2
    grown = [e for e in log if e["kind"] == "resize" and e["reason"] == "grown"][0]
    assert grown["dp"] == 2 and grown["dp_from"] == 1
    assert any(e["reason"] == "capacity_returned" for e in log)
    assert result["status"]["restarts"] == 1 and result["status"]["dp"] == 2
    losses = result["losses"]
    assert losses == list(range(1, max(losses) + 1))  # no step missing
    assert result["stopped"] == "cancelled"


@pytest.mark.parametrize("variant", ["auto", "shm", "mp"])
def test_live_resizes_keep_the_ranks_and_read_no_checkpoint(variant):
    """With host copies a killed rank and a removed node each shrink the group in place,
    and the lost seat or the returned node grows it back in place: the job's ranks are
    started once, every resize restores from host memory, and no step is missing from
    the history. Also with collectives through shared memory: a survivor waiting at a
    barrier for the killed rank gives up as it would on gloo. And model-parallel (mp
    2): a replica leaves whole (the killed rank's partner with it) and comes back
    whole, two newcomers on one node."""
    result = _scenario("live", *([variant] if variant != "auto" else []))
    if variant == "mp":
        assert result["world_after_shrink"] == 2
        ranks = result["ranks_after"]
        assert len(ranks) == 4
        for replica in (ranks[:2], ranks[2:]):  # each replica's two ranks on one node
            assert len({r["node_id"] for r in replica}) == 1, ranks
    log = result["events"]
    placed = [e for e in log if e["kind"] == "placed"]
    assert [e["reason"] for e in placed].count("started") == 1
    regrouped = [e for e in placed if e["reason"] == "regrouped"]
    assert len(regrouped) == 4 and all(e["from_peers"] for e in regrouped), regrouped
    resizes = [e["reason"] for e in log if e["kind"] == "resize"]
    assert resizes == ["shrunk", "grown", "shrunk", "grown"]
    # Each grow says where its newcomers' start went (ray_group.start_figures).
    mp = 2 if variant == "mp" else 1
    for event, grew in zip(regrouped, [False, True, False, True], strict=True):
        # A shrink's survivors were interrupted: how long their failed call took to end.
        assert ("settle" in event["phases"]) == (not grew), event
        assert event["phases"].get("settle", 0) < 10, event  # SETTLE_S, or a restart
        starts = event["newcomers"]
        assert [s["rank"] for s in starts] == list(range(mp, 2 * mp) if grew else []), event
        for figures in starts:
            assert set(figures) == {"rank", "process", "imports", "constructor", "idle"}
            assert figures["imports"] > 0 and figures["constructor"] > 0, figures
            assert min(figures.values()) >= 0, figures
    assert [e["reason"] for e in log if e["kind"] == "restart"] == ["worker_lost"] * 2
    losses = result["losses"]
    assert losses == list(range(1, max(losses) + 1))  # no step missing
    history = result["history"]  # steps trained again appear again (the store keeps one)
    assert sorted(set(history)) == list(range(1, max(history) + 1))
