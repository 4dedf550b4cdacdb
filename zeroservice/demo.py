"""The engine demo: train the reference GPT on local ranks and report what ZeRO saved.

Run through ``zeroservice demo`` (which spawns the ranks); ``train`` runs on each rank.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

import zeroservice

from .config import ScheduleConfig, ZeroConfig
from .data import SyntheticTokens, micro_batch
from .models import GPT, GPTConfig


@dataclass
class DemoSpec:
    stage: int = 3
    precision: str = "fp32"
    steps: int = 30
    batch: int = 8
    accum: int = 1
    lr: float = 3e-3
    seed: int = 0
    model: GPTConfig | None = None

    def gpt(self) -> GPTConfig:
        return self.model or GPTConfig(vocab_size=512, seq_len=64, n_layer=4, n_head=4, dim=128)


def train(spec: DemoSpec) -> dict:
    """Train on this rank; return losses, step times and both ledgers."""
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = spec.gpt()
    torch.manual_seed(spec.seed)
    init = None
    if spec.stage == 3:  # built straight into shards: no rank ever holds the whole model
        with zeroservice.deferred_init():
            model = GPT(cfg)
        init = GPT.initializer(cfg)
    else:
        model = GPT(cfg)
    config = ZeroConfig(
        stage=spec.stage,
        precision=spec.precision,  # type: ignore[arg-type]
        gradient_accumulation_steps=spec.accum,
        gradient_clipping=1.0,
        bucket_elements=2**18,
        lr_schedule=ScheduleConfig(
            "cosine", warmup_steps=min(3, spec.steps - 1), total_steps=spec.steps
        ),
    )
    engine = zeroservice.initialize(
        model,
        config,
        optimizer=lambda ps: torch.optim.AdamW(ps, lr=spec.lr, weight_decay=0.1),
        init=init,
    )
    data = SyntheticTokens(cfg.vocab_size, cfg.seq_len, seed=spec.seed)
    losses, times = [], []
    for step in range(spec.steps):
        if step == 1:
            engine.comm_ledger().reset()  # count from a steady-state step on
        t0 = time.perf_counter()
        total = 0.0
        for m in range(spec.accum):
            x, y = micro_batch(data, step, m, spec.batch, rank, world, spec.accum)
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            total += loss.item() / spec.accum
        times.append(time.perf_counter() - t0)
        mean = torch.tensor([total])
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
        if rank == 0:
            line = f"step {step + 1:4d}/{spec.steps}  loss {losses[-1]:.4f}  {times[-1]:.3f} s"
            print(line, flush=True)
    return {
        "losses": losses,
        "times": times,
        "memory": engine.memory_ledger().as_dict(),
        "comm": engine.comm_ledger().as_list(),
        "comm_volume": engine.comm_ledger().volume_elements(),
        "measured_steps": spec.steps - 1,
        "tokens_per_step": spec.batch * spec.accum * world * cfg.seq_len,
        "spec": asdict(spec) | {"model": asdict(cfg)},
    }


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:9.2f} MiB"


def format_report(results: list[dict]) -> str:
    r0 = results[0]
    m = r0["memory"]
    times = sorted(r0["times"][1:]) or r0["times"]
    median = times[len(times) // 2]
    lines = [
        "",
        f"ZeRO stage {m['stage']}, {m['precision']}, N_d = {m['n_d']}, "
        f"Ψ = {m['psi']:,} parameters ({m['psi_padded']:,} padded)",
        f"loss {r0['losses'][0]:.4f} -> {r0['losses'][-1]:.4f} over {len(r0['losses'])} steps; "
        f"median step {median:.3f} s, {r0['tokens_per_step'] / median:,.0f} tokens/s",
        "",
        "memory per rank (rank 0)",
    ]
    kinds = ("params", "grads", "master", "optimizer_states", "optimizer_other", "comm_buffers")
    for kind in kinds:
        lines.append(f"  {kind:<18}{_mib(m[kind])}")
    lines += [
        f"  {'model states':<18}{_mib(m['model_states'])}",
        f"  {'paper formula':<18}{_mib(m['expected_padded'])}  "
        f"(equal: {m['model_states'] == m['expected_padded']})",
        f"  {'vs stage 0 (16Ψ)':<18}{_mib(16 * m['psi_padded'])}",
    ]
    if m["stage"] == 3:
        peak = _mib(m["gathered_peak"])
        lines.append(f"  {'gathered, peak':<18}{peak}  (whole units, transient)")
    if not r0["measured_steps"]:
        lines += ["", "communication per rank: not measured (one step: the first, start-up's)"]
        return "\n".join(lines)
    lines += [
        "",
        f"communication per rank, {r0['measured_steps']} steps after the first",
        f"  {'op':<15}{'tag':<8}{'calls':>7}{'payload':>14}{'seconds':>10}{'busbw GB/s':>12}",
    ]
    for e in r0["comm"]:
        lines.append(
            f"  {e['op']:<15}{e['tag']:<8}{e['calls']:>7}{_mib(e['payload_bytes']):>14}"
            f"{e['seconds']:>10.3f}{e['busbw_bytes_per_second'] / 1e9:>12.3f}"
        )
    per_step = r0["comm_volume"] / max(1, r0["measured_steps"])
    lines.append(
        f"  volume per step: {per_step:,.0f} elements = {per_step / m['psi_padded']:.2f} Ψ "
        f"(paper: {'3Ψ at stage 3' if m['stage'] == 3 else '2Ψ for stages 0-2'})"
        + (
            "\n  (below 3Ψ: small units stay gathered between steps, and units that "
            "backward never reads are not gathered twice)"
            if m["stage"] == 3 and per_step < 3 * m["psi_padded"]
            else ""
        )
    )
    return "\n".join(lines)
