"""bf16 tracks DDP under autocast; fp16 skips an overflowed step on every rank."""

from __future__ import annotations

import functools

import pytest
import torch

from tests.engine.scenarios import Spec, fp16_overflow, parity
from zeroservice.launch import run_local

# bf16 keeps 8 bits of mantissa in parameters and gradients (fp32 master and Adam
# states); DDP under autocast keeps fp32 weights. Stated tolerance: per-step losses
# within 2e-3 relative, final weights within 0.05 absolute (a few bf16 ulps of the
# largest weights, which sit near 1.0 in the LayerNorms).
BF16_LOSS_RTOL = 2e-3
BF16_WEIGHT_ATOL = 0.05


BF16_CASES = [(s, "param") for s in (0, 1, 2)] + [(s, "fp32") for s in (1, 2)]


def _bf16_and_fp16():
    specs = [Spec(stage=s, precision="bf16", reduce_dtype=r) for s, r in BF16_CASES]
    return dict(zip(BF16_CASES, parity(specs), strict=True)), fp16_overflow()


@functools.cache
def _results():
    return run_local(_bf16_and_fp16, 2)


@pytest.mark.parametrize("stage,reduce_dtype", BF16_CASES)
def test_bf16_tracks_ddp_autocast(stage, reduce_dtype):
    r = _results()[0][0][(stage, reduce_dtype)]
    torch.testing.assert_close(
        torch.tensor(r["losses"]), torch.tensor(r["ref_losses"]), rtol=BF16_LOSS_RTOL, atol=0
    )
    assert r["losses"][-1] < r["losses"][0]
    for name, ref in r["ref_state"].items():
        torch.testing.assert_close(r["state"][name], ref, rtol=0, atol=BF16_WEIGHT_ATOL, msg=name)


def test_fp16_overflow_skips_on_every_rank_and_backs_off():
    per_rank = [r[1] for r in _results()]
    bad = 3
    for r in per_rank:
        assert r["applied"] == [True, True, True, False, True, True]
        assert r["skipped"] == 1 and r["applied_steps"] == 5
        assert r["scales"][bad] == 1024.0 and r["final_scale"] == 512.0
        # The skipped step left the weights exactly as they were.
        assert r["digests"][bad] == r["digests"][bad - 1]
        assert r["digests"][bad + 1] != r["digests"][bad]
    # Every rank holds the same weights after the skip.
    assert len({tuple(r["digests"]) for r in per_rank}) == 1
