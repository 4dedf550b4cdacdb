"""Every parity check can fail: the same comparisons as test_parity.py, run against an
engine broken on purpose in its rank processes (harness.install_fault), must each
report the defect."""

from __future__ import annotations

import pytest
import torch

from tests.engine.harness import FAULT_ENV, FAULTS, combine_ranks
from tests.engine.scenarios import Spec, parity
from zeroservice.launch import run_local

# Where each fault passes silently: stage 0 has no shards and gathers nothing; at
# stage 1 a shifted shard overlaps the reduced chunk in one buffer and torch refuses
# the copy (a loud failure, tested below).
STAGES = {"skip-reduction": (0, 1, 2, 3), "shard-offset": (2, 3), "stale-gather": (1, 2, 3)}


def _passes(r: dict) -> bool:
    """The verdict test_parity.py would give."""
    losses = torch.tensor(r["losses"])
    ref = torch.tensor(r["ref_losses"])
    close = bool(torch.isclose(losses, ref, rtol=1e-5, atol=0).all())
    return close and max(r["grad_ratio"]) <= 1.0 and r["weight_ratio"] <= 1.0


@pytest.mark.slow
@pytest.mark.parametrize("fault", FAULTS)
def test_every_parity_check_can_fail(fault):
    specs = [Spec(stage=s, steps=3) for s in STAGES[fault]]
    results = run_local(parity, 2, specs, env={FAULT_ENV: fault})
    for spec, *per_rank in zip(specs, *results, strict=True):
        r = combine_ranks(per_rank)
        assert not _passes(r), f"stage {spec.stage}: the {fault} fault went unnoticed"
        # The SGD run's gradient or weight check sees it, not only the losses.
        assert max(r["grad_ratio"]) > 1.0 or r["weight_ratio"] > 1.0, (fault, spec.stage)


def test_a_sound_engine_passes_the_same_checks():
    specs = [Spec(stage=s, steps=3) for s in (0, 1, 2, 3)]
    results = run_local(parity, 2, specs)
    for per_rank in zip(*results, strict=True):
        assert _passes(combine_ranks(list(per_rank)))


def test_a_shifted_shard_at_stage_1_fails_loudly():
    with pytest.raises(RuntimeError, match="single memory location"):
        run_local(parity, 2, [Spec(stage=1, steps=1)], env={FAULT_ENV: "shard-offset"})
