"""A bound on request bodies: a larger one is answered 413 before any route reads it."""

from __future__ import annotations

from typing import Any

from .asgi import read_body, replay, send_error

Scope = dict[str, Any]


class BodyLimit:
    """ASGI middleware: the body is read (at most ``max_bytes``) before the app runs,
    then replayed to it; a declared or actual larger body gets 413, a declared length
    that is not a number 400."""

    def __init__(self, app: Any, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers", [])).get(b"content-length")
        if declared is not None and not declared.isdigit():
            await send_error(send, 400, "Content-Length: not a whole number of bytes")
            return
        if declared is not None and int(declared) > self.max_bytes:
            await self._refuse(send)
            return
        body = await read_body(receive, self.max_bytes)
        if body is None:
            await self._refuse(send)
            return
        await self.app(scope, replay(body, receive), send)

    async def _refuse(self, send: Any) -> None:
        detail = f"body: larger than {self.max_bytes} bytes (ZEROSERVICE_MAX_BODY_BYTES)"
        await send_error(send, 413, detail)
