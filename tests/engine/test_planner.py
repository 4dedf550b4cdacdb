"""The planner reproduces the paper's Table 1, predicts the engine's ledger to the byte,
and recommends the cheapest configuration that fits."""

from __future__ import annotations

import functools
import json
from decimal import Decimal

import pytest
import torch

from zeroservice import planner
from zeroservice.launch import run_local
from zeroservice.memory import expected_model_state_bytes
from zeroservice.models import GPT, GPTConfig
from zeroservice.planner import ModelSpec, PlanError
from zscli.cli import main

# Odd sizes everywhere (vocab 509, 31 positions, dim 63), so that units need padding.
ODD = dict(vocab_size=509, seq_len=31, n_layer=2, n_head=3, dim=63)
BUCKET = 20_000

# -- Table 1 ----------------------------------------------------------------------------

# As printed: (P_os, P_os+g, P_os+g+p) at N_d = 4, 16, 64, 256, 1024; GB unless "TB".
PRINTED = {
    7_500_000_000: (
        "120",
        [("52.5", "41.3", "30"), ("35.6", "21.6", "7.5"), ("31.4", "16.6", "1.88")]
        + [("30.4", "15.4", "0.47"), ("30.1", "15.1", "0.12")],
    ),
    128_000_000_000: (
        "2048",
        [("896", "704", "512"), ("608", "368", "128"), ("536", "284", "32")]
        + [("518", "263", "8"), ("513", "257", "2")],
    ),
    1_000_000_000_000: (
        "16 TB",
        [("7 TB", "5.5 TB", "4 TB"), ("4.75 TB", "2.88 TB", "1 TB")]
        + [("4.18 TB", "2.22 TB", "250"), ("4.05 TB", "2.05 TB", "62.5")]
        + [("4.01 TB", "2.01 TB", "15.6")],
    ),
}
# Printed values that are not the formula rounded to the printed digit, but one
# last-digit unit below it (truncated): 513.5, 257.75 and 4.1875 TB.
TRUNCATED = {(128_000_000_000, 1024, 1), (128_000_000_000, 1024, 2), (10**12, 64, 1)}


def _close_to_printed(gb: float, printed: str) -> tuple[bool, bool]:
    """(within one unit of the last printed digit, exactly the rounded value)."""
    text, _, unit = printed.partition(" ")
    value = Decimal(repr(gb / 1000 if unit == "TB" else gb))
    step = Decimal(1).scaleb(Decimal(text).as_tuple().exponent)  # type: ignore[arg-type]
    rounded = value.quantize(step, rounding="ROUND_HALF_UP")
    return abs(value - Decimal(text)) <= step, rounded == Decimal(text)


def test_paper_table_1():
    rows = {(r.psi, r.n_d): r for r in planner.paper_table()}
    assert len(rows) == 18
    inexact = set()
    for psi, (baseline, printed) in PRINTED.items():
        one = rows[(psi, 1)]
        for gb in (one.baseline, one.p_os, one.p_os_g, one.p_os_g_p):
            assert _close_to_printed(gb, baseline) == (True, True), (psi, gb)
        for n_d, cells in zip((4, 16, 64, 256, 1024), printed, strict=True):
            r = rows[(psi, n_d)]
            assert r.baseline == one.baseline
            for stage, (gb, text) in enumerate(
                zip((r.p_os, r.p_os_g, r.p_os_g_p), cells, strict=True), 1
            ):
                near, exact = _close_to_printed(gb, text)
                assert near, (psi, n_d, stage, gb, text)
                if not exact:
                    inexact.add((psi, n_d, stage))
    assert inexact == TRUNCATED


def test_formula_is_the_paper_formula_by_kind():
    # 16Ψ, 4Ψ + 12Ψ/N_d, 2Ψ + 14Ψ/N_d, 16Ψ/N_d, split into p, g, m, k.
    psi, n = 7_500_000_000, 64
    plans = [planner.plan(psi, dp=n, stage=s) for s in range(4)]
    assert [p.model_states for p in plans] == [
        16 * psi,
        4 * psi + 12 * psi // n,
        2 * psi + 14 * psi // n,
        16 * psi // n,
    ]
    s2 = plans[2]
    assert (s2.params, s2.grads, s2.master, s2.optimizer_states) == (
        2 * psi,
        2 * psi // n,
        4 * psi // n,
        8 * psi // n,
    )
    # Rounding when N_d does not divide Ψ: memory.py's formula to the byte.
    for stage in range(4):
        for precision in ("fp32", "bf16", "fp16"):
            for psi, n in ((1_000_003, 7), (134_912, 3), (5, 4)):
                got = planner.plan(psi, dp=n, stage=stage, precision=precision).model_states
                assert got == expected_model_state_bytes(stage, precision, psi, n)


