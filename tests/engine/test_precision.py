"""bf16 and fp16 follow DDP under autocast (and GradScaler); fp16 skips an overflowed
step on every rank."""

from __future__ import annotations

import functools
import re

import pytest
import torch

import zeroservice
from tests.engine.scenarios import (
    Spec,
    fp16_overflow,
    fp16_summed_range,
    mixed_precision_parity,
)
from zeroservice import ConfigError
from zeroservice.launch import run_local
from zeroservice.precision import DTYPES, check_param_dtypes

# The engine keeps bf16/fp16 parameters and gradients with fp32 masters; DDP under
# autocast keeps fp32 weights and casts per op. Both follow the same SGD + momentum
# steps, so the engine's fp32 masters stay near DDP's weights: measured
# ||master - ref|| / ||ref - initial|| <= 0.004 (bf16) and 0.003 (fp16) over 10 steps,
# held at 0.05. An engine that never updated (or updated other elements) gives 1.0,
# and its masters must have moved as far as DDP's weights. Per-step losses: measured
# within 2.5e-5 relative (bf16) and 2.7e-6 (fp16), held at 1e-3 and 1e-4.
DRIFT_BOUND = 0.05
LOSS_RTOL = {"bf16": 1e-3, "fp16": 1e-4}
FP16_SCALES = {"no-overflow": 2.0**10, "overflowing": 2.0**24}

BF16_CASES = [(s, "param") for s in (0, 1, 2, 3)] + [(s, "fp32") for s in (1, 2)]
FP16_CASES = [(s, name) for s in (2, 3) for name in FP16_SCALES]
RANGE_CASES = [(s, r) for s in (0, 1, 2, 3) for r in ("param", "fp32")]


def mixed_and_overflow():
    bf16 = [
        mixed_precision_parity(Spec(stage=s, precision="bf16", reduce_dtype=r))
        for s, r in BF16_CASES
    ]
    fp16 = [
        mixed_precision_parity(Spec(stage=s, precision="fp16"), FP16_SCALES[name])
        for s, name in FP16_CASES
    ]
    in_range = [fp16_summed_range(s, r) for s, r in RANGE_CASES]
    return bf16, fp16, fp16_overflow(), in_range


@functools.cache
def _results():
    return run_local(mixed_and_overflow, 2)


def _per_rank(kind: int, index: int) -> list[dict]:
    return [r[kind][index] for r in _results()]


def assert_follows_ddp(per_rank: list[dict], precision: str) -> None:
    r = per_rank[0]
    torch.testing.assert_close(
        torch.tensor(r["losses"]), torch.tensor(r["ref_losses"]), rtol=LOSS_RTOL[precision], atol=0
    )
    for rank in per_rank:
        assert rank["drift"] <= DRIFT_BOUND, rank["drift"]
        assert rank["moved"] > 0.9, rank["moved"]


@pytest.mark.parametrize("stage,reduce_dtype", BF16_CASES)
def test_bf16_follows_ddp_under_autocast(stage, reduce_dtype):
    per_rank = _per_rank(0, BF16_CASES.index((stage, reduce_dtype)))
    assert_follows_ddp(per_rank, "bf16")
    assert per_rank[0]["losses"][-1] < per_rank[0]["losses"][0]


@pytest.mark.parametrize("stage,scale", FP16_CASES)
def test_fp16_follows_ddp_with_grad_scaler(stage, scale):
    assert_fp16_follows_ddp(_per_rank(1, FP16_CASES.index((stage, scale))), scale)


def assert_fp16_follows_ddp(per_rank: list[dict], scale: str) -> None:
    """Dynamic loss scaling skips exactly the steps GradScaler skips."""
    assert_follows_ddp(per_rank, "fp16")
    for r in per_rank:
        assert r["skipped"] == r["ref_skipped"]
    assert any(per_rank[0]["skipped"]) == (scale == "overflowing")


@pytest.mark.parametrize("stage,reduce_dtype", RANGE_CASES)
def test_fp16_gradients_are_averaged_before_they_are_summed(stage, reduce_dtype):
    """Every rank's scaled gradient fits in fp16 and their sum does not: GradScaler
    under DDP applies the steps (it judges the mean), and so does the engine.

    The weights (the engine's fp16 copies of fp32 masters that follow DDP's fp32
    weights exactly) are held to half an fp16 ulp, 1e-3 relative. The losses are sums
    computed in fp16 by the CPU's own half-precision kernels, along another path under
    autocast than the engine's: measured 2.7e-4 apart here, one ulp of one rank's loss,
    and held at 5e-3 so that another CPU's accumulation order fits. A skipped step
    moves the loss by about 6% and the weights by 1-2%."""
    for r in _per_rank(3, RANGE_CASES.index((stage, reduce_dtype))):
        assert r["ref_skipped"] == [False, False, False]
        assert r["skipped"] == r["ref_skipped"]
        torch.testing.assert_close(
            torch.tensor(r["losses"]), torch.tensor(r["ref_losses"]), rtol=5e-3, atol=0
        )
        torch.testing.assert_close(
            torch.tensor(r["weight"]), torch.tensor(r["ref_weight"]), rtol=1e-3, atol=0
        )


