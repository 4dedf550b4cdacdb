"""Service settings, from the environment (ZEROSERVICE_*), with local defaults."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def _data_dir() -> Path:
    if "ZEROSERVICE_HOME" in os.environ:
        return Path(os.environ["ZEROSERVICE_HOME"])
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "zeroservice"


def _listed(value: str, sep: str) -> tuple[str, ...]:
    return tuple(item.strip() for item in value.split(sep) if item.strip())


class SettingsError(ValueError):
    """A ZEROSERVICE_* variable whose value is not of its kind; the message names it."""


def _number(env: Mapping[str, str], name: str, kind: type[int] | type[float]) -> Any:
    text = env[name]
    try:
        value = kind(text)
    except ValueError:
        noun = "a whole number" if kind is int else "a number"
        raise SettingsError(f"{name}={text[:40]!r}: not {noun}") from None
    if isinstance(value, float) and not math.isfinite(value):
        raise SettingsError(f"{name}={text[:40]!r}: not a finite number")
    return value


def _amounts(env: Mapping[str, str], name: str) -> dict[str, float]:
    """A JSON object of resource amounts, ``{"CPU": 64, "GPU": 8}``."""
    text = env[name]
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise SettingsError(f"{name}={text[:40]!r}: not JSON ({exc})") from None
    amounts = isinstance(value, dict) and all(
        isinstance(v, int | float) and not isinstance(v, bool) and 0 <= v < math.inf
        for v in value.values()
    )
    if not amounts:
        raise SettingsError(
            f'{name}={text[:40]!r}: not an object of resource amounts ({{"CPU": 64, "GPU": 8}})'
        )
    return {str(k): float(v) for k, v in value.items()}


TOKEN_FILE = "admin-token"
"""Where the first start writes the admin token, in the data directory (mode 600)."""


@dataclass
class Settings:
    data_dir: Path = field(default_factory=_data_dir)
    database_url: str = ""
    """SQLAlchemy URL; default: a SQLite file in the data directory."""
    host: str = "127.0.0.1"
    port: int = 8765
    ray_address: str | None = None
    """Ray cluster to join ("auto", "ray://...", host:port); None: already connected."""
    checkpoint_root: str = ""
    """Where jobs keep checkpoints (default: <data_dir>/checkpoints/<job id>); a
    directory or an ``s3://bucket/prefix``."""
    checkpoint_s3_root: str = ""
    """An ``s3://bucket/prefix`` under which a tenant may name ``checkpoint.dir`` as
    ``s3://bucket/prefix/<tenant>/...``; empty: tenants may name no s3 prefix."""
    scheduler_interval_s: float = 1.0
    backfill_grace_s: float = 600.0
    """A queued job that does not fit lets smaller ones pass for this long, then holds
    the queue until it starts."""
    max_queued_jobs: int = 100
    """Queued jobs per tenant unless an admin set the tenant's own limit."""
    rate_per_s: float = 20.0
    """Requests per second per token (sustained), answered 429 beyond."""
    rate_burst: int = 40
    """Requests a token may make at once before the rate applies."""
    scheduler_lease_s: float = 15.0
    """A replica that has not ticked for this long loses the scheduler to another."""
    supervisor_poll_timeout_s: float = 30.0
    """How long one poll of a job's supervisor may take before it counts as unanswered."""
    supervisor_silent_s: float = 120.0
    """A supervisor that has answered no poll for this long (its process stopped or
    hung) is stopped and replaced, as a lost one is (see [Note: supervised supervisor]
    in api/scheduler.py)."""
    max_cluster: dict[str, float] = field(default_factory=lambda: {"CPU": 64.0, "GPU": 8.0})
    """Upper bound of what the autoscaler is asked for, in total."""
    device_memory_gib: float = 80.0
    """Memory per GPU rank that submitted jobs' memory plans are checked against."""
    cpu_rank_memory_gib: float = 16.0
    """Memory per CPU rank for the same check."""
    model_factories: tuple[str, ...] = ()
    """Module prefixes whose ``module:function`` tenants may name as a factory model
    (``*``: any); empty: factory models are refused. See docs/operations.md."""
    data_roots: tuple[str, ...] = ()
    """Directories a tenant's ``data.path`` must resolve under (``{tenant}`` is replaced
    by the tenant's name); default: ``<data_dir>/data/{tenant}``."""
    data_s3_root: str = ""
    """An ``s3://bucket/prefix`` under which a tenant may name ``data.path`` as
    ``s3://bucket/prefix/<tenant>/...``; empty: tenants may name no s3 object."""
    plan_timeout_s: float = 120.0
    """How long building a factory or transformers model for its plan may take."""
    plan_memory_gib: float = 4.0
    """How much memory that build may take on its worker."""
    plan_builds_per_tenant: int = 2
    """How many such builds one tenant may have in flight at once (more: 429): each
    holds a request thread while it waits."""
    max_events_per_job: int = 10_000
    """Events kept per job (the newest; older ones are deleted)."""
    max_log_lines_per_job: int = 10_000
    """Log lines kept per job (the newest)."""
    max_history_per_job: int = 2_000
    """Points of the per-step history kept per job: every step up to this many, then
    downsampled (windows of 2, 4, 8... steps merged), so between half of it and it."""
    mlflow_tracking_uri: str = ""
    """Where jobs with ``tracking.mlflow`` log their runs unless they name a server;
    default: a local file store, ``<data_dir>/mlruns``."""
    mlflow_uris: tuple[str, ...] = ()
    """MLflow servers (http/https URIs) a job may name as ``tracking.mlflow_uri``
    besides the default; empty: none."""
    token_ttl_days: int = 90
    """Lifetime of tokens created through the API when the request names none."""
    max_body_bytes: int = 2**20
    """Largest request body accepted (413 above)."""
    metrics_token: str | None = field(default=None, repr=False)
    """A read-only token for Prometheus: it reads /v1/targets (every job's rank
    endpoints) and nothing else; from a Secret or an env file."""
    admin_token: str | None = field(default=None, repr=False)
    """An admin token provisioned from outside (a Kubernetes Secret, compose): ensured
    to exist at start; without one, the first start creates a token and writes it to
    the data directory."""

    def __post_init__(self) -> None:
        self.data_dir = Path(self.data_dir)
        if not self.database_url:
            self.database_url = f"sqlite:///{self.data_dir / 'zeroservice.db'}"
        if not self.checkpoint_root:
            self.checkpoint_root = str(self.data_dir / "checkpoints")
        if not self.mlflow_tracking_uri:
            self.mlflow_tracking_uri = (self.data_dir / "mlruns").absolute().as_uri()
        if not self.data_roots:
            self.data_roots = (str(self.data_dir / "data" / "{tenant}"),)
        for name in ("supervisor_poll_timeout_s", "supervisor_silent_s"):
            value = getattr(self, name)
            if not value > 0:
                raise SettingsError(f"{name}: must be a number of seconds > 0, got {value!r}")

    @classmethod
    def from_env(cls) -> Settings:
        """The settings the environment gives; SettingsError names a variable whose
        value is not of its kind."""
        env = os.environ
        kwargs: dict = {}
        if "ZEROSERVICE_DATABASE_URL" in env:
            kwargs["database_url"] = env["ZEROSERVICE_DATABASE_URL"]
        if "ZEROSERVICE_HOST" in env:
            kwargs["host"] = env["ZEROSERVICE_HOST"]
        if "ZEROSERVICE_PORT" in env:
            kwargs["port"] = _number(env, "ZEROSERVICE_PORT", int)
        if "ZEROSERVICE_RAY_ADDRESS" in env:
            kwargs["ray_address"] = env["ZEROSERVICE_RAY_ADDRESS"]
        if "ZEROSERVICE_CHECKPOINT_ROOT" in env:
            kwargs["checkpoint_root"] = env["ZEROSERVICE_CHECKPOINT_ROOT"]
        if "ZEROSERVICE_CHECKPOINT_S3_ROOT" in env:
            kwargs["checkpoint_s3_root"] = env["ZEROSERVICE_CHECKPOINT_S3_ROOT"]
        if "ZEROSERVICE_MAX_CLUSTER" in env:
            kwargs["max_cluster"] = _amounts(env, "ZEROSERVICE_MAX_CLUSTER")
        if "ZEROSERVICE_DEVICE_MEMORY_GIB" in env:
            kwargs["device_memory_gib"] = _number(env, "ZEROSERVICE_DEVICE_MEMORY_GIB", float)
        if env.get("ZEROSERVICE_METRICS_TOKEN"):
            kwargs["metrics_token"] = env["ZEROSERVICE_METRICS_TOKEN"]
        if env.get("ZEROSERVICE_ADMIN_TOKEN"):
            kwargs["admin_token"] = env["ZEROSERVICE_ADMIN_TOKEN"]
        if "ZEROSERVICE_SCHEDULER_INTERVAL_S" in env:
            kwargs["scheduler_interval_s"] = _number(env, "ZEROSERVICE_SCHEDULER_INTERVAL_S", float)
        if "ZEROSERVICE_SCHEDULER_LEASE_S" in env:
            kwargs["scheduler_lease_s"] = _number(env, "ZEROSERVICE_SCHEDULER_LEASE_S", float)
        if "ZEROSERVICE_MODEL_FACTORIES" in env:
            kwargs["model_factories"] = _listed(env["ZEROSERVICE_MODEL_FACTORIES"], ",")
        if "ZEROSERVICE_DATA_ROOTS" in env:
            kwargs["data_roots"] = _listed(env["ZEROSERVICE_DATA_ROOTS"], os.pathsep)
        if "ZEROSERVICE_DATA_S3_ROOT" in env:
            kwargs["data_s3_root"] = env["ZEROSERVICE_DATA_S3_ROOT"]
        if env.get("ZEROSERVICE_MLFLOW_TRACKING_URI"):
            kwargs["mlflow_tracking_uri"] = env["ZEROSERVICE_MLFLOW_TRACKING_URI"]
        if "ZEROSERVICE_MLFLOW_URIS" in env:
            kwargs["mlflow_uris"] = _listed(env["ZEROSERVICE_MLFLOW_URIS"], ",")
        if "ZEROSERVICE_PLAN_TIMEOUT_S" in env:
            kwargs["plan_timeout_s"] = _number(env, "ZEROSERVICE_PLAN_TIMEOUT_S", float)
        if "ZEROSERVICE_PLAN_MEMORY_GIB" in env:
            kwargs["plan_memory_gib"] = _number(env, "ZEROSERVICE_PLAN_MEMORY_GIB", float)
        for name in (
            "backfill_grace_s",
            "rate_per_s",
            "supervisor_poll_timeout_s",
            "supervisor_silent_s",
        ):
            if f"ZEROSERVICE_{name.upper()}" in env:
                kwargs[name] = _number(env, f"ZEROSERVICE_{name.upper()}", float)
        for name in (
            "plan_builds_per_tenant",
            "max_events_per_job",
            "max_log_lines_per_job",
            "max_history_per_job",
            "max_queued_jobs",
            "rate_burst",
        ):
            if f"ZEROSERVICE_{name.upper()}" in env:
                kwargs[name] = _number(env, f"ZEROSERVICE_{name.upper()}", int)
        if "ZEROSERVICE_TOKEN_TTL_DAYS" in env:
            kwargs["token_ttl_days"] = _number(env, "ZEROSERVICE_TOKEN_TTL_DAYS", int)
        if "ZEROSERVICE_MAX_BODY_BYTES" in env:
            kwargs["max_body_bytes"] = _number(env, "ZEROSERVICE_MAX_BODY_BYTES", int)
        if "ZEROSERVICE_CPU_RANK_MEMORY_GIB" in env:
            kwargs["cpu_rank_memory_gib"] = _number(env, "ZEROSERVICE_CPU_RANK_MEMORY_GIB", float)
        return cls(**kwargs)
