"""Stage 3 on models it was not written for, deferred construction, and misuse."""

from __future__ import annotations

import functools

import pytest
import torch

from tests.engine import stage3_scenarios as sc
from tests.engine.harness import assert_matches_ddp, combine_ranks
from zeroservice.launch import run_local

MODEL_CASES = {
    # name: (model, engine config, worlds)
    "odd": ("odd", {}, (2, 4)),
    "odd-tight-prefetch-accum-clip": (
        "odd",
        {
            "stage3_prefetch_elements": 3000,
            "gradient_accumulation_steps": 2,
            "gradient_clipping": 0.05,
            "bucket_elements": 1024,
        },
        (2,),
    ),
    "odd-reorder": ("odd-reorder", {"stage3_prefetch_elements": 4000}, (2,)),
    "odd-penalised": ("odd-penalised", {"stage3_persistence_elements": 0}, (2,)),
    "odd-penalised-persistent": ("odd-penalised", {"stage3_persistence_elements": 2000}, (2,)),
    "gpt2": ("gpt2", {}, (2, 4)),
    "llama": ("llama", {"stage3_persistence_elements": 0}, (2,)),
}


def _run_models(world: int) -> dict[str, dict]:
    """Losses are rank averages; gradient and weight ratios the worst over the ranks."""
    names = [n for n, (_, _, worlds) in MODEL_CASES.items() if world in worlds]
    results = run_local(
        _models_in_rank, world, [(MODEL_CASES[n][0], MODEL_CASES[n][1]) for n in names]
    )
    return {name: combine_ranks([r[i] for r in results]) for i, name in enumerate(names)}


def _models_in_rank(cases):
    return [sc.model_parity(model, config) for model, config in cases]


@functools.cache
def _models(world: int) -> dict[str, dict]:
    return _run_models(world)


@pytest.mark.parametrize(
    "world,case", [(w, c) for c, (_, _, ws) in MODEL_CASES.items() for w in ws]
)
def test_models_match_ddp(world, case):
    r = _models(world)[case]
    assert_matches_ddp(r)
    assert r["losses"][-1] < r["losses"][0]
    eval_loss, ref_eval = r["eval"]
    assert eval_loss == pytest.approx(ref_eval, rel=1e-5)
    assert r["gathered_after_eval"] == 0
    assert set(r["state"]) == set(r["ref_state"])


def test_tied_weights_stay_tied_in_transformers_gpt2():
    r = _models(2)["gpt2"]
    torch.testing.assert_close(r["state"]["lm_head.weight"], r["state"]["transformer.wte.weight"])


@functools.cache
def _construction() -> tuple[dict, dict]:
    """Each in fresh processes: memory freed by one would hide the other's growth."""
    deferred = run_local(sc.construction_peak, 4, True, timeout_s=600, start="spawn")[0]
    eager = run_local(sc.construction_peak, 4, False, timeout_s=600, start="spawn")[0]
    return deferred, eager


def test_deferred_construction_never_holds_the_whole_model():
    deferred, eager = _construction()
    full = deferred["full_bytes"]
    # The ledger: this rank holds a quarter of the parameters (padded to 4).
    assert deferred["params_bytes"] == 4 * deferred["psi_padded"] // 4
    assert deferred["psi_padded"] - full // 4 < 4 * 200
    # The process: building and wrapping added well under one model's bytes (shards of
    # params and grads are half of it at N_d = 4, plus two staging buffers) ...
    assert deferred["peak_bytes"] < 0.75 * full, (deferred["peak_bytes"], full)
    # ... while the same measurement sees the whole model when it is built eagerly.
    assert eager["peak_bytes"] > full, (eager["peak_bytes"], full)


def test_deferred_model_trains():
    deferred, _ = _construction()
    assert torch.isfinite(torch.tensor(deferred["loss"]))
    assert abs(deferred["loss"] - torch.log(torch.tensor(8192.0)).item()) < 0.5


def test_deferred_init_gives_every_rank_the_same_weights():
    states = run_local(sc.deferred_init_agrees, 2)
    a, b = states[0]["state"], states[1]["state"]
    assert set(a) == set(b)
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=0, msg=name)
    assert torch.count_nonzero(a["blocks.0.attn.qkv.bias"]) == 0
    std = a["blocks.0.mlp.fc.weight"].std().item()
    assert 0.015 < std < 0.025
    scaled = a["blocks.0.mlp.proj.weight"].std().item()
    assert 0.006 < scaled < 0.0125  # 0.02 / sqrt(2 * n_layer) = 0.01


