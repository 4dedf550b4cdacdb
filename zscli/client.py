"""A small HTTP client of the REST API, used by the CLI."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit

import httpx

from api.settings import Settings

from .server import StackError, read_stack


class ApiError(Exception):
    """An answer of the API that is not a success, or none (``status`` 0: the service
    could not be reached, or the URL or token cannot be used); the CLI prints it as one
    line."""

    def __init__(self, status: int, detail: Any):
        super().__init__(f"HTTP {status}: {detail}" if status else str(detail))
        self.status, self.detail = status, detail


class Client:
    def __init__(self, url: str, token: str, timeout: float = 30.0):
        not_url = ApiError(0, f"ZEROSERVICE_URL: {url[:80]!r} is not an http:// or https:// URL")
        try:
            parts = urlsplit(url)
            parts.port  # noqa: B018 -- a port that is not a number raises here
        except ValueError:  # an unclosed [ or a bad port
            raise not_url from None
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise not_url
        if not token.isascii() or not token.isprintable() or " " in token:
            raise ApiError(
                0,
                "ZEROSERVICE_TOKEN: not a token (it holds spaces, control or non-ASCII characters)",
            )
        self.url = url
        try:
            self.http = httpx.Client(
                base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=timeout
            )
        except (httpx.InvalidURL, ValueError):
            raise not_url from None

    @classmethod
    def from_env(cls, settings: Settings | None = None) -> Client:
        """URL and token from ZEROSERVICE_URL / ZEROSERVICE_TOKEN, else the local stack."""
        settings = settings or Settings.from_env()
        url = os.environ.get("ZEROSERVICE_URL")
        token = os.environ.get("ZEROSERVICE_TOKEN")
        if not url or token is None:  # the local stack only for what is not set
            try:
                stack = read_stack(settings) or {}
            except StackError as exc:
                raise ApiError(0, exc) from None
            url = url or stack.get("url")
            token_file = stack.get("token_file")
            if token is None and isinstance(token_file, str) and Path(token_file).is_file():
                try:
                    token = Path(token_file).read_text().strip()
                except (OSError, UnicodeDecodeError) as exc:
                    raise ApiError(0, f"{token_file}: not a token file ({exc})") from None
        if not url or not token:
            raise ApiError(
                0,
                "no service: run `zeroservice up`, or set ZEROSERVICE_URL and ZEROSERVICE_TOKEN",
            )
        return cls(url, token)

    def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            response = self.http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:  # refused, timed out, a name that does not resolve
            raise ApiError(0, f"cannot reach the service at {self.url}: {exc}") from None
        if not response.is_success:  # a redirect is not an answer of this API either
            try:
                body = response.json()
                detail = body.get("detail", response.text) if isinstance(body, dict) else body
            except ValueError:
                detail = response.text[:200] or response.reason_phrase
            raise ApiError(response.status_code, detail)
        try:
            return response.json()
        except ValueError:
            raise ApiError(
                response.status_code, f"{method} {path}: the answer is not JSON"
            ) from None

    def submit(
        self, spec: dict, submission_id: str | None = None, priority: int | None = None
    ) -> dict:
        body: dict[str, Any] = {"spec": spec}
        if priority is not None:  # absent: the service's default (see docs/api.md)
            body["priority"] = priority
        if submission_id is not None:
            body["submission_id"] = submission_id
        return self._call("POST", "/v1/jobs", json=body)

    def jobs(
        self, status: str | None = None, limit: int = 50, offset: int = 0, cursor: str | None = None
    ) -> dict:
        params: dict[str, Any] = {"limit": limit, "offset": offset}
        if status:
            params["status"] = status
        if cursor is not None:
            params["cursor"] = cursor
        return self._call("GET", "/v1/jobs", params=params)

    def job(self, job_id: str) -> dict:
        return self._call("GET", f"/v1/jobs/{_segment(job_id)}")

    def cancel(self, job_id: str) -> dict:
        return self._call("POST", f"/v1/jobs/{_segment(job_id)}/cancel")

    def events(self, job_id: str, after: int = 0) -> list[dict]:
        """One page of the job's events after event id ``after``."""
        return self._call("GET", f"/v1/jobs/{_segment(job_id)}/events", params={"after": after})

    def all_events(self, job_id: str) -> list[dict]:
        """Every event of the job, page after page."""
        events: list[dict] = []
        while page := self.events(job_id, events[-1]["id"] if events else 0):
            events += page
        return events

    def logs(self, job_id: str, after: int = 0) -> list[dict]:
        return self._call("GET", f"/v1/jobs/{_segment(job_id)}/logs", params={"after": after})

    def metrics(self, job_id: str, after: int = -1, limit: int = 1000) -> dict:
        """Per-rank stats and one page of the per-step history (after step ``after``)."""
        params = {"history_after": after, "history_limit": limit}
        return self._call("GET", f"/v1/jobs/{_segment(job_id)}/metrics", params=params)

    def plan(self, spec: dict, device_memory_gib: float | None = None) -> dict:
        body: dict[str, Any] = {"spec": spec}
        if device_memory_gib is not None:
            body["device_memory_gib"] = device_memory_gib
        return self._call("POST", "/v1/plan", json=body)

    def cluster(self) -> dict:
        return self._call("GET", "/v1/cluster")


def _segment(job_id: str) -> str:
    """A job id as one path segment: ``..``, ``/`` or ``#`` in it reach no other route."""
    if job_id.strip(".") == "":
        raise ApiError(0, f"{job_id!r} is not a job id (see `zeroservice list`)")
    return quote(job_id, safe="")
