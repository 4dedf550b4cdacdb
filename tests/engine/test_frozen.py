"""Frozen parameters (requires_grad=False) are kept, broadcast, trained around, counted,
saved and exported: a LoRA-style model matches DDP at every stage."""

from __future__ import annotations

import functools

import pytest
import torch

from tests.engine.frozen_scenarios import LoRANet, frozen_names, lora_vs_ddp
from tests.engine.harness import assert_matches_ddp, combine_ranks
from zeroservice.checkpoint import export_checkpoint
from zeroservice.launch import run_local
from zeroservice.planner import frozen_bytes_for_module

STAGES = (0, 1, 2, 3)


@functools.cache
def _run(stage: int, precision: str = "fp32", save: str = "") -> list[dict]:
    return run_local(lora_vs_ddp, 2, stage, precision, 6, save)


@pytest.mark.parametrize("stage", STAGES)
def test_lora_matches_ddp(stage):
    per_rank = _run(stage)
    assert_matches_ddp(combine_ranks(per_rank))
    for r in per_rank:
        # Every rank holds rank 0's frozen weights, unchanged by training ...
        for name, value in r["frozen_after"].items():
            assert torch.equal(value, r["frozen_rank0"][name]), name
        # ... while the adapters moved.
        for name, value in r["trained"].items():
            assert not torch.equal(value, r["trained_rank0"][name]), name


@pytest.mark.parametrize("stage", STAGES)
def test_frozen_bytes_in_the_ledger(stage):
    psi_f = sum(p.numel() for n, p in LoRANet().named_parameters() if n in frozen_names(LoRANet()))
    for r in _run(stage):
        ledger = r["ledger"]
        padded = sum(padded for _, padded in r["frozen_units"])
        assert sum(n for n, _ in r["frozen_units"]) == psi_f == ledger["frozen_psi"]
        # 4 bytes per padded element (fp32), only this rank's 1/N_d at stage 3.
        assert ledger["frozen"] == 4 * padded // (2 if stage == 3 else 1)
        # The planner predicts it to the byte from the module alone.
        planned = frozen_bytes_for_module(
            LoRANet(), dp=2, stage=stage, precision="fp32", bucket_elements=2048
        )
        assert planned == ledger["frozen"]
        assert abs(ledger["frozen"] - 4 * psi_f / (2 if stage == 3 else 1)) < 4 * 2 * len(
            r["frozen_units"]
        )
        # No gradient, master or optimizer state for them: model states cover Ψ only.
        assert ledger["model_states"] == ledger["expected_padded"]
        assert ledger["total"] >= ledger["model_states"] + ledger["frozen"]
        assert r["optimizer_params"] == r["trainable_units"]


def test_frozen_bf16_bytes():
    for r in _run(2, "bf16"):
        padded = sum(padded for _, padded in r["frozen_units"])
        assert r["ledger"]["frozen"] == 2 * padded
        planned = frozen_bytes_for_module(
            LoRANet(), dp=2, stage=2, precision="bf16", bucket_elements=2048
        )
        assert planned == r["ledger"]["frozen"]


@pytest.mark.parametrize("stage", (1, 3))
def test_export_with_frozen_weights_loads_strictly(tmp_path, stage):
    root = tmp_path / "ckpt"
    per_rank = run_local(lora_vs_ddp, 2, stage, "fp32", 6, str(root))
    step_dir = sorted(root.glob("step-*"))[-1]
    out = export_checkpoint(step_dir, tmp_path / "model.pt", "pt")
    model = LoRANet()
    model.load_state_dict(torch.load(out, weights_only=True))  # strict
    r = per_rank[0]
    with torch.no_grad():
        loss = model(*r["input"]).item()
    assert loss == pytest.approx(r["engine_loss"], rel=1e-6)
    for name, value in r["frozen_rank0"].items():
        assert torch.equal(model.state_dict()[name], value), name
