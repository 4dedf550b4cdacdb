"""The planner as an oracle: predicted peak bytes per rank against the measured peak.

Each configuration trains the reference GPT for a few steps in two fresh gloo ranks
(MP 1 x DP 2, or MP 2 x DP 1) on synthetic tokens and measures, on every rank, the peak
resident size above the start-up baseline; ``zeroservice.peak.predict_peak`` predicts
the same figure from the configuration alone.

The baseline, precisely: after imports, process-group init and the topology, and after
a tiny model of the same configuration has been trained for two steps and let go (so
that lazily initialised libraries, thread pools and gloo's buffers count as start-up);
then ``gc.collect()``, a barrier, ``/proc/self/clear_refs`` = 5 (VmHWM := VmRSS) and
VmRSS read. The model is built next, under ``deferred_init`` (its parameters never
exist whole outside the engine's units), wrapped and trained. The peak is VmHWM minus
that baseline, the largest over the phases of every step (VmHWM is reset at the start
of each phase, so the phase holding the peak is known). The prediction counts the same
thing: every byte the engine and the step allocate, from none; for an fp32 case, also
MKL's buffer cache as ``zeroservice.mkl_cache.measure_mkl_cache`` measures it on this
host, once per shape and MP degree (a few seconds each; see [Note: MKL's buffer cache]).

``MALLOC_MMAP_THRESHOLD_=131072`` (as the other benchmarks) by default: glibc then maps
every block above 128 KiB on its own and returns it when freed; ``--default-malloc``
runs under glibc's default instead. ``--mkl-cache-off`` sets ``MKL_DISABLE_FAST_MM=1``
in the ranks: MKL then frees its matrix-product buffers after each product instead of
keeping them for the next, and the cache is neither measured nor predicted.

``--cuda`` runs the matrix on one GPU instead, on GPU-sized shapes (``CUDA_SHAPES``),
the two ranks sharing it over gloo: the peak is ``torch.cuda.max_memory_allocated``
above the bytes held before the model was built, after the same warm-up, and the
prediction is ``PeakConfig(device="cuda")`` (see [Note: peak on a GPU] in peak.py).
``--cuda --auto N`` trains N random models instead, each with the configuration
``auto_configure(device="cuda")`` chooses for a random budget, and reports each peak
against its budget.

    python -m benchmarks.planner_oracle                 # the matrix, printed, JSON written
    python -m benchmarks.planner_oracle --full          # every combination (slow)
    python -m benchmarks.planner_oracle --shapes odd,long  # the matrix on two other shapes
    python -m benchmarks.planner_oracle --rescore FILE  # today's predictions, stored measurements
    python -m benchmarks.planner_oracle --cuda          # the matrix on the GPU
    python -m benchmarks.planner_oracle --cuda --auto 30
"""

from __future__ import annotations

import argparse
import functools
import gc
import itertools
import json
import os
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

import zeroservice
from benchmarks.output import result_path
from zeroservice.autoconf import auto_configure
from zeroservice.data import SyntheticTokens, micro_batch
from zeroservice.launch import run_local
from zeroservice.memory import process_status_kib
from zeroservice.mkl_cache import measure_mkl_cache
from zeroservice.models import GPT, GPTConfig
from zeroservice.peak import PeakConfig, native_bf16_matmul, predict_peak
from zeroservice.tensor_parallel import MPGroup