def test_offload_moves_master_and_optimizer_states_to_host():
    on = planner.plan(10**9, dp=8, stage=2, offload_optimizer=True)
    off = planner.plan(10**9, dp=8, stage=2)
    assert on.model_states == off.model_states  # bf16: the master exists either way
    grad_shard = 4 * 10**9 // 8  # the fp32 gradient shard the host step reads
    assert on.host_total == on.master + on.optimizer_states + grad_shard
    assert on.device_total == off.device_total - on.master - on.optimizer_states


# -- the reference GPT ------------------------------------------------------------------


def test_gpt_params_per_mp_rank():
    cfg = GPTConfig(vocab_size=512, seq_len=32, n_layer=2, n_head=4, dim=64)
    assert planner.gpt_params_per_mp_rank(cfg, 1) == cfg.num_params() == 134_912
    # By hand, mp = 2. Sharded: wte 512*64 = 32,768; per block qkv 3*64*64 + 192 = 12,480,
    # attn.proj weight 4,096, mlp.fc 64*256 + 256 = 16,640, mlp.proj weight 16,384:
    # 49,600 a block. (32,768 + 2 * 49,600) / 2 = 65,984. Replicated: wpe 32*64 = 2,048;
    # per block ln1 128 + ln2 128 + attn.proj bias 64 + mlp.proj bias 64 = 384; ln_f 128.
    assert planner.gpt_params_per_mp_rank(cfg, 2) == 65_984 + 2_048 + 2 * 384 + 128
    untied = GPTConfig(vocab_size=512, seq_len=32, n_layer=2, n_head=4, dim=64, tie_weights=False)
    assert planner.gpt_params_per_mp_rank(untied, 1) == untied.num_params()
    assert planner.gpt_params_per_mp_rank(untied, 2) == 68_928 + 512 * 64 // 2
    assert planner.gpt_params_per_mp_rank(untied, 4) == (131_968 + 32_768) // 4 + 2_944


def test_activation_formula():
    spec = ModelSpec(10**9, layers=2, dim=64, heads=4, seq_len=32, vocab=512)
    s, b, h, a, t = 32, 2, 64, 4, 2
    layer = s * b * h * 10 + 24 * s * b * h // t + 5 * a * s * s * b // t
    logits = s * b * 512 // t * 4
    bf16 = planner.activation_bytes(spec, mp=t, micro_batch=b)
    assert bf16 == (2 * layer + logits, 0)
    fp32 = planner.activation_bytes(spec, mp=t, micro_batch=b, precision="fp32")
    assert fp32 == (4 * layer + logits, 0)
    ckpt = planner.activation_bytes(spec, mp=t, micro_batch=b, checkpointing=True)
    assert ckpt == (2 * 2 * s * b * h + layer + logits, 0)
    part = planner.activation_bytes(spec, mp=t, micro_batch=b, checkpointing=True, partition=True)
    assert part == (2 * 2 * s * b * h // t + layer + logits, 0)
    off = planner.activation_bytes(spec, mp=t, micro_batch=b, checkpointing=True, cpu_offload=True)
    assert off == (layer + logits, 2 * 2 * s * b * h)
    assert planner.activation_bytes(spec, micro_batch=None) == (0, 0)
    p = planner.plan(spec, dp=2, stage=1, activation_checkpointing=True, micro_batch=b)
    assert (
        p.activations
        == 2 * 2 * s * b * h + s * b * h * (10 + 24) + 5 * a * s * s * b + s * b * 512 * 4
    )


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(dp=0, stage=1), "dp"),
        (dict(dp=2, stage=4), "stage"),
        (dict(dp=2, stage=1.0), "stage"),
        (dict(dp=2, stage=True), "stage"),
        (dict(dp=2, stage=1, offload_optimizer="no"), "offload_optimizer"),
        (dict(dp=2, stage=1, activation_checkpointing="yes"), "activation_checkpointing"),
        (dict(dp=2, stage=1, precision="fp8"), "precision"),
        (dict(dp=2, stage=1, mp=5), "mp"),  # 4 heads
        (dict(dp=2, stage=1, mp=0), "mp"),
        (dict(dp=2, stage=1, micro_batch=1, seq_len=64), "seq_len"),  # GPT: 32 positions
        (dict(dp=2, stage=1, partition_activations=True), "partition_activations"),
        (dict(dp=2.0, stage=1), "dp"),
        (dict(dp="2", stage=3, ranks_per_node=2), "dp"),
        (dict(dp=2, stage=3, quantized_weights=1), "quantized_weights"),
        (
            dict(dp=2, stage=2, hierarchical_partition=True, ranks_per_node=2),
            "hierarchical_partition",
        ),
        (dict(dp=2, stage=3, hierarchical_partition=True), "hierarchical_partition"),
        (dict(dp=2, stage=0, quantized_gradients="int8"), "quantized_gradients"),
        (dict(dp=2, stage=1, quantized_gradients="int2"), "quantized_gradients"),
        (dict(dp=4, stage=1, ranks_per_node=3), "ranks_per_node"),
        (dict(dp=2, stage=1, quantization_block=4), "quantization_block"),
        (dict(dp=2, stage=3, quantization_block=12), "quantization_block"),  # as the engine
        (dict(dp=2, stage=2, bucket_elements=1023), "bucket_elements"),  # the engine's minimum
    ],
)
def test_invalid_input_names_the_field(kwargs, field):
    cfg = GPTConfig(vocab_size=512, seq_len=32, n_layer=2, n_head=4, dim=64)
    with pytest.raises(PlanError, match=f"^{field}: "):
        planner.plan(cfg, **kwargs)


