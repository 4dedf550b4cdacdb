"""The GPU oracle's driver (``benchmarks.planner_oracle.run_cuda``), on the CPU: every
trial gets exactly one row, in order, whether it measured, raised on every rank, or
took its ranks down; the trials after a failure still run, in fresh processes."""

from __future__ import annotations

import json
import os

import torch.distributed as dist

from benchmarks.planner_oracle import CudaTrial, run_cuda
from zeroservice.models import GPTConfig

TINY = GPTConfig(vocab_size=64, seq_len=16, n_layer=1, n_head=2, dim=32)


def scripted_ranks(trials: list[CudaTrial], jsonl: str) -> None:
    """What the ranks do, by each trial's ``row["kind"]``: "ok" records a measurement,
    "raise" records a failure and raises on every rank (as ``cuda_trials`` does), "crash"
    ends both processes without a row."""
    for trial in trials:
        kind = trial.row["kind"]
        if kind == "crash":
            os._exit(3)
        row = {**trial.row, "name": trial.name}
        if kind == "raise":
            row["failed"] = "RuntimeError: refused"
        else:
            row["measured_bytes"] = 1000 + len(trial.name)
        dist.barrier()
        if dist.get_rank() == 0:
            with open(jsonl, "a") as f:
                f.write(json.dumps(row) + "\n")
        dist.barrier()
        if kind == "raise":
            raise RuntimeError("refused")


def test_every_trial_gets_one_row_in_order_and_failures_do_not_stop_the_rest(tmp_path):
    kinds = [("a", "ok"), ("b", "raise"), ("c", "ok"), ("d", "crash"), ("e", "ok")]
    trials = [CudaTrial(n, TINY, 1, 1, {"stage": 0}, {"kind": k}) for n, k in kinds]
    shown: list[dict] = []
    rows = run_cuda(
        trials, tmp_path / "out.json", shown.append, chunk=3, trial_s=60, ranks_fn=scripted_ranks
    )
    assert [r["name"] for r in rows] == ["a", "b", "c", "d", "e"]
    assert shown == rows
    failed = {r["name"]: r["failed"] for r in rows if "failed" in r}
    assert failed == {"b": "RuntimeError: refused", "d": "the ranks stopped"}
    assert all(r["measured_bytes"] == 1001 for r in rows if "failed" not in r)