WORLD = 2
SHAPES = {
    # 6 layers, dim 256: 5.3M parameters (tied head), 512 tokens per micro-batch
    "deep": (GPTConfig(vocab_size=2048, seq_len=128, n_layer=6, n_head=4, dim=256), 4),
    # 2 layers, dim 384: 6.5M parameters (untied head), 512 tokens per micro-batch
    "wide": (
        GPTConfig(vocab_size=4096, seq_len=64, n_layer=2, n_head=6, dim=384, tie_weights=False),
        8,
    ),
    # 3 layers, dim 192, 6 heads: 1.9M parameters (tied head), 288 tokens per micro-batch:
    # no width or vocabulary a power of two
    "odd": (GPTConfig(vocab_size=3000, seq_len=96, n_layer=3, n_head=6, dim=192), 3),
    # 4 layers, dim 128, 2 heads: 1.0M parameters (untied head), 1024 tokens per
    # micro-batch: activations larger than the model
    "long": (
        GPTConfig(vocab_size=512, seq_len=256, n_layer=4, n_head=2, dim=128, tie_weights=False),
        4,
    ),
}
"""The CPU matrix's shapes; ``--shapes`` picks two (the first: the one the extra cases use),
deep and wide by default."""
CUDA_SHAPES = {
    # 8 layers, dim 768: 70M parameters (tied head), 4096 tokens per micro-batch
    "gpu-deep": (GPTConfig(vocab_size=16384, seq_len=1024, n_layer=8, n_head=12, dim=768), 4),
    # 2 layers, dim 1024: 93M parameters (an untied head of 33.5M, above C_B), 4096 tokens
    "gpu-wide": (
        GPTConfig(vocab_size=32768, seq_len=512, n_layer=2, n_head=16, dim=1024, tie_weights=False),
        8,
    ),
}
"""The GPU's shapes (``--cuda``): large enough that a step's tensors, not the CUDA
libraries' workspaces, make the peak."""
ALL_SHAPES = {**SHAPES, **CUDA_SHAPES}
STEPS = 2
PHASES = ("forward", "backward", "step")


@dataclass(frozen=True)
class Case:
    """One configuration of the matrix."""

    shape: str
    stage: int
    precision: str
    checkpointing: bool
    mp: int
    offload: bool
    """offload_optimizer, and with checkpointing cpu_offload_activations too."""
    device: str = "cpu"
    """"cpu", or "cuda": the ranks share one GPU over gloo."""

    @property
    def name(self) -> str:
        ck = "ckpt" if self.checkpointing else "full"
        off = " off" if self.offload else ""
        return f"{self.shape} s{self.stage} {self.precision} {ck} mp{self.mp}{off}"

    def engine_config(self) -> dict:
        out: dict = {"stage": self.stage, "precision": self.precision}
        if self.checkpointing:
            out["activation_checkpointing"] = True
            out["partition_activations"] = self.mp > 1
            out["cpu_offload_activations"] = self.offload
        if self.offload:
            out["offload_optimizer"] = True
        return out

    def peak_config(self, native_bf16: bool | None = None, mkl_cache: int = 0) -> PeakConfig:
        """The prediction's input; ``native_bf16`` and ``mkl_cache``: as for
        ``PeakConfig`` (None: this host; 0: not counted)."""
        cfg, batch = ALL_SHAPES[self.shape]
        return PeakConfig(
            cfg,
            stage=self.stage,
            dp=WORLD // self.mp,
            mp=self.mp,
            precision=self.precision,
            micro_batch=batch,
            activation_checkpointing=self.checkpointing,
            partition_activations=self.checkpointing and self.mp > 1,
            cpu_offload_activations=self.checkpointing and self.offload,
            offload_optimizer=self.offload,
            native_bf16=native_bf16,
            device=self.device,
            mkl_cache=mkl_cache,
        )


