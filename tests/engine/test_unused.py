"""Parameters that some ranks leave unused on some steps: no hang, DDP's result."""

from __future__ import annotations

import functools

import pytest
import torch

from tests.engine.scenarios import unused_parameters
from zeroservice.launch import run_local


@functools.cache
def _results():
    return run_local(unused_parameters, 2, [0, 1, 2], timeout_s=300)[0]


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_unused_parameters_match_ddp(stage):
    r = _results()[stage]
    torch.testing.assert_close(
        torch.tensor(r["losses"]), torch.tensor(r["ref_losses"]), rtol=1e-5, atol=0
    )
    for name, ref in r["ref_state"].items():
        torch.testing.assert_close(r["state"][name], ref, rtol=0, atol=1e-5, msg=name)
