"""Load a checkpoint at any world size and any stage, directly.

[Note: resharding on load]
The manifest stores each parameter's elements per kind (master, Adam's moments...)
as segments written by the old ranks. The new engine knows, for each of its units,
which elements of which parameters its masters hold (layout.py); for each such
piece it reads the overlapping parts of the old segments, whatever the old world
size or stage was. Loading happens in two passes: the first reads and checks every
byte this rank needs (sizes, block checksums) without touching the engine; all
ranks agree on the outcome; only then does the second pass write into the engine.
So a bad checkpoint leaves the engine as it was, and the caller falls back to the
next newest one.
"""

from __future__ import annotations

import base64
import binascii
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist

from ..naming import some_names
from .files import CheckpointError, SegmentReader, dtype_of
from .layout import Piece, held_pieces
from .manifest import candidates, entry_names, read_manifest
from .save import buffer_names
from .state import Counters, ShardedState
from .storage import Location, Where


class CheckpointMismatch(CheckpointError):
    """The checkpoint is sound but does not fit this model (no fallback is attempted)."""


@dataclass
class LoadResult:
    path: Location
    """A local path, or an ``ObjectPath`` (its ``str()`` is the URI)."""
    step: int
    client_state: dict[str, Any]
    counters: Counters
    """The engine's step counters at the save: the engine applies them."""
    skipped: list[tuple[Location, str]] = field(default_factory=list)
    """Newer checkpoints passed over, and why."""
    hyperparameters: list[str] = field(default_factory=list)
    """Where the checkpoint's optimizer hyperparameters differ from this engine's, which
    apply (see [Note: hyperparameters on load])."""


Read = tuple[dict[str, Any], int, int, int]
"""(segment, first element in the segment, end element, destination offset)."""
Destination = tuple[dict[str, Any], int, int, torch.Tensor]
"""(segment, first element, end element, the flat tensor those elements are written to)."""


class Reader(Protocol):
    """Where a plan's segments come from: rank files (SegmentReader) or peers' host
    copies (peers.py). ``read`` returns elements [start, end) of the segment."""

    def read(self, seg: dict[str, Any], start: int, end: int, what: str) -> torch.Tensor: ...


