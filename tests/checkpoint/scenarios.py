"""Checkpoint scenarios run inside spawned ranks (see zeroservice.launch)."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist

from tests.engine import harness
from tests.engine.scenarios import Spec, _batches, engine_for
from zeroservice import deferred_init as zeroservice_deferred
from zeroservice import initialize as zeroservice_initialize
from zeroservice.checkpoint import CheckpointError, CheckpointMismatch, save


def _train(engine, spec: Spec, steps: range) -> list[float]:
    batches = lambda step, accum: _batches(spec, step)  # noqa: E731
    run = harness.run_engine(
        engine, batches, len(steps), spec.accum, start=steps.start, keep_state=False
    )
    return run.losses


def exact_resume(spec: Spec, root: str, split: int, background: bool = False) -> dict:
    """Uninterrupted losses, and the losses of a run saved at ``split`` and resumed by a
    fresh engine built from other initial weights. ``background``: the save is written
    while the first engine trains on (its snapshot must not see those steps)."""
    straight = _train(engine_for(spec), spec, range(spec.steps))
    first = engine_for(spec)
    before = _train(first, spec, range(split))
    first.save_checkpoint(root, client_state={"next_step": split}, background=background)
    if background:
        _train(first, spec, range(split, split + 2))
    first.close()
    torch.manual_seed(999)  # the resumed engine starts elsewhere: only the load may fix it
    second = engine_for(spec)
    with torch.no_grad():
        for unit in second.units:
            unit.flat.normal_()
    result = second.load_checkpoint(root)
    after = _train(second, spec, range(result.client_state["next_step"], spec.steps))
    return {"straight": straight, "resumed": before + after, "step": result.step}


def train_and_save(spec: Spec, root: str, steps: int, keep: int = 3) -> list[float]:
    engine = engine_for(spec)
    losses = _train(engine, spec, range(steps))
    engine.save_checkpoint(root, client_state={"next_step": steps}, keep=keep)
    return losses


def save_every(
    spec: Spec,
    root: str,
    steps: int,
    keep: int,
    die_at: int | None = None,
    background: bool = False,
) -> None:
    """Save after every step; with ``die_at``, rank 1 exits inside that step's save, after
    rank 0's file and before its own."""
    engine = engine_for(spec)
    if die_at is not None and dist.get_rank() == 1:
        real = save.write_rank_file

        def dying(path, state, kinds):
            if state.counters.global_steps == die_at:
                os._exit(17)
            return real(path, state, kinds)

        save.write_rank_file = dying
    for step in range(steps):
        _train(engine, spec, range(step, step + 1))
        engine.save_checkpoint(
            root, client_state={"next_step": step + 1}, keep=keep, background=background
        )
    engine.wait_for_save()


def load_and_continue(spec: Spec, path: str, steps: int, resave: str | None = None) -> dict:
    """Load at this world size and stage; optionally save again at once; train on."""
    engine = engine_for(spec)
    result = engine.load_checkpoint(path)
    if resave:
        engine.save_checkpoint(resave, client_state=result.client_state)
    start = result.client_state["next_step"]
    losses = _train(engine, spec, range(start, start + steps))
    x, y = _batches(spec, 0)[0]
    engine.eval()
    with torch.no_grad():
        logits = engine(x)
    return {
        "path": str(result.path),
        "step": result.step,
        "skipped": [(str(p), why) for p, why in result.skipped],
        "losses": losses,
        "logits": logits if dist.get_rank() == 0 else None,
        "input": x,
    }


def go_back_and_save(spec: Spec, path: str, root: str, keep: int) -> dict:
    """Load ``path`` (a step, or the root to fall back from), train one step, save under
    ``root`` with ``keep``: where the save went and which step was loaded."""
    engine = engine_for(spec)
    result = engine.load_checkpoint(path)
    start = result.client_state["next_step"]
    _train(engine, spec, range(start, start + 1))
    saved = engine.save_checkpoint(root, client_state={"next_step": start + 1}, keep=keep)
    return {"loaded": result.step, "saved": str(saved)}


OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-2),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3),
    "adamw-amsgrad": lambda ps: torch.optim.AdamW(ps, lr=1e-3, amsgrad=True),
}


def save_then_load_with(spec: Spec, root: str, saved_with: str, loaded_with: str) -> str:
    """Train a step with one optimizer and save; load into an engine with another: what
    the load says, or the first step's outcome."""
    engine = engine_for(spec, optimizer=OPTIMIZERS[saved_with])
    _train(engine, spec, range(1))
    engine.save_checkpoint(root, client_state={"next_step": 1})
    engine.close()
    other = engine_for(spec, optimizer=OPTIMIZERS[loaded_with])
    try:
        other.load_checkpoint(root)
    except CheckpointError as exc:
        return f"{type(exc).__name__}: {exc}"
    _train(other, spec, range(1, 2))
    return "loaded and stepped"


def save_and_load_at(spec: Spec, root: str) -> list[str]:
    """What a save and a load under ``root`` raise (a CheckpointError), or "ok"."""
    engine = engine_for(spec)
    said = []
    for action in (engine.save_checkpoint, engine.load_checkpoint):
        try:
            action(root)
            said.append("ok")
        except CheckpointError as exc:
            said.append(f"{type(exc).__name__}: {exc}")
    return said


def try_load(spec: Spec, path: str) -> str:
    engine = engine_for(spec)
    try:
        engine.load_checkpoint(path)
    except CheckpointError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "loaded"


def save_mid_accumulation(root: str) -> str:
    spec = Spec(stage=2, accum=2)
    engine = engine_for(spec)
    x, y = _batches(spec, 0)[0]
    engine.backward(engine(x, y))
    engine.step()
    try:
        engine.save_checkpoint(root)
    except CheckpointError as exc:
        return str(exc)
    return "saved"


MEDIUM = dict(vocab_size=8192, seq_len=64, n_layer=12, n_head=8, dim=512)


def save_medium(root: str) -> int:
    """A 42M-parameter GPT built into shards and saved (no step: masters only)."""
    from zeroservice.config import ZeroConfig
    from zeroservice.models import GPT, GPTConfig

    cfg = GPTConfig(**MEDIUM)
    with zeroservice_deferred():
        model = GPT(cfg)
    engine = zeroservice_initialize(
        model, ZeroConfig(stage=3), lambda ps: torch.optim.AdamW(ps), init=GPT.initializer(cfg)
    )
    engine.save_checkpoint(root)
    return cfg.num_params()


def export_peak(directory: str, out: str) -> int:
    """Peak resident bytes added while exporting (this process does nothing else)."""
    from pathlib import Path

    from zeroservice.checkpoint import export_checkpoint

    def kib(field: str) -> int:
        line = next(
            x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(field)
        )
        return int(line.split()[1])

    Path("/proc/self/clear_refs").write_text("5")
    base = kib("VmRSS")
    export_checkpoint(directory, out)
    return (kib("VmHWM") - base) * 1024


