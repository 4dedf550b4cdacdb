"""``zeroservice up | down | submit | list | status | events | logs | cancel``: the
service from the command line (the REST API through api/client.py)."""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

from api.settings import Settings

from .client import ApiError, Client

PROGRESS = re.compile(r"step (\d+)/(\d+) loss ([\d.naninf]+) ([\d,]+) tokens/s")


def _client() -> Client:
    return Client.from_env()


def _fail(exc: Exception) -> int:
    print(f"zeroservice: {exc}", file=sys.stderr)
    return 1


def _up(args: argparse.Namespace) -> int:
    from .server import up

    settings = Settings.from_env()
    if args.port:
        settings.port = args.port
    try:
        record = up(settings, num_cpus=args.cpus, num_gpus=args.gpus)
    except RuntimeError as exc:
        return _fail(exc)
    print(f"zeroservice is up at {record['url']}")
    print(f"  admin token: {record['token_file']} (mode 600; export ZEROSERVICE_TOKEN=$(cat ...))")
    print(f"  Ray: {record['ray_address']}   log: {record['log']}")
    print(f"  Prometheus service discovery: {record['url']}/v1/targets (bearer token)")
    return 0


def _down(args: argparse.Namespace) -> int:
    from .server import down

    stopped = down(Settings.from_env())
    print("zeroservice stopped" if stopped else "zeroservice: nothing running")
    return 0


def _load_spec(path: str) -> dict[str, Any]:
    text = Path(path).read_text()
    if path.endswith((".yaml", ".yml")):
        import yaml

        return yaml.safe_load(text)
    return json.loads(text)


def _submit(args: argparse.Namespace) -> int:
    try:
        spec = _load_spec(args.file)
    except (OSError, ValueError) as exc:
        return _fail(f"{args.file}: {exc}")
    try:
        client = _client()
        job = client.submit(spec, args.submission_id, args.priority)
    except ApiError as exc:
        return _fail(exc)
    print(f"job {job['id']} ({job['name']}): {job['status']}")
    if not args.watch:
        return 0
    return watch(client, job["id"])


def _bar(done: int, total: int, width: int = 24) -> str:
    filled = int(width * done / total) if total else 0
    return "#" * filled + "." * (width - filled)


def watch(client: Client, job_id: str, out=sys.stdout, poll_s: float = 1.0) -> int:
    """Follow a job to its end: a progress line (step, loss, tokens/s, ETA), events."""
    seen_events, seen_logs = 0, 0
    tty = hasattr(out, "isatty") and out.isatty()
    shown: tuple[str, int] | None = None
    clear = f"\r{' ' * 100}\r" if tty else ""
    loss, rate = float("nan"), 0.0
    t0, step0 = time.monotonic(), None
    while True:
        job = client.job(job_id)
        for event in client.events(job_id, seen_events):
            seen_events = event["id"]
            out.write(f"{clear}  [{event['kind']}] {event['message']}\n")
        for line in client.logs(job_id, seen_logs):
            seen_logs = line["id"]
            match = PROGRESS.search(line["line"])
            if match:
                loss = float(match.group(3))
                rate = float(match.group(4).replace(",", ""))
        step, steps = job["step"], job["steps"]
        if step0 is None and step > 0:
            step0, t0 = step, time.monotonic()
        eta = "?"
        if step0 is not None and step > step0:
            per_step = (time.monotonic() - t0) / (step - step0)
            eta = time.strftime("%H:%M:%S", time.gmtime(per_step * (steps - step)))
        line = (
            f"{job['status']:>9} step {step}/{steps} [{_bar(step, steps)}] "
            f"loss {loss:.4f} {rate:,.0f} tokens/s ETA {eta}"
        )
        if tty:
            out.write(f"\r{line}  ")
        elif (job["status"], step) != shown:  # a log: one line per change
            out.write(line + "\n")
            shown = (job["status"], step)
        out.flush()
        if job["status"] in ("succeeded", "failed", "cancelled"):
            end = "\n" if tty else ""
            out.write(f"{end}{job['status']}: {job['reason']}: {job['message']}\n")
            return 0 if job["status"] == "succeeded" else 1
        time.sleep(poll_s)


