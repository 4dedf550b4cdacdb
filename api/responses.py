"""What the OpenAPI schema says a route may answer besides its result: every error
status the service sends, with the body it sends (``ErrorOut``), so that a client
generated from the schema, or a checker holding responses to it, meets no status and
no body the schema does not describe."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel


class ErrorOut(BaseModel):
    """An error's body."""

    detail: str | list[dict[str, Any]] | dict[str, Any]
    """A message naming the field or the numbers; for a request of the wrong form
    (422), a list of ``{"loc", "msg", "type"}``; a plan that does not fit, the numbers."""


_WHY = {
    400: "a Content-Length that is not a whole number of bytes",
    401: "no valid bearer token (with WWW-Authenticate: Bearer)",
    403: "an admin token is required",
    404: "no such object visible to this token (another tenant's answers the same)",
    409: "the request conflicts with the object's state or a unique name",
    413: "the body is larger than the service accepts",
    422: "the request's form or what it asks is refused, naming the field or the numbers",
    429: "this token's rate, its tenant's queue or its tenant's model builds in flight "
    "are at their limit (with Retry-After)",
    503: "the store or the cluster does not answer now (with Retry-After)",
}


def errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    """``responses=`` for a router or a route: each status with its body and why."""
    return {code: {"model": ErrorOut, "description": _WHY[code]} for code in codes}


ANY_REQUEST = (400, 413, 422, 503)
"""What any route may answer: the body limit's 400 and 413, the text guard's 422 (a
NUL in the URL), and 503 from the store."""
AUTHENTICATED = (*ANY_REQUEST, 401, 429)
"""What a route that needs a token may answer besides."""
