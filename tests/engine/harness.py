"""The shared harness of the engine tests: batches, the DDP reference loop, the engine
loop, the rank average, the gradient capture and the test-only fault injection.

[Note: what parity compares]
Adam turns any rounding noise into a step of about lr: an element whose gradient is
about zero receives noise whose sign follows the order of float sums (the CPU's vector
width, gloo's algorithm, the engine's reduction order), so Adam-trained weights can
differ from DDP's by ~lr in single elements on one CPU and not on another. What is
deterministic at fp32 precision is compared instead:

* per-step losses of the Adam run, at rtol 1e-5 (a sum over many elements);
* every step's reduced gradient (the engine's gradient shards, divided by N_d and the
  loss scale) against the same slice of DDP's averaged ``.grad`` at the same step, in
  a run with SGD + momentum, which does not amplify noise;
* the weights after that SGD run, elementwise.

Gradients and weights are held within ``rtol * |ref| + atol_rel * max|ref|``, where
the max is over the parameter tensor: float summation noise scales with the
magnitude of the terms summed, not with the element's own value, so an element whose
gradient is nearly zero is held to the tensor's scale, never to its own. A defect
(a lost reduction, a shifted shard, a stale gathered unit) moves whole slices by
the gradient's own size, orders of magnitude past either bound; ``test_faults.py``
shows that each one fails these checks.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from zeroservice import comm
from zeroservice.data import SyntheticTokens, micro_batch
from zeroservice.flat import FlatUnit

DEVICE_ENV = "ZEROSERVICE_TEST_DEVICE"


def device() -> torch.device:
    """Where the scenarios' models and batches live: the CPU, or with
    ``ZEROSERVICE_TEST_DEVICE=cuda`` (tests/gpu) this process's GPU. Read at each call:
    a spawned rank imports this module before its environment is set."""
    return torch.device(os.environ.get(DEVICE_ENV, "cpu"))


RTOL = 1e-5
GRAD_ATOL_REL = 1e-5
"""Of the tensor's largest |gradient|: see [Note: what parity compares]."""
WEIGHT_ATOL_REL = 1e-5
"""Of the tensor's largest |weight|."""

Batch = tuple[torch.Tensor, ...]
LossFn = Callable[[Callable, Batch], torch.Tensor]
OptimizerFactory = Callable[[object], torch.optim.Optimizer]


def on_device(module: nn.Module) -> nn.Module:
    """``module`` on the scenarios' device (see ``device``); a model built under
    ``deferred_init`` (meta parameters) stays as it is: the engine places it."""
    if any(p.is_meta for p in module.parameters()):
        return module
    return module.to(device())


def collective_device(group=None) -> torch.device:
    """Where a collective's tensor must be: NCCL takes only GPU tensors."""
    if str(dist.get_backend(group)) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def mean_over_ranks(value: float, group=None) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=collective_device(group))
    dist.all_reduce(t, group=group)
    return t.item() / dist.get_world_size(group)


class ResidualBlocks(nn.Module):
    """A tiny model of residual blocks, the nn.ModuleList activation checkpointing takes:
    8 features in, 4 classes out, each block built by ``block`` (16 features)."""

    def __init__(self, block: Callable[[], nn.Module], depth: int = 2):
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(block() for _ in range(depth))
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for b in self.blocks:
            h = h + b(h)
        return self.head(h)


def average_gradients(model: nn.Module) -> None:
    """Data parallelism written out by hand: each gradient summed over the ranks and
    divided by their number (a parameter without one is left alone)."""
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()


def token_batches(vocab: int, seq: int, seed: int, batch: int = 2):
    """``batches(step, accum)``: this rank's micro-batches of a synthetic token stream."""
    data = SyntheticTokens(vocab, seq, seed=seed)

    def batches(step: int, accum: int) -> list[Batch]:
        rank, world = dist.get_rank(), dist.get_world_size()
        return [
            tuple(t.to(device()) for t in micro_batch(data, step, m, batch, rank, world, accum))
            for m in range(accum)
        ]

    return batches


