"""Scenarios with model parallelism and activation checkpointing, run inside each rank.

The reference for MP = t × DP = d is MP = 1 × DP = t·d on the same seed: the tensor-
parallel GPT starts from exactly the unsplit model's weights (sliced initialisation)
and each DP rank's micro-batch is the union of the t ranks' micro-batches it replaces,
so the global batch and its mean loss are the same.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

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


def build(spec: MPSpec, restored: bool = False):
    """``restored``: built as a re-forming rank builds it, without initial weights."""
    topo = zeroservice.build_topology(spec.mp)
    torch.manual_seed(1234)
    cfg = GPTConfig(**TINY_MP, tie_weights=spec.tie)
    with zeroservice.deferred_init() if restored else contextlib.nullcontext():
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
        model,
        config,
        lambda ps: torch.optim.AdamW(ps, lr=3e-3, weight_decay=0.1),
        topology=topo,
        init=zeroservice.RESTORED if restored else None,
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


# -- live resize from peers' host copies, with model parallelism -------------------------


def _train_steps(spec: MPSpec, topo, engine, steps: range) -> list[float]:
    losses = []
    for step in steps:
        (x, y), *_ = batches(spec, topo, step)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _with_host_copies(spec: MPSpec) -> MPSpec:
    from tests.engine.peer_scenarios import host

    return dataclasses.replace(spec, engine={**spec.engine, **host(1)})


def _restore_and_compare(spec: MPSpec, held, root: str, rng: bool = True) -> dict:
    """Restore from ``held`` on an engine built as a re-forming rank builds it; load
    the newest checkpoint under ``root`` on another; both train 2 more steps. The
    differences, both runs' losses, and the steps restored and loaded."""
    from tests.engine.peer_scenarios import captured, differences

    topo, restored = build(spec, restored=True)
    try:
        result = restored.restore_from_peers(held)
    except Exception:  # PeersIncomplete, say: reported by the caller
        restored.close()
        raise
    mine = captured(restored)
    _, loaded = build(spec)
    disk = loaded.load_checkpoint(root)
    more = range(result.step, result.step + 2)
    return {
        "dp": topo.dp,
        "step": result.step,
        "disk_step": disk.step,
        "diffs": differences(mine, captured(loaded), rng=rng),
        "losses": _train_steps(spec, topo, restored, more),
        "ref_losses": _train_steps(spec, topo, loaded, more),
        "held_after": restored.memory_ledger().redundancy_host,
    }


def peer_shrink(
    spec: MPSpec, root: str, store: str, leave: int, stale_slice: int | None, spare: bool = False
) -> dict:
    """MP × DP with host copies trains ``spec.steps`` steps (a checkpoint after the
    last); the replica ``leave`` (its MP ranks) goes; the others re-form at one replica
    fewer and restore from host memory, then train 2 more steps beside an engine that
    loaded the checkpoint. ``stale_slice``: that MP slice's survivors pass the copies
    of one step before (as if their last refresh was cut short), and the checkpoint is
    of that step. ``spare``: the survivors offer the copy before their last too
    (``peer_snapshots``)."""
    from tests.engine.peer_scenarios import _rejoin
    from zeroservice.checkpoint import PeersIncomplete

    spec = _with_host_copies(spec)
    topo, engine = build(spec)

    def copies():
        return engine.peer_snapshots() if spare else engine.peer_snapshot()

    _train_steps(spec, topo, engine, range(spec.steps - 1))
    stale = stale_slice is not None and topo.mp_rank == stale_slice
    before = copies() if stale else None  # handed out: never written again
    if stale_slice is not None:
        engine.save_checkpoint(root, keep=5)
    _train_steps(spec, topo, engine, range(spec.steps - 1, spec.steps))
    if stale_slice is None:
        engine.save_checkpoint(root, keep=5)
    held = copies()
    ledger = engine.memory_ledger()
    kept = {"held_before": ledger.redundancy_host, "psi_padded": ledger.psi_padded}
    if stale:
        held = before
    engine.close()
    world, rank = dist.get_world_size(), dist.get_rank()
    if rank // spec.mp == leave:
        dist.destroy_process_group()
        return {"left": True} | kept
    _rejoin([r for r in range(world) if r // spec.mp != leave], rank, store)
    try:
        return {"left": False} | kept | _restore_and_compare(spec, held, root)
    except PeersIncomplete as exc:
        return {"left": False} | kept | {"error": str(exc)}


def peer_grow(spec: MPSpec, root: str, store: str) -> dict:
    """One replica (ranks 0..mp-1) trains with host copies and saves; a second replica
    joins; the first hands it its shards (``snapshot_now``), and both equal an engine
    that loaded the checkpoint at the larger world, then train alike."""
    spec = _with_host_copies(spec)
    world, rank = dist.get_world_size(), dist.get_rank()
    dist.destroy_process_group()
    held = None
    if rank < spec.mp:  # the first replica alone
        dist.init_process_group(
            "gloo", store=dist.FileStore(store + "-one", spec.mp), rank=rank, world_size=spec.mp
        )
        topo, engine = build(spec)
        _train_steps(spec, topo, engine, range(spec.steps))
        engine.save_checkpoint(root, keep=5)
        held = engine.snapshot_now()
        engine.close()
        dist.destroy_process_group()
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    # A newcomer has no old rank's generators to take (as at MP 1).
    return _restore_and_compare(spec, held, root, rng=held is not None)


def interrupted_mp(spec: MPSpec, flag: str) -> dict:
    """MP 2, DP 1: rank 1 stops taking part after a step but stays alive; rank 0's
    next forward waits in a tensor-parallel all-reduce until another thread calls
    ``Engine.interrupt``, then raises CommInterrupted. Closing the engine hands the
    model's MP communicators back (no Interrupt). Rank 1 waits for ``flag`` (bounded)
    so that its exit cannot end rank 0's wait."""
    from pathlib import Path

    from tests.engine.peer_scenarios import interrupted_during, wait_for_flag

    topo, engine = build(spec)
    _train_steps(spec, topo, engine, range(1))
    groups = [getattr(m, "mp", None) for m in engine.module.modules()]
    model_comms = list({id(g): g.comm for g in groups if isinstance(g, MPGroup)}.values())
    attached = all(c.interrupt is not None for c in model_comms)
    if topo.mp_rank == 1:
        wait_for_flag(flag)
        return {"left": True}
    raised = interrupted_during(
        engine, "rank 1 lost", lambda: _train_steps(spec, topo, engine, range(1, 2))
    )
    engine.close()
    Path(flag).touch()
    return {
        "left": False,
        "raised": raised,
        "attached": attached and len(model_comms) > 0,
        "detached": all(c.interrupt is None for c in model_comms),
    }


def save_for_export(spec: MPSpec, root: str) -> dict:
    """Train ``spec.steps`` steps, save, then the loss of the next batch in eval mode:
    what the whole model built from the exported file must compute on the same batch."""
    topo, engine = build(spec)
    for step in range(spec.steps):
        (x, y), *_ = batches(spec, topo, step)
        engine.backward(engine(x, y))
        engine.step()
    engine.save_checkpoint(root)
    (x, y), *_ = batches(spec, topo, spec.steps)
    engine.eval()
    with torch.no_grad():
        loss = engine(x, y).item()
    engine.close()
    return {"loss": loss, "x": x, "y": y, "dp_rank": topo.dp_rank}
