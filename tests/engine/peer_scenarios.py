"""Recovery from peers' host copies, run inside spawned ranks (see zeroservice.launch).

A rank "dies" by returning early; the survivors destroy the old process group and form
a new one on a fresh FileStore, as a caller would after a failure."""

from __future__ import annotations

import gc
import threading
import time
import weakref
from pathlib import Path

import torch
import torch.distributed as dist

import zeroservice
from tests.checkpoint.scenarios import _train
from tests.engine.scenarios import Spec, _batches, _model, engine_for
from zeroservice.checkpoint import PeersIncomplete, peers
from zeroservice.checkpoint.manifest import step_dir_name
from zeroservice.checkpoint.peers import ALIGN
from zeroservice.checkpoint.save import per_element_kinds, snapshot_items
from zeroservice.interrupt import CommInterrupted


def host(k: int) -> dict:
    return {"redundancy": "host-copy", "redundancy_interval": k}


def _engine(spec: Spec, variant: str, restored: bool = False, **config):
    """``variant`` "frozen": the GPT with its position embedding frozen and a persistent
    buffer (which ``_tick`` changes every step), so both must come back too.
    ``restored``: built as a re-forming rank builds it, without initial weights
    (``zeroservice.RESTORED``)."""
    if restored:
        with zeroservice.deferred_init():
            model = _model(spec)
    else:
        model = _model(spec)
    if variant == "frozen":
        model.wpe.requires_grad_(False)
        model.register_buffer("ticks", torch.zeros(5))
    init = zeroservice.RESTORED if restored else None
    return engine_for(spec, model=model, init=init, **config)


def _tick(engine) -> None:
    if hasattr(engine.module, "ticks"):
        with torch.no_grad():
            engine.module.ticks += 1


def captured(engine) -> dict:
    """Everything a restore must reproduce, cloned: masters, every optimizer state,
    hyperparameters, counters, the published parameters and the RNG."""
    opt = engine.optimizer.optimizer
    masters = list(engine.optimizer.masters)
    return {
        "masters": [m.detach().clone() for m in masters],
        "states": [
            {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in opt.state[m].items()}
            for m in masters
        ],
        "groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
        "counters": (engine.global_steps, engine.applied_steps),
        "params": {k: v.clone() for k, v in engine.state_dict().items()},
        "frozen": [u.flat.clone() for u in engine.units if u.frozen],
        "rng": torch.get_rng_state(),
    }


def differences(a: dict, b: dict, rng: bool = True) -> list[str]:
    """Where two captures differ (torch.equal: exact)."""
    out = []

    def same(x, y) -> bool:
        if isinstance(x, torch.Tensor):
            return isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)
        return x == y

    for i, (x, y) in enumerate(zip(a["masters"], b["masters"], strict=True)):
        if not same(x, y):
            out.append(f"master {i}")
    for i, (x, y) in enumerate(zip(a["states"], b["states"], strict=True)):
        if x.keys() != y.keys():
            out.append(f"optimizer state keys {i}: {sorted(x)} vs {sorted(y)}")
        out += [f"optimizer state {i} {k}" for k in x if k in y and not same(x[k], y[k])]
    for key in ("groups", "counters"):
        if a[key] != b[key]:
            out.append(f"{key}: {a[key]} vs {b[key]}")
    out += [f"param {k}" for k in a["params"] if not same(a["params"][k], b["params"][k])]
    out += [
        f"frozen {i}"
        for i, (x, y) in enumerate(zip(a["frozen"], b["frozen"], strict=True))
        if not same(x, y)
    ]
    if rng and not same(a["rng"], b["rng"]):
        out.append("rng")
    return out


