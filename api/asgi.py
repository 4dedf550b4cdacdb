"""What the ASGI middlewares share: a body read once and replayed to the app, and a
JSON error answered before any route runs."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any


async def read_body(receive: Any, max_bytes: int | None = None) -> bytes | None:
    """The request's whole body, or None once it passes ``max_bytes``."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":  # the client went away
            return b"".join(chunks)
        chunks.append(message.get("body", b""))
        size += len(chunks[-1])
        if max_bytes is not None and size > max_bytes:
            return None
        if not message.get("more_body", False):
            return b"".join(chunks)


def replay(body: bytes, receive: Any) -> Any:
    """A ``receive`` that hands the app ``body`` (already read) first."""
    sent = False

    async def replayed() -> dict[str, Any]:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replayed


async def send_error(
    send: Any, status: int, detail: str, extra: Sequence[tuple[bytes, bytes]] = ()
) -> None:
    """``{"detail": ...}`` with ``status`` (and ``extra`` headers), as the app's own
    errors look."""
    payload = json.dumps({"detail": detail}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(payload))]
    headers += list(extra)
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})