def test_fp16_overflow_skips_on_every_rank_and_backs_off():
    assert_overflow_skips([r[2] for r in _results()])


def assert_overflow_skips(per_rank: list[dict]) -> None:
    """The overflowed step is skipped on every rank, the scale halves, the weights stay."""
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


class _Mixed(torch.nn.Module):
    """Four float32 layers, ``odd`` of them converted to ``dtype``."""

    def __init__(self, dtype: torch.dtype, odd: int):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(4))
        for layer in self.layers[:odd]:
            layer.to(dtype)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x.to(layer.weight.dtype))
        return x.float().sum()


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_float32_and_training_dtype_parameters_are_accepted(precision):
    check_param_dtypes(_Mixed(torch.float32, 0), precision)
    check_param_dtypes(_Mixed(DTYPES[precision], 2), precision)


@pytest.mark.parametrize(
    "precision,dtype,message",
    [
        ("fp32", torch.float64, "not float32: precision 'fp32' trains every parameter in float32;"),
        ("fp32", torch.bfloat16, "not float32:"),
        ("bf16", torch.float16, "not float32 or bfloat16: precision 'bf16' trains every "),
        ("fp16", torch.float64, "not float32 or float16:"),
    ],
)
def test_other_parameter_dtypes_are_refused_by_name(precision, dtype, message):
    with pytest.raises(ConfigError, match=re.escape(message)) as refused:
        check_param_dtypes(_Mixed(dtype, 1), precision)
    assert f"layers.0.weight ({str(dtype).removeprefix('torch.')})" in str(refused.value)
    with pytest.raises(ConfigError, match=r"layers\.1\.weight .* and 3 more are not"):
        check_param_dtypes(_Mixed(dtype, 3), precision)


def test_an_integer_parameter_is_told_to_be_a_buffer():
    model = _Mixed(torch.float32, 0)
    model.steps = torch.nn.Parameter(torch.zeros(2, dtype=torch.int64), requires_grad=False)
    with pytest.raises(ConfigError, match=r"steps \(int64\) are not float32: .* keep integer"):
        check_param_dtypes(model, "fp32")
    with pytest.raises(ConfigError, match=r"convert the model first \(e\.g\. model\.float\(\)\)$"):
        check_param_dtypes(_Mixed(torch.float64, 1), "fp32")


def _initialize_float64(stage: int) -> str:
    """In each rank: the error ``initialize`` raises for a model with float64 layers."""
    try:
        zeroservice.initialize(_Mixed(torch.float64, 1), {"stage": stage}, torch.optim.AdamW)
    except ConfigError as e:
        return str(e)
    return "accepted"


def test_initialize_refuses_float64_parameters_on_every_rank():
    """Without the check the weights were cast to float32 and the model's own forward
    failed later (``mat1 and mat2 must have the same dtype``)."""
    for stage in (0, 3):
        messages = run_local(_initialize_float64, 2, stage)
        assert all(m.startswith("model: parameters layers.0.weight (float64)") for m in messages)


def _overflowing_at_the_minimum_scale() -> str:
    import zeroservice

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    config = {
        "stage": 2,
        "precision": "fp16",
        "loss_scale": {"initial_scale": 2.0, "min_scale": 1.0, "hysteresis": 1},
    }
    engine = zeroservice.initialize(model, config, torch.optim.AdamW)
    steps = []
    try:
        for _ in range(3):
            engine.backward(engine(torch.randn(2, 4).half()).float().sum() * float("inf"))
            steps.append(engine.step().loss_scale)
    except RuntimeError as exc:
        return f"after {steps}: {exc}"
    finally:
        engine.close()
    return f"no error after {steps}"


def test_an_overflow_at_the_minimum_scale_stops_the_run():
    """Every step overflows: the scale backs off to min_scale, and the next overflow
    there raises (as DeepSpeed's scaler does) rather than skipping steps for ever."""
    (said,) = run_local(_overflowing_at_the_minimum_scale, 1)
    assert said.startswith("after [2.0]: step: the fp16 gradients overflowed at the minimum"), said