@pytest.mark.parametrize("stage", [3, 1])
def test_deferred_model_loaded_from_a_state_dict_file_matches_ddp(tmp_path, stage):
    path = str(tmp_path / "init.pt")
    sc.small_gpt_state(path)
    r = run_local(sc.file_init_parity, 2, path, stage)[0]
    torch.testing.assert_close(
        torch.tensor(r["losses"]), torch.tensor(r["ref_losses"]), rtol=1e-5, atol=0
    )


def _error(case: str, path: str = "") -> str:
    return run_local(sc.error_message, 1, case, path)[0]


def test_init_function_needs_a_deferred_model():
    assert _error("init-fn-on-real-model").startswith("ConfigError: init:")


@pytest.mark.parametrize("stage", [1, 3])
def test_an_engine_built_to_be_restored_holds_no_weights_until_it_is(stage):
    """``init=RESTORED`` skips initialising (and broadcasting) weights that a load
    will overwrite: only for a deferred model, and nothing reads the weights before.
    (Restores into such engines are exact: test_peer_restore.py.)"""
    msg = _error(f"restored-on-real-model-{stage}")
    assert msg.startswith("ConfigError: init: zeroservice.RESTORED applies only"), msg
    msg = _error(f"restored-snapshot-{stage}")
    assert msg.startswith("RuntimeError: snapshot_now: the engine was built with"), msg


def test_in_place_write_to_a_gathered_weight_is_refused():
    msg = _error("in-place-weight")
    assert msg.startswith("RuntimeError") and "blocks.0.weight" in msg, msg
    assert "modified in place" in msg


def test_a_loss_term_from_weights_read_outside_the_forward_is_refused():
    """Outside a forward a stage-3 weight is its empty placeholder: a penalty built from
    ``engine.module.parameters()`` there would add nothing, silently."""
    msg = _error("penalty-outside-forward")
    used = "wte.weight, wpe.weight, blocks.0.ln1.weight and 25 more outside the model's forward"
    assert msg.startswith(f"RuntimeError: backward: the loss used {used}; "), msg
    assert "Compute it inside the model's forward" in msg


def test_plain_loss_backward_is_refused_at_stage3():
    msg = _error("plain-backward")
    assert msg.startswith("RuntimeError") and "engine.backward(loss)" in msg


@pytest.mark.parametrize("stage_case", ["file", "file-stage2"])
def test_state_dict_file_errors_name_the_entry(tmp_path, stage_case):
    good = tmp_path / "good.pt"
    sc.small_gpt_state(str(good))
    state = torch.load(good, weights_only=True)

    missing = dict(state)
    del missing["blocks.1.mlp.fc.weight"]
    torch.save(missing, tmp_path / "missing.pt")
    msg = _error(stage_case, str(tmp_path / "missing.pt"))
    assert "no entry for parameter blocks.1.mlp.fc.weight" in msg

    shaped = dict(state)
    shaped["ln_f.bias"] = torch.zeros(3)
    torch.save(shaped, tmp_path / "shape.pt")
    msg = _error(stage_case, str(tmp_path / "shape.pt"))
    assert "ln_f.bias has shape (3,), the model expects (64,)" in msg

    extra = dict(state, **{"blocks.9.lin.weight": torch.zeros(2)})
    torch.save(extra, tmp_path / "extra.pt")
    assert "entries the model lacks: blocks.9.lin.weight" in _error(
        stage_case, str(tmp_path / "extra.pt")
    )

    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    assert "is not a torch state-dict file" in _error(stage_case, str(tmp_path / "junk.pt"))
    assert "is not a file" in _error(stage_case, str(tmp_path / "absent.pt"))


def test_rank_divergent_control_flow_is_named_not_silent():
    messages = run_local(sc.divergent_control_flow, 2)
    for message in messages:
        assert message.startswith("stage 3: ranks gather different units"), message
        assert "rank 0: unit 1 [blocks.1.weight" in message, message
        assert "rank 1: unit 2 [blocks.2.weight" in message, message
