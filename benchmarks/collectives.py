"""Where a small model's step goes, and what each collective implementation costs.

Two tables, world 2 on gloo, one torch thread per rank, ``MALLOC_MMAP_THRESHOLD_=131072``:

* **collectives**: the median seconds of one all-reduce, reduce-scatter and all-gather of
  ``--elements`` fp32 elements through the engine's ``Communicator`` with each
  implementation (gloo's own ops, the rings, shared memory);
* **phases**: the 7.4 M GPT's step split into forward, backward (of which the wait for
  the last reduction after autograd), and optimizer step (of which zeroing the gradient
  buffers), rank 0, medians, for our stage 0 with rings and with shared memory, DDP,
  and the same model with no communication at all. Systems step in rotation on the
  same batches, as ``compare --paired-steps`` does.

    python -m benchmarks.collectives            # prints both tables, writes JSON to results/
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from benchmarks.output import write_result

IMPLS = {
    "all_reduce": ("native", "shm"),
    "reduce_scatter": ("native", "ring", "shm"),
    "all_gather": ("native", "ring", "shm"),
}
PHASE_SYSTEMS = ("zero0", "zero0-shm", "ddp", "local")


def _collectives(elements: int, repeats: int) -> dict[str, dict[str, float]]:
    import torch
    import torch.distributed as dist

    from zeroservice.comm import CommLedger, Communicator

    world = dist.get_world_size()
    chunk = elements // world
    comms = {i: Communicator(None, CommLedger(), i, ring_chunk=chunk) for i in IMPLS["all_gather"]}
    data = torch.randn(chunk * world, generator=torch.Generator().manual_seed(dist.get_rank()))
    out: dict[str, dict[str, float]] = {}
    for op, impls in IMPLS.items():
        for impl in impls:
            times = []
            for _ in range(repeats):
                buffer = data.clone()
                dist.barrier()
                t0 = time.perf_counter()
                getattr(comms[impl], op)(buffer, "bench").wait()
                times.append(time.perf_counter() - t0)
            out.setdefault(op, {})[impl] = statistics.median(times)
    for c in comms.values():
        c.close()
    return out


def _phases(steps: int) -> dict[str, dict[str, float]]:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import zeroservice
    from benchmarks.systems import MICRO_BATCH, MODELS, _adamw
    from zeroservice.data import SyntheticTokens, micro_batch
    from zeroservice.models import GPT

    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = MODELS["small"]
    timed: dict[str, dict[str, list[float]]] = {}
    runs = {}
    for name in PHASE_SYSTEMS:
        torch.manual_seed(0)
        model = GPT(cfg)
        timed[name] = {k: [] for k in ("forward", "backward", "last_wait", "step", "zeroing")}
        if name.startswith("zero"):
            collectives = "shm" if name.endswith("-shm") else "auto"
            engine = zeroservice.initialize(
                model, {"stage": 0, "collectives": collectives}, optimizer=_adamw
            )
            _time_method(engine.reducer, "finalize_backward", timed[name]["last_wait"])
            _time_method(engine.reducer, "zero_grads", timed[name]["zeroing"])
            runs[name] = (engine, engine.backward, engine.step)
        else:
            optimizer = _adamw(model.parameters())
            run = DistributedDataParallel(model) if name == "ddp" else model

            def step(opt=optimizer) -> None:
                opt.step()
                opt.zero_grad(set_to_none=True)

            runs[name] = (run, lambda loss: loss.backward(), step)
    data = SyntheticTokens(cfg.vocab_size, cfg.seq_len, seed=1)
    warmup = 3
    for s in range(warmup + steps):
        x, y = micro_batch(data, s, 0, MICRO_BATCH, rank, world)
        names = list(PHASE_SYSTEMS)
        shift = s % len(names)
        for name in names[shift:] + names[:shift]:
            forward, backward, step = runs[name]
            dist.barrier()
            t0 = time.perf_counter()
            loss = forward(x, y)
            t1 = time.perf_counter()
            backward(loss)
            t2 = time.perf_counter()
            step()
            t3 = time.perf_counter()
            if s >= warmup:
                timed[name]["forward"].append(t1 - t0)
                timed[name]["backward"].append(t2 - t1)
                timed[name]["step"].append(t3 - t2)
    for name in ("zero0", "zero0-shm"):
        runs[name][0].close()
    return {
        name: {k: statistics.median(v[-steps:]) if v else 0.0 for k, v in parts.items()}
        for name, parts in timed.items()
    }


def _time_method(obj, name: str, into: list[float]) -> None:
    """Record the seconds of every call of ``obj.name`` in ``into``."""
    original = getattr(obj, name)

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        result = original(*args, **kwargs)
        into.append(time.perf_counter() - t0)
        return result

    setattr(obj, name, timed)


def _both(elements: int, repeats: int, steps: int) -> dict:
    return {"collectives": _collectives(elements, repeats), "phases": _phases(steps)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--elements", type=int, default=7_400_000)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")  # inherited by the ranks
    from zeroservice.launch import run_local

    result = run_local(_both, 2, args.elements, args.repeats, args.steps, timeout_s=1800)[0]
    print(f"\ncollectives, {args.elements / 1e6:.1f} M fp32 elements, world 2 (median ms)")
    impls = IMPLS["all_gather"]
    print(f"{'op':16s}" + "".join(f"{i:>9s}" for i in impls))
    for op, times in result["collectives"].items():
        cells = [f"{1e3 * times[i]:9.2f}" if i in times else f"{'-':>9s}" for i in impls]
        print(f"{op:16s}" + "".join(cells))
    print(f"\n7.4 M GPT step, rank 0, median ms of {args.steps} steps")
    keys = ("forward", "backward", "last_wait", "step", "zeroing")
    print(f"{'system':12s}" + "".join(f"{k:>11s}" for k in keys))
    for name, parts in result["phases"].items():
        print(f"{name:12s}" + "".join(f"{1e3 * parts[k]:11.1f}" for k in keys))
    write_result(args.out, "collectives", {"elements": args.elements, "world": 2, **result})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