def matrix(
    full: bool, device: str = "cpu", shapes: tuple[str, ...] = ("deep", "wide")
) -> list[Case]:
    """Stage x precision x checkpointing for two shapes (32), with MP and offload taken
    from a balanced pattern so that each of their four combinations meets every stage
    and precision; then four more with both on. ``full``: all 128 combinations.
    ``device`` "cuda": the same on the GPU's shapes (``shapes`` then unused)."""
    deep, wide = shapes if device == "cpu" else tuple(CUDA_SHAPES)
    cases = []
    for shape in (deep, wide):
        for i, (stage, precision, ckpt) in enumerate(
            itertools.product((0, 1, 2, 3), ("fp32", "bf16"), (False, True))
        ):
            if full:
                for mp, off in itertools.product((1, 2), (False, True)):
                    cases.append(Case(shape, stage, precision, ckpt, mp, off, device))
                continue
            mp = 1 + (i + stage) % 2
            off = (i // 2 + stage) % 2 == 1
            cases.append(Case(shape, stage, precision, ckpt, mp, off, device))
    if not full:
        cases += [
            Case(deep, 3, "bf16", True, 2, True, device),
            Case(wide, 2, "fp32", True, 2, True, device),
            Case(deep, 1, "bf16", False, 2, True, device),
            Case(wide, 0, "fp32", False, 1, True, device),
        ]
    return list(dict.fromkeys(cases))


def _engine(engine_config: dict, mp: int, cfg: GPTConfig, topo):
    with zeroservice.deferred_init():
        model = GPT(cfg, MPGroup(topo.mp_group) if mp > 1 else None)
    return zeroservice.initialize(
        model,
        engine_config,
        lambda ps: torch.optim.AdamW(ps, lr=1e-4),
        init=GPT.initializer(cfg),
        topology=topo,
    )


def _train(engine, cfg: GPTConfig, batch: int, topo, steps: int, mark, device="cpu"):
    """``steps`` steps; ``mark(phase, step)`` (if given) after each phase, and
    ``mark(None, step)`` before the first."""
    data = SyntheticTokens(cfg.vocab_size, cfg.seq_len, seed=2)
    mark = mark or (lambda phase, step: None)
    for step in range(steps):
        x, y = micro_batch(data, step, 0, batch, topo.dp_rank, topo.dp)
        x, y = x.to(device), y.to(device)
        mark(None, step)
        loss = engine(x, y)
        mark("forward", step)
        engine.backward(loss)
        del loss
        mark("backward", step)
        engine.step()
        mark("step", step)


def _host_marks(marks: list):
    """A ``mark`` recording each phase's peak (VmHWM) and end (VmRSS), then resetting
    VmHWM to now."""

    def mark(phase: str | None, step: int) -> None:
        if phase is not None:
            marks.append((phase, step, process_status_kib("VmHWM"), process_status_kib("VmRSS")))
        Path("/proc/self/clear_refs").write_text("5")

    return mark


def trial(case: Case) -> dict:
    """In each rank: the peak above the baseline (see the module's docstring)."""
    cfg, batch = SHAPES[case.shape]
    return measure(cfg, batch, case.mp, case.engine_config())


def measure(cfg: GPTConfig, batch: int, mp: int, engine_config: dict) -> dict:
    """In each rank: train ``cfg`` with ``engine_config`` (MP ``mp``) and return the peak
    above the baseline, the phase that holds it and the engine's ledger."""
    topo = zeroservice.build_topology(mp)
    heads = max(2, mp)  # divisible by N_m, as the vocabulary (64) is for N_m <= 64
    tiny = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=heads, dim=16 * heads)
    warm = _engine(engine_config, mp, tiny, topo)
    _train(warm, tiny, 2, topo, 1, None)
    warm.close()
    del warm
    gc.collect()
    dist.barrier()
    Path("/proc/self/clear_refs").write_text("5")
    base = process_status_kib("VmRSS")
    marks: list = []
    engine = _engine(engine_config, mp, cfg, topo)
    built = process_status_kib("VmHWM")
    _train(engine, cfg, batch, topo, STEPS, _host_marks(marks))
    ledger = engine.memory_ledger()
    engine.close()
    phases = [(p, s, (hwm - base) * 1024, (rss - base) * 1024) for p, s, hwm, rss in marks]
    where = max(phases, key=lambda m: m[2])
    return {
        "peak_bytes": max(where[2], (built - base) * 1024),
        "peak_phase": where[0],
        "build_bytes": (built - base) * 1024,
        "phases": phases,
        "ledger": ledger.as_dict(),
    }


def trials(cases: list[Case]) -> list[dict]:
    """``trial`` for each case in turn, in the same ranks (each with its own baseline)."""
    out = []
    for case in cases:
        out.append(trial(case))
        gc.collect()
    return out


# -- on one GPU ----------------------------------------------------------------------------


def _cuda_engine(engine_config: dict, mp: int, cfg: GPTConfig, topo):
    """The model built on the GPU and wrapped: under gloo a deferred model's shards would
    go to the host (only NCCL implies the GPU)."""
    torch.manual_seed(0)
    group = MPGroup(topo.mp_group) if mp > 1 else None
    with torch.device("cuda"):
        model = GPT(cfg, group)
    engine = zeroservice.initialize(
        model, engine_config, lambda ps: torch.optim.AdamW(ps, lr=1e-4), topology=topo
    )
    del model
    gc.collect()
    return engine


def _cuda_marks(marks: list, base: int):
    """A ``mark`` recording each phase's peak and end (bytes the CUDA allocator handed
    out, above ``base``), then resetting the peak to now."""

    def mark(phase: str | None, step: int) -> None:
        torch.cuda.synchronize()
        if phase is not None:
            peak = torch.cuda.max_memory_allocated() - base
            marks.append((phase, step, peak, torch.cuda.memory_allocated() - base))
        torch.cuda.reset_peak_memory_stats()

    return mark


