"""Parameters that some ranks leave unused on some steps: no hang, DDP's result."""

from __future__ import annotations

import functools

import pytest

from tests.engine.harness import assert_matches_ddp, combine_ranks
from tests.engine.scenarios import unused_parameters
from zeroservice.launch import run_local


@functools.cache
def _results():
    per_rank = run_local(unused_parameters, 2, [0, 1, 2], timeout_s=300)
    return [combine_ranks(list(r)) for r in zip(*per_rank, strict=True)]


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_unused_parameters_match_ddp(stage):
    assert_matches_ddp(_results()[stage])