def test_the_planner_takes_the_bucket_sizes_the_engine_takes():
    """No plan for a C_B the engine would refuse; the engine's smallest one plans."""
    from zeroservice.config import MIN_BUCKET_ELEMENTS, ConfigError, ZeroConfig

    cfg = GPTConfig(vocab_size=512, seq_len=32, n_layer=2, n_head=4, dim=64)
    for size in (1, MIN_BUCKET_ELEMENTS - 1):
        with pytest.raises(ConfigError, match="bucket_elements"):
            ZeroConfig(stage=2, bucket_elements=size)
        with pytest.raises(PlanError, match=f"must be >= {MIN_BUCKET_ELEMENTS}"):
            planner.plan(cfg, dp=2, stage=2, bucket_elements=size)
    ZeroConfig(stage=2, bucket_elements=MIN_BUCKET_ELEMENTS)
    assert planner.plan(cfg, dp=2, stage=2, bucket_elements=MIN_BUCKET_ELEMENTS).stage == 2


def test_vocab_must_divide_over_mp():
    cfg = GPTConfig(**ODD)  # 3 heads, 509 words
    with pytest.raises(PlanError, match="^mp: 3 does not divide the model's vocab"):
        planner.plan(cfg, dp=1, mp=3, stage=1)
    with pytest.raises(PlanError, match="^params: "):
        planner.plan(0, dp=1, stage=1)


# -- the engine's ledger, to the byte ----------------------------------------------------

ENGINE_CASES = [(2, s, p, False) for s in (0, 1, 2, 3) for p in ("fp32", "bf16")]
ENGINE_CASES += [(4, 1, "bf16", False), (4, 3, "fp32", False)]
# ZeRO-Offload: the fp32 master is a host copy of its own, in fp32 too.
ENGINE_CASES += [(2, 0, "fp32", True), (2, 3, "fp32", True), (2, 2, "bf16", True)]


def _snapshot(module: torch.nn.Module):
    return [
        (name, id(p), p.data_ptr(), tuple(p.shape), p.dtype, p.requires_grad, p.detach().clone())
        for name, p in module.named_parameters(remove_duplicate=False)
    ]


def _same(a, b) -> bool:
    return len(a) == len(b) and all(
        x[:6] == y[:6] and torch.equal(x[6], y[6]) for x, y in zip(a, b, strict=True)
    )


