"""Activation checkpointing with a parameter that more than one checkpointed call uses
(a block called twice, weights tied across blocks or with a module outside them): every
stage matches DDP; torch's reentrant checkpoint, which the engine cannot see into, is
refused by name when it would lose a gradient."""

from __future__ import annotations

import functools

import pytest

from tests.engine.harness import assert_matches_ddp, combine_ranks
from tests.engine.shared_checkpoint_scenarios import (
    KINDS,
    shared_parameters,
    user_reentrant_refused,
)
from zeroservice.launch import run_local

STAGES = [0, 1, 2, 3]


@functools.cache
def _results() -> dict:
    per_rank = run_local(shared_parameters, 2, STAGES, timeout_s=600)
    return {key: combine_ranks([r[key] for r in per_rank]) for key in per_rank[0]}


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("kind", KINDS)
def test_a_parameter_of_several_checkpointed_calls_matches_ddp(kind, stage):
    assert_matches_ddp(_results()[(kind, stage)])


def test_torch_reentrant_checkpoint_losing_a_gradient_is_refused():
    for per_rank in run_local(user_reentrant_refused, 2, STAGES, timeout_s=300):
        for stage in STAGES:
            assert "blocks.0" in per_rank[stage], stage
            assert "use_reentrant=False" in per_rank[stage], stage
