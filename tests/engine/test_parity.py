"""Every stage trains as DDP does on the same seed: the Adam run's losses, and every
step's reduced gradients and the final weights of an SGD + momentum run. See
[Note: what parity compares] in harness.py."""

from __future__ import annotations

import functools

import pytest
import torch

from tests.engine.harness import assert_matches_ddp, combine_ranks
from tests.engine.scenarios import Spec, _model, parity
from zeroservice.launch import run_local

CASES = {
    "plain": {},
    "accum4": {"accum": 4},
    "clip": {"clip": 0.05},
    "untied": {"tie": False},
    "cosine": {"schedule": {"kind": "cosine", "warmup_steps": 3, "total_steps": 10}},
    "no-overlap": {"overlap": False},
    "native-collectives": {"collectives": "native"},
    "shm-collectives": {"collectives": "shm"},
    "unfused-adamw": {"fuse": False},
    "vocab-tiles": {"vocab_tiles": 3},
    "vocab-tiles-untied": {"vocab_tiles": 3, "tie": False},
}
# Stage 3 only: prefetch squeezed below one block, small units kept gathered, groups
# formed by size (the tied embedding is then read outside its own group).
STAGE3_CASES = {
    "tight-prefetch": {"prefetch": 20_000, "accum": 2},
    "persistent-units": {"persistence": 2**16},
    "size-groups": {"grouping": "size", "clip": 0.05},
}
CASES |= STAGE3_CASES
STAGES = (0, 1, 2, 3)
WORLD_CASES = {
    2: list(CASES),
    4: ["plain", "accum4", "clip", "shm-collectives", "tight-prefetch"],
}


def _stages(case: str) -> tuple[int, ...]:
    return (3,) if case in STAGE3_CASES else STAGES


def _specs(world: int) -> list[tuple[int, str, Spec]]:
    return [(s, c, Spec(stage=s, **CASES[c])) for c in WORLD_CASES[world] for s in _stages(c)]


@functools.cache
def _results(world: int) -> dict[tuple[int, str], tuple[Spec, dict]]:
    """Every case of one world size, run in one group of processes."""
    specs = _specs(world)
    per_rank = run_local(parity, world, [s for _, _, s in specs])
    return {
        (stage, case): (spec, combine_ranks([r[i] for r in per_rank]))
        for i, (stage, case, spec) in enumerate(specs)
    }


@pytest.fixture(params=[2, 4], ids=lambda w: f"world{w}")
def results(request):
    return _results(request.param)


@pytest.mark.parametrize(
    "world,case,stage",
    [(w, c, s) for w, cases in WORLD_CASES.items() for c in cases for s in _stages(c)],
)
def test_matches_ddp(world, case, stage):
    _, r = _results(world)[(stage, case)]
    assert_matches_ddp(r)


def test_clipping_was_active(results):
    """The clip case must actually clip: the norm before clipping exceeds the limit."""
    for stage in STAGES:
        spec, r = results[(stage, "clip")]
        assert min(r["norms"]) > spec.clip


def test_training_moves_the_loss(results):
    """Parity is not vacuous: both runs learn. Each step draws other samples, whose
    losses differ by about as much as ten steps of SGD at this rate move them (±0.05),
    so the first and last three steps are compared, and SGD's weights must have moved."""
    initial = {k: v.cpu() for k, v in _model(Spec(stage=0)).state_dict().items()}
    for stage in STAGES:
        _, r = results[(stage, "plain")]
        assert _mean(r["losses"][-3:]) < _mean(r["losses"][:3]) - 0.05, r["losses"]
        assert _mean(r["sgd_losses"][-3:]) < _mean(r["sgd_losses"][:3]), r["sgd_losses"]
        change = sum(float((r["state"][k].cpu() - v).square().sum()) for k, v in initial.items())
        moved = (change / sum(float(v.square().sum()) for v in initial.values())) ** 0.5
        assert moved > 1e-3, moved


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def test_tied_weights_stay_tied(results):
    for stage in STAGES:
        _, r = results[(stage, "plain")]
        torch.testing.assert_close(r["state"]["wte.weight"], r["state"]["head.weight"])
