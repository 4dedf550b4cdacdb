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
thing: every byte the engine and the step allocate, from none.

``MALLOC_MMAP_THRESHOLD_=131072`` (as the other benchmarks) by default: glibc then maps
every block above 128 KiB on its own and returns it when freed; ``--default-malloc``
runs under glibc's default instead. ``--mkl-cache-off`` sets ``MKL_DISABLE_FAST_MM=1``
in the ranks: MKL then frees its matrix-product buffers after each product instead of
keeping them for the next (a few MiB that the prediction does not count; see
docs/planner.md).

    python -m benchmarks.planner_oracle                 # the matrix, printed, JSON written
    python -m benchmarks.planner_oracle --full          # every combination (slow)
    python -m benchmarks.planner_oracle --rescore FILE  # today's predictions, stored measurements
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

import zeroservice
from benchmarks.output import result_path
from zeroservice.data import SyntheticTokens, micro_batch
from zeroservice.launch import run_local
from zeroservice.memory import process_status_kib
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
}
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

    def peak_config(self, native_bf16: bool | None = None) -> PeakConfig:
        """The prediction's input; ``native_bf16``: as for ``PeakConfig`` (None: this
        host)."""
        cfg, batch = SHAPES[self.shape]
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
        )


def matrix(full: bool) -> list[Case]:
    """Stage x precision x checkpointing for both shapes (32), with MP and offload taken
    from a balanced pattern so that each of their four combinations meets every stage
    and precision; then four more with both on. ``full``: all 128 combinations."""
    cases = []
    for shape in SHAPES:
        for i, (stage, precision, ckpt) in enumerate(
            itertools.product((0, 1, 2, 3), ("fp32", "bf16"), (False, True))
        ):
            if full:
                for mp, off in itertools.product((1, 2), (False, True)):
                    cases.append(Case(shape, stage, precision, ckpt, mp, off))
                continue
            mp = 1 + (i + stage) % 2
            off = (i // 2 + stage) % 2 == 1
            cases.append(Case(shape, stage, precision, ckpt, mp, off))
    if not full:
        cases += [
            Case("deep", 3, "bf16", True, 2, True),
            Case("wide", 2, "fp32", True, 2, True),
            Case("deep", 1, "bf16", False, 2, True),
            Case("wide", 0, "fp32", False, 1, True),
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


def _train(engine, cfg: GPTConfig, batch: int, topo, steps: int, marks: list | None):
    data = SyntheticTokens(cfg.vocab_size, cfg.seq_len, seed=2)
    for step in range(steps):
        x, y = micro_batch(data, step, 0, batch, topo.dp_rank, topo.dp)
        _mark(marks)
        loss = engine(x, y)
        _mark(marks, "forward", step)
        engine.backward(loss)
        del loss
        _mark(marks, "backward", step)
        engine.step()
        _mark(marks, "step", step)


def _mark(marks: list | None, phase: str | None = None, step: int = 0) -> None:
    """Record the phase's peak (VmHWM) and end (VmRSS), then reset VmHWM to now."""
    if marks is None:
        return
    if phase is not None:
        marks.append((phase, step, process_status_kib("VmHWM"), process_status_kib("VmRSS")))
    Path("/proc/self/clear_refs").write_text("5")


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
    _train(engine, cfg, batch, topo, STEPS, marks)
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
    }
    return score(row)


def score(row: dict) -> dict:
    """Add the prediction (and its error) to a row of measurements, for the host that
    measured it (rows recorded before ``native_bf16`` was kept ran on a CPU without
    native bf16 products)."""
    native = row.setdefault("native_bf16", False)
    predicted = predict_peak(Case(**row["case"]).peak_config(native_bf16=native))
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


def _print_table(rows: list[dict], header: bool = True) -> dict:
    if header:
        print(HEADER)
        for r in rows:
            print(_row(r))
    worst = max(rows, key=lambda r: abs(r["error"]))
    within = sum(abs(r["error"]) <= 0.10 for r in rows)
    print(
        f"\nworst error {100 * worst['error']:+.1f}% ({worst['name']}); "
        f"{within}/{len(rows)} within ±10%"
    )
    return worst


def _write(path: Path, malloc: str, rows: list[dict], mkl_cache: bool = True) -> None:
    shapes = {k: {"gpt": asdict(c), "micro_batch": b} for k, (c, b) in SHAPES.items()}
    worst = max(rows, key=lambda r: abs(r["error"]))
    summary = {"malloc": malloc, "world": WORLD, "steps": STEPS, "shapes": shapes}
    summary["mkl_cache"] = mkl_cache
    summary["worst_error"] = worst["error"]
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
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument(
        "--rescore",
        metavar="JSON",
        help="predict again for the measurements of a results file (rewritten in place)",
    )
    args = parser.parse_args(argv)
    if args.rescore:
        before = json.loads(Path(args.rescore).read_text())
        rows = [score(r) for r in before["rows"]]
        _print_table(rows)
        _write(Path(args.rescore), before["malloc"], rows, before.get("mkl_cache", True))
        print(f"rewrote {args.rescore} with today's predictions")
        return 0
    if args.default_malloc:
        os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
    else:
        # Inherited by the spawned ranks: glibc reads it when a process starts.
        os.environ["MALLOC_MMAP_THRESHOLD_"] = "131072"
    if args.mkl_cache_off:
        os.environ["MKL_DISABLE_FAST_MM"] = "1"  # read by MKL when a rank first uses it
    cases = [c for c in matrix(args.full) if args.only in c.name]
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