def _list(args: argparse.Namespace) -> int:
    try:
        page = _client().jobs(args.status, args.limit)
    except ApiError as exc:
        return _fail(exc)
    print(f"{'id':36}  {'name':16} {'status':10} {'step':>11} {'dp':>3} {'restarts':>8}  created")
    for j in page["items"]:
        print(
            f"{j['id']:36}  {j['name'][:16]:16} {j['status']:10} "
            f"{j['step']:>5}/{j['steps']:<5} {j['current_dp']:>3} {j['attempts']:>8}  "
            f"{j['created_at']}"
        )
    print(f"({len(page['items'])} of {page['total']})")
    return 0


def _status(args: argparse.Namespace) -> int:
    try:
        job = _client().job(args.id)
    except ApiError as exc:
        return _fail(exc)
    if not args.spec:
        job.pop("spec", None)
    print(json.dumps(job, indent=2, default=str))
    return 0


def _events(args: argparse.Namespace) -> int:
    try:
        events = _client().events(args.id)
    except ApiError as exc:
        return _fail(exc)
    for e in events:
        print(f"{e['time']}  {e['kind']:10} {e['reason']:20} {e['message']}")
    return 0


def _logs(args: argparse.Namespace) -> int:
    try:
        lines = _client().logs(args.id)
    except ApiError as exc:
        return _fail(exc)
    for x in lines:
        print(x["line"])
    return 0


def _cancel(args: argparse.Namespace) -> int:
    try:
        job = _client().cancel(args.id)
    except ApiError as exc:
        return _fail(exc)
    print(f"job {job['id']}: cancel requested ({job['status']})")
    return 0


def _report(args: argparse.Namespace) -> int:
    from .report import render

    try:
        client = _client()
        job = client.job(args.id)
        metrics = client.metrics(args.id)
        files = render(job, metrics, args.out or f"report-{args.id[:8]}")
    except (ApiError, ValueError) as exc:
        return _fail(exc)
    for path in files:
        print(f"wrote {path} ({path.stat().st_size:,} bytes)")
    return 0


def add_service_parsers(sub) -> None:
    p = sub.add_parser("up", help="start the local stack: Ray, the API, SQLite (loopback)")
    p.add_argument("--cpus", type=int, default=4, help="CPUs the local Ray offers")
    p.add_argument("--gpus", type=int, default=0, help="GPUs the local Ray offers")
    p.add_argument("--port", type=int, default=0, help="API port (default 8765)")
    p.set_defaults(func=_up)
    p = sub.add_parser("down", help="stop the local stack")
    p.set_defaults(func=_down)
    p = sub.add_parser("submit", help="submit a job spec file (JSON or YAML)")
    p.add_argument("file")
    p.add_argument("--watch", action="store_true", help="follow it to the end")
    p.add_argument("--submission-id", help="idempotency key: resubmitting returns the same job")
    p.add_argument("--priority", type=int, default=0)
    p.set_defaults(func=_submit)
    p = sub.add_parser("list", help="list jobs")
    p.add_argument("--status")
    p.add_argument("--limit", type=int, default=50)
    p.set_defaults(func=_list)
    p = sub.add_parser("report", help="PNG plots of a job: memory, loss, throughput, bandwidth")
    p.add_argument("id")
    p.add_argument("--out", help="directory (default: report-<id prefix>)")
    p.set_defaults(func=_report)
    for name, func, text in (
        ("status", _status, "a job's status"),
        ("events", _events, "a job's events"),
        ("logs", _logs, "a job's log lines"),
        ("cancel", _cancel, "cancel a job"),
    ):
        p = sub.add_parser(name, help=text)
        p.add_argument("id")
        if name == "status":
            p.add_argument("--spec", action="store_true", help="include the job spec")
        p.set_defaults(func=func)
