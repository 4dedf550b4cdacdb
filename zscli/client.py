"""A small HTTP client of the REST API, used by the CLI."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import httpx

from api.settings import Settings

from .server import read_stack


class ApiError(Exception):
    def __init__(self, status: int, detail: Any):
        super().__init__(f"HTTP {status}: {detail}")
        self.status, self.detail = status, detail


class Client:
    def __init__(self, url: str, token: str, timeout: float = 30.0):
        self.http = httpx.Client(
            base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=timeout
        )

    @classmethod
    def from_env(cls, settings: Settings | None = None) -> Client:
        """URL and token from ZEROSERVICE_URL / ZEROSERVICE_TOKEN, else the local stack."""
        settings = settings or Settings.from_env()
        stack = read_stack(settings) or {}
        url = os.environ.get("ZEROSERVICE_URL") or stack.get("url")
        token = os.environ.get("ZEROSERVICE_TOKEN")
        if token is None and stack.get("token_file") and Path(stack["token_file"]).is_file():
            token = Path(stack["token_file"]).read_text().strip()
        if not url or not token:
            raise ApiError(
                0,
                "no service: run `zeroservice up`, or set ZEROSERVICE_URL and ZEROSERVICE_TOKEN",
            )
        return cls(url, token)

    def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        response = self.http.request(method, path, **kwargs)
        if response.status_code >= 400:
            try:
                detail = response.json().get("detail", response.text)
            except ValueError:
                detail = response.text
            raise ApiError(response.status_code, detail)
        return response.json()

    def submit(self, spec: dict, submission_id: str | None = None, priority: int = 0) -> dict:
        body: dict[str, Any] = {"spec": spec, "priority": priority}
        if submission_id:
            body["submission_id"] = submission_id
        return self._call("POST", "/v1/jobs", json=body)

    def jobs(self, status: str | None = None, limit: int = 50, offset: int = 0) -> dict:
        params: dict[str, Any] = {"limit": limit, "offset": offset}
        if status:
            params["status"] = status
        return self._call("GET", "/v1/jobs", params=params)

    def job(self, job_id: str) -> dict:
        return self._call("GET", f"/v1/jobs/{job_id}")

    def cancel(self, job_id: str) -> dict:
        return self._call("POST", f"/v1/jobs/{job_id}/cancel")

    def events(self, job_id: str, after: int = 0) -> list[dict]:
        return self._call("GET", f"/v1/jobs/{job_id}/events", params={"after": after})

    def logs(self, job_id: str, after: int = 0) -> list[dict]:
        return self._call("GET", f"/v1/jobs/{job_id}/logs", params={"after": after})

    def metrics(self, job_id: str, after: int = -1, limit: int = 1000) -> dict:
        """Per-rank stats and one page of the per-step history (after step ``after``)."""
        params = {"history_after": after, "history_limit": limit}
        return self._call("GET", f"/v1/jobs/{job_id}/metrics", params=params)

    def plan(self, spec: dict, device_memory_gib: float | None = None) -> dict:
        body: dict[str, Any] = {"spec": spec}
        if device_memory_gib is not None:
            body["device_memory_gib"] = device_memory_gib
        return self._call("POST", "/v1/plan", json=body)

    def cluster(self) -> dict:
        return self._call("GET", "/v1/cluster")
