"""What a tenant may ask of the shared cluster: a priority up to its ceiling, ranks and
GPUs in use up to its quotas, a bounded queue; and no job larger than the cluster can
ever be. Ceilings and quotas are set per tenant by an admin (``PUT
/v1/tenants/{name}/limits``)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from pydantic import ValidationError
from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from workers.spec import JobSpec, ResourcesSpec
from workers.state import ACTIVE, JobState

from .auth import Principal
from .backend import job_bundles
from .db import Job, Tenant
from .settings import Settings


class OverLimit(Exception):
    """A submission beyond a limit; ``status``: 422 (never admissible) or 429 (not now)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@dataclass
class Usage:
    ranks: int = 0
    gpus: int = 0


def quota_ranks(res: ResourcesSpec) -> int:
    """Ranks a job counts for against its tenant's quotas: its largest size. An
    elastic job starts at what fits and grows to max_dp as capacity returns, without
    asking the control plane again, so only counting it whole keeps the tenant within
    its quota."""
    return res.highest_dp * res.mp


def count_usage(usage: dict[int, Usage], tenant_id: int, res: ResourcesSpec) -> None:
    ranks = quota_ranks(res)
    usage[tenant_id].ranks += ranks
    usage[tenant_id].gpus += ranks * res.gpus_per_rank


def active_usage(session: Session) -> dict[int, Usage]:
    """Ranks and GPUs each tenant's active jobs hold."""
    usage: dict[int, Usage] = defaultdict(Usage)
    for tenant_id, spec in session.execute(
        select(Job.tenant_id, Job.spec).where(Job.status.in_(ACTIVE))
    ).tuples():
        count_usage(usage, tenant_id, _held_resources(spec.get("resources", {})))
    return usage


def _held_resources(resources: dict) -> ResourcesSpec:
    """An active job's resources as stored. One stored by an older version may no longer
    validate (a bound tightened since); it still holds its ranks, and counting it must
    not stop admission for every tenant: its numbers are taken as they are."""
    try:
        return ResourcesSpec.model_validate(resources)
    except ValidationError:
        fields = ResourcesSpec.model_fields
        numbers = {k: v for k, v in resources.items() if k in fields and _number(v)}
        return ResourcesSpec.model_construct(**numbers)


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value >= 0


def within_quota(session: Session, tenant_id: int, spec: JobSpec, usage: dict) -> bool:
    tenant = session.get(Tenant, tenant_id)
    held = usage[tenant_id]
    ranks = quota_ranks(spec.resources)
    if tenant is None:
        return True
    if tenant.max_ranks is not None and held.ranks + ranks > tenant.max_ranks:
        return False
    gpus = ranks * spec.resources.gpus_per_rank
    return tenant.max_gpus is None or held.gpus + gpus <= tenant.max_gpus


def check_submission(
    session: Session,
    who: Principal,
    spec: JobSpec,
    priority: int | None,
    settings: Settings,
    hold: bool = True,
) -> int:
    """The job's priority (``None``: the default, see ``JobSubmit.priority``), or
    OverLimit unless the job may be queued now for this tenant. With ``hold`` the
    tenant is held until the session ends (see ``_hold_tenant``): the caller stores
    the job in it; without, the same answer as a first look (before the costly plan)."""
    _fits_the_cluster(spec, settings)
    if hold:
        _hold_tenant(session, who.tenant_id)
    tenant = session.get(Tenant, who.tenant_id)
    assert tenant is not None
    if priority is None:
        priority = min(0, tenant.max_priority)
    elif priority > tenant.max_priority and not who.admin:
        raise OverLimit(
            422, f"priority: {priority} is above this tenant's ceiling {tenant.max_priority}"
        )
    _within_quotas(tenant, spec)
    queued = session.execute(
        select(func.count(Job.id)).where(
            Job.tenant_id == who.tenant_id, Job.status == JobState.QUEUED
        )
    ).scalar_one()
    most = (
        tenant.max_queued_jobs if tenant.max_queued_jobs is not None else settings.max_queued_jobs
    )
    if queued >= most:
        raise OverLimit(429, f"quota: {queued} jobs queued, this tenant's limit is {most}")
    return priority


def check_admissible(session: Session, tenant_id: int, spec: JobSpec, settings: Settings) -> None:
    """OverLimit (422) when the job could never be admitted, whatever else runs: larger
    than the cluster can ever be, or than the tenant's rank or GPU quota. ``POST
    /v1/plan`` asks this, so that a plan and a submission of one spec agree."""
    _fits_the_cluster(spec, settings)
    tenant = session.get(Tenant, tenant_id)
    if tenant is not None:
        _within_quotas(tenant, spec)


def _within_quotas(tenant: Tenant, spec: JobSpec) -> None:
    ranks = quota_ranks(spec.resources)
    gpus = ranks * spec.resources.gpus_per_rank
    largest = "" if spec.resources.highest_dp == spec.resources.lowest_dp else " at max_dp"
    for name, need, limit in (("ranks", ranks, tenant.max_ranks), ("GPUs", gpus, tenant.max_gpus)):
        if limit is not None and need > limit:
            raise OverLimit(
                422, f"resources: needs {need} {name}{largest}; this tenant's quota is {limit}"
            )


def _hold_tenant(session: Session, tenant_id: int) -> None:
    """Count and store one submission at a time per tenant, across API replicas: an
    UPDATE of the tenant's row to its own values takes the row's lock on PostgreSQL, and
    SQLite's write lock, until the session commits the job or rolls back. Without it
    concurrent submissions each counted the queue before any of them was stored, and
    all were queued past ``max_queued_jobs``."""
    session.execute(
        update(Tenant).where(Tenant.id == tenant_id).values(max_priority=Tenant.max_priority)
    )


def _fits_the_cluster(spec: JobSpec, settings: Settings) -> None:
    """422 with the numbers when the job's smallest size exceeds the cluster's maximum
    (ZEROSERVICE_MAX_CLUSTER): it could never start."""
    need: dict[str, float] = {}
    for bundle in job_bundles(spec):
        for resource, amount in bundle.items():
            need[resource] = need.get(resource, 0.0) + amount
    for resource, amount in sorted(need.items()):
        most = settings.max_cluster.get(resource)
        if most is not None and amount > most:
            raise OverLimit(
                422,
                f"resources: needs {amount:g} {resource} at min_dp {spec.resources.lowest_dp} "
                f"× mp {spec.resources.mp}; the cluster has at most {most:g} "
                "(ZEROSERVICE_MAX_CLUSTER)",
            )