class _Plan:
    """Every read this rank needs, grouped by destination. ``source`` (a checkpoint
    directory, or a description of the peers) names the data in error messages; the
    segments' ``file`` names whatever the reader reads them from."""

    def __init__(self, state: ShardedState, manifest: dict[str, Any], source: Location):
        self.source, self.manifest = source, manifest
        self.kinds: list[str] = manifest.get("kinds", ["master"])
        by_name = {n: p for p in manifest["params"] for n in p["names"]}
        _check_names(state, manifest["params"], by_name, source)
        index: dict[tuple[str, str], list[dict[str, Any]]] = {}
        for seg in manifest["segments"]:
            index.setdefault((seg["param"], seg["kind"]), []).append(seg)
        held = sorted({kind for _, kind in index} - {"buffer"})
        if held and held != sorted(self.kinds):
            raise CheckpointError(
                f"{source}: the manifest lists the state kinds {sorted(self.kinds)} but its "
                f"segments hold {held} (an edited or damaged manifest)"
            )
        self.reads: dict[tuple[int, str], list[Read]] = {}
        self.files: set[str] = set()
        for piece in held_pieces(state.units, state.whole):
            saved = _entry(piece.slot.names, by_name)
            assert saved is not None  # _check_names
            for kind in ["master"] if piece.unit.frozen else self.kinds:
                segs = index.get((saved["name"], kind), [])
                if not segs and kind != "master":
                    _no_state(source, saved["name"], kind, self.kinds, index)
                self._cover(piece, kind, segs, saved["name"])
        self.buffers: list[tuple[torch.Tensor, dict[str, Any]]] = []
        shapes = {n: b.get("shape") for b in manifest.get("buffers", []) for n in entry_names(b)}
        model_buffers = buffer_names(state.module)
        _check_buffer_names(model_buffers, manifest, index, source)
        for names, buffer in model_buffers:
            name, segs = next(
                ((n, index[(n, "buffer")]) for n in names if (n, "buffer") in index),
                (names[0], []),
            )
            if not segs:
                raise CheckpointMismatch(f"{source}: no entry for buffer {names[0]}")
            seg = _rank_segment(segs, state.rank)
            shape = shapes.get(name)
            if seg["end"] != buffer.numel() or (
                shape is not None and tuple(shape) != tuple(buffer.shape)
            ):
                was = tuple(shape) if shape is not None else f"{seg['end']} elements"
                raise CheckpointMismatch(
                    f"{source}: buffer {name} is {was} in the checkpoint and "
                    f"{tuple(buffer.shape)} in this model"
                )
            self.buffers.append((buffer, seg))
            self.files.add(seg["file"])

    def _cover(self, piece: Piece, kind: str, segs: list[dict[str, Any]], name: str) -> None:
        reads = self.reads.setdefault((piece.unit.index, kind), [])
        covered = 0
        for seg in segs:
            a, b = max(piece.start, seg["start"]), min(piece.end, seg["end"])
            if a < b:
                dest = piece.local + (a - piece.start)
                reads.append((seg, a - seg["start"], b - seg["start"], dest))
                self.files.add(seg["file"])
                covered += b - a
        if covered != piece.end - piece.start:
            raise CheckpointError(
                f"{self.source}: no {kind} data for elements {piece.start}..{piece.end} "
                f"of {name} (a rank's file is not listed)"
            )

    def destinations(self, state: ShardedState) -> list[Destination]:
        """(segment, start, end, the flat view of ``state``'s tensor it is written to)
        for every read, buffers included, creating missing optimizer states: a reader
        may fill them in place (peers.py)."""
        out = []
        for (unit_index, kind), reads in self.reads.items():
            target = _target(state, unit_index, kind)
            out += [(seg, a, b, target[dest : dest + (b - a)]) for seg, a, b, dest in reads]
        return out + [(seg, 0, seg["end"], buf.detach().reshape(-1)) for buf, seg in self.buffers]

    def run(self, reader: Reader, apply: ShardedState | None) -> None:
        """Read (and check) everything; with ``apply``, copy it into that state (not
        where the reader returned the destination itself: it wrote it already)."""
        for (unit_index, kind), reads in self.reads.items():
            target = _target(apply, unit_index, kind) if apply is not None else None
            for seg, a, b, dest in reads:
                what = f"{seg['kind']} of {seg['param']}"
                data = reader.read(seg, a, b, what)
                if target is not None:
                    view = target[dest : dest + (b - a)]
                    if data.data_ptr() != view.data_ptr():
                        view.copy_(data)
        for buffer, seg in self.buffers:
            data = reader.read(seg, 0, seg["end"], f"buffer {seg['param']}")
            if apply is not None and data.data_ptr() != buffer.data_ptr():
                with torch.no_grad():
                    buffer.copy_(data.view(buffer.shape))


def _no_state(
    source: Location,
    name: str,
    kind: str,
    kinds: list[str],
    index: dict[tuple[str, str], list[dict[str, Any]]],
) -> None:
    """A trainable parameter without segments of optimizer state ``kind``: a manifest
    that lists other kinds of it was damaged (skipped, the load falls back); one holding
    its weights alone was saved with the parameter frozen (a mismatch)."""
    states = [k for k in kinds if k != "master" and (name, k) in index]
    if states:
        raise CheckpointError(
            f"{source}: the manifest lists {', '.join(states)} of {name} but no {kind} "
            "(an edited or damaged manifest)"
        )
    if (name, "master") in index:
        raise CheckpointMismatch(
            f"{source}: {name} was frozen (requires_grad=False) when this checkpoint was "
            f"saved and is trainable now: the checkpoint holds its weights but no {kind} "
            "for it. Keep it frozen to load this checkpoint, or start from its weights with "
            "a fresh optimizer: `zeroservice checkpoint export` and "
            "initialize(..., init=<file>)"
        )