def call_loss(model: Callable, batch: Batch) -> torch.Tensor:
    """The default loss: the model returns it from (inputs, targets)."""
    return model(*batch)


@dataclass
class Run:
    """One training run's record, on this rank."""

    losses: list[float]
    norms: list[float | None]
    grads: list[dict[str, torch.Tensor]]
    """DDP only: each step's averaged gradients, before clipping."""
    grad_ratio: list[float]
    """Engine only: each step's worst |engine - DDP| / bound over the reduced gradients."""
    state: dict[str, torch.Tensor]
    units: int = 0
    """Engine only: how many flat units it formed."""
    skipped: list[bool] | None = None
    """Each step: skipped for an overflow (fp16)."""


def run_ddp(
    model: nn.Module,
    optimizer: OptimizerFactory,
    batches: Callable[[int, int], list[Batch]],
    steps: int,
    accum: int = 1,
    clip: float = 0.0,
    lr_lambda: Callable[[int], float] | None = None,
    autocast: torch.dtype | None = None,
    capture: bool = False,
    loss_fn: LossFn = call_loss,
    ddp_kwargs: dict | None = None,
    scaler: torch.amp.GradScaler | None = None,
) -> Run:
    """The reference: DDP + the optimizer (+ clip_grad_norm_, + LambdaLR) with fp32
    weights, under autocast for bf16/fp16 (and a GradScaler for fp16)."""
    ddp = DDP(model, **(ddp_kwargs or {}))
    opt = optimizer(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda) if lr_lambda else None
    run = Run([], [], [], [], {}, skipped=[])
    for step in range(steps):
        total = 0.0
        for m, batch in enumerate(batches(step, accum)):
            ctx = ddp.no_sync() if m < accum - 1 else contextlib.nullcontext()
            with ctx:
                with torch.autocast(
                    device().type, autocast or torch.bfloat16, enabled=bool(autocast)
                ):
                    loss = loss_fn(ddp, batch)
                scaled = loss / accum
                (scaler.scale(scaled) if scaler is not None else scaled).backward()
            total += loss.item() / accum
        if scaler is not None:
            scaler.unscale_(opt)
        if capture:
            run.grads.append(_named_grads(model))
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip or float("inf"))
        run.norms.append(norm.item())
        _optimizer_step(opt, scaler, run)
        if sched is not None:
            sched.step()
        opt.zero_grad(set_to_none=True)
        run.losses.append(mean_over_ranks(total))
    run.state = _float_state(model.state_dict())
    return run


def _optimizer_step(opt, scaler: torch.amp.GradScaler | None, run: Run) -> None:
    if scaler is None:
        opt.step()
        run.skipped.append(False)  # type: ignore[union-attr]
        return
    before = scaler.get_scale()
    scaler.step(opt)
    scaler.update()
    run.skipped.append(scaler.get_scale() < before)  # type: ignore[union-attr]


def run_engine(
    engine,
    batches: Callable[[int, int], list[Batch]],
    steps: int,
    accum: int = 1,
    reference: Run | None = None,
    loss_fn: LossFn = call_loss,
    start: int = 0,
    keep_state: bool = True,
) -> Run:
    """The engine on the same batches from step ``start`` on; with ``reference`` (a
    captured DDP run from step 0) every step's reduced gradients are held against DDP's."""
    run = Run([], [], [], [], {}, skipped=[])
    for step in range(start, start + steps):
        total = 0.0
        for m, batch in enumerate(batches(step, accum)):
            loss = loss_fn(engine, batch)
            engine.backward(loss)
            if reference is not None and m == accum - 1:
                run.grad_ratio.append(gradient_ratio(engine, reference.grads[step]))
            report = engine.step()
            total += loss.item() / accum
        run.norms.append(report.grad_norm)
        run.skipped.append(report.skipped)  # type: ignore[union-attr]
        run.losses.append(mean_over_ranks(total))
    if keep_state:
        run.state = _float_state(engine.state_dict())
    return run