def measure_cuda(cfg: GPTConfig, batch: int, mp: int, engine_config: dict) -> dict:
    """In each rank (the ranks share the GPU over gloo): the CUDA allocator's peak above
    its bytes before the model was built. The same warm-up as ``measure`` first (the
    CUDA libraries' workspaces, allocated at their first use, count as start-up); the
    engine's construction (the whole model built on the GPU, then flattened) is reported
    apart, as ``build_bytes``: the peak is the steps'."""
    topo = zeroservice.build_topology(mp)
    heads = max(2, mp)
    tiny = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=heads, dim=16 * heads)
    warm = _cuda_engine(engine_config, mp, tiny, topo)
    _train(warm, tiny, 2, topo, 1, None, "cuda")
    warm.close()
    del warm
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    dist.barrier()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    engine = _cuda_engine(engine_config, mp, cfg, topo)
    torch.cuda.synchronize()
    build_peak = torch.cuda.max_memory_allocated() - base
    built = torch.cuda.memory_allocated() - base
    torch.cuda.reset_peak_memory_stats()
    marks: list = []
    mark = _cuda_marks(marks, base)
    _train(engine, cfg, batch, topo, STEPS, mark, "cuda")
    ledger = engine.memory_ledger()
    engine.close()
    del engine
    gc.collect()
    torch.cuda.synchronize()
    left = torch.cuda.memory_allocated() - base
    torch.cuda.empty_cache()
    where = max(marks, key=lambda m: m[2])
    return {
        "peak_bytes": where[2],
        "peak_phase": where[0],
        "build_bytes": built,
        "build_peak_bytes": build_peak,
        "phases": marks,
        "left_after_close": left,
        "ledger": ledger.as_dict(),
        "device_name": torch.cuda.get_device_name(),
        "torch": torch.__version__,
    }


@dataclass(frozen=True)
class CudaTrial:
    """One training run on the GPU: the model, its micro-batch, N_m and engine config,
    and what its row carries besides the measurement (``row``)."""

    name: str
    gpt: GPTConfig
    batch: int
    mp: int
    engine: dict
    row: dict

    @classmethod
    def of(cls, case: Case) -> CudaTrial:
        cfg, batch = CUDA_SHAPES[case.shape]
        return cls(case.name, cfg, batch, case.mp, case.engine_config(), {"case": asdict(case)})


def cuda_trials(trials: list[CudaTrial], jsonl: str) -> None:
    """In each rank: ``measure_cuda`` for each trial in turn, in the same two processes
    (the allocator counts exactly, so one trial leaves nothing to the next but what it
    fails to free, which the row reports); rank 0 appends each trial's row to ``jsonl``
    as it ends, so that a run cut short keeps what it measured."""
    for trial in trials:
        t0 = time.time()
        try:
            result = measure_cuda(trial.gpt, trial.batch, trial.mp, trial.engine)
        except Exception as e:  # both ranks fail alike (a config the GPU refuses)
            result = {"error": f"{type(e).__name__}: {e}"}
        ranks: list = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, result)
        if dist.get_rank() == 0:
            row: dict = {**trial.row, "name": trial.name, "seconds": time.time() - t0}
            errors = [r["error"] for r in ranks if "error" in r]
            if errors:
                row["failed"] = errors[0]
            else:
                worst = max(ranks, key=lambda r: r["peak_bytes"])
                row.update(
                    measured_bytes=worst["peak_bytes"],
                    measured_phase=worst["peak_phase"],
                    ranks=ranks,
                    native_bf16=False,
                )
            with open(jsonl, "a") as f:
                f.write(json.dumps(row) + "\n")
        if "error" in result:
            raise RuntimeError(result["error"])
        gc.collect()


