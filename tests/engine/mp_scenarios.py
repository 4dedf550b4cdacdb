"""Scenarios with model parallelism and activation checkpointing, run inside each rank.

The reference for MP = t × DP = d is MP = 1 × DP = t·d on the same seed: the tensor-
parallel GPT starts from exactly the unsplit model's weights (sliced initialisation)
and each DP rank's micro-batch is the union of the t ranks' micro-batches it replaces,
so the global batch and its mean loss are the same.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

import zeroservice
from tests.engine import harness
from zeroservice.config import ZeroConfig
from zeroservice.data import SyntheticTokens, micro_batch
from zeroservice.models import GPT, GPTConfig
from zeroservice.tensor_parallel import MPGroup

TINY_MP = dict(vocab_size=512, seq_len=32, n_layer=2, n_head=4, dim=64)


@dataclass
class MPSpec:
    stage: int
    mp: int
    steps: int = 8
    accum: int = 1
    clip: float = 0.0
    batch: int = 2
    """Samples per micro-batch of a rank at MP = 1 (a DP rank at MP = t takes t of them)."""
    precision: str = "fp32"
    tie: bool = True
    engine: dict = field(default_factory=dict)
    """Extra ZeroConfig fields (activation checkpointing, offload, buckets...)."""


def build(spec: MPSpec):
    topo = zeroservice.build_topology(spec.mp)
    torch.manual_seed(1234)
    cfg = GPTConfig(**TINY_MP, tie_weights=spec.tie)
    model = GPT(cfg, MPGroup(topo.mp_group) if spec.mp > 1 else None)
    config = ZeroConfig(
        stage=spec.stage,
        precision=spec.precision,
        gradient_accumulation_steps=spec.accum,
        gradient_clipping=spec.clip,
        bucket_elements=20_000,
        **spec.engine,
    )
    engine = zeroservice.initialize(
        model, config, lambda ps: torch.optim.AdamW(ps, lr=3e-3, weight_decay=0.1), topology=topo
    )
    return topo, engine


def batches(spec: MPSpec, topo, step: int):
    data = SyntheticTokens(TINY_MP["vocab_size"], TINY_MP["seq_len"], seed=7)
    return [
        micro_batch(data, step, m, spec.batch * spec.mp, topo.dp_rank, topo.dp, spec.accum)
        for m in range(spec.accum)
    ]


def train(specs: list[MPSpec]) -> list[dict]:
    """Per-step losses (mean over DP ranks) and gradient norms."""
    out = []
    for spec in specs:
        topo, engine = build(spec)
        losses, norms = [], []
        for step in range(spec.steps):
            total = 0.0
            for x, y in batches(spec, topo, step):
                loss = engine(x, y)
                engine.backward(loss)
                report = engine.step()
                total += loss.item() / spec.accum
            losses.append(harness.mean_over_ranks(total, topo.dp_group))
            norms.append(report.grad_norm)
        ledger = engine.memory_ledger()
        engine.close()
        out.append({"losses": losses, "norms": norms, "ledger": ledger.as_dict()})
    return out


def gradients(specs: list[MPSpec]) -> list[dict]:
    """One step: activation bytes after forward, the reduced gradient shards, losses."""
    out = []
    for spec in specs:
        topo, engine = build(spec)
        acts, grads, losses = [], [], []
        for step in range(spec.steps):
            (x, y), *_ = batches(spec, topo, step)
            loss = engine(x, y)
            ledger = engine.memory_ledger()
            acts.append((ledger.activations, ledger.activations_host))
            engine.backward(loss)
            if step == 0:
                grads = [g.detach().clone() for g in engine.reducer.grad_shards()]
                storages = {g.untyped_storage().data_ptr() for g in engine.reducer.grad_shards()}
            engine.step()
            losses.append(loss.item())
        ledger = engine.memory_ledger()
        store = engine.activations
        out.append(
            {
                "activations": acts,
                "grads": grads,
                "losses": losses,
                "input_bytes": x.shape[0] * x.shape[1] * TINY_MP["dim"] * 4,
                "ledger": ledger.as_dict(),
                "overflows": store.overflows if store else None,
                "arena_allocations": store.arena_allocations if store else None,
                "saved": store.saved if store else None,
                "grad_storages": len(storages),
            }
        )
        engine.close()
    return out


def save_and_resume(spec: MPSpec, root: str, save_at: int) -> dict:
    """Train ``spec.steps`` steps saving after ``save_at``; then a fresh engine (other
    weights) loads the checkpoint and trains the remaining steps."""
    topo, engine = build(spec)
    losses, saved_state = [], None
    for step in range(spec.steps):
        (x, y), *_ = batches(spec, topo, step)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if step + 1 == save_at:
            engine.save_checkpoint(root, client_state={"step": step + 1})
            saved_state = {k: v.clone() for k, v in engine.state_dict().items()}
    engine.close()
    torch.manual_seed(99)
    _, resumed = build(spec)
    result = resumed.load_checkpoint(root)
    after = []
    for step in range(result.client_state["step"], spec.steps):
        (x, y), *_ = batches(spec, topo, step)
        loss = resumed(x, y)
        resumed.backward(loss)
        resumed.step()
        after.append(loss.item())
    resumed.close()
    return {"losses": losses, "resumed": after, "state": saved_state, "step": result.step}


def load_state(spec: MPSpec, root: str) -> dict:
    """Load ``root`` into a fresh engine; its full state and the load's step."""
    _, engine = build(spec)
    try:
        result = engine.load_checkpoint(root)
    except Exception as exc:  # reported to the test, which checks the message
        engine.close()
        return {"error": f"{type(exc).__name__}: {exc}"}
    state = {k: v.clone() for k, v in engine.state_dict().items()}
    engine.close()
    return {"state": state, "step": result.step}
