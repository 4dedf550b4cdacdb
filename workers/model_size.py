"""A job's trainable parameter count, measured on a worker node for its memory plan.

A factory or transformers model is code the tenant names; the control plane never
imports or calls it (see docs/operations.md, "Trust model"). The count runs instead
in a Ray task of its own process (``max_calls=1``: the process exits afterwards),
with the job's CPUs, a memory bound it enforces on itself and a timeout the caller
enforces by cancelling the task.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from .spec import JobSpec


class ModelNotBuildable(ValueError):
    """The model could not be built from its spec, or the spec names modules the model
    lacks; the message names the field."""


def count_parameters(spec: JobSpec) -> int:
    """Trainable parameters of the job's model, built without memory (deferred init).
    The engine's ``stage3_leaf_modules`` are checked against the built model too: a
    name no module has would otherwise fail every rank at start."""
    import zeroservice
    from zeroservice.partition import leaf_modules

    from .build import build_model

    try:
        with zeroservice.deferred_init():
            model, _ = build_model(spec, None)
    except ModelNotBuildable:
        raise
    except Exception as exc:
        raise ModelNotBuildable(_field_message(spec, exc)) from None
    try:
        leaf_modules(model, spec.engine.get("stage3_leaf_modules") or [])
    except zeroservice.ConfigError as exc:
        raise ModelNotBuildable(f"engine.{exc}") from None
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def _field_message(spec: JobSpec, exc: Exception) -> str:
    text = str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__
    if text.startswith("model."):
        return text
    field = "model.factory" if spec.model.kind == "factory" else "model.config"
    return f"{field}: building the model failed: {type(exc).__name__}: {text}"


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _exit_above(limit_bytes: int, done: threading.Event) -> None:
    """Kill this (single-use) worker process once it holds more than ``limit_bytes``."""
    while not done.wait(0.05):
        if _resident_bytes() > limit_bytes:
            os._exit(137)


def _bounded_count(spec_json: str, limit_bytes: int) -> int:
    done = threading.Event()
    threading.Thread(target=_exit_above, args=(limit_bytes, done), daemon=True).start()
    try:
        return count_parameters(JobSpec.model_validate_json(spec_json))
    finally:
        done.set()


def count_on_worker(spec: JobSpec, timeout_s: float, memory_bytes: int) -> int:
    """``count_parameters`` in a Ray task on a worker: ModelNotBuildable when the model
    cannot be built, exceeds ``memory_bytes`` or takes longer than ``timeout_s``."""
    import ray
    from ray.exceptions import GetTimeoutError, RayTaskError, WorkerCrashedError

    task: Any = ray.remote(max_calls=1, max_retries=0, retry_exceptions=False)(_bounded_count)
    task = task.options(num_cpus=spec.resources.cpus_per_rank, memory=memory_bytes)
    ref = task.remote(spec.model_dump_json(), memory_bytes)
    field = f"model.{'factory' if spec.model.kind == 'factory' else 'architecture'}"
    try:
        return int(ray.get(ref, timeout=timeout_s))
    except GetTimeoutError:
        ray.cancel(ref, force=True)
        raise ModelNotBuildable(
            f"{field}: building the model for its memory plan took over {timeout_s:g} s"
        ) from None
    except WorkerCrashedError:
        raise ModelNotBuildable(
            f"{field}: building the model for its memory plan took over "
            f"{memory_bytes / 2**30:g} GiB of memory"
        ) from None
    except RayTaskError as exc:
        cause = exc.cause if isinstance(exc.cause, ModelNotBuildable) else None
        raise ModelNotBuildable(str(cause) if cause else f"{field}: {exc}") from None
