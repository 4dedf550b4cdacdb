"""The engine on one CUDA GPU: memory against the ledger and the planner, bf16 MFU
against plain PyTorch, and the largest GPT that trains with its optimizer on the host.

Every trial runs in a fresh process (one rank on NCCL, ``zeroservice.launch``), so
that each one's CUDA allocator starts empty.

* ``memory``: a ~1 B-parameter GPT at each stage (bf16, AdamW; N_d = 1 on NCCL, or with
  ``--world 2`` two ranks sharing the GPU over gloo): the ledger's
  model states beside ``torch.cuda.memory_allocated`` after a step, and the planner's
  predicted peak (``zeroservice.peak``) beside ``max_memory_allocated``, both above the
  bytes allocated before the model was built; with activation checkpointing, the
  allocator's inactive split bytes with and without the contiguous activation arena.
* ``mfu``: tokens per second and model FLOPs utilisation (6N + attention, recomputation
  not counted, against the chip's dense bf16 peak) of a 1.3 B GPT at sequence 2048,
  with and without activation checkpointing, beside plain PyTorch (fp32 weights under
  bf16 autocast and a fused AdamW: the usual mixed-precision recipe) on the same model.
* ``host``: where a step's time goes at each stage on the MFU GPT (N_d = 1): its
  phases, the GPU's busy time under the profiler, and the host's collectives, device
  copies and kernel launches per step.
* ``offload``: GPTs of growing depth at dim 4096 with ``offload_optimizer`` (the depths
  given, until one fails): three steps each, the last one's time and the share of it
  spent in the host optimizer step.

    python -m benchmarks.gpu memory mfu host offload --out benchmarks/results

Prints each table and writes one JSON per part.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time

import torch
import torch.distributed as dist

import zeroservice
from benchmarks.output import write_result
from zeroservice.data import SyntheticTokens, micro_batch
from zeroservice.launch import run_local
from zeroservice.models import GPT, GPTConfig
from zeroservice.peak import PeakConfig, predict_peak

PEAK_BF16 = {"H100 PCIe": 756.5e12, "H200 NVL": 835.6e12, "H100": 989.4e12, "H200": 989.4e12}
"""Dense bf16 FLOP/s (vendor datasheets), by the first key the device's name contains: the
PCIe parts first, then the SXM parts, which CUDA names plainly."""

MEMORY_GPT = dict(vocab_size=32768, seq_len=2048, n_layer=20, n_head=16, dim=2048)
MFU_GPT = dict(vocab_size=50304, seq_len=2048, n_layer=24, n_head=16, dim=2048)


def _peak_flops() -> float:
    name = torch.cuda.get_device_name()
    for key, value in PEAK_BF16.items():
        if key in name:
            return value
    raise SystemExit(f"no dense bf16 peak known for {name!r}; add it to PEAK_BF16")


def _adamw(params):
    """The engine's optimizer in every trial (plain PyTorch's is the fused one)."""
    return torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1)


def _engine(cfg: GPTConfig, config: dict):
    with zeroservice.deferred_init():
        model = GPT(cfg)
    return zeroservice.initialize(
        model,
        config,
        optimizer=_adamw,
        init=GPT.initializer(cfg),
    )


def _batch(cfg: GPTConfig, step: int, micro: int):
    data = SyntheticTokens(cfg.vocab_size, cfg.seq_len, seed=0)
    x, y = micro_batch(data, step, 0, micro, dist.get_rank(), dist.get_world_size())
    return x.cuda(), y.cuda()


# -- memory ----------------------------------------------------------------------------


def memory_trial(stage: int, checkpointing: bool, contiguous: bool, micro: int) -> dict:
    cfg = GPTConfig(**MEMORY_GPT)  # type: ignore[arg-type]
    world = dist.get_world_size()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    config = {
        "stage": stage,
        "precision": "bf16",
        "activation_checkpointing": checkpointing,
        "contiguous_activations": contiguous,
    }
    if world == 1:
        engine = _engine(cfg, config)
    else:
        # Ranks sharing the GPU over gloo: a deferred model's shards would go to the host
        # (only NCCL implies the GPU), so the model is built on the GPU and the peak is
        # counted from the engine on.
        torch.manual_seed(0)
        with torch.device("cuda"):
            model = GPT(cfg)
        engine = zeroservice.initialize(model, config, optimizer=_adamw)
        del model
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    losses = []
    for step in range(2):
        x, y = _batch(cfg, step, micro)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    torch.cuda.synchronize()
    stats = torch.cuda.memory_stats()
    ledger = engine.memory_ledger()
    predicted = predict_peak(
        PeakConfig(
            gpt=cfg,
            stage=stage,
            dp=world,
            precision="bf16",
            micro_batch=micro,
            activation_checkpointing=checkpointing,
            native_bf16=False,
        )
    )
    out = {
        "stage": stage,
        "world": world,
        "checkpointing": checkpointing,
        "contiguous": contiguous,
        "params": cfg.num_params(),
        "ledger_model_states": ledger.model_states,
        "formula_model_states": zeroservice.expected_model_state_bytes(
            stage, "bf16", engine.psi, world
        ),
        "allocated_after_step": torch.cuda.memory_allocated() - base,
        "peak_allocated": torch.cuda.max_memory_allocated() - base,
        "predicted_peak": predicted.peak,
        "predicted_phase": predicted.phase,
        "predicted_phases": predicted.phases,
        "inactive_split_peak": stats.get("inactive_split_bytes.all.peak", 0),
        "reserved_peak": stats.get("reserved_bytes.all.peak", 0),
        "ledger": ledger.as_dict(),
        "losses": losses,
    }
    engine.close()
    return out


def memory(args) -> dict:
    rows = []
    cases = [(s, False, True) for s in (0, 1, 2, 3)]
    if args.world == 1:
        cases += [(2, True, True), (2, True, False)]
    backend = "nccl" if args.world == 1 else "gloo"
    for stage, ck, contiguous in cases:
        ranks = run_local(
            memory_trial, args.world, stage, ck, contiguous, args.micro, backend=backend
        )
        r = max(ranks, key=lambda x: x["peak_allocated"])
        r["peak_error"] = r["predicted_peak"] / r["peak_allocated"] - 1
        rows.append(r)
        print(
            f"N_d {args.world} stage {stage} ckpt {ck!s:5} arena {contiguous!s:5} | states ledger "
            f"{r['ledger_model_states'] / 2**30:7.3f} GiB formula "
            f"{r['formula_model_states'] / 2**30:7.3f} after step "
            f"{r['allocated_after_step'] / 2**30:7.3f} | peak measured "
            f"{r['peak_allocated'] / 2**30:7.3f} predicted {r['predicted_peak'] / 2**30:7.3f} "
            f"({r['peak_error']:+.1%}, {r['predicted_phase']}) | inactive split "
            f"{r['inactive_split_peak'] / 2**20:8.1f} MiB",
            flush=True,
        )
    worst = max(abs(r["peak_error"]) for r in rows)
    print(f"worst peak error {worst:.1%} (goal 5%)")
    return {
        "model": MEMORY_GPT,
        "world": args.world,
        "micro_batch": args.micro,
        "rows": rows,
        "worst_error": worst,
    }


# -- MFU --------------------------------------------------------------------------------


def _timed(step, warmup: int, steps: int) -> float:
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps


def mfu_trial(system: str, checkpointing: bool, micro: int, steps: int) -> dict:
    cfg = GPTConfig(**MFU_GPT)  # type: ignore[arg-type]
    x, y = _batch(cfg, 0, micro)
    torch.cuda.reset_peak_memory_stats()
    if system == "torch":
        torch.manual_seed(0)
        model = GPT(cfg).cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=True)
        blocks = list(model.blocks)

        def forward():
            if not checkpointing:
                return model(x, y)
            return _checkpointed_forward(model, blocks, x, y)

        def step():
            with torch.autocast("cuda", torch.bfloat16):
                loss = forward()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    else:
        stage = int(system.removeprefix("stage"))
        engine = _engine(
            cfg, {"stage": stage, "precision": "bf16", "activation_checkpointing": checkpointing}
        )

        def step():
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()

    seconds = _timed(step, 3, steps)
    tokens = micro * cfg.seq_len
    return _speed_row(
        system, checkpointing, cfg.num_params(), micro, tokens, cfg.flops_per_token(), seconds
    )


def _speed_row(system, checkpointing, params, micro, tokens, flops_per_token, seconds) -> dict:
    flops = flops_per_token * tokens / seconds
    return {
        "system": system,
        "checkpointing": checkpointing,
        "params": params,
        "micro_batch": micro,
        "step_s": seconds,
        "tokens_per_s": tokens / seconds,
        "tflops": flops / 1e12,
        "mfu": flops / _peak_flops(),
        "peak_allocated": torch.cuda.max_memory_allocated(),
        "device": torch.cuda.get_device_name(),
    }


LLAMA = dict(
    vocab_size=32000,
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=24,
    num_attention_heads=16,
    num_key_value_heads=16,
    max_position_embeddings=2048,
)
"""A ~1.3 B Llama (transformers' LlamaForCausalLM, SDPA attention, untied head)."""


def llama_trial(system: str, checkpointing: bool, micro: int, steps: int) -> dict:
    """``mfu_trial`` for transformers' Llama: the same recipes, the loss from ``labels``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**LLAMA, attn_implementation="sdpa")
    seq = cfg.max_position_embeddings
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.vocab_size, (micro, seq), generator=g).cuda()
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg)
    if checkpointing and system == "torch":
        model.gradient_checkpointing_enable({"use_reentrant": False})
    if system == "torch":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=True)

        def step():
            with torch.autocast("cuda", torch.bfloat16):
                loss = model(input_ids=x, labels=x).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    else:
        engine = zeroservice.initialize(
            model.to(torch.bfloat16),
            {
                "stage": int(system.removeprefix("stage")),
                "precision": "bf16",
                "activation_checkpointing": checkpointing,
            },
            optimizer=_adamw,
        )

        def step():
            loss = engine(input_ids=x, labels=x).loss
            engine.backward(loss)
            engine.step()

    seconds = _timed(step, 3, steps)
    # Every parameter but the input embedding's multiplies in each token's step.
    matmul_params = _llama_params(cfg) - cfg.vocab_size * cfg.hidden_size
    attention = 12 * cfg.num_hidden_layers * cfg.hidden_size * seq
    flops_per_token = 6 * matmul_params + attention
    return _speed_row(
        f"llama-{system}",
        checkpointing,
        _llama_params(cfg),
        micro,
        micro * seq,
        flops_per_token,
        seconds,
    )


def _llama_params(cfg) -> int:
    """Parameters of the Llama: embedding, untied head, and per layer attention (q, k, v,
    o), the gated MLP (three maps) and two RMS norms; a final norm."""
    d, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    kv = d * cfg.num_key_value_heads // cfg.num_attention_heads
    layer = 2 * d * d + 2 * d * kv + 3 * d * f + 2 * d
    return 2 * v * d + cfg.num_hidden_layers * layer + d


def _checkpointed_forward(model: GPT, blocks, x, y):
    """Plain PyTorch's activation checkpointing: each block under torch.utils.checkpoint."""
    from torch.utils.checkpoint import checkpoint

    originals = [b.forward for b in blocks]
    try:
        for b, f in zip(blocks, originals, strict=True):
            b.forward = lambda h, f=f: checkpoint(f, h, use_reentrant=False)
        return model(x, y)
    finally:
        for b, f in zip(blocks, originals, strict=True):
            b.forward = f


def mfu(args) -> dict:
    rows = []
    systems = ["torch"] + [f"stage{s}" for s in args.stages]
    trials = [(mfu_trial, s) for s in systems if "gpt" in args.models]
    trials += [(llama_trial, s) for s in systems if "llama" in args.models]
    for checkpointing in (False, True):
        for trial, system in trials:
            try:
                r = run_local(
                    trial, 1, system, checkpointing, args.micro, args.steps, backend="nccl"
                )[0]
            except RuntimeError as exc:
                r = {"system": system, "checkpointing": checkpointing, "error": str(exc)[-400:]}
                print(f"{system:7} ckpt {checkpointing!s:5} failed: {str(exc)[-300:]}", flush=True)
                rows.append(r)
                continue
            rows.append(r)
            print(
                f"{r['system']:13} ckpt {checkpointing!s:5} | step {r['step_s'] * 1e3:7.1f} ms "
                f"{r['tokens_per_s']:9.0f} tok/s {r['tflops']:6.1f} TFLOP/s MFU {r['mfu']:.1%} "
                f"| peak {r['peak_allocated'] / 2**30:6.1f} GiB",
                flush=True,
            )
    return {"model": MFU_GPT, "llama": LLAMA, "micro_batch": args.micro, "rows": rows}


# -- offload ----------------------------------------------------------------------------


def offload_trial(n_layer: int, micro: int) -> dict:
    cfg = GPTConfig(vocab_size=50304, seq_len=2048, n_layer=n_layer, n_head=32, dim=4096)
    engine = _engine(
        cfg,
        {
            "stage": 2,
            "precision": "bf16",
            "offload_optimizer": True,
            "activation_checkpointing": True,
        },
    )
    x, y = _batch(cfg, 0, micro)
    host_step = []
    real_step = engine.optimizer.optimizer.step

    def timed_host_step(*a, **k):
        t0 = time.perf_counter()
        out = real_step(*a, **k)
        host_step.append(time.perf_counter() - t0)
        return out

    engine.optimizer.optimizer.step = timed_host_step
    times, losses = [], []
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    ledger = engine.memory_ledger()
    return {
        "n_layer": n_layer,
        "params": cfg.num_params(),
        "step_s": times[-1],
        "host_step_s": host_step[-1],
        "host_share": host_step[-1] / times[-1],
        "losses": losses,
        "peak_allocated": torch.cuda.max_memory_allocated(),
        "host_bytes": ledger.host_bytes,
    }


def offload(args) -> dict:
    rows = []
    for n_layer in args.offload_layers:
        t0 = time.time()
        try:
            r = run_local(offload_trial, 1, n_layer, 1, backend="nccl", timeout_s=900)[0]
        except RuntimeError as exc:
            print(f"n_layer {n_layer}: failed: {str(exc)[-300:]}", flush=True)
            rows.append({"n_layer": n_layer, "error": str(exc)[-400:]})
            break
        rows.append(r)
        print(
            f"n_layer {n_layer:3} {r['params'] / 1e9:5.2f} B | step {r['step_s']:6.2f} s, host "
            f"step {r['host_step_s']:6.2f} s ({r['host_share']:.0%}) | GPU peak "
            f"{r['peak_allocated'] / 2**30:6.1f} GiB host {r['host_bytes'] / 2**30:6.1f} GiB "
            f"| losses {[round(v, 3) for v in r['losses']]} ({time.time() - t0:.0f} s)",
            flush=True,
        )
    ok = [r for r in rows if "error" not in r]
    return {"rows": rows, "largest_params": max((r["params"] for r in ok), default=0)}


# -- host ----------------------------------------------------------------------------


def host_trial(stage: int, checkpointing: bool, micro: int, steps: int) -> dict:
    """One stage's step on the MFU GPT: its phases (each ended by a synchronisation), the
    step as trained (no synchronisation inside), and under the profiler the GPU's busy
    time and the host's calls per step. A step longer than the GPU's busy time waits on
    the host issuing work."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cfg = GPTConfig(**MFU_GPT)  # type: ignore[arg-type]
    x, y = _batch(cfg, 0, micro)
    engine = _engine(
        cfg, {"stage": stage, "precision": "bf16", "activation_checkpointing": checkpointing}
    )

    def step():
        engine.backward(engine(x, y))
        engine.step()

    phases = []
    for i in range(3 + steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = engine(x, y)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        engine.backward(loss)
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        if i >= 3:
            phases.append((t1 - t0, t2 - t1, time.perf_counter() - t2))
    seconds = _timed(step, 1, steps)
    profiled = 2
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(profiled):
            step()
        torch.cuda.synchronize()
    events = prof.key_averages()

    def calls(*names: str) -> float:
        return sum(e.count for e in events if any(n in e.key for n in names)) / profiled

    # The kernels' own rows (an operator's row repeats the time of the kernels it ran).
    gpu_us = sum(e.self_device_time_total for e in events if e.device_type == DeviceType.CUDA)
    engine.close()
    return {
        "stage": stage,
        "checkpointing": checkpointing,
        "forward_s": sum(p[0] for p in phases) / steps,
        "backward_s": sum(p[1] for p in phases) / steps,
        "optimizer_s": sum(p[2] for p in phases) / steps,
        "step_s": seconds,
        "gpu_busy_s": gpu_us / 1e6 / profiled,
        "collectives": calls("record_param_comms"),
        "device_copies": calls("Memcpy DtoD"),
        "kernel_launches": calls("cudaLaunchKernel", "cuLaunchKernelEx"),
    }


def host(args) -> dict:
    rows = []
    for checkpointing in (False, True):
        for stage in args.stages:
            r = run_local(
                host_trial, 1, stage, checkpointing, args.micro, args.steps, backend="nccl"
            )[0]
            rows.append(r)
            print(
                f"stage {stage} ckpt {checkpointing!s:5} | forward {r['forward_s'] * 1e3:6.1f} "
                f"backward {r['backward_s'] * 1e3:6.1f} optimizer {r['optimizer_s'] * 1e3:5.1f} "
                f"ms | step {r['step_s'] * 1e3:6.1f} ms, GPU busy {r['gpu_busy_s'] * 1e3:6.1f} "
                f"ms | per step: {r['collectives']:5.0f} collectives, {r['device_copies']:5.0f} "
                f"device copies, {r['kernel_launches']:5.0f} kernel launches",
                flush=True,
            )
    return {"model": MFU_GPT, "micro_batch": args.micro, "rows": rows}


PARTS = {"memory": memory, "mfu": mfu, "offload": offload, "host": host}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("parts", nargs="+", choices=sorted(PARTS))
    ap.add_argument("--micro", type=int, default=4, help="micro-batch (sequences)")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per MFU trial")
    ap.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3])
    ap.add_argument("--models", nargs="+", default=["gpt", "llama"], choices=["gpt", "llama"])
    ap.add_argument("--offload-layers", type=int, nargs="+", default=[24, 30])
    ap.add_argument(
        "--world", type=int, default=1, help="memory: ranks (above 1: gloo, sharing the GPU)"
    )
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks.gpu: no CUDA device here", file=sys.stderr)
        return 2
    for part in args.parts:
        print(f"== {part}", flush=True)
        result = PARTS[part](args)
        result.update(
            device=torch.cuda.get_device_name(),
            torch=torch.__version__,
            date=time.strftime("%Y-%m-%d"),
        )
        stem = f"gpu-{part}" + (f"-dp{args.world}" if part == "memory" and args.world > 1 else "")
        write_result(args.out, stem, result)
        gc.collect()
    return 0


if __name__ == "__main__":
    sys.exit(main())