def predict_and_train(cases: list[tuple[int, str, bool]]) -> list[dict]:
    """Runs on each rank: the planner's prediction, then the engine's ledger after a step."""
    import torch.distributed as dist

    import zeroservice
    from zeroservice.config import ZeroConfig

    world, out = dist.get_world_size(), []
    for stage, precision, offload in cases:
        torch.manual_seed(0)
        model = GPT(GPTConfig(**ODD))
        before = _snapshot(model)
        predicted = planner.model_state_bytes_for_module(
            model,
            dp=world,
            stage=stage,
            precision=precision,
            bucket_elements=BUCKET,
            offload_optimizer=offload,
        )
        unchanged = _same(before, _snapshot(model))
        config = ZeroConfig(
            stage=stage, precision=precision, bucket_elements=BUCKET, offload_optimizer=offload
        )
        engine = zeroservice.initialize(model, config, optimizer=torch.optim.AdamW)
        x = torch.randint(0, ODD["vocab_size"], (2, ODD["seq_len"]))
        engine.backward(engine(x, x))
        engine.step()
        ledger = engine.memory_ledger().as_dict()
        engine.close()
        out.append({"predicted": predicted, "unchanged": unchanged, "ledger": ledger})
    return out


@functools.cache
def _engine_results() -> dict[tuple[int, int, str, bool], dict]:
    results = {}
    for world in (2, 4):
        cases = [(s, p, o) for w, s, p, o in ENGINE_CASES if w == world]
        ranks = run_local(predict_and_train, world, cases)
        for rank_results in ranks[1:]:
            assert [r["ledger"] for r in rank_results] == [r["ledger"] for r in ranks[0]]
        for (stage, precision, offload), r in zip(cases, ranks[0], strict=True):
            results[(world, stage, precision, offload)] = r
    return results


@pytest.mark.parametrize("world,stage,precision,offload", ENGINE_CASES)
def test_module_prediction_equals_the_engine_ledger(world, stage, precision, offload):
    r = _engine_results()[(world, stage, precision, offload)]
    ledger = r["ledger"]
    assert r["unchanged"]
    assert r["predicted"] == ledger["model_states"]
    # The odd sizes make padding real (stage 0 shards over one rank: none).
    assert (ledger["psi_padded"] > ledger["psi"]) == (stage > 0)
    # From the config alone: the unpadded formula, by kind as the ledger reports it.
    cfg = GPTConfig(**ODD)
    p = planner.plan(cfg, dp=world, stage=stage, precision=precision, offload_optimizer=offload)
    assert p.psi_local == cfg.num_params() == ledger["psi"]
    assert p.model_states == ledger["expected"]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_module_prediction_leaves_the_module_alone(stage):
    model = GPT(GPTConfig(**ODD))
    before = _snapshot(model)
    sizes = planner.unit_sizes_for_module(model, dp=4, stage=stage, bucket_elements=BUCKET)
    assert _same(before, _snapshot(model))
    assert sum(n for n, _ in sizes) == GPTConfig(**ODD).num_params()
    assert all(padded % (4 if stage else 1) == 0 and padded - n < 4 for n, padded in sizes)


def test_module_prediction_works_on_a_deferred_model():
    import zeroservice

    with zeroservice.deferred_init():
        model = GPT(GPTConfig(**ODD))
    real = GPT(GPTConfig(**ODD))
    for stage in range(4):
        kw = dict(dp=4, stage=stage, precision="bf16", bucket_elements=BUCKET)
        got = planner.model_state_bytes_for_module(model, **kw)
        assert got == planner.model_state_bytes_for_module(real, **kw)
    assert all(p.is_meta for p in model.parameters())


# -- the recommender --------------------------------------------------------------------

# Long sequences: activations dominate, so checkpointing and N_m matter.
LONG = ModelSpec(2_000_000_000, layers=24, dim=2048, heads=16, seq_len=4096, vocab=50304)
GIB = 2**30


def _need(ranks: int, mp: int, stage: int, ckpt: bool) -> int:
    p = planner.plan(
        LONG, dp=ranks // mp, mp=mp, stage=stage, activation_checkpointing=ckpt, micro_batch=1
    )
    return p.device_total


def _recommend(ranks: int, devices_per_node: int, memory: int) -> planner.Recommendation:
    return planner.recommend(
        LONG, ranks=ranks, devices_per_node=devices_per_node, device_memory_bytes=memory
    )


