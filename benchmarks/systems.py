"""Each benchmarked system, set up inside a rank: ours (stages 0-3) and the peers.

Every system trains the same GPT on the same batches with fp32 AdamW and no clipping,
so their loss curves agree to 4-5 decimals (a correctness cross-check that the table
prints beside the times).
"""

from __future__ import annotations

import dataclasses
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

import zeroservice
from zeroservice.data import SyntheticTokens, micro_batch
from zeroservice.models import GPT, GPTConfig

MODELS = {
    # 7.4M parameters
    "small": GPTConfig(
        vocab_size=8192, seq_len=128, n_layer=4, n_head=4, dim=256, tie_weights=False
    ),
    # 106M parameters
    "large": GPTConfig(
        vocab_size=32000, seq_len=128, n_layer=8, n_head=12, dim=768, tie_weights=False
    ),
}
# The 106M GPT with its head and loss in 8 vocabulary tiles (models/tiled_head.py)
MODELS["large-tiled"] = dataclasses.replace(MODELS["large"], vocab_tiles=8)
MICRO_BATCH = 4
LR = 1e-4


@dataclass
class Trainer:
    backward: Callable[[torch.Tensor, torch.Tensor], float]
    """Forward and backward of one micro-batch; returns the loss."""
    update: Callable[[], None]
    """The optimizer step (and whatever the system does around it)."""
    model_state_bytes: Callable[[], int]
    """Measured after a backward, before the step, when every system holds its gradients."""
    comm_volume: Callable[[], int | None] = lambda: None
    """Elements moved so far in the paper's accounting (None: not measured)."""


def _adamw(params):
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.0)


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views counted once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.numel():
            local = getattr(t, "_local_tensor", t)
            s = local.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def _reachable(model: nn.Module, optimizer) -> list[torch.Tensor]:
    """Parameters, gradients, optimizer state and every tensor one attribute deep."""
    out: list[torch.Tensor] = []
    for p in model.parameters():
        out += [p, p.grad] if p.grad is not None else [p]
    inner = [getattr(optimizer, name, None) for name in ("optim", "optimizer")]
    for obj in (optimizer, *inner):
        if obj is None:
            continue
        for state in getattr(obj, "state", {}).values():
            out += [v for v in state.values() if isinstance(v, torch.Tensor)]
        for group in getattr(obj, "param_groups", []):
            for p in group["params"]:
                out += [p, p.grad] if p.grad is not None else [p]
        for value in vars(obj).values():
            items = value if isinstance(value, list | tuple) else [value]
            for item in items:
                if isinstance(item, torch.Tensor):
                    out.append(item)
                elif isinstance(item, list | tuple):
                    out += [t for t in item if isinstance(t, torch.Tensor)]
    return out


def _plain(model, optimizer, wrapped=None) -> tuple[Callable, Callable, Callable]:
    run = wrapped or model

    def backward(x, y) -> float:
        loss = run(x, y)
        loss.backward()
        return loss.item()

    def update() -> None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return backward, update, lambda: _storage_bytes(_reachable(model, optimizer))


def _engine_like(engine) -> tuple[Callable, Callable]:
    """Split a DeepSpeed-style engine's micro-step into backward and update."""

    def backward(x, y) -> float:
        loss = engine(x, y)
        engine.backward(loss)
        return loss.item()

    return backward, engine.step


def ours(stage: int, collectives: str = "auto", **extra: object) -> Callable[[GPT], Trainer]:
    def build(model: GPT) -> Trainer:
        config = {"stage": stage, "collectives": collectives, **extra}
        engine = zeroservice.initialize(model, config, optimizer=_adamw)
        return Trainer(
            *_engine_like(engine),
            lambda: engine.memory_ledger().model_states,
            lambda: engine.comm_ledger().volume_elements(),
        )

    return build


def ddp(model: GPT) -> Trainer:
    from torch.nn.parallel import DistributedDataParallel as DDP

    return Trainer(*_plain(model, _adamw(model.parameters()), DDP(model)))


