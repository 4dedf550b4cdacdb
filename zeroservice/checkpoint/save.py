"""Sharded save: every rank writes only what it owns; rank 0 commits with the manifest.

Stage 0 keeps whole masters on every rank, so only rank 0 writes them; at stages 1-3
each rank writes its shards. Nothing is written twice. Parameters in the training
dtype are not saved: they are the masters, cast.

[Note: failed save]
A save fails as a whole or commits as a whole. A rank whose write fails (ENOSPC,
EIO) removes its temporary file and reports the error through the same all-gather
that collects the segments, so no rank waits in a collective for one that gave up;
rank 0 commits (writes the manifest) only when every rank wrote, and its verdict,
shared with every rank, is the save's closing barrier. On a failure rank 0 removes
the step directory, every rank raises SaveFailed, and the newest complete
checkpoint is the one before: a later save tries again.

A step saved again (a save right after loading that step) must not lose the checkpoint
already committed there if it fails. So its rank files get new names beside the
committed ones, the new manifest replaces the old one atomically, and only then are
the old files removed; a failure removes the new files alone. (The step directory used
to be un-committed first and removed on the failure: the only checkpoint was gone.)

[Note: pruning]
After a commit, ``keep`` bounds the complete checkpoints: the newest ``keep`` up to the
one just committed stay (that one always), older ones go, and so do older step
directories an interrupted save left. Going means the files a save writes (the manifest
first, then rank files and temporary names), then the directory if nothing else is in
it. Never touched: the checkpoint just committed; directories of a higher step, which a
run that went back (a fall-back past corrupt checkpoints, a load of an older step) left
behind (a corrupt one may still be newest: a load from the root skips it and finds this
run's); directories whose name this engine does not write (``step-0``); files it does
not write. A resume from the root loads the highest step that is sound, so after going
back to an older step of one's own choosing, a sound higher step of the abandoned run
is what it would load: remove those, or save under another root.
"""

from __future__ import annotations

import base64
import errno
import json
import random
import re
import secrets
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from .files import CheckpointError, SaveFailed, atomic_file, fsync_dir, write_segment
from .layout import held_pieces
from .manifest import (
    FORMAT,
    MANIFEST,
    STEP_DIR,
    VERSION,
    candidates,
    read_manifest,
    step_dir_name,
    write_manifest,
)
from .state import ShardedState
from .storage import Location, Storage, Where, location, storage_for


def per_element_kinds(state: ShardedState) -> tuple[list[str], list[dict[str, Any]]]:
    """Optimizer state keys that are shard-sized (saved per element), and each param
    group's scalars.

    Read over every master, not the first alone: param groups may keep different state
    (SGD's momentum on the weights' group only, amsgrad on one group), and a key one
    group lacks would be dropped, or the save fail on it. A key is per element when its
    tensor has the master's shape, so a one-element shard's moments stay per element
    (a 0-dim ``step`` is a scalar). A master without a key saves zeros for it
    (``_state_tensor``), which the optimizers read only in the groups that keep it.

    Scalars are kept per group: some follow the group's hyperparameters (ASGD's ``eta``
    its lr, NAdam's ``mu_product`` its betas and momentum decay), and one value for
    every group resumed each group but one from another's. Within a group every master
    steps together, so its first master's values are the group's."""
    kinds: list[str] = []
    scalars: list[dict[str, Any]] = []
    for group in state.optimizer.param_groups:
        found: dict[str, Any] = {}
        for master in group["params"]:
            for key, value in state.optimizer.state.get(master, {}).items():
                per_element = isinstance(value, torch.Tensor) and value.dim() > 0
                if per_element and value.shape == master.shape:
                    if key not in kinds:
                        kinds.append(key)
                elif key in found or value is None:
                    continue
                elif isinstance(value, torch.Tensor):
                    found[key] = {
                        "value": value.item(),
                        "dtype": str(value.dtype).removeprefix("torch."),
                        "shape": list(value.shape),
                    }
                else:
                    found[key] = {"value": value}
        scalars.append(found)
    return kinds, [{k: v for k, v in found.items() if k not in kinds} for found in scalars]


