"""Bearer tokens: generated once, shown once, stored only as SHA-256 digests.

Tokens are 256 random bits, so a fast digest is enough (no password stretching is
needed against guessing); comparisons go through the database's unique index on the
digest, never through the token itself.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass

PREFIX = "zs_"


def new_token() -> str:
    return PREFIX + secrets.token_urlsafe(32)


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


@dataclass(frozen=True)
class Principal:
    """Who is calling: a tenant, and whether the token is an admin token."""

    tenant_id: int
    tenant: str
    admin: bool
    token_id: int