def _check_names(
    state: ShardedState,
    params: list[dict[str, Any]],
    by_name: dict[str, dict[str, Any]],
    source: object,
) -> None:
    """Every parameter of the model has an entry of its shape, and every entry a
    parameter (as ``load_state_dict(strict=True)`` checks): an entry this model has none
    of is another model's, and would be dropped without a word. Every rank reads the
    whole model's parameters, not its shard's, so all decide alike. A tied parameter
    matches by any of its names."""
    slots = [slot for unit in state.units for slot in unit.slots]
    said = []
    for slot in slots:
        saved = _entry(slot.names, by_name)
        entries = {id(by_name[n]): by_name[n]["name"] for n in slot.names if n in by_name}
        if len(entries) > 1:
            said.append(
                f"{' / '.join(slot.names)} is one tied parameter in this model and "
                f"{len(entries)} in the checkpoint ({', '.join(entries.values())}: saved "
                "untied); tie them alike, or load a checkpoint of the tied model"
            )
        elif saved is None:
            said.append(f"no entry for parameter {' / '.join(slot.names)}")
        elif tuple(saved["shape"]) != tuple(slot.shape):
            said.append(
                f"{slot.names[0]} has shape {tuple(saved['shape'])} in the checkpoint, "
                f"the model has {tuple(slot.shape)}"
            )
    known = {n for slot in slots for n in slot.names}
    strangers = [p["name"] for p in params if not known.intersection(p["names"])]
    if strangers:
        said.append(
            f"the checkpoint holds parameters this model does not have: "
            f"{some_names(strangers, 5)} (a checkpoint of another model, or of this one "
            "with its weights untied where this model ties them)"
        )
    if said:
        raise CheckpointMismatch(f"{source}: {some_names(said, 5)}")


def _check_buffer_names(
    model_buffers: list[tuple[list[str], torch.Tensor]],
    manifest: dict[str, Any],
    index: dict[tuple[str, str], list[dict[str, Any]]],
    source: object,
) -> None:
    """A buffer the checkpoint holds that this model has none of is another model's
    (or one a setting dropped: BatchNorm's ``track_running_stats=False``) and would be
    dropped without a word: refused, as ``load_state_dict(strict=True)`` refuses it."""
    known = {n for names, _ in model_buffers for n in names}
    saved = {name for name, kind in index if kind == "buffer"}
    saved |= {n for b in manifest.get("buffers", []) for n in entry_names(b)}
    strangers = sorted(saved - known)
    if strangers:
        raise CheckpointMismatch(
            f"{source}: the checkpoint holds buffers this model does not have: "
            f"{some_names(strangers, 5)} (a checkpoint of another model, or of this one "
            "with other settings, such as BatchNorm's track_running_stats)"
        )


def _rank_segment(segs: list[dict[str, Any]], rank: int) -> dict[str, Any]:
    """Of a buffer's segments, this rank's own (saved with ``rank_buffers``), or else
    rank 0's, which every rank loads where ranks kept no buffers of their own."""
    own = [s for s in segs if s.get("rank", 0) == rank]
    return (own or [s for s in segs if s.get("rank", 0) == 0] or segs)[0]