def _state_tensor(state: ShardedState, unit_index: int, kind: str) -> torch.Tensor:
    unit = state.units[unit_index]
    if unit.frozen:  # its values, saved as fp32 like every master
        return unit.param_shard.float()
    master = state.masters[unit_index]
    if kind == "master":
        return master.detach()
    value = state.optimizer.state.get(master, {}).get(kind)
    return torch.zeros_like(master.detach()) if value is None else value


Item = tuple[dict[str, Any], torch.Tensor]
"""A segment's description and its data."""


def snapshot_items(state: ShardedState, kinds: list[str], copy: bool) -> list[Item]:
    """What this rank writes: its pieces of every kind (and rank 0: the buffers; every
    rank its own where ``state.rank_buffers``).

    ``copy``: host copies that training may not touch (for a background write)."""
    whole = state.whole
    items: list[Item] = []

    def add(meta: dict[str, Any], data: torch.Tensor) -> None:
        items.append((meta, data.detach().to("cpu", copy=True) if copy else data.detach()))

    if not whole or state.rank == 0:
        for piece in held_pieces(state.units, whole):
            for kind in ["master"] if piece.unit.frozen else ["master", *kinds]:
                data = _state_tensor(state, piece.unit.index, kind)
                meta = {"param": piece.slot.names[0], "kind": kind}
                n = piece.end - piece.start
                add(
                    meta | {"start": piece.start, "end": piece.end},
                    data[piece.local : piece.local + n],
                )
    if state.rank == 0 or state.rank_buffers:
        own: dict[str, Any] = {"rank": state.rank} if state.rank_buffers else {}
        for name, buffer in persistent_buffers(state.module):
            add(own | {"param": name, "kind": "buffer", "start": 0, "end": buffer.numel()}, buffer)
    return items


def write_items(path: Location, items: list[Item]) -> list[dict[str, Any]]:
    """One rank file, atomically (tmp, fsync, rename); returns its segments."""
    segments: list[dict[str, Any]] = []
    with atomic_file(path) as f:
        for meta, data in items:
            segments.append(write_segment(f, data) | meta | {"file": path.name})
    return segments


def write_rank_file(path: Location, state: ShardedState, kinds: list[str]) -> list[dict[str, Any]]:
    return write_items(path, snapshot_items(state, kinds, copy=False))