def _memory_for(usable: int) -> int:
    """Device memory whose usable 90% is exactly ``usable`` bytes."""
    memory = -(-usable * 10 // 9)
    while int(memory * 0.9) > usable:
        memory -= 1
    assert int(memory * 0.9) == usable
    return memory


def test_stage_1_when_it_fits():
    r = _recommend(8, 1, 80 * GIB)
    assert r.fits and r.choice is not None
    assert (r.choice.stage, r.choice.mp, r.choice.activation_checkpointing) == (1, 1, False)
    # Stage 2 fits too, moves as much, holds less: stage 1 wins the tie.
    assert _need(8, 1, 2, False) <= r.usable_bytes
    assert r.choice.plan == planner.plan(LONG, dp=8, stage=1, micro_batch=1)


def test_stage_3_when_only_it_fits():
    usable = _need(8, 1, 3, True)
    assert usable < min(_need(8, 1, 2, True), _need(8, 1, 1, True))
    r = _recommend(8, 1, _memory_for(usable))
    assert r.fits and r.choice is not None
    assert (r.choice.stage, r.choice.dp, r.choice.mp) == (3, 8, 1)
    assert r.choice.activation_checkpointing


def test_model_parallel_stage_3_when_only_it_fits():
    usable = _need(8, 2, 3, True)
    others = [
        _need(8, mp, s, c)
        for mp in (1, 2)
        for s in (1, 2, 3)
        for c in (False, True)
        if mp == 1 or s < 3
    ]
    assert usable < min(others)
    r = _recommend(8, 2, _memory_for(usable))
    assert r.fits and r.choice is not None
    assert (r.choice.stage, r.choice.dp, r.choice.mp) == (3, 4, 2)
    assert r.choice.mp_comm_bytes > 0


def test_nothing_fits_says_so_with_numbers():
    r = _recommend(8, 2, 4 * GIB)
    assert not r.fits and r.choice is None
    smallest = r.smallest.plan.device_total
    assert smallest == _need(8, 2, 3, True) == min(c.plan.device_total for c in r.candidates)
    assert planner.human_bytes(smallest) in r.reason
    assert planner.human_bytes(r.usable_bytes) in r.reason and "4.00 GiB" in r.reason
    assert r.reason.startswith("nothing fits")


@pytest.mark.parametrize("devices_per_node", [1, 2, 4, 16])
def test_model_parallel_stays_inside_a_node(devices_per_node):
    r = _recommend(16, devices_per_node, 80 * GIB)
    mps = {c.mp for c in r.candidates}
    assert mps == {m for m in (1, 2, 4, 8, 16) if m <= devices_per_node}
    assert r.choice is not None and r.choice.mp <= devices_per_node


def test_communication_model():
    dp_bytes, mp_bytes = planner.communication_bytes(LONG, stage=3, dp=4, mp=2)
    assert dp_bytes == 3 * 1_000_000_000 * 2 * 3 // 4
    assert mp_bytes == 24 * 4 * 4096 * 2048 * 2 * 2 * 1 // 2
    assert planner.communication_bytes(LONG, stage=1, dp=1, mp=8)[0] == 0
    ckpt = planner.communication_bytes(LONG, stage=1, dp=4, mp=2, activation_checkpointing=True)
    assert ckpt[1] == mp_bytes * 6 // 4


# -- the command line -------------------------------------------------------------------


def test_cli_prints_the_table(capsys):
    assert main(["plan", "--params", "7.5e9", "--dp", "64", "--stage", "3"]) == 0
    out = capsys.readouterr().out
    assert "model states" in out and "1,875,000,000" in out and "1.75 GiB" in out
    args = ["plan", "--gpt-layers", "2", "--gpt-dim", "64", "--gpt-heads", "4", "--vocab", "512"]
    assert main([*args, "--seq", "32", "--dp", "2", "--stage", "1", "--mp", "2", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["psi_local"] == 68_928 and plan["mp"] == 2


def test_cli_vocab_tiles_count_one_tile_of_logits(capsys):
    """The activation formula's logits (s*b*V * 4 bytes) become one tile's: 8 tiles of
    a 512-word vocabulary, 2 x 32 tokens, remove 7/8 of 64 x 512 x 4 bytes."""
    args = ["plan", "--gpt-layers", "2", "--gpt-dim", "64", "--gpt-heads", "4", "--vocab", "512"]
    args += ["--seq", "32", "--dp", "2", "--stage", "1", "--micro-batch", "2", "--json"]
    acts = []
    for tiles in ("1", "8"):
        assert main([*args, "--vocab-tiles", tiles]) == 0
        acts.append(json.loads(capsys.readouterr().out)["activations"])
    assert acts[0] - acts[1] == 64 * 512 * 4 * 7 // 8


def test_cli_paper(capsys):
    assert main(["plan", "--paper"]) == 0
    out = capsys.readouterr().out
    assert "1.88" in out and "15.6" in out and "Pos+g+p" in out


def test_cli_recommend(capsys):
    args = ["plan", "--params", "2e9", "--gpt-layers", "24", "--gpt-dim", "2048"]
    args += ["--gpt-heads", "16", "--seq", "4096", "--vocab", "50304", "--recommend"]
    args += ["--ranks", "8", "--devices-per-node", "1"]
    assert main([*args, "--device-memory", "80GiB"]) == 0
    assert "recommended: ZeRO stage 1, N_d = 8, N_m = 1" in capsys.readouterr().out
    assert main([*args, "--device-memory", "4GiB"]) == 1
    assert "nothing fits: the smallest requirement is" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv,flag",
    [
        (["--params", "7.5e9", "--dp", "0", "--stage", "3"], "--dp"),
        (["--params", "7.5e9", "--dp", "2", "--stage", "5"], "--stage"),
        (["--params", "7.5e9", "--dp", "2", "--stage", "1", "--precision", "fp8"], "--precision"),
        (["--params", "7.5e9", "--stage", "1"], "--dp"),
        (["--gpt-layers", "2", "--gpt-dim", "64", "--dp", "2", "--stage", "1"], "--gpt-heads"),
        (["--gpt-layers", "2", "--gpt-dim", "64", "--gpt-heads", "5", "--dp", "1"], "--gpt-dim"),
        (["--gpt-layers", "2", "--gpt-dim", "64", "--gpt-heads", "4"] + ["--mp", "8"], "--mp"),
        (["--params", "1e9", "--recommend", "--ranks", "8"], "--devices-per-node"),
        (["--dp", "2", "--stage", "1"], "--params"),
        (["--params", "1e9", "--dp", "2", "--stage", "2", "--quantized-weights"], "--quantized-w"),
        (["--params", "1e9", "--dp", "4", "--stage", "3", "--hierarchical-partition"], "--hier"),
        (["--params", "1e9", "--dp", "4", "--stage", "3", "--ranks-per-node", "3"], "--ranks-per"),
        (["--params", "1e9", "--dp", "2", "--stage", "1", "--quantized-gradients", "int2"], "--q"),
        (
            ["--gpt-layers", "2", "--gpt-dim", "64", "--gpt-heads", "4", "--vocab-tiles", "0"],
            "--voc",
        ),
        (["--params", "1e9", "--dp", "2", "--stage", "1", "--vocab-tiles", "4"], "--vocab-tiles"),
    ],
)
def test_cli_bad_input_exits_2_naming_the_flag(argv, flag, capsys):
    if "--stage" not in argv and "--recommend" not in argv and "--gpt-layers" in argv:
        argv = [*argv, "--dp", "1", "--stage", "1"]
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("zeroservice plan: ") and flag in err and "Traceback" not in err


def test_cli_shows_zeropp_bytes_only_when_held(capsys):
    base = ["plan", "--params", "1e9", "--dp", "4", "--stage", "3", "--precision", "bf16"]
    assert main(base) == 0
    assert "hpZ" not in capsys.readouterr().out
    zpp = ["--quantized-weights", "--quantized-gradients", "int4", "--ranks-per-node", "2"]
    assert main([*base, *zpp, "--hierarchical-partition", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    # Ψ / L of bf16 parameters.
    assert got["secondary_params"] == 2 * (10**9 // 2)
    assert got["quantization_scratch"] > 0
    assert got["device_total"] == main_total(got)


def main_total(p: dict) -> int:
    """The device total as the sum of its kinds (nothing offloaded)."""
    kinds = ("model_states", "activations", "comm_buffers", "gathered_params")
    return sum(p[k] for k in kinds) + p["secondary_params"] + p["quantization_scratch"]


def test_cli_unparsable_number_exits_2(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["plan", "--params", "lots", "--dp", "1", "--stage", "1"])
    assert exc.value.code == 2
    assert "argument --params: 'lots' is not a count" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flag,value",
    [("--params", "1e400"), ("--params", "1e19"), ("--memory-per-rank", "1e30")],
)
def test_cli_a_number_past_64_bits_exits_2_naming_it(capsys, flag, value):
    """1e400 was an OverflowError traceback from the report's formatting."""
    args = ["plan", "--params", "1e9", "--auto", "--memory-per-rank", "80GiB", "--ranks", "2"]
    args[args.index(flag) + 1] = value
    with pytest.raises(SystemExit) as exc:
        main(args)
    assert exc.value.code == 2
    assert f"argument {flag}: '{value}' is too large" in capsys.readouterr().err
