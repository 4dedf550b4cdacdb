"""Automatic configuration: the fastest configuration that fits, a refusal with numbers,
the command's flag, and chosen configurations that stay within their budget when run."""

from __future__ import annotations

import json
import os
import random

import pytest

from benchmarks.planner_oracle import measure
from zeroservice.autoconf import RUNTIME_RESERVE, auto_configure
from zeroservice.launch import run_local
from zeroservice.models import GPTConfig
from zscli.cli import main

DEEP = GPTConfig(vocab_size=2048, seq_len=128, n_layer=6, n_head=4, dim=256)
MIB = 2**20


def test_choice_is_the_fastest_that_fits():
    result = auto_configure(DEEP, world=2, memory_per_rank=70 * MIB, micro_batch=4)
    assert result.fits and result.choice is not None
    fitting = [a for a in result.candidates if result.need(a) <= 70 * MIB]
    assert all((a.peak.peak + RUNTIME_RESERVE) * 1.1 <= 70 * MIB for a in fitting)
    assert result.choice.step_seconds == min(a.step_seconds for a in fitting)
    assert 0 < len(fitting) < len(result.candidates)  # the budget rules some out
    # Every stage, N_m in {1, 2}, checkpointing, offload and two bucket sizes were weighed.
    configs = {(a.config.stage, a.config.mp, a.config.activation_checkpointing) for a in fitting}
    assert len(result.candidates) == 4 * 2 * 2 * 2 * 2
    assert configs
    assert "predicted peak" in result.reason and "70.00 MiB" in result.reason


def test_more_memory_never_chooses_a_slower_configuration():
    times = [
        auto_configure(DEEP, world=2, memory_per_rank=m * MIB, micro_batch=4).choice
        for m in (60, 80, 120, 400)
    ]
    seconds = [c.step_seconds for c in times if c is not None]
    assert seconds == sorted(seconds, reverse=True)


def test_refuses_with_numbers():
    result = auto_configure(DEEP, world=2, memory_per_rank=40 * MIB, micro_batch=4)
    assert not result.fits and result.choice is None
    smallest = min(a.peak.peak for a in result.candidates)
    assert result.smallest.peak.peak == smallest
    assert "nothing fits" in result.reason and "40.00 MiB" in result.reason
    assert f"{smallest / MIB:.2f} MiB" in result.reason