def run_cuda(
    trials: list[CudaTrial],
    path: Path,
    show,
    chunk: int = 6,
    trial_s: float = 45.0,
    ranks_fn=None,
):
    """Every trial on the GPU, two ranks sharing it over gloo, ``chunk`` trials to a pair
    of processes (given ``trial_s`` seconds a trial), each row passed to ``show`` as it
    comes; a trial that fails or hangs is recorded as failed and the rest go on in fresh
    processes. Returns the rows. ``ranks_fn``: what the ranks run (``cuda_trials``; a
    test passes its own)."""
    ranks_fn = ranks_fn or cuda_trials
    jsonl = path.with_suffix(".jsonl")
    jsonl.unlink(missing_ok=True)
    todo = list(trials)
    while todo:
        batch = todo[:chunk]
        before = len(_rows(jsonl))
        try:
            run_local(ranks_fn, WORLD, batch, str(jsonl), timeout_s=trial_s * len(batch))
        except Exception as e:
            print(f"ranks stopped: {str(e).strip().splitlines()[-1][:300]}", flush=True)
        new = _rows(jsonl)[before:]
        for row in new:
            show(row)
        names = {r["name"] for r in new}
        left = [t for t in batch if t.name not in names]
        if left and not (new and "failed" in new[-1]):
            # The ranks died or hung inside a trial without recording it: record, skip it.
            row = {**left[0].row, "name": left[0].name, "failed": "the ranks stopped"}
            with open(jsonl, "a") as f:
                f.write(json.dumps(row) + "\n")
            show(row)
            left = left[1:]
        rest = left + todo[chunk:]
        if len(rest) >= len(todo):  # each round ends at least one trial
            raise RuntimeError(f"no trial ended in a round: {[t.name for t in batch]}")
        todo = rest
    return _rows(jsonl)


def auto_trials(n: int, seed: int) -> list[CudaTrial]:
    """``n`` random GPU-sized GPTs, precisions and GPU budgets at world 2, each with the
    configuration ``auto_configure(device="cuda")`` chooses for it. A budget lies
    between just above the smallest need and just above what the unconstrained choice
    needs (margin included), so that it decides the choice (as tests/engine/
    test_autoconf.py does on the CPU)."""
    rng = random.Random(seed)
    out: list[CudaTrial] = []
    while len(out) < n:
        heads = rng.choice([8, 12, 16])
        cfg = GPTConfig(
            vocab_size=rng.choice([8192, 16384, 32768]),
            seq_len=rng.choice([512, 1024]),
            n_layer=rng.randint(2, 8),
            n_head=heads,
            dim=heads * 64,
            tie_weights=rng.random() < 0.5,
        )
        batch = rng.choice([2, 4])
        precision = rng.choice(["fp32", "bf16"])
        kw = dict(world=WORLD, micro_batch=batch, precision=precision, device="cuda")
        floor = auto_configure(cfg, memory_per_rank=2**40, **kw)  # type: ignore[arg-type]
        assert floor.choice is not None
        least = min(floor.need(a) for a in floor.candidates)
        fastest = floor.need(floor.choice)
        budget = int(rng.uniform(least * 1.02, max(fastest * 1.1, least * 1.2)))
        chosen = auto_configure(cfg, memory_per_rank=budget, **kw)  # type: ignore[arg-type]
        if chosen.choice is None:
            continue
        c = chosen.choice
        row = {
            "auto": {
                "gpt": asdict(cfg),
                "micro_batch": batch,
                "budget_bytes": budget,
                "need_bytes": chosen.need(c),
                "predicted_bytes": c.peak.peak,
                "choice": c.describe(),
                "engine": c.engine_config(),
                "mp": c.config.mp,
            }
        }
        name = f"auto {len(out)}"
        out.append(CudaTrial(name, cfg, batch, c.config.mp, c.engine_config(), row))
    return out


def _show_auto(row: dict) -> None:
    if "failed" in row:
        print(f"{row['name']:10s} failed: {row['failed']}", flush=True)
        return
    a, mib = row["auto"], 2**20
    print(
        f"{row['name']:10s} budget {a['budget_bytes'] / mib:8.1f} MiB  predicted "
        f"{a['predicted_bytes'] / mib:8.1f}  measured {row['measured_bytes'] / mib:8.1f}  "
        f"measured/budget {row['measured_bytes'] / a['budget_bytes']:.3f}  {a['choice']}",
        flush=True,
    )


def _show_case(row: dict) -> None:
    print(_row(score(row)) if "failed" not in row else f"{row['name']:32s} {row['failed']}")


def _rows(jsonl: Path) -> list[dict]:
    return [json.loads(line) for line in jsonl.read_text().splitlines()] if jsonl.exists() else []


