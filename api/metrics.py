"""The control plane's own metrics (prometheus_client): requests, jobs, queue, cluster."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily

from .schemas import STATUSES

# Every family the control plane exports (dashboards are checked against this list).
FAMILIES = {
    "zeroservice_api_requests": "HTTP requests by method, route and status code",
    "zeroservice_api_request_seconds": "HTTP request latency by method and route",
    "zeroservice_api_errors": "HTTP requests answered 4xx or 5xx, by route and status",
    "zeroservice_jobs": "jobs by status",
    "zeroservice_job_queue_wait_seconds": "seconds from submission to admission",
    "zeroservice_job_workers": "ranks of each active job",
    "zeroservice_cluster_resources": "cluster resources by resource and state (total, free)",
}


class _Live:
    """Families read at scrape time from the store and the cluster."""

    def __init__(self, read: Callable[[], dict]):
        self.read = read

    def collect(self):
        data = self.read()
        jobs = GaugeMetricFamily(
            "zeroservice_jobs", FAMILIES["zeroservice_jobs"], labels=["status"]
        )
        for status in STATUSES:
            jobs.add_metric([status], float(data.get("jobs", {}).get(status, 0)))
        yield jobs
        workers = GaugeMetricFamily(
            "zeroservice_job_workers", FAMILIES["zeroservice_job_workers"], labels=["job_id"]
        )
        for job_id, n in data.get("workers", {}).items():
            workers.add_metric([job_id], float(n))
        yield workers
        res = GaugeMetricFamily(
            "zeroservice_cluster_resources",
            FAMILIES["zeroservice_cluster_resources"],
            labels=["resource", "state"],
        )
        for state in ("total", "free"):
            for name, value in data.get(state, {}).items():
                if name in ("CPU", "GPU", "memory"):
                    res.add_metric([name, state], float(value))
        yield res


class ApiMetrics:
    def __init__(self, read: Callable[[], dict]):
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "zeroservice_api_requests",
            FAMILIES["zeroservice_api_requests"],
            ["method", "route", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "zeroservice_api_request_seconds",
            FAMILIES["zeroservice_api_request_seconds"],
            ["method", "route"],
            registry=self.registry,
        )
        self.errors = Counter(
            "zeroservice_api_errors",
            FAMILIES["zeroservice_api_errors"],
            ["route", "status"],
            registry=self.registry,
        )
        self.queue_wait = Histogram(
            "zeroservice_job_queue_wait_seconds",
            FAMILIES["zeroservice_job_queue_wait_seconds"],
            buckets=(0.5, 1, 2, 5, 10, 30, 60, 300, 900, 3600, 14400, 86400),
            registry=self.registry,
        )
        self.registry.register(_Live(read))  # type: ignore[arg-type]
