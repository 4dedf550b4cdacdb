"""``zeroservice up | down | submit | list | status | events | logs | cancel | report |
compare``: the service from the command line (the REST API through api/client.py)."""

from __future__ import annotations

import argparse
import json
import math
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
    note = ""
    if record.get("ray_kept"):
        note = " (already running: its jobs go on)"
    elif record.get("ray_restarted"):
        note = " (had stopped: started again, the API rejoined it)"
    print(f"  Ray: {record['ray_address']}{note}   log: {record['log']}")
    print(f"  Prometheus service discovery: {record['url']}/v1/targets (bearer token)")
    return 0


def _down(args: argparse.Namespace) -> int:
    from .server import StackError, down

    try:
        stopped = down(Settings.from_env())
    except StackError as exc:
        return _fail(exc)
    print("zeroservice stopped" if stopped else "zeroservice: nothing running")
    return 0


def _load_spec(path: str) -> dict[str, Any]:
    """The job spec in a JSON or YAML file; ValueError (or OSError) names what is wrong,
    so that a malformed file is a one-line error, not a parser's traceback."""
    text = Path(path).read_text()
    if path.endswith((".yaml", ".yml")):
        import yaml

        try:
            spec = yaml.load(text, Loader=_yaml_loader())  # a SafeLoader
        except RecursionError:
            raise ValueError(f"nested deeper than {MAX_DEPTH} levels") from None
        except yaml.MarkedYAMLError as exc:
            mark = exc.problem_mark
            where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
            raise ValueError(f"not valid YAML: {where}{exc.problem or exc.context}") from exc
        except yaml.YAMLError as exc:
            raise ValueError(f"not valid YAML: {exc}") from exc
    else:
        try:
            spec = json.loads(text, parse_constant=_no_constant, object_pairs_hook=_unique_keys)
        except RecursionError:
            raise ValueError(f"nested deeper than {MAX_DEPTH} levels") from None
    if spec is None:
        raise ValueError("empty: no job spec in it")
    if not isinstance(spec, dict):
        raise ValueError(f"a job spec is a mapping of fields, not a {type(spec).__name__}")
    _check_json(spec, "", 0, set(), [0])
    return spec


MAX_DEPTH = 64
"""Nesting a job spec may have here (the API allows 16 levels inside its free-form
fields); deeper is refused before anything is sent."""
MAX_VALUES = 100_000
"""Values a job spec may hold, counted as sent: YAML aliases repeat a node without
repeating its text, so a few hundred bytes can stand for billions of values."""


