"""Parameters that some ranks leave unused on some steps: no hang, DDP's result."""

from __future__ import annotations

import functools

import pytest

from tests.engine.harness import assert_matches_ddp, combine_ranks
from tests.engine.scenarios import unused_parameters, unused_parameters_at
from zeroservice.launch import run_local


@functools.cache
def _results():
    per_rank = run_local(unused_parameters, 2, [0, 1, 2], timeout_s=300)
    return [combine_ranks(list(r)) for r in zip(*per_rank, strict=True)]


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_unused_parameters_match_ddp(stage):
    assert_matches_ddp(_results()[stage])


@pytest.mark.parametrize("width", [16, 48])
def test_unused_parameters_match_ddp_at_stage_3_with_the_model_as_a_leaf(width):
    """The branch is taken in the root's own forward: naming the model's class in
    stage3_leaf_modules gathers and reduces all of it together in backward, so ranks
    that skipped the branch issue the same collectives (at width 48 the weights exceed
    the bucket: each its own unit)."""
    per_rank = run_local(unused_parameters_at, 2, 3, 6, width, ("_Branchy",), timeout_s=300)
    assert_matches_ddp(combine_ranks(per_rank))