def _named_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        name: p.grad.detach().float().clone()
        for name, p in model.named_parameters()
        if p.grad is not None
    }


def _float_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().cpu().clone() for k, v in state.items()}


def _worst(got: torch.Tensor, ref: torch.Tensor, scale: float, atol_rel: float) -> float:
    """The largest |got - ref| / (RTOL |ref| + atol_rel * scale): above 1 fails."""
    if got.numel() == 0:
        return 0.0
    bound = RTOL * ref.abs() + atol_rel * scale
    excess = (got - ref).abs() / bound.clamp_min(torch.finfo(torch.float32).tiny)
    return float(excess.max())


def unit_gradient_slices(
    engine, unit: FlatUnit, shard: torch.Tensor
) -> Iterator[tuple[list[str], int, torch.Tensor]]:
    """(parameter names, first element, values) of each parameter's part of a reduced
    gradient shard. The shard's place follows from the rank and the unit's size alone,
    never from the unit's own offsets, so a shifted shard cannot hide itself."""
    whole = shard.numel() == unit.padded_numel
    lo = 0 if whole else engine.dp_rank * unit.shard_numel
    hi = lo + shard.numel()
    for slot in unit.slots:
        a, b = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
        if a < b:
            yield slot.names, a - slot.offset, shard[a - lo : b - lo]


def gradient_ratio(engine, ref_grads: dict[str, torch.Tensor]) -> float:
    """Worst ratio over this rank's reduced gradients (see [Note: what parity compares])."""
    divisor = engine.optimizer.summed_ranks * engine.loss_scale
    worst = 0.0
    for unit, shard in zip(engine.trainable_units, engine.reducer.grad_shards(), strict=True):
        for names, start, values in unit_gradient_slices(engine, unit, shard):
            ref = next((ref_grads[n] for n in names if n in ref_grads), None)
            if ref is None:
                # DDP saw no gradient
                ref = torch.zeros(start + values.numel(), device=values.device)
            flat = ref.reshape(-1)[start : start + values.numel()]
            scale = float(ref.abs().max()) if ref.numel() else 0.0
            worst = max(worst, _worst(values.float() / divisor, flat, scale, GRAD_ATOL_REL))
    return worst


def master_drift(
    engine, initial: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]
) -> tuple[float, float]:
    """Mixed precision: (||master - ref|| / ||ref - initial||, ||master - initial|| /
    ||ref - initial||) over this rank's fp32 master shards. The first is small when the
    engine follows the reference; the second near 1 when its weights moved as far (an
    engine that never updated gives 1 and 0)."""
    off = moved = update = 0.0
    for unit, master in zip(engine.trainable_units, engine.optimizer.masters, strict=True):
        for names, start, values in unit_gradient_slices(engine, unit, master.detach().cpu()):
            name = next(n for n in names if n in reference)
            n = values.numel()
            ref = reference[name].reshape(-1)[start : start + n].cpu()
            init = initial[name].reshape(-1)[start : start + n].cpu()
            off += float((values - ref).square().sum())
            moved += float((values - init).square().sum())
            update += float((ref - init).square().sum())
    return (off / update) ** 0.5, (moved / update) ** 0.5


def combine_ranks(per_rank: list[dict]) -> dict:
    """Rank 0's record (losses are rank averages already), with the gradient and weight
    ratios the worst over every rank's own shards."""
    out = dict(per_rank[0])
    if "grad_ratio" in out:
        steps = range(len(out["grad_ratio"]))
        out["grad_ratio"] = [max(r["grad_ratio"][k] for r in per_rank) for k in steps]
    if "weight_ratio" in out:
        out["weight_ratio"] = max(r["weight_ratio"] for r in per_rank)
    return out