def own_bytes(engine) -> int:
    """Bytes of this rank's packed copy, computed from the items it checkpoints."""
    state = engine._sharded_state()
    if state.whole:
        state.rank = 0  # stage 0: every rank copies the whole state, as rank 0 writes it
    kinds, _ = per_element_kinds(state)
    items = snapshot_items(state, kinds, copy=False)
    return sum(-(-t.numel() * t.element_size() // ALIGN) * ALIGN for _, t in items)


def _ledger(engine, op: str) -> int:
    stats = engine.comm_ledger().entries.get((op, "redundancy"))
    return stats.payload_bytes if stats is not None else 0


_LEFT: list = []
"""Groups left, kept referenced as a rank actor keeps them ([Note: groups left are
kept] in workers/rank.py): the last reference of a gloo group dropped while an abandoned
collective occupies its worker thread joins that thread, until the group's timeout."""


def _rejoin(survivors: list[int], old_rank: int, store: str) -> None:
    _LEFT.append(dist.group.WORLD)
    dist.destroy_process_group()
    dist.init_process_group(
        "gloo",
        store=dist.FileStore(store, len(survivors)),
        rank=survivors.index(old_rank),
        world_size=len(survivors),
    )


def _compare(
    spec: Spec,
    k: int,
    held,
    root: str,
    step: int,
    more: int,
    variant: str = "plain",
    original: dict | None = None,
    release: bool = False,
) -> dict:
    """Restore from ``held`` on a new engine; load ``step`` from disk on another; both
    train ``more`` steps. Returns the differences and both runs' losses. The RNG is
    compared except at stage 0, where no copy of a lost rank's generators exists, and
    on a newcomer. ``original``: the capture of the engine that held the state, at the
    same world size: the restored engine must equal it too, every element (the restored
    and the loaded engine could agree on something else). ``release``: the restore
    lets go of ``held``; "alive_at_refresh" counts, each time the new engine takes a
    host copy (its first: inside the restore), the held tensors still alive."""
    restored = _engine(spec, variant, restored=True, **host(k))
    spent = _tensor_refs(held) if release else []
    alive_at_refresh: list[int] = []
    if release:
        refresh = restored.host_copies.refresh

        def watched(state):
            alive_at_refresh.append(sum(r() is not None for r in spent))
            refresh(state)

        restored.host_copies.refresh = watched
    with torch.no_grad():  # frozen weights too must come from the peers
        for unit in restored.units:
            if unit.frozen:
                unit.flat.normal_()
    refused = []
    x, y = _batches(spec, 0)[0]
    for call in (lambda: restored(x, y), lambda: restored.save_checkpoint(root + "-never")):
        try:
            call()
        except RuntimeError as exc:
            refused.append("RESTORED" in str(exc))
    result = restored.restore_from_peers(held, release=release)
    load = restored.comm_ledger().entries.get(("recv", "load"))
    mine = captured(restored)
    loaded = _engine(spec, variant, **host(k))
    disk = loaded.load_checkpoint(Path(root) / step_dir_name(step))
    ref = captured(loaded)
    start = result.step
    sent = _ledger(restored, "send")
    losses = _train(restored, spec, range(start, start + more))
    ref_losses = _train(loaded, spec, range(start, start + more))
    return {
        "refused_before": refused,
        "held_after": restored.memory_ledger().redundancy_host,
        "snapshot_after": restored.peer_snapshot() is not None,
        "sent_after": _ledger(restored, "send") - sent,
        "step": result.step,
        "disk_step": disk.step,
        "path": str(result.path),
        # A newcomer (holding nothing) has no old rank's generators to take: its own
        # stay as its construction left them, which differs between the two builds.
        "diffs": differences(mine, ref, rng=spec.stage != 0 and held is not None),
        "vs_original": differences(mine, original, rng=False) if original is not None else [],
        "ticks": mine["params"]["ticks"].tolist() if "ticks" in mine["params"] else None,
        "frozen_units": len(mine["frozen"]),
        "losses": losses,
        "ref_losses": ref_losses,
        "load_received": (load.calls, load.payload_bytes) if load is not None else (0, 0),
        "spent": len(spent),
        "alive_at_refresh": alive_at_refresh,
        "covers_after": sorted(_copies_of(held)),
    }


def _copies_of(held) -> list[int]:
    """The old ranks ``held`` still covers."""
    return [r for snapshot in peers.snapshots_of(held) for r in snapshot.copies]


def _tensor_refs(held) -> list[weakref.ref]:
    """Weak references to every tensor ``held`` refers to (and the bases of views)."""
    tensors = []
    for snapshot in peers.snapshots_of(held):
        for copy in snapshot.copies.values():
            own = [copy.data] if isinstance(copy, peers.HeldCopy) else list(copy.tensors)
            tensors += own + [t._base for t in own if t._base is not None]
    return [weakref.ref(t) for t in tensors]


def shrink(
    spec: Spec,
    k: int,
    leave: list[int],
    root: str,
    store: str,
    save_at: list[int],
    steps: int,
    variant: str = "plain",
    direct_bytes: int | None = None,
    release: bool = False,
) -> dict:
    """Train ``steps`` with host copies (and disk saves at ``save_at``); the ranks in
    ``leave`` die; the rest restore from peers at the new world size. ``direct_bytes``:
    as in ``grow``; ``release``: as in ``_compare`` (the old engine dropped first)."""
    if direct_bytes is not None:
        peers.DIRECT_BYTES = direct_bytes
    old_rank, world = dist.get_rank(), dist.get_world_size()
    engine = _engine(spec, variant, **host(k))
    ledger = []
    for step in range(steps):
        sent, received = _ledger(engine, "send"), _ledger(engine, "recv")
        _tick(engine)
        _train(engine, spec, range(step, step + 1))
        if step + 1 in save_at:
            engine.save_checkpoint(root, keep=10)
        # Looked at, not handed out: the refreshes write into the spare's buffers.
        snap = engine.host_copies.held
        assert snap is not None or (step + 1) % k
        neighbour_bytes: list = [None] * world
        dist.all_gather_object(neighbour_bytes, own_bytes(engine))
        ledger.append(
            {
                "step": step + 1,
                "held": engine.memory_ledger().redundancy_host,
                "psi": engine.memory_ledger().psi,
                "psi_padded": engine.memory_ledger().psi_padded,
                "world": engine.dp_world,
                "held_copies": snap.nbytes if snap else 0,
                "snap_step": snap.step if snap else None,
                "copies": sorted(snap.copies) if snap else [],
                "own": own_bytes(engine),
                "neighbour": neighbour_bytes[(old_rank + 1) % world],
                "sent": _ledger(engine, "send") - sent,
                "received": _ledger(engine, "recv") - received,
                "snap_sent": snap.sent_bytes if snap else None,
                "own_copy": snap.copies[old_rank].nbytes if snap else None,
                "spare": engine.memory_ledger().redundancy_spare,
                "buffers": sorted(c.data.data_ptr() for c in snap.copies.values()) if snap else [],
            }
        )
    held = engine.peer_snapshot()
    engine.close()
    if release:
        del engine, snap
        gc.collect()
    if old_rank in leave:
        dist.destroy_process_group()
        return {"left": True, "ledger": ledger}
    survivors = [r for r in range(world) if r not in leave]
    _rejoin(survivors, old_rank, store)
    out = {"left": False, "ledger": ledger}
    expect = held.step if held is not None else 0
    try:
        return out | _compare(spec, k, held, root, expect, 2, variant, release=release)
    except PeersIncomplete as exc:
        return out | {"incomplete": str(exc)}


def handed_out(steps: int) -> dict:
    """A copy handed out by ``peer_snapshot`` is never written again, while the
    refreshes after it still take copies; once the caller drops it, the spare forms
    again."""
    spec = Spec(stage=2)
    engine = engine_for(spec, **host(1))
    _train(engine, spec, range(1))
    snap = engine.peer_snapshot()
    assert snap is not None
    kept = {r: c.data.clone() for r, c in snap.copies.items()}
    _train(engine, spec, range(1, 1 + steps))
    unchanged = all(torch.equal(snap.copies[r].data, kept[r]) for r in kept)
    current = engine.host_copies.held
    ours = {c.data.data_ptr() for c in snap.copies.values()}
    out = {
        "unchanged": unchanged,
        "snap_step": snap.step,
        "step_now": current.step,
        "shared": bool(ours & {c.data.data_ptr() for c in current.copies.values()}),
        "spare_while_kept": engine.memory_ledger().redundancy_spare,
    }
    del snap, current
    _train(engine, spec, range(1 + steps, 3 + steps))
    ledger = engine.memory_ledger()
    return out | {"spare_after": ledger.redundancy_spare, "held": ledger.redundancy_host}


def wait_for_flag(flag: str) -> None:
    """A silent peer's wait (bounded): its exit must not end the others' wait."""
    deadline = time.monotonic() + 120
    while not Path(flag).exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def interrupted_during(engine, reason: str, train) -> str | None:
    """Run ``train()`` while another thread calls ``engine.interrupt(reason)`` after
    0.5 s; what it raised, as ``Type: message`` (None if nothing)."""
    timer = threading.Timer(0.5, engine.interrupt, args=(reason,))
    timer.start()
    try:
        train()
        return None
    except CommInterrupted as exc:
        return f"CommInterrupted: {exc}"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        timer.join()


def interrupted(spec: Spec, root: str, store: str, flag: str, steps: int) -> dict:
    """Rank 2 stops taking part after ``steps`` steps but stays alive (its process
    would be killed; on gloo a transfer it left half sent never fails): the others are
    blocked in the next step's collectives until another thread calls
    ``Engine.interrupt``. They must raise CommInterrupted, close the engine with its
    transfers still in flight, form a new group and restore from the host copies.
    Rank 2 waits for ``flag`` (bounded) so that its exit cannot end their wait."""
    old_rank = dist.get_rank()
    engine = _engine(spec, "plain", **host(1))
    _train(engine, spec, range(steps))
    engine.save_checkpoint(root, keep=10)
    if old_rank == 2:
        wait_for_flag(flag)
        return {"left": True}
    raised = interrupted_during(
        engine, "rank 2 lost", lambda: _train(engine, spec, range(steps, steps + 1))
    )
    held = engine.peer_snapshot()
    engine.close()  # its ring or waiter thread is still inside a transfer
    _rejoin([0, 1], old_rank, store)
    Path(flag).with_suffix(f".{old_rank}").touch()
    if all(Path(flag).with_suffix(f".{r}").exists() for r in (0, 1)):
        Path(flag).touch()
    assert held is not None
    return {"left": False, "raised": raised} | _compare(spec, 1, held, root, steps, 2)


def lost_neighbours(spec: Spec, leave: list[int], store: str, steps: int) -> dict:
    """Adjacent ranks die: the survivors' copies miss one of them. Every survivor must
    raise PeersIncomplete and leave the new engine as it was."""
    old_rank, world = dist.get_rank(), dist.get_world_size()
    engine = engine_for(spec, **host(1))
    _train(engine, spec, range(steps))
    held = engine.peer_snapshot()
    engine.close()
    if old_rank in leave:
        dist.destroy_process_group()
        return {"left": True}
    _rejoin([r for r in range(world) if r not in leave], old_rank, store)
    fresh = engine_for(spec, **host(1))
    before = captured(fresh)
    try:
        fresh.restore_from_peers(held)
        error = None
    except PeersIncomplete as exc:
        error = str(exc)
    return {"left": False, "error": error, "diffs": differences(before, captured(fresh))}


def grow(
    spec: Spec, root: str, steps: int, direct_bytes: int | None = None, lend: bool = False
) -> dict:
    """Ranks 0 and 1 train on a group of their own (no redundancy) and hand their state
    to a 3-rank engine that includes newcomer rank 2 (holding None). ``direct_bytes``
    overrides peers.DIRECT_BYTES (this model's slices are all below the default);
    ``lend``: the old engines lend their tensors (``snapshot_now(lend=True)``), and are
    closed and dropped before the new engine is built."""
    if direct_bytes is not None:
        peers.DIRECT_BYTES = direct_bytes
    rank = dist.get_rank()
    old_group = dist.new_group([0, 1])
    held, ledger = None, None
    if rank < 2:
        engine = engine_for(spec, group=old_group)
        for step in range(steps):
            x, y = _batches(spec, step)[0]
            engine.backward(engine(x, y))
            engine.step()
        engine.save_checkpoint(root)
        held = engine.snapshot_now(lend=lend)
        own = held.copies[held.own]
        engine_storages = {m.untyped_storage().data_ptr() for m in engine.optimizer.masters}
        ledger = {
            "held": engine.memory_ledger().redundancy_host,
            "tags": sorted({tag for _, tag in engine.comm_ledger().entries}),
            "lent": isinstance(own, peers.LentCopy),
            # Lent: the masters' segments are the engine's own storage, not copies.
            "shared": [
                t.untyped_storage().data_ptr() in engine_storages
                for seg, t in zip(own.segments, own.tensors, strict=True)
                if seg["kind"] == "master"
            ]
            if lend
            else [],
        }
        engine.close()
        del engine
        gc.collect()
    return {"ledger": ledger} | _compare(spec, 1, held, root, steps, 2)


def reform_from_lent(spec: Spec, root: str, steps: int, release: bool = False) -> dict:
    """Every rank lends its engine's state, closes and drops the engine, and a new
    engine of the same group restores from the lent tensors (every stage: stage 3's
    closed engine keeps its shards). ``release``: as in ``_compare``."""
    engine = engine_for(spec)
    _train(engine, spec, range(steps))
    engine.save_checkpoint(root)
    original = captured(engine)
    held = engine.snapshot_now(lend=True)
    engine.close()
    del engine
    gc.collect()
    return _compare(spec, 1, held, root, steps, 2, original=original, release=release)


def snapshot_mid_accumulation() -> list[str]:
    spec = Spec(stage=2, accum=2)
    engine = engine_for(spec, **host(1))
    x, y = _batches(spec, 0)[0]
    engine.backward(engine(x, y))
    engine.step()
    out = []
    for call in (engine.snapshot_now, lambda: engine.restore_from_peers(None)):
        try:
            call()
            out.append("ok")
        except RuntimeError as exc:
            out.append(f"{type(exc).__name__}: {exc}")
    return out


def cut_refresh(spec: Spec, root: str, store: str, steps: int, spare: bool) -> dict:
    """World 3: rank 2 is lost during the refresh after step ``steps``, which rank 1
    completed (its copies: steps ``steps`` and the one before) and rank 0 did not (it
    passes its copies as they stood one step earlier). Neither step's last copies
    cover every old rank, but with ``spare`` (Engine.peer_snapshots) the step before
    is covered: rank 0's last copy and rank 1's spare. A checkpoint of that step is
    the reference."""
    old_rank = dist.get_rank()
    engine = engine_for(spec, **host(1))

    def copies():
        return engine.peer_snapshots() if spare else engine.peer_snapshot()

    _train(engine, spec, range(steps - 1))
    engine.save_checkpoint(root, keep=10)
    earlier = copies() if old_rank == 0 else None
    _train(engine, spec, range(steps - 1, steps))
    held = earlier if old_rank == 0 else copies()
    engine.close()
    if old_rank == 2:
        dist.destroy_process_group()
        return {"left": True}
    _rejoin([0, 1], old_rank, store)
    try:
        return {"left": False} | _compare(spec, 1, held, root, steps - 1, 2)
    except PeersIncomplete as exc:
        return {"left": False, "error": str(exc)}
