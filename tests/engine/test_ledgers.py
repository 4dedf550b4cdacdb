"""The memory ledger equals the paper's formula; each step moves 2Ψ elements per rank."""

from __future__ import annotations

import functools

import pytest

from tests.engine.scenarios import Spec, ledgers
from zeroservice.launch import run_local
from zeroservice.memory import expected_model_state_bytes

CASES = [(s, p) for s in (0, 1, 2) for p in ("fp32", "bf16", "fp16")]


@functools.cache
def _results(world: int):
    specs = [Spec(stage=s, precision=p) for s, p in CASES]
    return dict(zip(CASES, run_local(ledgers, world, specs)[0], strict=True))


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("stage,precision", CASES)
def test_memory_ledger_equals_formula(world, stage, precision):
    r = _results(world)[(stage, precision)]
    m = r["memory"]
    assert m["n_d"] == world and m["stage"] == stage
    # To the byte, with Ψ counted after padding ...
    assert m["model_states"] == m["expected_padded"]
    # ... and padding is fewer than N_d elements per unit (none at stage 0).
    pad = m["psi_padded"] - m["psi"]
    units = len(r["units"])
    assert 0 <= pad < (world if stage > 0 else 1) * units
    assert all(padded - n < world for n, padded in r["units"])
    # The formula itself, in the paper's words (Adam: 8 bytes of state per element).
    mixed = precision != "fp32"
    psi, n = m["psi_padded"], world
    paper = {
        0: 16 * psi,
        1: (4 * psi + 12 * psi // n) if mixed else (8 * psi + 8 * psi // n),
        2: (2 * psi + 14 * psi // n) if mixed else (4 * psi + 12 * psi // n),
    }[stage]
    assert m["expected_padded"] == paper == expected_model_state_bytes(stage, precision, psi, n)
    # Adam's step counters are the only optimizer tensors that are not shard-sized.
    assert m["optimizer_other"] == 4 * units


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("stage,precision", CASES)
def test_communication_is_two_psi_per_step(world, stage, precision):
    r = _results(world)[(stage, precision)]
    psi = r["memory"]["psi_padded"]
    assert r["volume"] == 2 * psi
    ops = {(e["op"], e["tag"]): e for e in r["entries"]}
    units = len(r["units"])
    if stage == 0:
        assert ops[("all_reduce", "grads")]["payload_elements"] == psi
        assert ops[("all_reduce", "grads")]["calls"] == units
        assert ("all_gather", "params") not in ops
    else:
        assert ops[("reduce_scatter", "grads")]["payload_elements"] == psi
        assert ops[("all_gather", "params")]["payload_elements"] == psi
        assert ops[("reduce_scatter", "grads")]["calls"] == units
        # One scalar all-reduce carries the global norm (and any overflow).
        assert ops[("all_reduce", "norm")]["payload_elements"] == 1
    # Seconds are measured per op: positive, and within the step that issued them.
    assert all(0 < e["seconds"] <= r["wall_seconds"] for e in r["entries"])
    assert all(e["busbw_bytes_per_second"] > 0 for e in r["entries"])