def save_on_a_full_disk(spec: Spec, root: str, steps: int, full_at: int, where: str) -> dict:
    """Save after every step; at step ``full_at`` the disk is full (ENOSPC) for
    ``where``: rank 1's shard file (after part of it was written), rank 0's manifest,
    or rank 0's step directory. Returns each save's outcome and what is on disk then."""
    import errno

    from zeroservice.checkpoint import SaveFailed, files, manifest

    engine = engine_for(spec)
    rank = dist.get_rank()

    def full(*args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    real_segment, real_bytes, real_fsync = (
        save.write_segment,
        files.atomic_write_bytes,
        save.fsync_dir,
    )

    def segment(f, tensor):
        if engine.global_steps == full_at and rank == 1 and where == "shard":
            f.write(b"\0" * 64)  # part of it reached the disk
            full()
        return real_segment(f, tensor)

    def atomic(path, data):
        if engine.global_steps == full_at and where == "manifest":
            with open(path.with_name(path.name + ".tmp"), "wb") as f:
                f.write(data[:10])
            full()
        return real_bytes(path, data)

    synced: list[str] = []

    def fsync(path):
        synced.append(str(path))
        if engine.global_steps == full_at and where == "directory":
            full()
        return real_fsync(path)

    save.write_segment, manifest.atomic_write_bytes, save.fsync_dir = segment, atomic, fsync
    outcomes, listings = [], []
    for step in range(steps):
        _train(engine, spec, range(step, step + 1))
        try:
            engine.save_checkpoint(root, client_state={"next_step": step + 1}, keep=10)
            outcomes.append("saved")
        except SaveFailed as exc:
            outcomes.append(f"SaveFailed: {exc}")
        dist.barrier()
        listings.append(sorted(p.relative_to(root).as_posix() for p in Path(root).rglob("*")))
    return {"outcomes": outcomes, "listings": listings, "synced": synced}


class _Positions(torch.nn.Module):
    """A linear layer beside a persistent buffer sized by ``max_len``."""

    def __init__(self, max_len: int):
        super().__init__()
        self.lin = torch.nn.Linear(8, 4)
        self.register_buffer("table", torch.arange(max_len, dtype=torch.float32)[:, None])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + self.table[: x.shape[0]]


def buffer_of_another_shape(root: str, stage: int) -> dict:
    """Saved with a 16-row buffer, loaded into a model whose buffer has 32: refused
    before anything is written."""

    def engine(max_len: int, seed: int):
        torch.manual_seed(seed)
        model = _Positions(max_len)
        return zeroservice_initialize(
            model, {"stage": stage}, lambda ps: torch.optim.AdamW(ps, lr=1e-2)
        )

    saved = engine(16, 0)
    loss = saved(torch.randn(4, 8)).square().mean()
    saved.backward(loss)
    saved.step()
    saved.save_checkpoint(root)
    saved.wait_for_save()
    saved.close()
    other = engine(32, 1)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    try:
        other.load_checkpoint(root)
        message = "loaded"
    except CheckpointMismatch as e:
        message = f"CheckpointMismatch: {e}"
    after = other.state_dict()
    unchanged = all(torch.equal(before[k], after[k]) for k in before)
    other.close()
    return {"message": message, "unchanged": unchanged}


def changed_hyperparameters(root: str, stage: int) -> dict:
    """Saved under AdamW(lr 1e-2, weight decay 0.1, betas (0.9, 0.999)); loaded by the
    same factory and by one with other hyperparameters (see [Note: hyperparameters on
    load] in zeroservice/checkpoint/load.py)."""
    import warnings

    def engine(lr: float, wd: float, betas: tuple[float, float]):
        torch.manual_seed(0)
        model = _Positions(16)
        return zeroservice_initialize(
            model,
            {"stage": stage},
            lambda ps: torch.optim.AdamW(ps, lr=lr, weight_decay=wd, betas=betas),
        )

    def step(e) -> None:
        loss = e(torch.randn(4, 8)).square().mean()
        e.backward(loss)
        e.step()

    saved = engine(1e-2, 0.1, (0.9, 0.999))
    step(saved)
    saved.save_checkpoint(root)
    saved.wait_for_save()
    saved.close()
    out = {}
    for name, hyper in (("same", (1e-2, 0.1, (0.9, 0.999))), ("changed", (1e-4, 0.0, (0.8, 0.99)))):
        e = engine(*hyper)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            e.load_checkpoint(root)
        step(e)
        group = e.optimizer.optimizer.param_groups[0]
        out[name] = {
            "warnings": [str(w.message) for w in caught],
            "applied": (group["lr"], group["weight_decay"], tuple(group["betas"])),
        }
        e.close()
    return out


def background_save_failed_then_saved(root: str) -> dict:
    """A background save whose write fails on every rank (ENOSPC), waited through its
    handle, then the next save: it is written, not refused with the old failure."""
    import errno

    from zeroservice.checkpoint import background

    torch.manual_seed(0)
    engine = zeroservice_initialize(
        _Positions(16), {"stage": 2}, lambda ps: torch.optim.AdamW(ps, lr=1e-2)
    )

    def step() -> None:
        loss = engine(torch.randn(4, 8)).square().mean()
        engine.backward(loss)
        engine.step()

    real = background.write_items

    def full(*args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    step()
    background.write_items = full
    try:
        handle = engine.save_checkpoint(root, background=True)
        try:
            handle.wait()
            first = "saved"
        except CheckpointError as e:
            first = str(e)
    finally:
        background.write_items = real
    step()
    second = engine.save_checkpoint(root, background=True).wait()
    engine.close()
    return {"first": first, "second": str(second)}


def background_save_failed_on_one_rank(root: str) -> dict:
    """Rank 1's background write fails (ENOSPC): rank 0 fails the save naming it at
    once, not after waiting out the save's timeout for rank 1's report."""
    import errno
    import time

    from zeroservice.checkpoint import background

    torch.manual_seed(0)
    engine = zeroservice_initialize(
        _Positions(16), {"stage": 2}, lambda ps: torch.optim.AdamW(ps, lr=1e-2)
    )
    loss = engine(torch.randn(4, 8)).square().mean()
    engine.backward(loss)
    engine.step()
    real = background.write_items

    def full(*args):
        if dist.get_rank() == 1:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(*args)

    background.write_items = full
    t0 = time.monotonic()
    try:
        engine.save_checkpoint(root, background=True).wait()
        message = "saved"
    except CheckpointError as e:
        message = str(e)
    finally:
        background.write_items = real
    seconds = time.monotonic() - t0
    engine.close()
    return {"message": message, "seconds": seconds}


def resave_on_a_full_disk(spec: Spec, root: str) -> dict:
    """Save step 2, load it into a new engine and save step 2 again while rank 1's disk
    is full; then load it, and save it again with room."""
    import errno

    from zeroservice.checkpoint import SaveFailed

    first = engine_for(spec)
    _train(first, spec, range(2))
    first.save_checkpoint(root, client_state={"next_step": 2})
    first.close()
    engine = engine_for(spec)
    engine.load_checkpoint(root)
    real_segment = save.write_segment

    def segment(f, tensor):
        if dist.get_rank() == 1:
            f.write(b"\0" * 64)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_segment(f, tensor)

    save.write_segment = segment
    try:
        engine.save_checkpoint(root, client_state={"next_step": 2})
        failed = "saved"
    except SaveFailed as exc:
        failed = f"SaveFailed: {exc}"
    finally:
        save.write_segment = real_segment
    dist.barrier()
    step = Path(root) / "step-00000002"
    after_failure = sorted(p.name for p in step.iterdir())
    loaded = engine_for(spec).load_checkpoint(root).step
    engine.save_checkpoint(root, client_state={"next_step": 2})
    dist.barrier()
    return {
        "failed": failed,
        "after_failure": after_failure,
        "loaded": loaded,
        "after_retry": sorted(p.name for p in step.iterdir()),
    }


class EmptyTensors(torch.nn.Module):
    """A parameter and a persistent buffer of no elements (no extra tokens, a rank-0
    adapter) beside ordinary weights: a save writes no segment for them."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(16, 8)
        self.empty = torch.nn.Parameter(torch.zeros(0, 8))
        self.register_buffer("none_yet", torch.zeros(0, dtype=torch.int64))
        self.lin = torch.nn.Linear(8, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.lin(self.emb(x) + self.empty.sum())
        return torch.nn.functional.cross_entropy(logits.reshape(-1, 16), x.reshape(-1))


def save_empty_tensors(root: str) -> dict[str, torch.Tensor]:
    """Stage 3, one step, saved under ``root``; the engine's whole state dict."""
    torch.manual_seed(0)
    engine = zeroservice_initialize(
        EmptyTensors(), {"stage": 3}, lambda ps: torch.optim.AdamW(ps, lr=1e-2)
    )
    x = torch.randint(0, 16, (2, 5), generator=torch.Generator().manual_seed(dist.get_rank()))
    engine.backward(engine(x))
    engine.step()
    engine.save_checkpoint(root)
    state = {k: v.clone() for k, v in engine.state_dict().items()}
    engine.close()
    return state
