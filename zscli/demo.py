"""The service demo (``./scripts/demo``): a real training job through the whole stack.

Starts the local stack (Ray head on loopback, the API, SQLite) in a fresh data
directory, submits a ZeRO stage-3 GPT job on 2 CPU workers over REST, follows it to
the end, prints what each rank held beside the paper's formula, the communication
volume per step, the throughput and where Prometheus scrapes, writes the report's
per-step charts and says where the curves are (the report, REST, TensorBoard,
MLflow), then stops everything it started. Exit status 0 when the job succeeded.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import httpx

from api.settings import Settings
from workers.tracking import tensorboard_dir

from .client import Client
from .report import history_pages, render
from .server import down, up
from .service_cli import watch


def demo_spec(steps: int, stage: int, precision: str) -> dict:
    return {
        "name": "demo-gpt",
        "model": {
            "kind": "gpt",
            "vocab_size": 512,
            "seq_len": 64,
            "n_layer": 4,
            "n_head": 4,
            "dim": 128,
        },
        "data": {"kind": "synthetic"},
        "engine": {
            "stage": stage,
            "precision": precision,
            "gradient_clipping": 1.0,
            "lr_schedule": {
                "kind": "cosine",
                "warmup_steps": min(3, steps - 1),
                "total_steps": steps,
            },
        },
        "optimizer": {"type": "adamw", "lr": 3e-3, "weight_decay": 0.1},
        "steps": steps,
        "micro_batch": 8,
        "resources": {"dp": 2, "cpus_per_rank": 1},
        "checkpoint": {"interval_steps": max(1, steps // 2), "keep": 2},
        "timeouts": {"bootstrap_s": 180, "step_s": 300},
        "tracking": {"tensorboard": True, "mlflow": True},
    }


def _mib(n: float) -> str:
    return f"{n / 2**20:8.3f} MiB"


def report(client: Client, job: dict, endpoints: list[str]) -> str:
    metrics = client.metrics(job["id"])["ranks"]
    lines = [f"\njob {job['id']}: {job['status']} after {job['step']} steps"]
    for rank in sorted(metrics, key=int):
        stats = metrics[rank]
        led = stats["ledger"]
        lines.append(
            f"\nrank {rank}: Ψ = {led['psi']:,} parameters ({led['psi_padded']:,} padded), "
            f"N_d = {led['n_d']}, stage {led['stage']}, {led['precision']}"
        )
        for kind in ("params", "grads", "master", "optimizer_states"):
            lines.append(f"  {kind:18} {_mib(led[kind])}")
        lines.append(
            f"  {'model states':18} {_mib(led['model_states'])}   "
            f"formula {_mib(led['expected_padded'])}   "
            f"{'equal' if led['model_states'] == led['expected_padded'] else 'DIFFERENT'}"
        )
        lines.append(f"  {'comm buffers':18} {_mib(led['comm_buffers'])}")
        volume = stats.get("comm_volume_per_step", 0)
        lines.append(
            f"  communication per step: {volume:,} elements = {volume / led['psi_padded']:.2f} Ψ"
        )
        lines.append(
            f"  throughput: {stats.get('tokens_per_second', 0):,.0f} tokens/s per replica, "
            f"{stats.get('tflops', 0) * 1e3:.2f} GFLOPS achieved"
        )
    lines.append("\nmetrics while it ran:")
    for endpoint in endpoints:
        lines.append(f"  http://{endpoint}/metrics")
    base = str(client.http.base_url).rstrip("/")
    lines.append(f"  service discovery for Prometheus: {base}/v1/targets (bearer token)")
    lines.append(f"  control plane: {base}/metrics")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--stage", type=int, choices=(0, 1, 2, 3), default=3)
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--keep", action="store_true", help="leave the stack running")
    parser.add_argument("--report", help="where to write the charts (default: <data dir>/report)")
    args = parser.parse_args(argv)
    if args.steps < 1:
        print("demo: --steps must be >= 1", file=sys.stderr)
        return 2
    home = Path(tempfile.mkdtemp(prefix="zeroservice-demo-"))
    from zeroservice.launch import free_port

    settings = Settings(data_dir=home, port=free_port())
    print(f"starting the local stack in {home} (Ray on loopback, API, SQLite) ...", flush=True)
    record = up(settings, num_cpus=4)
    try:
        token = Path(record["token_file"]).read_text().strip()
        client = Client(record["url"], token)
        print(f"API at {record['url']}; admin token in {record['token_file']}", flush=True)
        job = client.submit(demo_spec(args.steps, args.stage, args.precision))
        print(f"submitted job {job['id']}: stage {args.stage} GPT on 2 CPU workers", flush=True)
        endpoints = _endpoints_while_running(client, job["id"])
        status = watch(client, job["id"])
        done = client.job(job["id"])
        print(report(client, done, endpoints))
        print(charts(client, done, Path(args.report or home / "report"), settings))
        return status
    finally:
        if not args.keep:
            down(settings)
            print("\nstopped the local stack")


def charts(client: Client, job: dict, out: Path, settings: Settings) -> str:
    """Write the job's report (per-step charts and index.html) and say where the
    curves are, in the service and in the tracking tools."""
    files = render(job, history_pages(client, job["id"]), out)
    tensorboard = tensorboard_dir(job["checkpoint_path"], job["id"])
    return "\n".join(
        [
            "\nper-step curves:",
            f"  report: {out / 'index.html'} ({', '.join(f.name for f in files[:-1])})",
            f"  REST: GET /v1/jobs/{job['id']}/metrics (pages of the per-step history)",
            f"  TensorBoard: tensorboard --logdir {tensorboard}",
            f"  MLflow: MLFLOW_ALLOW_FILE_STORE=true mlflow ui --backend-store-uri "
            f"{settings.mlflow_tracking_uri} (experiment 'admin')",
        ]
    )


def _endpoints_while_running(client: Client, job_id: str, timeout: float = 300) -> list[str]:
    """The ranks' metrics endpoints, read from service discovery once the job runs; one
    is scraped to show it answers."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = client.job(job_id)
        if job["status"] in ("succeeded", "failed", "cancelled"):
            return []
        targets = client._call("GET", "/v1/targets")
        if targets:
            endpoints = [t for group in targets for t in group["targets"]]
            text = httpx.get(f"http://{endpoints[0]}/metrics", timeout=5).text
            series = sum(1 for line in text.splitlines() if line.startswith("zeroservice_"))
            print(f"scraped {endpoints[0]}/metrics: {series} zeroservice series", flush=True)
            return endpoints
        time.sleep(0.5)
    return []


if __name__ == "__main__":
    sys.exit(main())
