"""Text the store cannot hold is refused at the door: a NUL character (PostgreSQL's
text refuses it) or an unpaired UTF-16 surrogate (no UTF-8 encodes it, so a job
stored with one could never be read back), anywhere in the URL or in a JSON body's
keys and strings. 422 names where; nothing reaches a route. So is JSON that Python
reads only past its own limits (a number of thousands of digits, deep nesting), a
body that is not UTF-8 (RFC 8259), which Python's reader would otherwise decode, and
an object with a key twice."""

from __future__ import annotations

import json
import sys
from typing import Any
from urllib.parse import unquote_to_bytes

from .asgi import read_body, replay, send_error

Scope = dict[str, Any]


def _bad(text: str) -> bool:
    return "\x00" in text or any("\ud800" <= c <= "\udfff" for c in text)


def bad_string_path(value: Any, path: str = "") -> str | None:
    """The dotted path of the first key or string holding bad text, or None."""
    if isinstance(value, str):
        return (path or "body") if _bad(value) else None
    if isinstance(value, dict):
        for key, item in value.items():
            where = f"{path}.{key}" if path else str(key)
            if _bad(key):
                return f"{path or 'body'} (a key)"
            found = bad_string_path(item, where)
            if found is not None:
                return found
    if isinstance(value, list):
        for i, item in enumerate(value):
            found = bad_string_path(item, f"{path}[{i}]")
            if found is not None:
                return found
    return None


def storable(value: Any) -> Any:
    """``value`` with every key and string made storable: a NUL or an unpaired
    surrogate replaced by U+FFFD. For what the cluster reports (a supervisor's
    messages carry a rank's exception text, which a tenant's model can choose): one
    such report must not stop a job's sync, as a refused write on PostgreSQL would."""
    if isinstance(value, str):
        if not _bad(value):
            return value
        return "".join("\ufffd" if c == "\x00" or "\ud800" <= c <= "\udfff" else c for c in value)
    if isinstance(value, dict):
        return {storable(k): storable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [storable(v) for v in value]
    return value


class TextGuard:
    """ASGI middleware; runs inside BodyLimit, which bounds and replays the body."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if "\x00" in scope.get("path", "") or b"\x00" in unquote_to_bytes(
            scope.get("query_string", b"")
        ):
            await send_error(send, 422, "url: a NUL character is refused")
            return
        body = await read_body(receive) or b""
        refused = _refused_body(body)
        if refused is not None:
            await send_error(send, 422, refused)
            return
        await self.app(scope, replay(body, receive), send)


_BOMS = (
    (b"\xff\xfe\x00\x00", "UTF-32 (little-endian, with a byte order mark)"),
    (b"\x00\x00\xfe\xff", "UTF-32 (big-endian, with a byte order mark)"),
    (b"\xef\xbb\xbf", "UTF-8 with a byte order mark"),
    (b"\xff\xfe", "UTF-16 (little-endian, with a byte order mark)"),
    (b"\xfe\xff", "UTF-16 (big-endian, with a byte order mark)"),
)


def _other_encoding(body: bytes) -> str | None:
    """What a body is when it is not plain UTF-8 that ``json.loads`` would still read:
    Python's JSON reader detects UTF-16 and UTF-32 by their NUL bytes and skips a byte
    order mark, which RFC 8259 forbids on the wire. JSON in UTF-8 never holds a NUL
    byte (a NUL in a string is written ``\\u0000``)."""
    for bom, name in _BOMS:
        if body.startswith(bom):
            return name
    if b"\x00" in body[:4]:
        return "UTF-16 or UTF-32"
    return None


class DuplicateKey(ValueError):
    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An object whose keys are all different. With one twice, parsers differ on which
    value counts (Python's keeps the last, others the first), so a proxy or a log could
    read another job than the one stored: RFC 8259 leaves it open, and it is refused."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise DuplicateKey(key)
        out[key] = value
    return out


MAX_DEPTH = 512
"""The deepest nesting a body may have. Fixed well below the interpreter's recursion
limit: the routes parse the body again further down the stack than this guard, and a
depth between the two would fail there as a bare 400."""


def _deeper_than(value: Any, most: int) -> bool:
    """Whether ``value`` nests lists and objects deeper than ``most`` (without recursion)."""
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict | list):
            if depth > most:
                return True
            items = node.values() if isinstance(node, dict) else node
            stack.extend((item, depth + 1) for item in items if isinstance(item, dict | list))
    return False


def _refused_body(body: bytes) -> str | None:
    """Why a JSON body is refused before any route reads it, or None. JSON that Python
    reads only past its own limits (an integer of more than 4300 digits, nesting deeper
    than the interpreter's recursion) is bad input too, not a body that failed to parse."""
    if not body:
        return None
    encoding = _other_encoding(body)
    if encoding is not None:
        return f"body: JSON must be UTF-8 text (RFC 8259); this body is {encoding}"
    try:
        value = json.loads(body, object_pairs_hook=_unique_keys)
        if _deeper_than(value, MAX_DEPTH):
            return f"body: nested deeper than {MAX_DEPTH} levels"
        where = bad_string_path(value)
    except DuplicateKey as exc:
        return f"body: the key {exc.key[:64]!r} appears twice in one object"
    except json.JSONDecodeError:
        return None  # not JSON: the route answers it
    except UnicodeDecodeError as exc:  # a ValueError too: before the digits' case
        return f"body: not UTF-8 text (byte {body[exc.start]:#04x} at offset {exc.start})"
    except ValueError:  # int() refuses that many digits
        return f"body: a number has more than {sys.get_int_max_str_digits()} digits"
    except RecursionError:
        return "body: nested too deep"
    if where is None:
        return None
    return f"{where}: text with a NUL character or an unpaired surrogate is refused"