def test_cli_auto(capsys):
    shape = ["--gpt-layers", "6", "--gpt-dim", "256", "--gpt-heads", "4", "--vocab", "2048"]
    run = ["plan", "--auto", *shape, "--seq", "128", "--micro-batch", "4", "--ranks", "2"]
    assert main([*run, "--precision", "fp32", "--memory-per-rank", "70MiB"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("chosen: ZeRO stage") and '"stage":' in out
    assert main([*run, "--precision", "fp32", "--memory-per-rank", "40MiB"]) == 1
    assert "nothing fits" in capsys.readouterr().err
    assert main(["plan", "--auto", *shape, "--ranks", "2"]) == 2
    assert "--memory-per-rank" in capsys.readouterr().err
    # Without --precision, auto plans the engine's default (fp32), as REST does.
    assert main([*run, "--memory-per-rank", "70MiB", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["choice"]["engine"]["precision"] == "fp32"


@pytest.mark.parametrize(
    ("mode", "flag"),
    [
        (["--auto", "--ranks", "2", "--memory-per-rank", "1GiB"], ["--stage", "2"]),
        (["--auto", "--ranks", "2", "--memory-per-rank", "1GiB"], ["--offload-optimizer"]),
        (["--auto", "--ranks", "2", "--memory-per-rank", "1GiB"], ["--headroom", "0.5"]),
        (["--auto", "--ranks", "2", "--memory-per-rank", "1GiB"], ["--recommend"]),
        (["--dp", "2", "--stage", "1"], ["--margin", "0.2"]),
        (["--dp", "2", "--stage", "1"], ["--ranks", "4"]),
        (["--paper"], ["--dp", "2"]),
    ],
)
def test_cli_refuses_a_flag_its_mode_does_not_read(capsys, mode, flag):
    """A flag a mode ignored was silently dropped: `--auto --stage 2` printed a choice
    that was not stage 2."""
    shape = ["--gpt-layers", "2", "--gpt-dim", "64", "--gpt-heads", "4"]
    assert main(["plan", *shape, *mode, *flag]) == 2
    assert f"zeroservice plan: {flag[0]}: not " in capsys.readouterr().err


def test_cli_describes_an_untied_biasless_gpt_as_the_api_does(capsys):
    """The CLI planned the tied model whatever the job: 27% fewer model-state bytes."""
    from zeroservice import planner

    shape = ["--gpt-layers", "2", "--gpt-dim", "64", "--gpt-heads", "4", "--vocab", "512"]
    extra = ["--gpt-untied", "--gpt-no-bias", "--gpt-mlp-ratio", "2"]
    assert main(["plan", *shape, *extra, "--dp", "2", "--stage", "1", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    cfg = GPTConfig(
        vocab_size=512, n_layer=2, dim=64, n_head=4, tie_weights=False, bias=False, mlp_ratio=2
    )
    want = planner.plan(cfg, dp=2, stage=1)
    assert got["model_states"] == want.model_states and got["psi"] == cfg.num_params()
    assert main(["plan", "--params", "1e6", "--gpt-untied", "--dp", "2", "--stage", "1"]) == 2
    assert "--gpt-untied: describes the reference GPT" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"world": 2.0}, "world"),
        ({"micro_batch": 0}, "micro_batch"),
        ({"memory_per_rank": True}, "memory_per_rank"),
        ({"seq_len": 0}, "seq_len"),
        ({"seq_len": 129}, "seq_len"),
        ({"reserve_bytes": -1}, "reserve_bytes"),
        ({"flops_per_second": 0.0}, "flops_per_second"),
        ({"link_bytes_per_second": float("nan")}, "link_bytes_per_second"),
        ({"device": "gpu"}, "device"),
        ({"collective_seconds": -1.0}, "collective_seconds"),
        ({"collective_seconds": float("nan")}, "collective_seconds"),
        ({"seq_len": 2.5}, "seq_len"),
        ({"mp": True}, "mp"),
        ({"mp": 2.0}, "mp"),
        ({"reserve_bytes": 2.5}, "reserve_bytes"),
        ({"reserve_bytes": None}, "reserve_bytes"),
        ({"margin": "0.1"}, "margin"),
        ({"precision": ["fp32"]}, "precision"),
        ({"precision": "fp16"}, "precision"),
        ({"collectives": "fast"}, "collectives"),
        ({"persistence_elements": -1}, "persistence_elements"),
    ],
)
def test_bad_inputs_are_refused_naming_the_argument(change, field):
    args = {"world": 2, "memory_per_rank": 70 * MIB, "micro_batch": 4, **change}
    with pytest.raises(ValueError, match=f"^{field}: "):
        auto_configure(DEEP, **args)


def test_model_parallel_degrees_are_the_divisors_the_model_allows():
    """N_m divides the world, the heads (4) and the vocabulary: a world of 2^62 ranks is
    weighed at N_m 1, 2 and 4 at once; a tiled vocabulary allows N_m = 1 alone, in the
    planner too."""
    from zeroservice.planner import PlanError, plan

    huge = auto_configure(DEEP, world=2**62, memory_per_rank=2**50, micro_batch=4)
    assert sorted({a.config.mp for a in huge.candidates}) == [1, 2, 4]
    tiled = GPTConfig(vocab_size=2048, seq_len=128, n_layer=6, n_head=4, dim=256, vocab_tiles=4)
    choice = auto_configure(tiled, world=4, memory_per_rank=2**40, micro_batch=4)
    assert {a.config.mp for a in choice.candidates} == {1}
    with pytest.raises(ValueError, match="^mp: the model's vocab_tiles"):
        auto_configure(tiled, world=4, memory_per_rank=2**40, mp=2)
    with pytest.raises(PlanError, match="^mp: the model's vocab_tiles"):
        plan(tiled, dp=2, mp=2, stage=1)


def test_on_a_gpu_the_budget_is_the_devices_and_offload_frees_it():
    """50 MiB per rank: no configuration fits in host memory, where offload moves
    nothing off the rank; on a GPU, optimizer offload moves 12 bytes per shard element
    to the host (peak.py, [Note: peak on a GPU])."""
    host = auto_configure(DEEP, world=2, memory_per_rank=50 * MIB, micro_batch=4)
    gpu = auto_configure(DEEP, world=2, memory_per_rank=50 * MIB, micro_batch=4, device="cuda")
    assert host.choice is None and gpu.choice is not None
    assert gpu.choice.config.offload_optimizer and gpu.choice.config.device == "cuda"
    assert gpu.need(gpu.choice) <= 50 * MIB
    assert gpu.as_dict()["device"] == "cuda" and host.as_dict()["device"] == "cpu"


def test_a_model_the_peak_model_does_not_cover_is_refused():
    with pytest.raises(TypeError, match="model: the peak model covers the reference GPT"):
        auto_configure(4_000_000, world=2, memory_per_rank=70 * MIB)  # type: ignore[arg-type]


def test_cli_auto_takes_mp_and_refuses_a_zero_micro_batch(capsys):
    shape = ["--gpt-layers", "6", "--gpt-dim", "256", "--gpt-heads", "4", "--vocab", "2048"]
    run = ["plan", "--auto", *shape, "--seq", "128", "--ranks", "2", "--memory-per-rank", "1GiB"]
    chosen = {}
    for mp in (None, "1"):
        assert main([*run, "--json", *(["--mp", mp] if mp else [])]) == 0
        chosen[mp] = json.loads(capsys.readouterr().out)["choice"]["mp"]
    assert chosen == {None: 2, "1": 1}  # unbound, auto splits the model; --mp binds it
    assert main([*run, "--micro-batch", "0"]) == 2
    assert "--micro-batch: must be an integer >= 1" in capsys.readouterr().err


def _triples(n: int, seed: int, world: int) -> list[tuple[GPTConfig, int, int, dict, int]]:
    """Random small GPTs, precisions and budgets at ``world`` ranks, each with the chosen
    configuration: (model, micro-batch, N_m, engine config, budget). A budget lies
    between just above the smallest need and just above what the fastest configuration
    needs (margin included), so that it decides the choice."""
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        heads = rng.choice([2, 3, 4])  # 3 heads: N_m = 1, so the ZeRO stage decides
        cfg = GPTConfig(
            vocab_size=rng.choice([1024, 2048]),
            seq_len=rng.choice([64, 128]),
            n_layer=rng.randint(2, 4),
            n_head=heads,
            dim=heads * rng.choice([48, 64]),
            tie_weights=rng.random() < 0.5,
        )
        batch = rng.choice([2, 4])
        precision = rng.choice(["fp32", "bf16"])
        floor = auto_configure(
            cfg, world=world, memory_per_rank=2**40, micro_batch=batch, precision=precision
        )
        least = min(floor.need(a) for a in floor.candidates)
        assert floor.choice is not None
        fastest = floor.need(floor.choice)  # what the unconstrained choice needs
        budget = int(rng.uniform(least * 1.02, max(fastest * 1.1, least * 1.2)))
        chosen = auto_configure(
            cfg, world=world, memory_per_rank=budget, micro_batch=batch, precision=precision
        )
        if chosen.choice is not None:
            c = chosen.choice
            out.append((cfg, batch, c.config.mp, c.engine_config(), budget))
    return out


def run_triples(triples) -> list[dict]:
    return [measure(cfg, batch, mp, engine) for cfg, batch, mp, engine, _ in triples]


TRIALS = {1: 14, 2: 18, 4: 18}
"""Random (model, budget) pairs per world size: 50 in all, each run for real."""


@pytest.mark.slow
@pytest.mark.parametrize("world", sorted(TRIALS))
def test_chosen_configurations_stay_within_budget_when_run(world):
    triples = _triples(TRIALS[world], world, world)
    old = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "131072"  # the oracle's allocator setting
    try:
        ranks = run_local(run_triples, world, triples, timeout_s=600, start="spawn")
    finally:
        if old is None:
            os.environ.pop("MALLOC_MMAP_THRESHOLD_")
        else:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = old
    for i, (_, _, mp, engine, budget) in enumerate(triples):
        for rank in ranks:
            assert rank[i]["peak_bytes"] <= budget, (engine, mp, rank[i]["peak_bytes"], budget)
    chosen = {(mp, tuple(sorted(e.items()))) for _, _, mp, e, _ in triples}
    assert len(chosen) > 1, chosen  # the budgets are tight enough to change the choice
    worst = max(max(r[i]["peak_bytes"] for r in ranks) / t[4] for i, t in enumerate(triples))
    print(
        f"world {world}: {len(triples)} trials, {len(chosen)} configurations, "
        f"largest peak/budget {worst:.3f}"
    )
