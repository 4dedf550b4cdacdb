"""What a tenant's job may name: factories from allowed modules, data under the
operator's data roots, checkpoints under the tenant's own directory, and objects
below the tenant's own prefix of the operator's s3 roots.

Each check works on names and paths only: nothing a tenant names is imported, opened
or created here (see docs/operations.md, "Trust model").
"""

from __future__ import annotations

import os

from workers.spec import S3_SCHEME, FactoryModelSpec, JobSpec, TrackingSpec
from zeroservice.checkpoint.storage import location

from .settings import Settings


class Refused(ValueError):
    """A job names something outside what its tenant may use; the message names the field."""


def check_factory(factory: str, allowed: tuple[str, ...]) -> None:
    """``module:function`` must lie in a module under an allowed prefix (``*``: any)."""
    module = factory.partition(":")[0]
    if "*" in allowed or any(module == p or module.startswith(p + ".") for p in allowed):
        return
    offered = ", ".join(allowed) if allowed else "none are enabled"
    raise Refused(
        f"model.factory: {factory!r} is not in a module this service allows "
        f"(ZEROSERVICE_MODEL_FACTORIES: {offered})"
    )


NAME_MAX = 255
"""Bytes in one name of a path, the limit of Linux's file systems."""


def tenant_data_roots(settings: Settings, tenant: str) -> list[str]:
    return [os.path.realpath(root.replace("{tenant}", tenant)) for root in settings.data_roots]


def resolve_data_path(path: str, tenant: str, settings: Settings) -> str:
    """The real path (symlinks resolved) of ``path``, which must lie under one of the
    tenant's data roots; a relative path is taken from the first root."""
    roots = tenant_data_roots(settings, tenant)
    if any(c < " " or c == "\x7f" for c in path):
        raise Refused("data.path: a control character (a NUL, a newline, ...) is refused")
    long = next((part for part in path.split("/") if len(part.encode()) > NAME_MAX), None)
    if long is not None:
        raise Refused(
            f"data.path: the name {long[:24]!r}... is over {NAME_MAX} bytes, which no file "
            "system holds"
        )
    real = os.path.realpath(os.path.join(roots[0], path))
    if real in roots:
        raise Refused(f"data.path: {path!r} is a data root itself (a directory): name a file")
    if not any(real.startswith(root + os.sep) for root in roots):
        raise Refused(f"data.path: {path!r} is not under this tenant's data roots")
    return real


def checkpoint_base(settings: Settings, tenant: str) -> str:
    """The tenant's checkpoint directory (or s3 prefix): every job of the tenant
    checkpoints below it."""
    return str(location(settings.checkpoint_root) / tenant)


def checkpoint_path(base: str, job_id: str, sub: str | None) -> str:
    """``<base>/<sub>`` when the job names a sub-directory (to resume from an earlier
    job's checkpoints), else ``<base>/<job id>``. ``sub`` is a checked relative path
    (workers.spec.CheckpointSpec), or an s3 URI that ``check_checkpoint_uri`` allowed."""
    if sub is not None and sub.startswith(S3_SCHEME):
        return sub
    return str(location(base) / (sub or job_id))


def check_checkpoint_uri(uri: str, tenant: str, settings: Settings) -> None:
    """An ``s3://`` checkpoint.dir must lie strictly below ``<s3 root>/<tenant>/``."""
    _check_tenant_uri(
        uri, tenant, settings.checkpoint_s3_root, "checkpoint.dir", "ZEROSERVICE_CHECKPOINT_S3_ROOT"
    )


def check_data_uri(uri: str, tenant: str, settings: Settings) -> None:
    """An ``s3://`` data.path must lie strictly below ``<s3 root>/<tenant>/``."""
    _check_tenant_uri(uri, tenant, settings.data_s3_root, "data.path", "ZEROSERVICE_DATA_S3_ROOT")


def _check_tenant_uri(uri: str, tenant: str, root: str, field: str, env: str) -> None:
    """``uri`` must lie strictly below ``<root>/<tenant>/`` (the spec's validators already
    refused empty, ``.`` and ``..`` components); no root: no object storage at all."""
    if not root:
        raise Refused(
            f"{field}: {uri[:64]!r}: this service offers tenants no object storage here "
            f"({env} is not set)"
        )
    own = f"{location(root) / tenant}/"
    if not uri.startswith(own) or uri == own:
        raise Refused(
            f"{field}: {uri[:64]!r} is not under this tenant's object-storage prefix {own}"
        )


def confine_tracking(tracking: TrackingSpec, tenant: str, settings: Settings) -> TrackingSpec:
    """The job's tracking with the service's defaults filled in (the MLflow URI, the
    tenant's name as experiment); a URI other than the service's must be one of the
    servers the operator allows (a file store of a tenant's choosing never is). A
    named experiment is the tenant's own, ``<tenant>/<name>``: tenants share the
    tracking server, and a bare name could be another tenant's (its default
    experiment is its name; tenant names hold no ``/``)."""
    if not tracking.mlflow:
        return tracking
    uri = tracking.mlflow_uri
    allowed = (settings.mlflow_tracking_uri, *settings.mlflow_uris)
    if uri is not None and uri not in allowed:
        offered = ", ".join(settings.mlflow_uris) or "none besides the default"
        raise Refused(
            f"tracking.mlflow_uri: {uri[:64]!r} is not a server this service allows "
            f"(ZEROSERVICE_MLFLOW_URIS: {offered})"
        )
    return tracking.model_copy(
        update={
            "mlflow_uri": uri or settings.mlflow_tracking_uri,
            "experiment": tenant_experiment(tracking.experiment, tenant),
        }
    )


def tenant_experiment(name: str | None, tenant: str) -> str:
    """The MLflow experiment a tenant's job logs to: its name, or ``<tenant>/<name>``
    (a name already in the tenant's namespace is kept, so confining twice is a no-op)."""
    if name is None or name == tenant or name.startswith(tenant + "/"):
        return name or tenant
    return f"{tenant}/{name}"


def confine(spec: JobSpec, tenant: str, settings: Settings) -> JobSpec:
    """The spec as the workers will run it (data path resolved, tracking defaults
    filled in), or Refused."""
    if isinstance(spec.model, FactoryModelSpec):
        check_factory(spec.model.factory, settings.model_factories)
    if spec.checkpoint.dir is not None and spec.checkpoint.dir.startswith(S3_SCHEME):
        check_checkpoint_uri(spec.checkpoint.dir, tenant, settings)
    update: dict = {"tracking": confine_tracking(spec.tracking, tenant, settings)}
    if spec.data.path is not None and spec.data.path.startswith(S3_SCHEME):
        check_data_uri(spec.data.path, tenant, settings)
    elif spec.data.path is not None:
        path = resolve_data_path(spec.data.path, tenant, settings)
        update["data"] = spec.data.model_copy(update={"path": path})
    return spec.model_copy(update=update)