def run_case(case: Case) -> dict:
    t0 = time.time()
    ranks = run_local(trial, WORLD, case, timeout_s=600)
    worst = max(ranks, key=lambda r: r["peak_bytes"])
    row = {
        "case": asdict(case),
        "name": case.name,
        "measured_bytes": worst["peak_bytes"],
        "measured_phase": worst["peak_phase"],
        "ranks": ranks,
        "seconds": time.time() - t0,
        "native_bf16": native_bf16_matmul(),  # the ranks ran on this host
        "mkl_cache_bytes": host_mkl_cache(case),
    }
    return score(row)


@functools.cache
def _mkl_cache_of(shape: str, mp: int) -> int:
    cfg, batch = SHAPES[shape]
    return measure_mkl_cache(cfg, batch, mp)


def host_mkl_cache(case: Case) -> int:
    """MKL's buffer cache on this host for an fp32 case, measured once per shape and MP
    degree (0 with the cache off, and for bf16: see [Note: MKL's buffer cache])."""
    if case.precision != "fp32" or os.environ.get("MKL_DISABLE_FAST_MM"):
        return 0
    return _mkl_cache_of(case.shape, case.mp)


def score(row: dict) -> dict:
    """Add the prediction (and its error) to a row of measurements, for the host that
    measured it (rows recorded before ``native_bf16`` was kept ran on a CPU without
    native bf16 products)."""
    native = row.setdefault("native_bf16", False)
    mkl = row.setdefault("mkl_cache_bytes", 0)  # rows recorded before it was measured: 0
    predicted = predict_peak(Case(**row["case"]).peak_config(native_bf16=native, mkl_cache=mkl))
    row["predicted_bytes"] = predicted.peak
    row["predicted_phase"] = predicted.phase
    row["predicted"] = predicted.as_dict()
    row["error"] = predicted.peak / row["measured_bytes"] - 1
    return row


def _row(r: dict) -> str:
    mib = 2**20
    return (
        f"{r['name']:32s} {r['predicted_bytes'] / mib:9.1f} {r['measured_bytes'] / mib:9.1f} "
        f"{100 * r['error']:+7.1f}%  {r['predicted_phase']:>8s} {r['measured_phase']:>8s}"
    )


HEADER = (
    f"{'config':32s} {'pred MiB':>9s} {'meas MiB':>9s} {'error':>8s}  {'pred at':>8s} "
    f"{'meas at':>8s}"
)


def _print_table(rows: list[dict], header: bool = True, goal: float = 0.10) -> dict:
    """The table (with ``header``), the failed configurations, and the worst error."""
    failed = [r for r in rows if "failed" in r]
    rows = [r for r in rows if "failed" not in r]
    if header:
        print(HEADER)
        for r in rows:
            print(_row(r))
    for r in failed:
        print(f"failed: {r['name']}: {r['failed']}")
    if not rows:
        print("\nno configuration measured")
        return {}
    worst = max(rows, key=lambda r: abs(r["error"]))
    within = sum(abs(r["error"]) <= goal for r in rows)
    print(
        f"\nworst error {100 * worst['error']:+.1f}% ({worst['name']}); "
        f"{within}/{len(rows)} within ±{goal:.0%}"
    )
    return worst


