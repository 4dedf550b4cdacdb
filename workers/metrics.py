"""Per-rank metrics in Prometheus format, served by each rank itself.

[Note: rank metrics]
Every rank serves its own ``/metrics`` (prometheus_client on a port of its own), so
scraping scales with the cluster: no central process relays samples. The supervisor
collects each rank's address and the control plane serves them to Prometheus' HTTP
service discovery. Labels are bounded: job_id, rank, dp_rank, mp_rank, node (and op
or kind where a family has several series); no step or attempt label, so series keep
their identity across restarts and resizes.

Most families are read at scrape time from the rank's latest snapshot (the engine's
ledgers after the last step), so what Prometheus sees equals what the ledger says.
The step-time histogram is observed step by step.
"""

from __future__ import annotations

import threading
from typing import Any

from prometheus_client import CollectorRegistry, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LABELS = ("job_id", "rank", "dp_rank", "mp_rank", "node")
MEMORY_KINDS = (
    "params",
    "grads",
    "master",
    "optimizer",
    "activations",
    "comm_buffers",
    "gathered",
    "allocated",
    "peak",
)
STEP_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120, 300)

# Every family a rank exports (dashboards are checked against this list).
FAMILIES = {
    "zeroservice_memory_bytes": "bytes this rank holds, by kind (engine ledger; allocated/peak: "
    "the device allocator on CUDA, the process on CPU)",
    "zeroservice_memory_expected_bytes": "model-state bytes the paper's formula predicts",
    "zeroservice_model_state_bytes": "model-state bytes the engine holds (params+grads+master+"
    "optimizer states)",
    "zeroservice_collective_bytes": "payload bytes moved by collectives, by op and group",
    "zeroservice_collective_seconds": "seconds spent in collectives, by op and group",
    "zeroservice_collective_busbw_bytes_per_second": "bus bandwidth of the last step's "
    "collectives, by op and group",
    "zeroservice_tflops": "achieved TFLOPS of this rank over the last step",
    "zeroservice_mfu": "model FLOPs utilisation of this rank over the last step (0-1)",
    "zeroservice_step_seconds": "optimizer step wall time",
    "zeroservice_tokens": "tokens this rank's replica trained since its process started",
    "zeroservice_loss": "loss of the last step on this rank (over every replica with "
    "engine.redundancy)",
    "zeroservice_loss_scale": "fp16 loss scale (1 otherwise)",
    "zeroservice_step": "optimizer steps completed",
    "zeroservice_restarts": "restarts of the job so far",
    "zeroservice_workers": "ranks in the job now",
}


class _Snapshot:
    """Collects the families from the latest snapshot at scrape time."""

    def __init__(self, labels: dict[str, str]):
        self.labels = labels
        self.lock = threading.Lock()
        self.data: dict[str, Any] = {}

    def collect(self):
        with self.lock:
            d = dict(self.data)
        names, values = list(LABELS), [self.labels[k] for k in LABELS]

        def gauge(name: str, value: float | None, extra: dict[str, str] | None = None):
            if value is None:
                return None
            keys = names + list(extra or {})
            fam = GaugeMetricFamily(name, FAMILIES[name], labels=keys)
            fam.add_metric(values + list((extra or {}).values()), float(value))
            return fam

        memory = GaugeMetricFamily(
            "zeroservice_memory_bytes",
            FAMILIES["zeroservice_memory_bytes"],
            labels=names + ["kind"],
        )
        for kind in MEMORY_KINDS:
            if kind in d.get("memory", {}):
                memory.add_metric(values + [kind], float(d["memory"][kind]))
        yield memory
        for name, key in (
            ("zeroservice_memory_expected_bytes", "expected"),
            ("zeroservice_model_state_bytes", "model_states"),
            ("zeroservice_tflops", "tflops"),
            ("zeroservice_mfu", "mfu"),
            ("zeroservice_loss", "loss"),
            ("zeroservice_loss_scale", "loss_scale"),
            ("zeroservice_step", "step"),
            ("zeroservice_restarts", "restarts"),
            ("zeroservice_workers", "workers"),
        ):
            fam = gauge(name, d.get(key))
            if fam is not None:
                yield fam
        keys = names + ["op", "group"]
        total = CounterMetricFamily(
            "zeroservice_collective_bytes", FAMILIES["zeroservice_collective_bytes"], labels=keys
        )
        secs = CounterMetricFamily(
            "zeroservice_collective_seconds",
            FAMILIES["zeroservice_collective_seconds"],
            labels=keys,
        )
        busbw = GaugeMetricFamily(
            "zeroservice_collective_busbw_bytes_per_second",
            FAMILIES["zeroservice_collective_busbw_bytes_per_second"],
            labels=keys,
        )
        for (op, group), c in sorted(d.get("collectives", {}).items()):
            total.add_metric(values + [op, group], c["bytes"])
            secs.add_metric(values + [op, group], c["seconds"])
            busbw.add_metric(values + [op, group], c["busbw"])
        yield total
        yield secs
        yield busbw
        tokens = CounterMetricFamily(
            "zeroservice_tokens", FAMILIES["zeroservice_tokens"], labels=names
        )
        tokens.add_metric(values, float(d.get("tokens", 0)))
        yield tokens


class RankMetrics:
    """One rank's registry and HTTP endpoint. See [Note: rank metrics]."""

    def __init__(self, labels: dict[str, str]):
        missing = set(LABELS) - set(labels)
        if missing:
            raise ValueError(f"metrics labels missing: {sorted(missing)}")
        self.registry = CollectorRegistry()
        self.snapshot = _Snapshot({k: str(labels[k]) for k in LABELS})
        self.registry.register(self.snapshot)  # type: ignore[arg-type]
        self.step_seconds = Histogram(
            "zeroservice_step_seconds",
            FAMILIES["zeroservice_step_seconds"],
            labelnames=LABELS,
            buckets=STEP_BUCKETS,
            registry=self.registry,
        ).labels(**self.snapshot.labels)
        self.port: int | None = None
        self._server: Any = None

    def serve(self, host: str, port: int = 0) -> int:
        """Start the endpoint (port 0: any free port); returns the port."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        self._server = server
        self.port = int(server.server_port)
        return self.port

    def update(self, **values: Any) -> None:
        with self.snapshot.lock:
            self.snapshot.data.update(values)

    def close(self, wait: bool = True) -> None:
        """Stop the endpoint. The server's loop notices a shutdown only at its next
        poll (up to 0.5 s): ``wait=False`` leaves that to a daemon thread, so that a
        rank re-forming its group does not wait for it (the old endpoint may answer
        one last scrape meanwhile)."""
        server, self._server = self._server, None
        if server is None:
            return

        def stop() -> None:
            server.shutdown()
            server.server_close()

        if wait:
            stop()
        else:
            threading.Thread(target=stop, name="metrics-close", daemon=True).start()