def _check_json(value: Any, where: str, depth: int, open_: set[int], count: list[int]) -> None:
    """ValueError naming the field whose value JSON cannot carry: NaN or infinity, a
    YAML date, binary or set, a container holding itself, nesting past MAX_DEPTH, or
    more than MAX_VALUES values in all (``count``: those seen so far)."""
    name = where or "the spec"
    count[0] += 1
    if count[0] > MAX_VALUES:
        raise ValueError(
            f"more than {MAX_VALUES:,} values (at {name[:60]}: YAML aliases repeated?)"
        )
    if depth > MAX_DEPTH:
        raise ValueError(f"nested deeper than {MAX_DEPTH} levels (at {name[:60]}...)")
    if isinstance(value, bool) or value is None or isinstance(value, str | int):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{name}: {value} is not a finite number (JSON has none)")
        return
    if not isinstance(value, dict | list):
        kind = {"date": "a date", "datetime": "a date and time", "bytes": "binary data"}.get(
            type(value).__name__, f"a {type(value).__name__}"
        )
        raise ValueError(f"{name}: {kind} is not a JSON value (quote it, if it is text)")
    if id(value) in open_:
        raise ValueError(f"{name}: holds itself (a YAML alias of an enclosing node)")
    open_.add(id(value))
    items = value.items() if isinstance(value, dict) else enumerate(value)
    for key, item in items:
        if isinstance(value, dict) and not isinstance(key, str):
            raise ValueError(f"{name}: the key {key!r} is not text (quote it)")
        inner = f"{where}[{key}]" if isinstance(key, int) else f"{where}.{key}" if where else key
        _check_json(item, inner, depth + 1, open_, count)
    open_.discard(id(value))


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose keys are all different: a key given twice would be sent with
    its last value, which the API refuses (its parser keeps every pair)."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"the key {key[:64]!r} appears twice in one object")
        out[key] = value
    return out


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not a JSON number (a job spec's numbers are finite)")


def _yaml_loader() -> type:
    """A SafeLoader that reads ``3e-4`` as the number it is in YAML 1.2 and JSON:
    PyYAML follows YAML 1.1, where a float needs a dot, so ``lr: 3e-4`` would be the
    string "3e-4", which the job spec's strict types refuse."""
    import re

    import yaml

    class Loader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            """Refuse a key given twice in one mapping (PyYAML keeps the last value);
            keys a merge (``<<: *base``) brings in may be set again, as YAML intends."""
            seen: set = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=deep)
                try:
                    repeated = key in seen
                    seen.add(key)
                except TypeError:  # an unhashable key: the base class says so
                    continue
                if repeated:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"the key {str(key)[:64]!r} appears twice", key_node.start_mark
                    )
            return super().construct_mapping(node, deep=deep)

    exponent = re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$")
    Loader.add_implicit_resolver("tag:yaml.org,2002:float", exponent, list("-+0123456789"))
    return Loader


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
    try:
        return watch(client, job["id"])
    except ApiError as exc:
        return _fail(exc)
    except KeyboardInterrupt:
        print(f"\nstopped watching; the job goes on (zeroservice status {job['id']})")
        return 130


def _bar(done: int, total: int, width: int = 24) -> str:
    filled = int(width * done / total) if total else 0
    return "#" * filled + "." * (width - filled)


TERMINAL = ("succeeded", "failed", "cancelled")


class _Progress:
    """What ``watch`` knows of a job's progress; only figures it has are shown (no
    ``nan`` loss, no ``?`` ETA before the first step)."""

    def __init__(self) -> None:
        self.loss: float | None = None
        self.rate: float | None = None
        self.t0: float | None = None
        self.step0 = 0

    def read(self, line: str) -> None:
        match = PROGRESS.search(line)
        if match:
            loss = float(match.group(3))
            self.loss = loss if math.isfinite(loss) else self.loss
            self.rate = float(match.group(4).replace(",", "")) or self.rate

    def line(self, job: dict[str, Any], now: float) -> str:
        step, steps = job["step"], job["steps"]
        if self.t0 is None and step > 0:
            self.t0, self.step0 = now, step
        text = f"{job['status']:>9} step {step}/{steps} [{_bar(step, steps)}]"
        if self.loss is not None:
            text += f" loss {self.loss:.4f}"
        if self.rate:
            text += f" {self.rate:,.0f} tokens/s"
        if self.t0 is not None and self.step0 < step < steps and job["status"] not in TERMINAL:
            per_step = (now - self.t0) / (step - self.step0)
            text += " ETA " + time.strftime("%H:%M:%S", time.gmtime(per_step * (steps - step)))
        return text


def watch(client: Client, job_id: str, out=sys.stdout, poll_s: float = 1.0) -> int:
    """Follow a job to its end: its events as they come, and a progress line (step,
    loss, tokens/s, ETA) rewritten in place on a terminal; in a log, one progress
    line per step reached, never the same line twice."""
    seen_events, seen_logs = 0, 0
    tty = hasattr(out, "isatty") and out.isatty()
    clear = f"\r{' ' * 100}\r" if tty else ""
    progress = _Progress()
    shown_step, shown = 0, ""
    while True:
        job = client.job(job_id)
        for event in client.events(job_id, seen_events):
            seen_events = event["id"]
            out.write(f"{clear}  [{event['kind']}] {event['message']}\n")
            shown = ""  # the event overwrote the progress line on a terminal
        for line in client.logs(job_id, seen_logs):
            seen_logs = line["id"]
            progress.read(line["line"])
        text = progress.line(job, time.monotonic())
        if tty and text != shown:
            out.write(f"\r{text}  ")
            shown = text
        elif not tty and job["step"] > shown_step:
            out.write(text + "\n")
            shown_step = job["step"]
        out.flush()
        if job["status"] in TERMINAL:
            end = "\n" if tty else ""
            out.write(f"{end}{job['status']}: {job['reason']}: {job['message']}\n")
            return 0 if job["status"] == "succeeded" else 1
        time.sleep(poll_s)


