"""A submission_id makes a submission idempotent: a retry of the same request returns
the job the first one stored. The same id sent with a different request is the
client's mistake (an id reused, or a spec changed after a timeout the client took for a
failure) and is refused with 409: answering it with the first job would hand back a
job that is not the one asked for, and the client would never know."""

from __future__ import annotations

import hashlib
import json

from .db import Job
from .schemas import JobSubmit


class SubmissionIdReused(Exception):
    """A submission_id already stored with a different request."""


def request_digest(body: JobSubmit) -> str:
    """SHA-256 of the request as parsed, less its submission_id: the spec with its
    defaults filled in (a retry that spells a default out is the same request) and the
    priority as sent."""
    payload = body.model_dump(mode="json", exclude={"submission_id"})
    canonical = json.dumps(payload, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def check_retry(job: Job, digest: str) -> None:
    """Refuse a retry whose request differs from the one that stored ``job``. Jobs
    stored before digests were kept (``request_digest`` None) answer every retry."""
    if job.request_digest is not None and job.request_digest != digest:
        raise SubmissionIdReused(
            f"submission_id {job.submission_id!r} was used for another request (job "
            f"{job.id}); send that same request to retry it, or a new submission_id "
            "for a new job"
        )