def ddp_bucket_view(model: GPT) -> Trainer:
    """DDP whose ``param.grad`` are views of its buckets: one gradient copy, not two."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    wrapped = DDP(model, gradient_as_bucket_view=True)
    return Trainer(*_plain(model, _adamw(model.parameters()), wrapped))


def torch_zero1(model: GPT) -> Trainer:
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    opt = ZeroRedundancyOptimizer(
        model.parameters(), optimizer_class=torch.optim.AdamW, lr=LR, weight_decay=0.0
    )
    return Trainer(*_plain(model, opt, DDP(model)))


def fsdp2(model: GPT) -> Trainer:
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return Trainer(*_plain(model, _adamw(model.parameters())))


def deepspeed(stage: int) -> Callable[[GPT], Trainer]:
    def build(model: GPT) -> Trainer:
        import deepspeed as ds

        config = {
            "train_micro_batch_size_per_gpu": MICRO_BATCH,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": 0.0,
            "zero_optimization": {"stage": stage},
            "steps_per_print": 10**9,
        }
        engine, opt, _, _ = ds.initialize(
            model=model, optimizer=_adamw(model.parameters()), config=config
        )
        return Trainer(
            *_engine_like(engine), lambda: _storage_bytes(_reachable(engine.module, opt))
        )

    return build


SYSTEMS: dict[str, tuple[int, Callable[[GPT], Trainer]]] = {
    "zero0": (0, ours(0)),
    "zero1": (1, ours(1)),
    "zero2": (2, ours(2)),
    "zero3": (3, ours(3)),
    # The same with collectives through shared memory (every rank on this host).
    "zero0-shm": (0, ours(0, "shm")),
    "zero1-shm": (1, ours(1, "shm")),
    "zero2-shm": (2, ours(2, "shm")),
    "zero3-shm": (3, ours(3, "shm")),
    # Handing freed heap pages back to the system (trim_host_memory).
    "zero0-trim": (0, ours(0, trim_host_memory=True)),
    "zero3-trim": (3, ours(3, trim_host_memory=True)),
    "ddp": (0, ddp),
    "ddp-view": (0, ddp_bucket_view),
    "torch_zero1": (1, torch_zero1),
    "fsdp2": (3, fsdp2),
    "deepspeed1": (1, deepspeed(1)),
    "deepspeed2": (2, deepspeed(2)),
    "deepspeed3": (3, deepspeed(3)),
}
"""name -> (ZeRO stage it is compared at, builder)."""


def run_system(name: str, model_name: str, steps: int, warmup: int) -> dict:
    """Train ``warmup + steps`` steps on this rank; time the last ``steps``."""
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = MODELS[model_name]
    torch.manual_seed(0)
    model = GPT(cfg)
    psi = sum(p.numel() for p in model.parameters())
    trainer = SYSTEMS[name][1](model)
    data = SyntheticTokens(cfg.vocab_size, cfg.seq_len, seed=1)
    times, losses, volume0, state_bytes = [], [], None, 0
    for step in range(warmup + steps):
        if step == warmup:
            volume0 = trainer.comm_volume()
        x, y = micro_batch(data, step, 0, MICRO_BATCH, rank, world)
        dist.barrier()
        t0 = time.perf_counter()
        losses.append(trainer.backward(x, y))
        if step == warmup + steps - 1:
            t_measure = time.perf_counter()
            state_bytes = trainer.model_state_bytes()
            t0 += time.perf_counter() - t_measure  # not part of the step
        trainer.update()
        times.append(time.perf_counter() - t0)
    volume1 = trainer.comm_volume()
    per_step = None if volume1 is None or volume0 is None else (volume1 - volume0) / steps
    return {
        "system": name,
        "times": times[warmup:],
        "losses": losses,
        "psi": psi,
        "model_state_bytes": state_bytes,
        "comm_elements_per_step": per_step,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "tokens_per_step": MICRO_BATCH * cfg.seq_len * world,
    }


def run_pair(names: list[str], model_name: str, steps: int, warmup: int) -> dict:
    """Build several systems in the same ranks and step them in rotation.

    Each step every system trains on the same batch; the order rotates from step to
    step. Drift of a shared machine then hits all systems alike, and the ratio of two
    systems' times within one rotation is a robust estimate of their speed ratio.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = MODELS[model_name]
    trainers = {}
    for name in names:
        torch.manual_seed(0)
        trainers[name] = SYSTEMS[name][1](GPT(cfg))
    data = SyntheticTokens(cfg.vocab_size, cfg.seq_len, seed=1)
    times: dict[str, list[float]] = {n: [] for n in names}
    losses: dict[str, list[float]] = {n: [] for n in names}
    for step in range(warmup + steps):
        x, y = micro_batch(data, step, 0, MICRO_BATCH, rank, world)
        shift = step % len(names)
        for name in names[shift:] + names[:shift]:
            dist.barrier()
            t0 = time.perf_counter()
            losses[name].append(trainers[name].backward(x, y))
            trainers[name].update()
            if step >= warmup:
                times[name].append(time.perf_counter() - t0)
    return {"times": times, "losses": losses}
