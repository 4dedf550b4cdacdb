"""Model parallelism × ZeRO-DP, activation checkpointing (P_a, CPU offload) and
optimizer offload, each against its reference on the same seed."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from tests.engine.mp_scenarios import TINY_MP, MPSpec, gradients, train
from zeroservice.config import ConfigError, ZeroConfig
from zeroservice.launch import run_local
from zeroservice.models import GPT, GPTConfig
from zeroservice.planner import plan
from zeroservice.topology import TopologyError, check_degrees

WORLD = 4
STAGES = (1, 2, 3)
# fp32 tolerance between MP = 2 × DP = 2 and MP = 1 × DP = 4: the split matmuls and
# the vocabulary-parallel loss sum in another order (measured differences ~1e-7).
RTOL = 1e-5
CKPT = {
    "none": {},
    "checkpoint": {"activation_checkpointing": True},
    "P_a": {"activation_checkpointing": True, "partition_activations": True},
    "cpu": {"activation_checkpointing": True, "cpu_offload_activations": True},
    "P_a+cpu": {
        "activation_checkpointing": True,
        "partition_activations": True,
        "cpu_offload_activations": True,
    },
    "P_a-not-contiguous": {
        "activation_checkpointing": True,
        "partition_activations": True,
        "contiguous_activations": False,
    },
}


def _train_specs() -> dict[tuple, MPSpec]:
    specs: dict[tuple, MPSpec] = {}
    for stage in STAGES:
        for mp in (1, 2):
            specs[("mp", stage, mp)] = MPSpec(stage, mp, clip=0.05)
    specs[("mp-accum", 2, 2)] = MPSpec(2, 2, accum=2, clip=0.05)
    specs[("mp-accum", 2, 1)] = MPSpec(2, 1, accum=2, clip=0.05)
    for stage in STAGES:
        for offload in (False, True):
            specs[("offload", stage, offload)] = MPSpec(
                stage, 2, steps=4, engine={"offload_optimizer": offload}
            )
    specs[("offload-bf16", 2, True)] = MPSpec(
        2, 1, steps=4, precision="bf16", engine={"offload_optimizer": True}
    )
    specs[("offload-bf16", 2, False)] = MPSpec(2, 1, steps=4, precision="bf16")
    return specs


@functools.cache
def _trained() -> dict[tuple, dict]:
    specs = _train_specs()
    per_rank = run_local(train, WORLD, list(specs.values()))
    return {key: per_rank[0][i] for i, key in enumerate(specs)}


def _ckpt_specs() -> dict[tuple, MPSpec]:
    return {
        (stage, name): MPSpec(stage, 2, steps=3, engine=extra)
        for stage in (0, 2, 3)
        for name, extra in CKPT.items()
    }


@functools.cache
def _checkpointed() -> list[dict[tuple, dict]]:
    specs = _ckpt_specs()
    per_rank = run_local(gradients, WORLD, list(specs.values()))
    return [{key: r[i] for i, key in enumerate(specs)} for r in per_rank]


@pytest.mark.parametrize("stage", STAGES)
def test_mp2_dp2_trains_like_mp1_dp4(stage):
    ref, tp = _trained()[("mp", stage, 1)], _trained()[("mp", stage, 2)]
    np.testing.assert_allclose(tp["losses"], ref["losses"], rtol=RTOL)
    # The global norm counts MP-sharded parameters once per slice and replicated ones
    # (layer norms, biases after the all-reduce, positions) once in all; clipping is
    # active (norm > 0.05), so a wrong norm would change every step.
    np.testing.assert_allclose(tp["norms"], ref["norms"], rtol=RTOL)
    assert min(ref["norms"]) > 0.05
    assert tp["ledger"]["mp"] == 2 and tp["ledger"]["n_d"] == 2
    assert ref["ledger"]["n_d"] == 4
    # Each MP rank holds its slice: the formula over this rank's Ψ, to the byte.
    assert tp["ledger"]["model_states"] == tp["ledger"]["expected_padded"]
    assert tp["ledger"]["psi"] < ref["ledger"]["psi"]
    # The planner predicts this MP rank's slice and its model states from the config.
    for mp, run in ((2, tp), (1, ref)):
        predicted = plan(GPTConfig(**TINY_MP), dp=4 // mp, mp=mp, stage=stage, precision="fp32")
        assert predicted.psi_local == run["ledger"]["psi"]
        assert predicted.model_states == run["ledger"]["expected"]


def test_mp_with_accumulation():
    ref, tp = _trained()[("mp-accum", 2, 1)], _trained()[("mp-accum", 2, 2)]
    np.testing.assert_allclose(tp["losses"], ref["losses"], rtol=RTOL)
    np.testing.assert_allclose(tp["norms"], ref["norms"], rtol=RTOL)


@pytest.mark.parametrize("stage", STAGES)
def test_optimizer_offload_trains_identically(stage):
    on, off = _trained()[("offload", stage, True)], _trained()[("offload", stage, False)]
    assert on["losses"] == off["losses"]  # fp32: the same arithmetic, on the host
    ledger = on["ledger"]
    assert ledger["offloaded"]
    assert (
        ledger["host_bytes"] == ledger["master"] + ledger["optimizer_states"] + ledger["host_grads"]
    )
    # fp32 offload: the master is a separate fp32 copy (m = 4) on the host.
    assert ledger["master"] == 4 * ledger["psi_padded"] // (1 if stage == 0 else 2)
    assert ledger["model_states"] == ledger["expected_padded"]
    assert ledger["device_model_states"] == ledger["params"] + ledger["grads"]
    # The planner's offloaded plan: the same model states, the host part to the byte.
    predicted = plan(
        GPTConfig(**TINY_MP), dp=2, mp=2, stage=stage, precision="fp32", offload_optimizer=True
    )
    assert predicted.model_states == ledger["expected"]
    assert predicted.host_total == pytest.approx(ledger["host_bytes"], rel=1e-3)


def test_optimizer_offload_bf16():
    on, off = _trained()[("offload-bf16", 2, True)], _trained()[("offload-bf16", 2, False)]
    np.testing.assert_allclose(on["losses"], off["losses"], rtol=0)
    assert on["ledger"]["model_states"] == off["ledger"]["model_states"]


@pytest.mark.parametrize("stage", (0, 2, 3))
@pytest.mark.parametrize("variant", [v for v in CKPT if v != "none"])
def test_checkpointing_gives_the_same_gradients(stage, variant):
    for rank_results in _checkpointed():
        base, out = rank_results[(stage, "none")], rank_results[(stage, variant)]
        for a, b in zip(base["grads"], out["grads"], strict=True):
            assert torch.equal(a, b)
        assert out["losses"] == base["losses"]
        assert out["overflows"] == 0
        assert out["grad_storages"] == 1  # M_D: every unit's gradient in one buffer


@pytest.mark.parametrize("stage", (0, 2, 3))
def test_partitioned_activations_hold_one_mp_slice(stage):
    for rank_results in _checkpointed():
        blocks = 2
        whole = rank_results[(stage, "checkpoint")]["activations"]
        part = rank_results[(stage, "P_a")]["activations"]
        input_bytes = rank_results[(stage, "checkpoint")]["input_bytes"]
        # After each forward: one input per block, on the device; with P_a exactly 1/mp.
        assert whole == [(blocks * input_bytes, 0)] * 3
        assert part == [(blocks * input_bytes // 2, 0)] * 3
        assert rank_results[(stage, "cpu")]["activations"] == [(0, blocks * input_bytes)] * 3
        assert (
            rank_results[(stage, "P_a+cpu")]["activations"] == [(0, blocks * input_bytes // 2)] * 3
        )
        # M_D: one arena, allocated once for every step, sized for every block.
        contiguous = rank_results[(stage, "P_a")]
        assert contiguous["arena_allocations"] == 1
        assert contiguous["ledger"]["activation_arena"] == blocks * input_bytes // 2
        assert contiguous["ledger"]["activations"] == 0  # all freed by backward
        assert rank_results[(stage, "P_a-not-contiguous")]["ledger"]["activation_arena"] == 0


def test_degrees_must_divide_the_world():
    assert check_degrees(8, 2) == 4
    with pytest.raises(TopologyError, match="degree 3 does not divide the world size 4"):
        check_degrees(4, 3)
    with pytest.raises(TopologyError, match="2 × 2 = 4 is not the world size 8"):
        check_degrees(8, 2, dp=2)
    with pytest.raises(TopologyError, match="mp: 0"):
        check_degrees(4, 0)


def test_checkpointing_options_need_checkpointing():
    with pytest.raises(ConfigError, match="partition_activations: needs activation_checkpointing"):
        ZeroConfig(partition_activations=True)
    with pytest.raises(ConfigError, match="cpu_offload_activations"):
        ZeroConfig(cpu_offload_activations=True)
    with pytest.raises(ConfigError, match="offload_optimizer: must be true or false"):
        ZeroConfig(offload_optimizer="yes")  # type: ignore[arg-type]


class _FakeMP:
    """Just enough of an MPGroup to build a split model in one process."""

    def __init__(self, size: int, rank: int = 0):
        self.size, self.rank = size, rank

    def split(self, n: int, what: str) -> int:
        from zeroservice.tensor_parallel import MPGroup

        return MPGroup.split(self, n, what)  # type: ignore[arg-type]


def test_split_model_refuses_indivisible_sizes():
    with pytest.raises(
        ValueError, match="n_head: 4 is not divisible by the model-parallel degree 3"
    ):
        GPT(GPTConfig(vocab_size=48, seq_len=8, n_layer=1, n_head=4, dim=48), _FakeMP(3))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="vocab_size: 50 is not divisible"):
        GPT(GPTConfig(vocab_size=50, seq_len=8, n_layer=1, n_head=4, dim=64), _FakeMP(4))  # type: ignore[arg-type]


def test_checkpoint_per_mp_slice_resumes_and_reshards_dp(tmp_path):
    from tests.engine.mp_scenarios import load_state, save_and_resume

    root = str(tmp_path / "ckpt")
    spec = MPSpec(3, 2, steps=5)
    runs = run_local(save_and_resume, WORLD, spec, root, 3)
    for r in runs:
        assert r["resumed"] == r["losses"][3:]  # exact resume from step 3
    slices = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert slices == ["mp-00-of-02", "mp-01-of-02"]
    # DP degree 2 -> 1 (world 2, MP kept at 2), at another stage: the same weights.
    loaded = run_local(load_state, 2, MPSpec(1, 2), root)
    for mp_rank in range(2):
        want = runs[mp_rank]["state"]  # global rank mp_rank: dp 0, that MP slice
        got = loaded[mp_rank]["state"]
        assert got.keys() == want.keys()
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=0, atol=0)
    # The MP degree cannot change: refused with both degrees named.
    refused = run_local(load_state, 2, MPSpec(1, 1), root)
    assert "saved with model-parallel degree 2; this engine has mp = 1" in refused[0]["error"]


@pytest.mark.parametrize("stage,tie", [(3, True), (1, False)])
def test_an_mp_checkpoint_exports_the_whole_model(tmp_path, stage, tie):
    """Any MP rank's step directory names the save: the export puts every split
    parameter back together (q, k and v each whole), and the unsplit GPT loaded from it
    computes the MP engine's loss on the same batch."""
    from safetensors.torch import load_file

    from tests.engine.mp_scenarios import save_for_export
    from zeroservice.checkpoint import CheckpointError, export_checkpoint

    root = tmp_path / "ckpt"
    runs = run_local(save_for_export, WORLD, MPSpec(stage, 2, steps=3, tie=tie), str(root))
    model = GPT(GPTConfig(**TINY_MP, tie_weights=tie))
    for mp_slice in ("mp-00-of-02", "mp-01-of-02"):
        (step,) = (root / mp_slice).iterdir()
        state = load_file(export_checkpoint(step, tmp_path / "whole.safetensors"))
        model.load_state_dict(state)  # strict: every name, every whole shape
        model.eval()
        for r in runs:
            with torch.no_grad():
                got = model(r["x"], r["y"]).item()
            assert got == pytest.approx(r["loss"], rel=1e-5)
    # The job's root is no checkpoint: said so, with its MP ranks' directories.
    with pytest.raises(CheckpointError, match="one directory per MP rank .mp-00-of-02, mp-01"):
        export_checkpoint(root, tmp_path / "x.pt", "pt")
    # A slice that is not of the same save is refused by name.
    other = root / "mp-01-of-02" / step.name
    (other / "manifest.json").rename(other / "saved.json")
    with pytest.raises(CheckpointError, match=r"mp-01-of-02/step-\d+/manifest.json: missing"):
        export_checkpoint(root / "mp-00-of-02" / step.name, tmp_path / "x.pt", "pt")


