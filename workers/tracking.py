"""Experiment tracking where a job runs: TensorBoard event files and an MLflow run.

[Note: tracking]
The supervisor owns one ``Tracker`` per job (it runs on the cluster, never in the
control plane). What a job's ``tracking`` spec asks for:

- ``tensorboard``: event files written with ``torch.utils.tensorboard.SummaryWriter``
  under ``<checkpoint directory>/tensorboard/<job id>`` (inside the tenant's own
  checkpoint directory): one scalar per history field and step (``train/loss``,
  ``train/grad_norm``...), the job spec as text, a text entry per checkpoint.
- ``mlflow``: a run in the experiment ``tracking.experiment`` (the control plane
  fills in the tenant's name) at ``tracking.mlflow_uri`` (the control plane fills in
  the service's, a local file store by default). The job spec, flattened, is the
  run's parameters; the history fields are its metrics, per step; each checkpoint is
  an artifact *by reference*: ``checkpoints/step-<n>.json`` holding the checkpoint's
  path (the shards stay where they are) and the ``checkpoint`` tag the newest path.
  The run ends FINISHED, FAILED or KILLED with the job.

Tracking never fails a job: the first error of a sink is reported (an event) and
that sink is switched off. The libraries are imported only when a job asks for them.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from .history import FIELDS
from .spec import JobSpec
from .state import JobState

_RUN_STATUS = {
    JobState.SUCCEEDED: "FINISHED",
    JobState.FAILED: "FAILED",
    JobState.CANCELLED: "KILLED",
}
_PARAM_VALUE_MAX = 500
"""Longest parameter value logged (MLflow's older stores refuse more)."""


def flatten(value: Any, prefix: str = "") -> dict[str, str]:
    """Nested dicts as ``a.b.c`` keys with string values (MLflow parameters)."""
    if isinstance(value, dict):
        out: dict[str, str] = {}
        for key, item in value.items():
            out.update(flatten(item, f"{prefix}{key}."))
        return out
    text = json.dumps(value) if isinstance(value, list | tuple) else str(value)
    return {prefix[:-1]: text[:_PARAM_VALUE_MAX]}


def allow_file_store() -> None:
    """MLflow 3 keeps its file store in maintenance mode and refuses it unless
    ``MLFLOW_ALLOW_FILE_STORE`` is set: the service's default store is one, so the
    process that writes it (and whoever reads it) sets that."""
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")


def tensorboard_dir(checkpoint_root: str, job_id: str) -> Path:
    """Where a job's TensorBoard event files go. See [Note: tracking]."""
    return Path(checkpoint_root) / "tensorboard" / job_id


class Tracking(Protocol):
    """What the job's controller tells experiment tracking."""

    def steps(self, points: list[dict[str, Any]]) -> None: ...

    def checkpoint(self, step: int, path: str) -> None: ...

    def close(self, status: str) -> None: ...


class NoTracking:
    """A job that tracks nothing (and the controller's tests)."""

    def steps(self, points: list[dict[str, Any]]) -> None:
        pass

    def checkpoint(self, step: int, path: str) -> None:
        pass

    def close(self, status: str) -> None:
        pass


class Tracker:
    """See [Note: tracking]."""

    def __init__(
        self,
        job_id: str,
        spec: JobSpec,
        checkpoint_root: str,
        on_error: Callable[[str, str], None] | None = None,
    ):
        self.job_id, self.spec, self.root = job_id, spec, checkpoint_root
        self.on_error = on_error
        self._writer: Any = None
        self._client: Any = None
        self.run_id: str | None = None
        self._tensorboard = spec.tracking.tensorboard
        self._mlflow = spec.tracking.mlflow
        self._opened = False
        self._last_step = 0

    @property
    def enabled(self) -> bool:
        return self._tensorboard or self._mlflow

    # -- what the supervisor calls -----------------------------------------------------
    def steps(self, points: list[dict[str, Any]]) -> None:
        """Log history points (workers/history.py), oldest first; a step redone after
        a restart keeps its first values, as in the control plane's history."""
        points = [p for p in points if p["step"] > self._last_step]
        if not points or not self._open():
            return
        self._last_step = points[-1]["step"]
        if self._writer is not None:
            self._guard("tensorboard", self._tb_steps, points)
        if self.run_id is not None:
            self._guard("mlflow", self._mlflow_steps, points)

    def checkpoint(self, step: int, path: str) -> None:
        if not self._open():
            return
        if self._writer is not None:
            self._guard("tensorboard", self._writer.add_text, "checkpoint", path, step)
        if self.run_id is not None:
            self._guard("mlflow", self._mlflow_checkpoint, step, path)

    def close(self, status: str) -> None:
        if self._writer is not None:
            self._guard("tensorboard", self._writer.close)
            self._writer = None
        if self.run_id is not None:
            end = _RUN_STATUS.get(JobState(status), "FAILED")
            self._guard("mlflow", self._client.set_terminated, self.run_id, end)
            self.run_id = None

    # -- sinks ---------------------------------------------------------------------------
    def _open(self) -> bool:
        if not self._opened:
            self._opened = True
            if self._tensorboard:
                self._guard("tensorboard", self._open_tensorboard)
            if self._mlflow:
                self._guard("mlflow", self._open_mlflow)
        return self._writer is not None or self.run_id is not None

    def _open_tensorboard(self) -> None:
        from torch.utils.tensorboard import SummaryWriter

        directory = tensorboard_dir(self.root, self.job_id)
        directory.mkdir(parents=True, exist_ok=True)
        self._writer = SummaryWriter(log_dir=str(directory))
        spec = json.dumps(self.spec.model_dump(mode="json"), indent=2)
        self._writer.add_text("spec", f"```\n{spec}\n```", 0)

    def _tb_steps(self, points: list[dict[str, Any]]) -> None:
        for point in points:
            for key in FIELDS:
                if point.get(key) is not None:
                    self._writer.add_scalar(f"train/{key}", point[key], point["step"])
        self._writer.flush()

    def _open_mlflow(self) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        tracking = self.spec.tracking
        uri = tracking.mlflow_uri or (Path(self.root) / "mlruns").resolve().as_uri()
        if uri.startswith("file:"):
            allow_file_store()
        client = MlflowClient(tracking_uri=uri)
        name = tracking.experiment or "zeroservice"
        experiment = client.get_experiment_by_name(name)
        if experiment is None:
            try:
                experiment_id = client.create_experiment(name)
            except Exception:  # created meanwhile by another job
                found = client.get_experiment_by_name(name)
                if found is None:
                    raise
                experiment_id = found.experiment_id
        else:
            experiment_id = experiment.experiment_id
        run = client.create_run(
            experiment_id,
            run_name=f"{self.spec.name}-{self.job_id[:8]}",
            tags={"zeroservice.job_id": self.job_id},
        )
        self._client, self.run_id = client, run.info.run_id
        params = [Param(k, v) for k, v in flatten(self.spec.model_dump(mode="json")).items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 per batch
            client.log_batch(self.run_id, params=params[i : i + 100])

    def _mlflow_steps(self, points: list[dict[str, Any]]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [
            Metric(key, float(point[key]), now, int(point["step"]))
            for point in points
            for key in FIELDS
            if point.get(key) is not None
        ]
        for i in range(0, len(metrics), 1000):  # MLflow takes at most 1000 per batch
            self._client.log_batch(self.run_id, metrics=metrics[i : i + 1000])

    def _mlflow_checkpoint(self, step: int, path: str) -> None:
        reference = {"step": step, "path": path, "uri": Path(path).resolve().as_uri()}
        name = f"checkpoints/step-{step:08d}.json"
        self._client.log_text(self.run_id, json.dumps(reference, indent=2), name)
        self._client.set_tag(self.run_id, "checkpoint", path)

    def _guard(self, sink: str, fn: Callable[..., Any], *args: Any) -> None:
        """Run one sink's call; on its first error report it and switch the sink off."""
        try:
            fn(*args)
        except Exception as exc:
            if sink == "tensorboard":
                self._tensorboard, self._writer = False, None
            else:
                self._mlflow, self.run_id = False, None
            if self.on_error is not None:
                self.on_error(sink, f"{type(exc).__name__}: {str(exc)[:300]}")
