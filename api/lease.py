"""A named lease in the store: among API replicas sharing one store, the holder alone
runs the scheduler (syncs from Ray, admits, asks the autoscaler), so that jobs are
launched once and their events stored once.

Taking and renewing are each one conditional statement (insert if absent; update
when held by us or expired), atomic on SQLite and PostgreSQL alike; a holder that
stops renewing loses the lease after ``ttl_s``.

[Note: a replica restarted after a crash]
A replica that shuts down releases the lease. One that crashes cannot, and a new
process with a new name would wait ``ttl_s`` for it to lapse: a single replica
restarted after a crash would schedule nothing for that long. So a replica's name
belongs to its data directory on its host (``HOLDER_FILE``), and a process that starts
there takes the name over, lease included, when it can lock that file: an exclusive
``flock`` that the kernel drops when the process holding it exits, however it exits.
The lock held means no live process of this host holds the name, so two never share
it; where it cannot be taken (another replica runs on the same directory, which is
still alive if only stopped or hung), or the file names another host (a directory
shared between hosts), the process takes a name of its own and waits as before.
"""

from __future__ import annotations

import fcntl
import os
import socket
import uuid
from datetime import timedelta
from pathlib import Path
from typing import IO

from sqlalchemy import delete, or_, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from .db import Lease, utcnow

HOLDER_FILE = "scheduler-holder"
"""In a replica's data directory: the name its processes hold the lease under."""


def new_holder() -> str:
    """A name of its own for this process as a lease holder: host, pid and a random part."""
    return f"{_host()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def claim_holder(directory: Path) -> tuple[str, IO[str] | None]:
    """This process's name as a lease holder, and the open file whose lock keeps it this
    process's own (keep it open while the name is in use): the name of the last process
    that ran on ``directory`` on this host when none runs there now, else a new one
    (and no file). See [Note: a replica restarted after a crash]."""
    try:  # kept open: its lock is the claim
        f = open(Path(directory) / HOLDER_FILE, "a+", encoding="utf-8")  # noqa: SIM115
    except OSError:
        return new_holder(), None
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        f.seek(0)
        known = f.read().strip()
        if known.split(":")[0] == _host() and known.count(":") == 2:
            return known, f
        holder = new_holder()
        f.seek(0)
        f.truncate()
        f.write(holder)
        f.flush()
        return holder, f
    except OSError:  # locked by a live process of this directory, or unwritable
        f.close()
        return new_holder(), None


def _host() -> str:
    return socket.gethostname()[:80]


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


def hold(session: Session, name: str, holder: str, ttl_s: float) -> bool:
    """Renew the lease ``holder`` still holds, in the session's transaction (no commit);
    False when it lapsed or another holds it. A write committed with it is fenced: on
    PostgreSQL the renewal locks the lease's row until the commit, and SQLite's write
    lock does the same, so no other replica takes the lease in between. See [Note: a
    round fenced by its lease] in scheduler.py."""
    now = utcnow()
    held = session.execute(
        update(Lease)
        .where(Lease.name == name, Lease.holder == holder, Lease.expires_at >= now)
        .values(expires_at=now + timedelta(seconds=ttl_s))
    )
    return held.rowcount == 1  # type: ignore[attr-defined]


def release(session: Session, name: str, holder: str) -> None:
    session.execute(delete(Lease).where(Lease.name == name, Lease.holder == holder))
    session.commit()