@pytest.mark.parametrize("stage", [1, 3])
def test_live_shrink_restores_every_slice_from_peers(tmp_path, stage):
    """MP 2 × DP 2 with host copies loses replica 1 (both its MP ranks): each slice's
    survivor restores from its own and its neighbour's copy, exactly as the checkpoint
    of the same step loads at DP 1, and trains on alike (fp32: bit for bit)."""
    from tests.engine.mp_scenarios import peer_shrink

    root, store = str(tmp_path / "ckpt"), str(tmp_path / "store")
    results = run_local(peer_shrink, WORLD, MPSpec(stage, 2, steps=3), root, store, 1, None)
    assert [r["left"] for r in results] == [False, False, True, True]
    for r in results[:2]:
        assert r["dp"] == 1 and r["step"] == r["disk_step"] == 3
        assert r["diffs"] == [], r["diffs"]
        assert r["losses"] == r["ref_losses"]
        assert r["held_after"] == 0  # a group of one keeps no copy
    for r in results:  # each rank's copies: its slice's share, own and neighbour's
        planned = plan(r["psi_padded"], dp=2, stage=stage, redundancy="host-copy")
        assert abs(r["held_before"] - planned.redundancy_host) <= planned.redundancy_host // 100


def test_slices_at_different_steps_refuse_alike(tmp_path):
    """Slice 1's survivor holds only the copy of a step before slice 0's: no model
    exists at one step, so both raise PeersIncomplete (the caller loads a checkpoint)."""
    from tests.engine.mp_scenarios import peer_shrink

    root, store = str(tmp_path / "ckpt"), str(tmp_path / "store")
    results = run_local(peer_shrink, WORLD, MPSpec(2, 2, steps=3), root, store, 1, 1)
    for r in results[:2]:
        assert "host copies share no step (steps by slice: [[3], [2]])" in r["error"], r


