"""A request that carries a body to a ``/v1`` route is authenticated before its body
is read.

[Note: the body after the token]
Every ``/v1`` route needs a bearer token, but a route's dependencies (the token among
them) are solved only after FastAPI has read and parsed the body, and the middlewares
in front of it read, check and parse it too (api/body_limit.py, api/text_guard.py). So
anyone who reached the port could have the service read and parse up to
``max_body_bytes`` of JSON per request, on the event loop, without a token and beyond
any rate (rates are counted per token). This gate, in front of them, answers 401 at
once to such a request without a valid token, leaving its body unread, and hands the
caller it found to the route's dependency (``get_principal``), which then neither looks
the token up again nor skips the rate.
"""

from __future__ import annotations

from typing import Any

from anyio import to_thread

from . import store
from .asgi import send_error
from .errors import RETRY_AFTER_S, UNAVAILABLE, unavailable_detail

Scope = dict[str, Any]
PRINCIPAL = "principal"
"""The key of ``scope["state"]`` (``request.state.principal``) holding the caller."""


def _has_body(headers: dict[bytes, bytes]) -> bool:
    length = headers.get(b"content-length")
    return b"transfer-encoding" in headers or (length is not None and length.strip() != b"0")


def _bearer(headers: dict[bytes, bytes]) -> str | None:
    scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


class AuthGate:
    """ASGI middleware; see [Note: the body after the token]."""

    def __init__(self, app: Any, service: Any):
        self.app, self.service = app, service

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not str(scope.get("path", "")).startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers", []))
        if not _has_body(headers):
            await self.app(scope, receive, send)
            return
        token = _bearer(headers)
        try:
            who = await to_thread.run_sync(self._authenticate, token) if token else None
        except UNAVAILABLE as exc:  # as the routes answer it: the app's handlers are inside
            retry = [(b"retry-after", str(RETRY_AFTER_S).encode())]
            await send_error(send, 503, unavailable_detail(exc), retry)
            return
        if who is None:
            await send_error(
                send, 401, "missing or invalid bearer token", [(b"www-authenticate", b"Bearer")]
            )
            return
        scope.setdefault("state", {})[PRINCIPAL] = who
        await self.app(scope, receive, send)

    def _authenticate(self, token: str) -> Any:
        with self.service.sessions() as session:
            return store.authenticate(session, token)