def follow_logs(client: Client, job_id: str, follow: bool, out=sys.stdout, poll_s=1.0) -> int:
    """Print a job's log lines; with ``follow``, keep printing new ones until the job
    has ended (its status is read before its lines, so none written before the end is
    missed)."""
    after = 0
    while True:
        job = client.job(job_id) if follow else None
        while True:
            lines = client.logs(job_id, after)
            for x in lines:
                out.write(x["line"] + "\n")
                after = x["id"]
            if not lines:
                break
        out.flush()
        if job is None or job["status"] in TERMINAL:
            return 0
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
        events = _client().all_events(args.id)
    except ApiError as exc:
        return _fail(exc)
    for e in events:
        print(f"{e['time']}  {e['kind']:10} {e['reason']:20} {e['message']}")
    return 0


def _logs(args: argparse.Namespace) -> int:
    try:
        return follow_logs(_client(), args.id, args.follow)
    except ApiError as exc:
        return _fail(exc)
    except KeyboardInterrupt:
        return 130


def _cancel(args: argparse.Namespace) -> int:
    try:
        job = _client().cancel(args.id)
    except ApiError as exc:
        return _fail(exc)
    print(f"job {job['id']}: cancel requested ({job['status']})")
    return 0


def _report(args: argparse.Namespace) -> int:
    from .report import history_pages, render

    try:
        client = _client()
        job = client.job(args.id)
        metrics = history_pages(client, args.id)
        files = render(job, metrics, args.out or f"report-{args.id[:8]}")
    except (ApiError, ValueError, OSError) as exc:
        return _fail(exc)
    for path in files:
        print(f"wrote {path} ({path.stat().st_size:,} bytes)")
    return 0


def _compare(args: argparse.Namespace) -> int:
    from .report import compare, history_pages

    try:
        client = _client()
        runs = [(client.job(i), history_pages(client, i)) for i in args.ids]
    except ApiError as exc:
        return _fail(exc)
    empty = [job["id"] for job, metrics in runs if not metrics["history"]]
    if empty:
        return _fail(ValueError(f"no per-step history yet for {', '.join(empty)}"))
    try:
        path = compare(runs, args.out or f"compare-{args.ids[0][:8]}-{args.ids[1][:8]}.png")
    except OSError as exc:
        return _fail(exc)
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
    p.add_argument("--priority", type=int, default=None)
    p.set_defaults(func=_submit)
    p = sub.add_parser("list", help="list jobs")
    p.add_argument("--status")
    p.add_argument("--limit", type=int, default=50)
    p.set_defaults(func=_list)
    p = sub.add_parser(
        "report", help="charts of a job (loss, throughput, schedule, memory, bandwidth) + HTML"
    )
    p.add_argument("id")
    p.add_argument("--out", help="directory (default: report-<id prefix>)")
    p.set_defaults(func=_report)
    p = sub.add_parser("compare", help="two jobs' loss and throughput per step on one chart")
    p.add_argument("ids", nargs=2, metavar="ID")
    p.add_argument("--out", help="PNG file (default: compare-<id>-<id>.png)")
    p.set_defaults(func=_compare)
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
        if name == "logs":
            p.add_argument("--follow", "-f", action="store_true", help="until the job ends")
        p.set_defaults(func=func)