def parity_record(adam: Run, adam_ref: Run, sgd: Run, sgd_ref: Run) -> dict:
    """What ``assert_matches_ddp`` holds: an Adam run's losses beside DDP's, and an SGD
    run's reduced gradients and final weights against DDP's (see [Note: what parity
    compares])."""
    return {
        "losses": adam.losses,
        "ref_losses": adam_ref.losses,
        "grad_ratio": sgd.grad_ratio,
        "weight_ratio": weight_ratio(sgd.state, sgd_ref.state),
    }


def assert_matches_ddp(r: dict) -> None:
    """Losses at rtol 1e-5; every step's gradients and the final weights within bound."""
    steps = len(r["ref_losses"])
    assert len(r["losses"]) == steps and len(r["grad_ratio"]) == steps
    torch.testing.assert_close(
        torch.tensor(r["losses"]), torch.tensor(r["ref_losses"]), rtol=RTOL, atol=0
    )
    worst = max(range(steps), key=lambda k: r["grad_ratio"][k])
    assert r["grad_ratio"][worst] <= 1.0, (
        f"step {worst}: reduced gradients off by {r['grad_ratio'][worst]:.3g}x the bound"
    )
    assert r["weight_ratio"] <= 1.0, f"weights off by {r['weight_ratio']:.3g}x the bound"


def weight_ratio(state: dict[str, torch.Tensor], ref_state: dict[str, torch.Tensor]) -> float:
    """Worst ratio over every entry of the reference state (weights and buffers)."""
    worst = 0.0
    for name, ref in ref_state.items():
        scale = float(ref.abs().max()) if ref.numel() else 0.0
        worst = max(worst, _worst(state[name].float(), ref.float(), scale, WEIGHT_ATOL_REL))
    return worst


# -- test-only fault injection ---------------------------------------------------------

FAULT_ENV = "ZEROSERVICE_TEST_FAULT"
FAULTS = ("skip-reduction", "shard-offset", "stale-gather")
_fault = {"installed": False, "count": 0}


def restart_fault() -> None:
    """Count calls afresh, so that the next engine meets the fault too."""
    _fault["count"] = 0


def install_fault(name: str | None = None) -> None:
    """Break the engine on purpose in this rank process (``ZEROSERVICE_TEST_FAULT``):

    * ``skip-reduction``: the third gradient reduction (a reduce-scatter piece, or an
      all-reduce at stage 0) is not issued; the rank keeps its own unreduced values;
    * ``shard-offset``: rank 0's shard of every unit starts one element late (inside
      the unit, overlapping rank 1's first element);
    * ``stale-gather``: the fourth parameter all-gather (stage 3: a unit gathered for
      forward or backward; stages 1-2: the updated parameters after a step) is not
      issued; the buffer keeps whatever it held.

    Every rank skips the same call, so nothing hangs: the results are just wrong.
    """
    name = name if name is not None else os.environ.get(FAULT_ENV)
    restart_fault()
    if not name or _fault["installed"]:
        return
    _fault["installed"] = True
    if name == "skip-reduction":
        _skip_nth(("reduce_scatter", "all_reduce"), "grads", 3)
    elif name == "stale-gather":
        _skip_nth(("all_gather",), "params", 4)
    elif name == "shard-offset":
        original = FlatUnit.shard_start

        def shifted(unit: FlatUnit) -> int:
            start = original.fget(unit)  # type: ignore[attr-defined]
            return start + 1 if unit.shard_world > 1 and unit.shard_rank == 0 else start

        FlatUnit.shard_start = property(shifted)  # type: ignore[method-assign,assignment]
    else:
        raise ValueError(f"{FAULT_ENV}: unknown fault {name!r}; known: {', '.join(FAULTS)}")


def _skip_nth(ops: tuple[str, ...], tag: str, n: int) -> None:
    for op in ops:
        original = getattr(comm.Communicator, op)

        def patched(self, tensor, t, *args, _original=original, _op=op, **kwargs):
            if t == tag:
                _fault["count"] += 1
                if _fault["count"] == n:
                    return self._pending(lambda: True, _op, t, tensor)
            return _original(self, tensor, t, *args, **kwargs)

        setattr(comm.Communicator, op, patched)