def persistent_buffers(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Each persistent buffer once, under its first name (see ``buffer_names``)."""
    return [(names[0], buffer) for names, buffer in buffer_names(module)]


def buffer_names(module: torch.nn.Module) -> list[tuple[list[str], torch.Tensor]]:
    """Each persistent buffer with every name it is registered under: one tensor that
    two modules register (a shared table) is saved once and exported under each name,
    as ``state_dict()`` holds it."""
    out: dict[int, tuple[list[str], torch.Tensor]] = {}
    for name, buffer in module.named_buffers(remove_duplicate=False):
        owner, _, local = name.rpartition(".")
        if local not in module.get_submodule(owner)._non_persistent_buffers_set:
            out.setdefault(id(buffer), ([], buffer))[0].append(name)
    return list(out.values())


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode()


def rng_state() -> dict[str, Any]:
    """This process's random generators, as plain JSON (nothing executable on load)."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else []
    return {
        "torch": _b64(torch.get_rng_state()),
        "cuda": [_b64(t) for t in cuda],
        "python": [version, list(internal), gauss],
        "numpy": [kind, np.asarray(keys).tolist(), pos, has_gauss, cached],
    }


def _params(state: ShardedState) -> list[dict[str, Any]]:
    return [
        {"name": s.names[0], "names": s.names, "shape": list(s.shape), "numel": s.numel}
        for u in state.units
        for s in u.slots
    ]


def check_savable(state: ShardedState, keep: int, client_state: Any = None) -> None:
    """Refuse, before anything is written, a save that cannot be a checkpoint."""
    if state.pending_micro_steps:
        raise CheckpointError(
            f"save: {state.pending_micro_steps} micro-batch(es) accumulated since the last "
            "step; "
            "save after engine.step() completes an optimizer step"
        )
    if keep < 1:
        raise CheckpointError(f"keep: must be >= 1, got {keep}")
    if client_state is not None:
        if not isinstance(client_state, dict):
            raise CheckpointError(
                f"client_state: expected a dict, got {type(client_state).__name__}"
            )
        try:
            json.dumps(client_state, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise CheckpointError(
                f"client_state: must be JSON (numbers, strings, lists, dicts; no NaN or "
                f"infinity): {exc}"
            ) from None


def save_checkpoint(
    state: ShardedState, root: Where, client_state: dict[str, Any] | None = None, keep: int = 3
) -> Location:
    """Write a checkpoint of ``state`` under ``root`` (every rank calls this); ``root``
    is a directory or an object-store URI (``s3://bucket/prefix``).

    See [Note: failed save]."""
    check_savable(state, keep, client_state)
    root = location(root)
    directory = root / step_dir_name(state.counters.global_steps)
    group, rank = state.group, state.rank
    failure = _attempt(rank == 0, "create the step directory", lambda: _open_step(directory))
    _agree(failure, directory, state)  # every rank goes on only once it exists
    kinds, scalars = per_element_kinds(state)
    name = rank_file_name(directory, rank)  # before rank 0 commits, after the all-gather
    report: dict[str, Any] = {"file": name}
    try:
        report["segments"] = write_rank_file(directory / name, state, kinds)
        report["bytes"] = storage_for(directory).size(directory / name)
        report["rng"] = rng_state()
    except OSError as exc:
        report["error"] = f"rank {rank}: {_oserror(exc)}"
    reports: list[Any] = [None] * state.world
    dist.all_gather_object(reports, report, group=group)
    errors = [r["error"] for r in reports if "error" in r]
    if rank == 0 and not errors:
        header = manifest_header(state, kinds, scalars, client_state)
        replaced = committed_files(directory)
        commit = lambda: write_manifest(directory, assemble(header, reports))  # noqa: E731
        failure = _attempt(True, "commit", commit)
        errors = [failure] if failure else []
        if not errors:
            remove_replaced(directory, replaced, reports)
            prune(root, keep, directory)
    written = [r["file"] for r in reports]
    _agree("; ".join(errors) or None, directory, state, written)
    return directory


def rank_file_name(directory: Location, rank: int) -> str:
    """A rank file's name; beside a checkpoint already committed in ``directory`` (the
    same step saved again), a new one (see [Note: failed save])."""
    if storage_for(directory).is_file(directory / MANIFEST):
        return f"rank-{rank:05d}.{secrets.token_hex(4)}.bin"
    return f"rank-{rank:05d}.bin"


def committed_files(directory: Location) -> list[str]:
    """The rank files of the checkpoint committed in ``directory`` (none: empty)."""
    try:
        return list(read_manifest(directory)["files"])
    except CheckpointError:
        return []


def remove_replaced(directory: Location, replaced: list[str], reports: list[dict]) -> None:
    """After a commit: the files of the checkpoint it replaced that it does not use."""
    for name in set(replaced) - {r["file"] for r in reports}:
        storage_for(directory).remove(directory / name)


def _open_step(directory: Location) -> None:
    store = storage_for(directory)
    store.make_dirs(directory)
    if isinstance(directory, Path):  # an object store has no directory entries to sync
        fsync_dir(directory)
        fsync_dir(directory.parent)  # the step directory's entry is durable too


def _attempt(mine: bool, what: str, action) -> str | None:
    """Run ``action`` if it is this rank's to run; an OSError becomes its description."""
    if not mine:
        return None
    try:
        action()
    except OSError as exc:
        return f"rank 0: {what}: {_oserror(exc)}"
    return None


def _oserror(exc: OSError) -> str:
    name = errno.errorcode.get(exc.errno or 0, "")
    return f"{name + ': ' if name else ''}{exc.strerror or exc}"


def _agree(
    failure: str | None,
    directory: Location,
    state: ShardedState,
    written: list[str] | None = None,
) -> None:
    """Every rank learns rank 0's verdict (this is also the save's barrier); on a
    failure rank 0 removes the step directory (where it holds a committed checkpoint,
    only the files this save ``written``) and every rank raises SaveFailed."""
    verdicts: list[Any] = [None] * state.world
    dist.all_gather_object(verdicts, failure, group=state.group)
    failed = verdicts[0]
    if failed is None:
        return
    if state.rank == 0:
        store = storage_for(directory)
        if store.is_file(directory / MANIFEST):
            for name in written or ():
                store.remove(directory / name)
        else:
            store.remove_tree(directory)
    raise SaveFailed(
        f"{directory}: save failed, the previous checkpoint stays the newest: {failed}"
    )


def assemble(header: dict[str, Any], reports: list[dict[str, Any]]) -> dict[str, Any]:
    """The manifest: the engine's description plus what every rank wrote."""
    return header | {
        "files": {r["file"]: r["bytes"] for r in reports},
        "segments": [seg for r in reports for seg in r["segments"]],
        "rng": [r["rng"] for r in reports],
    }


def manifest_header(state: ShardedState, kinds, scalars, client_state) -> dict[str, Any]:
    opt = state.optimizer
    groups = [
        {k: v for k, v in g.items() if k != "params" and isinstance(v, int | float | bool | tuple)}
        for g in opt.param_groups
    ]
    return {
        "format": FORMAT,
        "version": VERSION,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "step": state.counters.global_steps,
        "world_size": state.world,
        "dp": state.world,
        **state.description,
        "params": _params(state),
        "buffers": [
            {
                "name": names[0],
                "names": names,
                "dtype": str(b.dtype).removeprefix("torch."),
                "shape": list(b.shape),
                "numel": b.numel(),
            }
            for names, b in buffer_names(state.module)
        ],
        "kinds": ["master", *kinds],
        "optimizer": {
            "class": type(opt).__name__,
            "scalars": scalars,
            "param_groups": groups,
            "base_lrs": list(state.base_lrs),
        },
        "engine": asdict(state.counters),
        "client_state": client_state or {},
    }


def prune(root: Where, keep: int, committed: Location) -> list[Location]:
    """Keep the newest ``keep`` complete checkpoints up to the one just ``committed``;
    drop older ones and older leftovers of interrupted saves. See [Note: pruning]."""
    removed, complete = [], 0
    store = storage_for(location(root))
    named = STEP_DIR.match(committed.name)
    step = int(named.group(1)) if named else None
    for path in candidates(root):
        match = STEP_DIR.match(path.name)
        if match is None or path.name != step_dir_name(int(match.group(1))):
            continue  # a name this engine does not write (step-0, step-001)
        if step is not None and int(match.group(1)) > step:
            continue  # from a run this one went back past: not counted, not removed
        if store.is_file(path / MANIFEST):
            complete += 1
            if complete <= keep or path == committed:
                continue
        elif complete == 0:
            continue  # newer than every complete checkpoint: perhaps being written
        if _remove_own_files(store, path):
            removed.append(path)
    return removed


_OWN_FILE = re.compile(r"^(rank-\d{5}(\.[0-9a-f]{8})?\.bin|manifest\.json)(\.tmp)?$")
"""The files a save writes in a step directory (and their temporary names)."""


def _remove_own_files(store: Storage, path: Location) -> bool:
    """Remove what a save writes in ``path`` (the manifest first: the checkpoint is then
    incomplete, never half there), then the directory if nothing else is in it.
    Whether the directory went."""
    entries = store.list_entries(path)
    own = [n for n, is_dir in entries if not is_dir and _OWN_FILE.match(n)]
    own.sort(key=lambda name: name != MANIFEST)  # the manifest (False) first
    for name in own:
        store.remove(path / name)
    if len(own) < len(entries):
        return False  # something this engine did not write: the directory stays
    store.remove_tree(path)
    return True
