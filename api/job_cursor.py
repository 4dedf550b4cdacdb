"""A position in the newest-first list of jobs, handed to clients as an opaque cursor.

An offset counts rows from the newest: a job submitted between two pages shifts every
row down one, and the next page repeats the last row of the one before. A cursor names
the last job shown (its creation time and id, the list's order), and the next page
starts after it whatever was submitted since."""

from __future__ import annotations

import base64
import binascii
import json
import re
from datetime import datetime, timezone
from typing import NamedTuple

_ID = re.compile(r"^[0-9a-f-]{1,36}$")
"""Job ids are UUIDs: anything else was not written by this module."""


class Position(NamedTuple):
    created_at: datetime
    job_id: str


class BadCursor(ValueError):
    """A cursor this service did not hand out (or one edited since)."""


def encode(position: Position) -> str:
    raw = json.dumps([position.created_at.isoformat(), position.job_id]).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode(cursor: str) -> Position:
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        when, job_id = json.loads(raw)
        created_at = datetime.fromisoformat(when)
        if created_at.tzinfo is None or not isinstance(job_id, str) or not _ID.match(job_id):
            raise ValueError("not a position")
        return Position(created_at.astimezone(timezone.utc), job_id)
    except (binascii.Error, ValueError, TypeError, OverflowError) as exc:  # JSON's too
        raise BadCursor(f"cursor: not a cursor this service gave ({exc})") from None