def _write(path: Path, malloc: str, rows: list[dict], mkl_cache: bool = True) -> None:
    names = {r["case"]["shape"] for r in rows}
    shapes = {
        k: {"gpt": asdict(c), "micro_batch": b} for k, (c, b) in ALL_SHAPES.items() if k in names
    }
    scored = [r for r in rows if "failed" not in r]
    summary = {"malloc": malloc, "world": WORLD, "steps": STEPS, "shapes": shapes}
    summary["mkl_cache"] = mkl_cache
    if scored:
        summary["worst_error"] = max(scored, key=lambda r: abs(r["error"]))["error"]
    path.write_text(json.dumps({**summary, "rows": rows}, indent=2))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="all 128 combinations")
    parser.add_argument("--default-malloc", action="store_true", help="glibc's default")
    parser.add_argument(
        "--mkl-cache-off",
        action="store_true",
        help="MKL_DISABLE_FAST_MM=1: MKL keeps no matrix-product buffers between products",
    )
    parser.add_argument("--only", default="", help="run the cases whose name contains this")
    parser.add_argument(
        "--shapes",
        default="deep,wide",
        help=f"the two CPU shapes of the matrix, of {', '.join(SHAPES)} (default deep,wide)",
    )
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument(
        "--rescore",
        metavar="JSON",
        help="predict again for the measurements of a results file (rewritten in place)",
    )
    parser.add_argument(
        "--cuda",
        action="store_true",
        help="on the GPU: its shapes, two ranks sharing it over gloo, the CUDA allocator's peak",
    )
    parser.add_argument("--chunk", type=int, default=6, help="--cuda: cases per pair of ranks")
    parser.add_argument(
        "--auto",
        type=int,
        default=0,
        metavar="N",
        help="--cuda: instead of the matrix, N random models and GPU budgets, each run with "
        "the configuration auto_configure(device='cuda') chooses",
    )
    args = parser.parse_args(argv)
    if args.auto and not args.cuda:
        parser.error(
            "--auto: runs on the GPU; add --cuda (the CPU's trials: tests/engine/test_autoconf.py)"
        )
    if args.rescore:
        before = json.loads(Path(args.rescore).read_text())
        rescored = [r if "failed" in r else score(r) for r in before["rows"]]
        _print_table(rescored, goal=0.05 if before["malloc"] == "cuda" else 0.10)
        _write(Path(args.rescore), before["malloc"], rescored, before.get("mkl_cache", True))
        print(f"rewrote {args.rescore} with today's predictions")
        return 0
    if args.cuda and args.auto:
        path = result_path(args.out, "autoconf-cuda")
        trials = auto_trials(args.auto, seed=0)
        print(f"{len(trials)} random models and GPU budgets, world {WORLD}", flush=True)
        done = run_cuda(trials, path, _show_auto, args.chunk)
        ok = [r for r in done if "failed" not in r]
        over = [r["name"] for r in ok if r["measured_bytes"] > r["auto"]["budget_bytes"]]
        most = max((r["measured_bytes"] / r["auto"]["budget_bytes"] for r in ok), default=0)
        path.write_text(json.dumps({"world": WORLD, "steps": STEPS, "rows": done}, indent=2))
        print(
            f"\n{len(ok)}/{len(done)} ran; over budget: {over or 'none'}; largest "
            f"measured/budget {most:.3f}\nwrote {path}"
        )
        return 0
    if args.cuda:
        cases = [c for c in matrix(args.full, "cuda") if args.only in c.name]
        print(f"{len(cases)} configurations on the GPU, world {WORLD}, {STEPS} steps each")
        print(HEADER, flush=True)
        path = result_path(args.out, "planner-oracle-cuda")
        ran = run_cuda([CudaTrial.of(c) for c in cases], path, _show_case, args.chunk)
        measured = [row if "failed" in row else score(row) for row in ran]
        _write(path, "cuda", measured)
        _print_table(measured, header=False, goal=0.05)
        print(f"wrote {path}")
        return 0
    if args.default_malloc:
        os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
    else:
        # Inherited by the spawned ranks: glibc reads it when a process starts.
        os.environ["MALLOC_MMAP_THRESHOLD_"] = "131072"
    if args.mkl_cache_off:
        os.environ["MKL_DISABLE_FAST_MM"] = "1"  # read by MKL when a rank first uses it
    shapes = tuple(args.shapes.split(","))
    if len(shapes) != 2 or len(set(shapes)) != 2 or not set(shapes) <= set(SHAPES):
        parser.error(f"--shapes: two different names of {', '.join(SHAPES)}, not {args.shapes!r}")
    cases = [c for c in matrix(args.full, shapes=shapes) if args.only in c.name]
    print(f"{len(cases)} configurations, world {WORLD}, {STEPS} steps each", flush=True)
    print(HEADER, flush=True)
    malloc = "default" if args.default_malloc else "mmap"
    mkl = "-mkl-cache-off" if args.mkl_cache_off else ""
    path = result_path(args.out, f"planner-oracle-{malloc}{mkl}")
    rows: list[dict] = []
    for case in cases:
        rows.append(run_case(case))
        print(_row(rows[-1]), flush=True)
        # After every row: a stopped run keeps what it measured.
        _write(path, malloc, rows, not args.mkl_cache_off)
    _print_table(rows, header=False)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