def _entry(names: list[str], by_name: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    return next((by_name[n] for n in names if n in by_name), None)


def _target(state: ShardedState, unit_index: int, kind: str) -> torch.Tensor:
    unit = state.units[unit_index]
    if unit.frozen:
        return unit.param_shard
    master = state.masters[unit_index]
    if kind == "master":
        return master.data
    per_param = state.optimizer.state[master]
    if kind not in per_param:
        per_param[kind] = torch.zeros_like(master, memory_format=torch.preserve_format)
    return per_param[kind]


def _all_errors(error: str | None, group) -> list[str]:
    """Every rank's error, so that all ranks decide alike and can say why."""
    errors: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(errors, error, group=group)
    return list(dict.fromkeys(e for e in errors if e is not None))


def load_checkpoint(state: ShardedState, path: Where) -> LoadResult:
    """Load ``path`` (a checkpoint directory, or a root: its newest valid checkpoint) into
    ``state``; the caller applies the returned counters and publishes the parameters."""
    if state.pending_micro_steps:
        raise CheckpointError("load: gradients are being accumulated; load between steps")
    skipped: list[tuple[Location, str]] = []
    for directory in candidates(path):
        error: str | None = None
        mismatch: str | None = None
        plan: _Plan | None = None
        reader: SegmentReader | None = None
        try:
            manifest = read_manifest(directory)
            _check_optimizer(state, manifest, directory)
            plan = _Plan(state, manifest, directory)
            reader = SegmentReader(directory, manifest["files"])
            reader.check_files(plan.files)
            plan.run(reader, apply=None)
            # Everything the result needs is read before anything is written.
            prepared = _prepare(state, manifest, directory)
            result = LoadResult(
                directory,
                manifest["step"],
                manifest["client_state"],
                saved_counters(manifest),
                skipped,
                hyperparameter_differences(state, manifest),
            )
        except CheckpointMismatch as exc:
            mismatch = str(exc)
        except (CheckpointError, OSError) as exc:
            error = str(exc)
        except Exception as exc:  # noqa: BLE001 - any other error of one rank: see below
            # Raised on one rank alone it would leave the others waiting in the verdict's
            # all-gather: every rank reaches it, whatever went wrong here.
            error = f"{directory}: malformed manifest ({type(exc).__name__}: {exc})"
        # Every rank decides alike: a mismatch one rank found (a shape only a piece of its
        # shard shows) is raised by all, where the others used to wait in their next
        # collective.
        mismatches = _all_errors(mismatch, state.group)
        errors = _all_errors(error, state.group)
        if not (mismatches or errors):
            assert plan is not None and reader is not None
            _apply(state, plan, reader, prepared=prepared)
            reader.close()
            return result
        if reader is not None:
            reader.close()
        if mismatches:
            raise CheckpointMismatch("; ".join(mismatches))
        skipped.append((directory, "; ".join(errors)))
    reasons = "; ".join(f"{p.name}: {why}" for p, why in skipped) or "none found"
    raise CheckpointError(f"{path}: no complete, valid checkpoint ({reasons})")


def saved_counters(manifest: dict[str, Any]) -> Counters:
    saved = manifest["engine"]
    return Counters(saved["global_steps"], saved["applied_steps"], saved.get("loss_scaler"))


def _check_optimizer(state: ShardedState, manifest: dict[str, Any], source: Location) -> None:
    saved = manifest.get("optimizer", {}).get("class")
    ours = type(state.optimizer).__name__
    if saved is not None and saved != ours:
        raise CheckpointMismatch(
            f"{source}: the checkpoint was saved by {saved}; this engine runs {ours}"
        )
    kinds = manifest.get("kinds", [])
    wants_max = any(g.get("amsgrad") for g in state.optimizer.param_groups)
    if wants_max and "exp_avg" in kinds and "max_exp_avg_sq" not in kinds:
        raise CheckpointMismatch(
            f"{source}: amsgrad is on here and was off at the save: the checkpoint has no "
            f"max_exp_avg_sq for {ours} to step from (turn amsgrad off, or start its "
            "optimizer afresh from an exported model)"
        )
    groups = manifest.get("optimizer", {}).get("param_groups")
    mine = state.optimizer.param_groups
    if groups is not None and len(groups) != len(mine):
        raise CheckpointMismatch(
            f"{source}: optimizer param_groups: the checkpoint has {len(groups)} groups, "
            f"this engine's optimizer factory builds {len(mine)}"
        )


_NOT_HYPERPARAMETERS = {"lr", "initial_lr", "foreach", "fused", "capturable", "differentiable"}
"""Group entries that are no training hyperparameter to compare: the rate (the schedule
moves it; its base is compared apart) and how torch computes the update."""


def hyperparameter_differences(state: ShardedState, manifest: dict[str, Any]) -> list[str]:
    """Where the checkpoint's group hyperparameters differ from this engine's factory's.

    [Note: hyperparameters on load]
    A checkpoint restores the training state: masters, optimizer states, counters, the
    schedule's position. The hyperparameters (each group's base lr, weight decay, betas,
    eps, momentum) are the optimizer factory's, the one place they are set: the engine
    refuses a rate changed on the inner optimizer later. Restoring the saved ones would
    leave no way to resume with new ones, and the rate was not restored anyway (the
    engine sets it each step from the factory's base), so a changed factory trained
    with its new lr and the old weight decay. Where they differ the engine warns and
    names each difference; an exact resume passes the same factory and sees none."""
    saved = manifest.get("optimizer", {}).get("param_groups") or []
    saved_bases = manifest.get("optimizer", {}).get("base_lrs")
    out = []
    for i, (group, values) in enumerate(zip(state.optimizer.param_groups, saved, strict=False)):
        for key, value in sorted(values.items()):
            if key in _NOT_HYPERPARAMETERS or key not in group:
                continue
            ours = group[key]
            theirs = tuple(value) if isinstance(ours, tuple) else value
            if ours != theirs:
                out.append(f"group {i} {key}: {ours!r} here, {theirs!r} in the checkpoint")
        base = state.base_lrs[i]
        if saved_bases is not None and i < len(saved_bases) and saved_bases[i] != base:
            out.append(f"group {i} lr: {base!r} here, {saved_bases[i]!r} in the checkpoint")
    return out


def zero_masters(state: ShardedState) -> None:
    """Before any master is written: the padding past the parameters stays zero."""
    for master in state.masters:
        master.data.zero_()


@dataclass
class _Prepared:
    """What a load sets beside the tensors, decoded and checked before anything is
    written: a malformed scalar or random state fails the load, not half of it."""

    scalars: list[dict[str, Any]]
    """Each param group's scalar optimizer states (``step``, ASGD's ``eta``)."""
    rng: Callable[[], None] | None


def _decode_scalars(specs: dict[str, Any]) -> dict[str, Any]:
    scalars: dict[str, Any] = {}
    for key, spec in specs.items():
        if "dtype" in spec:
            value = torch.tensor(spec["value"], dtype=dtype_of(spec["dtype"]))
            scalars[key] = value.reshape(spec["shape"])
        else:
            scalars[key] = spec["value"]
    return scalars


def _prepare(state: ShardedState, manifest: dict[str, Any], source: object = "") -> _Prepared:
    saved_scalars = manifest.get("optimizer", {}).get("scalars", {})
    groups = len(state.optimizer.param_groups)
    if isinstance(saved_scalars, dict):  # saved before scalars were kept per group
        scalars = [_decode_scalars(saved_scalars)] * groups
    elif len(saved_scalars) == groups:
        scalars = [_decode_scalars(specs) for specs in saved_scalars]
    else:
        raise CheckpointError(
            f"{source}: the manifest holds scalar optimizer states for "
            f"{len(saved_scalars)} param groups, this engine's optimizer has {groups}"
        )
    rng = manifest.get("rng", [])
    saved = rng[state.rank] if state.rank < len(rng) else None
    try:
        return _Prepared(scalars, None if saved is None else _rng_restorer(saved))
    except CheckpointError as exc:
        raise CheckpointError(f"{source}: rank {state.rank}'s {exc}") from None


def _apply(
    state: ShardedState,
    plan: _Plan,
    reader: Reader,
    zeroed: bool = False,
    prepared: _Prepared | None = None,
) -> None:
    """Write the checked checkpoint into ``state``'s tensors and this process's random
    generators (those of the old rank with this rank's index, where the source has
    them); the engine then applies the counters and publishes the parameters.
    ``zeroed``: the caller ran zero_masters before its reader wrote into them."""
    if prepared is None:
        prepared = _prepare(state, plan.manifest)
    if not zeroed:
        zero_masters(state)
    plan.run(reader, apply=state)
    # The trainable units' masters (frozen ones have none), group by group.
    for group, scalars in zip(state.optimizer.param_groups, prepared.scalars, strict=True):
        for master in group["params"]:
            per_param = state.optimizer.state[master]
            # A shard holding only padding read no segment: its state is still whole
            # (zeros, as the padding's moments are), or the optimizer would find its
            # step without its moments.
            for kind in plan.kinds:
                if kind != "master" and kind not in per_param:
                    per_param[kind] = torch.zeros_like(master.detach())
            for key in [k for k, v in per_param.items() if v is not None]:
                if key not in plan.kinds and key not in scalars:
                    del per_param[key]  # this engine's own state the checkpoint lacks
            for key, value in scalars.items():
                # A tensor of its own per master: optimizers step it in place (Adam's).
                tensor = isinstance(value, torch.Tensor)
                per_param[key] = value.to(master.device, copy=True) if tensor else value
    if prepared.rng is not None:
        prepared.rng()


def _bytes(encoded: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(encoded)), dtype=torch.uint8)


def _rng_restorer(state: dict[str, Any]) -> Callable[[], None]:
    """Decode one rank's saved random states, each checked on a generator of its own;
    return what sets them in this process."""
    try:
        cpu = _bytes(state["torch"])
        torch.Generator().set_state(cpu)
        version, internal, gauss = state["python"]
        python = (version, tuple(internal), gauss)
        random.Random().setstate(python)
        kind, keys, pos, has_gauss, cached = state["numpy"]
        numpy = (kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached)
        np.random.RandomState().set_state(numpy)
        cuda = [_bytes(s) for s in state["cuda"] or ()]
    except (KeyError, TypeError, ValueError, RuntimeError, binascii.Error) as exc:
        raise CheckpointError(f"malformed random state ({type(exc).__name__}: {exc})") from None

    def restore() -> None:
        torch.set_rng_state(cpu)
        random.setstate(python)
        np.random.set_state(numpy)
        if cuda and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(cuda)

    return restore
