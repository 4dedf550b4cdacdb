"""ZeRO++ scenarios that run inside each spawned rank (see zeroservice.launch).

Inputs are drawn from seeds every process knows, so the test process rebuilds every
rank's input and computes the exact reference itself.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tests.engine import scenarios as sc
from zeroservice import comm
from zeroservice.zeropp import (
    Scratch,
    build_node_groups,
    node_of,
    quantized_all_gather,
    quantized_reduce_scatter,
    shard_cuts,
)

BLOCK = 64


def rank_input(rank: int, numel: int) -> torch.Tensor:
    """Rank ``rank``'s input: random blocks of varied scale, and one block of zeros."""
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(numel, generator=g) * torch.rand(numel, generator=g).pow(3) * 10
    x[BLOCK : 2 * BLOCK] = 0
    return x


def collectives(numel: int, bits: int, ranks_per_node: int | None) -> dict:
    """qwZ all-gather and qgZ reduce-scatter of ``rank_input`` on the world group."""
    world, rank = dist.get_world_size(), dist.get_rank()
    ledger = comm.CommLedger()
    nodes = [node_of(r, ranks_per_node) for r in range(world)]
    c = comm.Communicator(None, ledger, "auto", nodes=nodes)
    scratch = Scratch()
    x = rank_input(rank, numel)
    shard = x.view(world, -1)[rank].clone()
    gathered = torch.empty(numel)
    quantized_all_gather(c, shard, gathered, BLOCK, scratch).wait()
    node = build_node_groups(None, ranks_per_node, ledger, "auto") if ranks_per_node else None
    buffer = x.clone()
    quantized_reduce_scatter(c, buffer, bits, BLOCK, scratch, node).wait()
    out = {
        "gathered": gathered,
        "reduced": c.chunk(buffer).clone(),
        "entries": ledger.as_list(),
        "scratch_left": scratch.current,
        "scratch_peak": scratch.peak,
    }
    c.close()
    if node is not None:
        node.local.close()
        node.cross.close()
    return out


def train(config: dict, steps: int = 6, watch_block: bool = False) -> dict:
    """The tiny GPT at stage 3 with ``config``: losses, one step's ledger entries, the
    memory ledger between forward and backward, and (``watch_block``) the whole units of
    blocks[0] as its forward saw them, beside this rank's shards of them."""
    spec = sc.Spec(stage=3, persistence=0, bucket_elements=2**16)
    engine = sc.engine_for(spec, **config)
    seen: dict[int, torch.Tensor] = {}
    shards: dict[int, torch.Tensor] = {}
    g = engine.gatherer
    assert g is not None
    groups = zip(engine.layout.groups or [], g.groups, strict=True)
    block_units = next(idx for grp, idx in groups if grp.module is engine.module.blocks[0])

    def look(module, args):
        if not seen:
            for i in block_units:
                seen[i] = g._buffer(i).clone()

    handle = engine.module.blocks[0].register_forward_pre_hook(look) if watch_block else None
    losses, memory, entries = [], {}, []
    for step in range(steps):
        if step == 1:
            engine.comm_ledger().reset()
        for x, y in sc._batches(spec, step):
            if step == 0:
                shards = {i: engine.units[i].flat.clone() for i in block_units}
            loss = engine(x, y)
            if step == 1:
                memory = engine.memory_ledger().as_dict()
            engine.backward(loss)
            engine.step()
        if step == 1:
            entries = engine.comm_ledger().as_list()
        losses.append(sc.harness.mean_over_ranks(loss.item()))
    if handle is not None:
        handle.remove()
    return {
        "losses": losses,
        "entries": entries,
        "memory": memory,
        "after": engine.memory_ledger().as_dict(),
        "seen": seen,
        "shards": shards,
        "units": [(u.numel, u.padded_numel) for u in engine.units],
        "backward_units": sorted(set(g.plan.recorded(sc.Pass.BACKWARD))),
        "forward_units": sorted(set(g.plan.recorded(sc.Pass.FORWARD))),
        "psi_padded": sum(u.padded_numel for u in engine.units),
        "cuts": [shard_cuts(u) for u in engine.units],
    }


def train_all(configs: list[dict], steps: int) -> list[dict]:
    """``train`` for each config in turn (one spawn for all: start-up dominates)."""
    return [train(c, steps, watch_block=True) for c in configs]


def engine_error(config: dict) -> str:
    """The error an engine with ``config`` raises at construction."""
    try:
        sc.engine_for(sc.Spec(stage=3), **config)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def train_below_stage3(stage: int, config: dict, steps: int = 4) -> dict:
    """The tiny GPT at stage 1 or 2 with ``config``: losses and the last step's entries."""
    spec = sc.Spec(stage=stage, bucket_elements=2**16)
    engine = sc.engine_for(spec, **config)
    losses = []
    for step in range(steps):
        engine.comm_ledger().reset()
        for x, y in sc._batches(spec, step):
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
        losses.append(sc.harness.mean_over_ranks(loss.item()))
    return {
        "losses": losses,
        "entries": engine.comm_ledger().as_list(),
        "units": [u.padded_numel for u in engine.trainable_units],
    }