def test_slices_at_different_steps_meet_at_the_copy_before(tmp_path):
    """The same, with each survivor offering its copy before the last too (the spare,
    ``peer_snapshots``): slice 0 holds steps 3 and 2, slice 1 steps 2 and 1, and both
    restore step 2, exactly as its checkpoint loads."""
    from tests.engine.mp_scenarios import peer_shrink

    root, store = str(tmp_path / "ckpt"), str(tmp_path / "store")
    results = run_local(peer_shrink, WORLD, MPSpec(2, 2, steps=3), root, store, 1, 1, True)
    for r in results[:2]:
        assert "error" not in r, r.get("error")
        assert r["step"] == r["disk_step"] == 2
        assert r["diffs"] == [], r["diffs"]
        assert r["losses"] == r["ref_losses"]


def test_live_grow_hands_a_new_replica_its_slices(tmp_path):
    """A replica (MP 2) joins one that trained alone: the new MP ranks receive their
    slices' shards from the old ones, equal to the checkpoint loaded at DP 2."""
    from tests.engine.mp_scenarios import peer_grow

    root, store = str(tmp_path / "ckpt"), str(tmp_path / "store")
    for r in run_local(peer_grow, WORLD, MPSpec(2, 2, steps=3), root, store):
        assert r["dp"] == 2 and r["step"] == r["disk_step"] == 3
        assert r["diffs"] == [], r["diffs"]
        assert r["losses"] == r["ref_losses"]


def test_an_interrupt_frees_a_rank_blocked_in_a_tensor_parallel_collective(tmp_path):
    """A rank whose MP partner stopped mid-step waits in the model's all-reduce; the
    engine's interrupt ends that wait at once (else: the group's timeout, 120 s here),
    and closing the engine detaches the model's communicators from it."""
    from tests.engine.mp_scenarios import interrupted_mp

    flag = str(tmp_path / "flag")
    first, second = run_local(interrupted_mp, 2, MPSpec(2, 2), flag, timeout_s=120)
    assert second["left"]
    assert first["raised"] == "CommInterrupted: collective abandoned: rank 1 lost", first
    assert first["attached"] and first["detached"]
