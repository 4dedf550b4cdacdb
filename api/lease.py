"""A named lease in the store: among API replicas sharing one store, the holder alone
runs the scheduler (syncs from Ray, admits, asks the autoscaler), so that jobs are
launched once and their events stored once.

Taking and renewing are each one conditional statement (insert if absent; update
when held by us or expired), atomic on SQLite and PostgreSQL alike; a holder that
stops renewing loses the lease after ``ttl_s``.
"""

from __future__ import annotations

import os
import socket
import uuid
from datetime import timedelta

from sqlalchemy import delete, or_, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from .db import Lease, utcnow


def new_holder() -> str:
    """This process's name as a lease holder: host, pid and a random part."""
    return f"{socket.gethostname()[:80]}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def acquire(session: Session, name: str, holder: str, ttl_s: float) -> bool:
    """Take or renew the lease for ``ttl_s`` more seconds; False when another holds it."""
    now = utcnow()
    expires = now + timedelta(seconds=ttl_s)
    taken = session.execute(
        update(Lease)
        .where(Lease.name == name, or_(Lease.holder == holder, Lease.expires_at < now))
        .values(holder=holder, expires_at=expires)
    )
    if taken.rowcount == 1:  # type: ignore[attr-defined]
        session.commit()
        return True
    session.add(Lease(name=name, holder=holder, expires_at=expires))
    try:
        session.commit()
    except IntegrityError:
        session.rollback()
        return False
    return True


def release(session: Session, name: str, holder: str) -> None:
    session.execute(delete(Lease).where(Lease.name == name, Lease.holder == holder))
    session.commit()
