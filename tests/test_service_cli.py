"""The service commands' output, on a scripted client: ``submit --watch`` shows no
placeholder before the first step and never the same line twice, ``logs --follow``
prints every line once until the job ends, ``report`` writes its charts and page,
``compare`` draws two jobs on one chart."""

from __future__ import annotations

import io
import json
from typing import Any

from tests.api.fakes import point
from zscli import service_cli
from zscli.cli import main
from zscli.report import compare, history_pages, render, volume_note


class ScriptedClient:
    """A job that moves one state per ``job()`` call: (status, step, new log lines,
    new events)."""

    def __init__(self, script: list[tuple[str, int, list[str], list[str]]]):
        self.script, self.i = script, -1
        self.log: list[dict[str, Any]] = []
        self.ev: list[dict[str, Any]] = []

    def job(self, job_id: str) -> dict[str, Any]:
        self.i = min(self.i + 1, len(self.script) - 1)
        status, step, lines, events = self.script[self.i]
        if self.i == len(self.script) - 1 and getattr(self, "_done", False):
            lines, events = [], []
        self._done = self.i == len(self.script) - 1
        for line in lines:
            self.log.append({"id": len(self.log) + 1, "line": line})
        for message in events:
            self.ev.append({"id": len(self.ev) + 1, "kind": "status", "message": message})
        return {
            "id": job_id,
            "name": "demo",
            "status": status,
            "reason": "completed" if status == "succeeded" else status,
            "message": f"{step} steps",
            "step": step,
            "steps": 6,
        }

    def events(self, job_id: str, after: int = 0) -> list[dict[str, Any]]:
        return [e for e in self.ev if e["id"] > after]

    def logs(self, job_id: str, after: int = 0) -> list[dict[str, Any]]:
        return [x for x in self.log if x["id"] > after][:2]  # pages of two


SCRIPT = [
    ("queued", 0, [], ["queued"]),
    ("starting", 0, [], ["starting: placing ranks"]),
    ("running", 0, [], ["running: dp 2 × mp 1"]),
    ("running", 0, [], []),
    ("running", 3, ["step 3/6 loss 5.1234 1,200 tokens/s dp 2"], []),
    ("running", 3, [], []),
    ("running", 6, ["step 6/6 loss 4.5678 1,300 tokens/s dp 2"], []),
    ("succeeded", 6, ["done"], ["succeeded: 6 steps"]),
]


def test_watch_shows_no_placeholders_and_no_repeated_lines(monkeypatch):
    monkeypatch.setattr(service_cli.time, "sleep", lambda s: None)
    out = io.StringIO()
    assert service_cli.watch(ScriptedClient(SCRIPT), "j1", out=out) == 0
    lines = out.getvalue().splitlines()
    assert lines == [
        "  [status] queued",
        "  [status] starting: placing ranks",
        "  [status] running: dp 2 × mp 1",
        "  running step 3/6 [############............] loss 5.1234 1,200 tokens/s",
        "  running step 6/6 [########################] loss 4.5678 1,300 tokens/s",
        "  [status] succeeded: 6 steps",
        "succeeded: completed: 6 steps",
    ]


def test_watch_on_a_terminal_rewrites_one_line(monkeypatch):
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr(service_cli.time, "sleep", lambda s: None)
    out = Tty()
    service_cli.watch(ScriptedClient(SCRIPT), "j1", out=out)
    text = out.getvalue()
    assert "nan" not in text and "?" not in text
    frames = [f.strip() for f in text.split("\r") if f.strip()]
    assert all(a != b for a, b in zip(frames, frames[1:], strict=False))
    assert "succeeded: completed: 6 steps" in text


def test_logs_follow_prints_every_line_once_until_the_end(monkeypatch):
    monkeypatch.setattr(service_cli.time, "sleep", lambda s: None)
    client = ScriptedClient(SCRIPT)
    out = io.StringIO()
    assert service_cli.follow_logs(client, "j1", follow=True, out=out) == 0
    assert out.getvalue().splitlines() == [
        "step 3/6 loss 5.1234 1,200 tokens/s dp 2",
        "step 6/6 loss 4.5678 1,300 tokens/s dp 2",
        "done",
    ]


class MetricsClient:
    def __init__(self, jobs: dict[str, int]):
        self.jobs = jobs

    def job(self, job_id: str) -> dict[str, Any]:
        steps = self.jobs[job_id]
        spec = {"engine": {"stage": 2}, "model": {"n_layer": 2, "dim": 32, "seq_len": 16}}
        return {
            "id": job_id,
            "name": f"run-{job_id}",
            "status": "succeeded",
            "reason": "completed",
            "message": "",
            "step": steps,
            "steps": steps,
            "current_dp": 2,
            "attempts": 0,
            "spec": spec,
        }

    def metrics(self, job_id: str, after: int = -1, limit: int = 1000) -> dict[str, Any]:
        points = [point(s, 6.0 - s / 20) for s in range(1, self.jobs[job_id] + 1)]
        page = [p for p in points if p["step"] > after][:limit]
        more = page and page[-1]["step"] < points[-1]["step"]
        return {
            "job_id": job_id,
            "ranks": {
                str(r): {
                    "ledger": {
                        "stage": 2,
                        "precision": "fp32",
                        "n_d": 2,
                        "psi_padded": 1000,
                        "params": 4000,
                        "grads": 2000,
                        "master": 0,
                        "optimizer_states": 4000,
                        "comm_buffers": 8000,
                        "comm_buffer_largest": 4000,
                        "expected_padded": 10000,
                    },
                    "phases": {
                        "reduce_scatter/grads": {"bytes": 8e6, "steps": 8, "busbw": 2e9},
                        "all_gather/params": {"bytes": 8e6, "steps": 8, "busbw": 3e9},
                    },
                }
                for r in range(2)
            },
            "history": page,
            "history_stride": 1,
            "next_after": page[-1]["step"] if more else None,
        }


def test_report_pages_through_the_history_and_writes_charts_and_a_page(tmp_path):
    client = MetricsClient({"a": 25})
    metrics = history_pages(client, "a", page=10)
    assert [p["step"] for p in metrics["history"]] == list(range(1, 26))
    files = render(client.job("a"), metrics, tmp_path)
    names = [f.name for f in files]
    assert names == [
        "loss.png",
        "throughput.png",
        "schedule.png",
        "memory.png",
        "bandwidth.png",
        "index.html",
    ]
    for f in files[:-1]:
        assert f.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page = (tmp_path / "index.html").read_text()
    assert all(f'src="{n}"' in page for n in names[:-1])
    assert "run-a (a)" in page and "5.9500 at the start, 4.7500 at the end" in page


def test_the_bandwidth_note_holds_a_step_against_the_paper_except_for_one_rank():
    ledger = {"stage": 3, "n_d": 2, "psi_padded": 1000}
    note = volume_note({"ledger": ledger, "comm_volume_per_step": 3000})
    assert "paper 3Ψ (stage 3), measured 3,000 elements = 3.00Ψ (Ψ = 1,000)" in note
    alone = volume_note({"ledger": {**ledger, "n_d": 1}, "comm_volume_per_step": 3900})
    assert "one rank (N_d = 1): no collective is issued" in alone and "paper" not in alone
    # One data-parallel rank of a model-parallel pair still talks to its MP peer.
    pair = volume_note({"ledger": {**ledger, "n_d": 1, "mp": 2}, "comm_volume_per_step": 3900})
    assert "no collective" not in pair and "paper 3Ψ" in pair


def test_compare_draws_two_jobs_on_one_chart(tmp_path, monkeypatch, capsys):
    client = MetricsClient({"a": 12, "b": 20})
    monkeypatch.setattr(service_cli, "_client", lambda: client)
    out = tmp_path / "both.png"
    assert main(["compare", "a", "b", "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"wrote {out}" in capsys.readouterr().out
    drawn = compare([(client.job("a"), history_pages(client, "a"))], tmp_path / "one.png")
    assert drawn.stat().st_size > 10_000


def test_a_yaml_job_file_reads_exponents_as_numbers(tmp_path):
    """``lr: 3e-4`` is a number (YAML 1.2, JSON), not PyYAML's YAML 1.1 string, so the
    strict job spec takes it; words and quoted exponents stay strings."""
    from workers.spec import JobSpec
    from zscli.service_cli import _load_spec

    path = tmp_path / "job.yaml"
    path.write_text(
        "name: e3\nsteps: 1e3\nmodel: {dim: 32, n_head: 4}\n"
        "optimizer: {lr: 3e-4, eps: 1.0E-8, betas: [0.9, 0.95], weight_decay: -1_0e-1}\n"
        "data: {kind: synthetic, seed: 7}\ntracking: {experiment: '1e3'}\n"
    )
    loaded = _load_spec(str(path))
    assert loaded["optimizer"] == {
        "lr": 3e-4,
        "eps": 1e-8,
        "betas": [0.9, 0.95],
        "weight_decay": -1.0,
    }
    assert loaded["tracking"]["experiment"] == "1e3" and loaded["name"] == "e3"
    assert isinstance(loaded["steps"], float)  # a count written 1e3 is refused by name
    spec = dict(loaded, steps=10, optimizer={**loaded["optimizer"], "weight_decay": 0.0})
    assert JobSpec.model_validate(spec).optimizer.lr == 3e-4


def test_a_malformed_job_file_is_a_one_line_error_before_any_request(tmp_path, capsys):
    """Broken YAML names its line and column, JSON its position; an empty file or one
    that holds a list is no job spec. The service is never asked (none runs here)."""
    cases = {
        "broken.yaml": ("name: x\nmodel: [1,\n", "not valid YAML: line 3, column 1: expected"),
        "mixed.yaml": ("a: 1\n- b\n", "not valid YAML: line 2, column 1: expected <block end>"),
        "tagged.yaml": ("a: !!python/object:os.system x\n", "not valid YAML: line 1, column 4"),
        "empty.yaml": ("", "empty: no job spec in it"),
        "list.json": ("[1, 2]", "a job spec is a mapping of fields, not a list"),
        "broken.json": ('{"name": ', "Expecting value: line 1 column 10"),
        # A key given twice would be sent with its last value; the API refuses it too.
        "twice.json": ('{"name": "a", "name": "b"}', "the key 'name' appears twice"),
        "twice.yaml": (
            "steps: 1\nsteps: 2\n",
            "not valid YAML: line 2, column 1: the key 'steps' appears twice",
        ),
    }
    for name, (text, message) in cases.items():
        (tmp_path / name).write_text(text)
        assert main(["submit", str(tmp_path / name)]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"{tmp_path / name}: {message}" in err, err


def _alias_bomb(levels: int) -> str:
    """A few hundred bytes of YAML whose aliases stand for 10**levels values."""
    lines = ["x0: &x0 [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]"]
    for i in range(1, levels):
        lines.append(f"x{i}: &x{i} [" + ", ".join([f"*x{i - 1}"] * 10) + "]")
    lines.append(f"a: [*x{levels - 1}]")
    return "\n".join(lines) + "\n"


def test_values_json_cannot_carry_are_a_one_line_error_naming_the_field(tmp_path, capsys):
    """NaN, infinities, YAML's dates, binary and sets, a node holding itself, nesting
    past the limit: each named, before any request (none is served here)."""
    deep = "[" * 70 + "]" * 70
    cases = {
        "nan.json": ('{"optimizer": {"lr": NaN}}', "NaN is not a JSON number"),
        "big.json": ('{"steps": 1e400}', "steps: inf is not a finite number"),
        "inf.yaml": ("optimizer: {lr: .inf}\n", "optimizer.lr: inf is not a finite number"),
        "date.yaml": ("name: 2024-01-01\n", "name: a date is not a JSON value (quote it"),
        "bin.yaml": ("name: !!binary aGk=\n", "name: binary data is not a JSON value"),
        "set.yaml": ("engine: !!set {a: null}\n", "engine: a set is not a JSON value"),
        "self.yaml": ("a: &a [*a]\n", "a[0]: holds itself"),
        "key.yaml": ("model: {1: x}\n", "model: the key 1 is not text"),
        "deep.json": ('{"model": {"kwargs": {"x": ' + deep + "}}}", "nested deeper than 64 levels"),
        "deeper.json": ("[" * 100_000 + "]" * 100_000, "nested deeper than 64 levels"),
        "aliases.yaml": (_alias_bomb(9), "more than 100,000 values (at x4[7][8][8][8][9]"),
    }
    for name, (text, message) in cases.items():
        (tmp_path / name).write_text(text)
        assert main(["submit", str(tmp_path / name)]) == 1, name
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"{tmp_path / name}: {message}" in err, err


def test_a_yaml_merge_may_set_a_key_again(tmp_path):
    from zscli.service_cli import _load_spec

    (tmp_path / "merged.yaml").write_text(
        "base: &b {lr: 0.1, eps: 1.0e-8}\noptimizer:\n  <<: *b\n  lr: 0.2\n"
    )
    assert _load_spec(str(tmp_path / "merged.yaml"))["optimizer"] == {"lr": 0.2, "eps": 1e-8}


def test_a_broken_stack_record_or_token_file_is_a_one_line_error(tmp_path, monkeypatch, capsys):
    """A stack.json cut short (or not ours) and a token file that is not text: one line
    naming the file; with ZEROSERVICE_URL and ZEROSERVICE_TOKEN set the record is not
    read at all."""
    monkeypatch.setenv("ZEROSERVICE_HOME", str(tmp_path))
    monkeypatch.delenv("ZEROSERVICE_URL", raising=False)
    monkeypatch.delenv("ZEROSERVICE_TOKEN", raising=False)
    stack = tmp_path / "stack.json"
    for text in ("", "[1]", '{"url": 5}'):
        stack.write_text(text)
        for argv in (["list"], ["down"]):
            assert main(argv) == 1, (text, argv)
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and f"{stack}: not a stack record" in err, err
    token = tmp_path / "token"
    token.write_bytes(b"\xff\xfe")
    record = {"url": "http://127.0.0.1:9", "ray_address": "127.0.0.1:1", "api_pid": None}
    stack.write_text(json.dumps({**record, "token_file": str(token)}))
    assert main(["list"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{token}: not a token file" in err, err
    stack.write_text("")
    monkeypatch.setenv("ZEROSERVICE_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("ZEROSERVICE_TOKEN", "zs_x")
    assert main(["list"]) == 1
    assert "cannot reach the service at" in capsys.readouterr().err


def test_a_service_that_cannot_be_used_is_a_one_line_error(monkeypatch, capsys):
    """No server at the URL, a URL or token that cannot be sent, a setting of the wrong
    kind, a job id that would name another route: one line each, no traceback."""
    from zscli.client import ApiError, Client, _segment

    cases = [
        ({"ZEROSERVICE_URL": "http://127.0.0.1:9"}, ["list"], "cannot reach the service at"),
        ({"ZEROSERVICE_URL": "localhost:8765"}, ["list"], "is not an http:// or https:// URL"),
        ({"ZEROSERVICE_URL": "http://[::1"}, ["list"], "is not an http:// or https:// URL"),
        ({"ZEROSERVICE_URL": "http://h:port"}, ["list"], "is not an http:// or https:// URL"),
        ({"ZEROSERVICE_TOKEN": "zs_\u00e9"}, ["list"], "ZEROSERVICE_TOKEN: not a token"),
        ({"ZEROSERVICE_TOKEN": "zs_a\nb"}, ["list"], "ZEROSERVICE_TOKEN: not a token"),
        ({"ZEROSERVICE_PORT": "abc"}, ["list"], "ZEROSERVICE_PORT='abc': not a whole number"),
        ({"ZEROSERVICE_MAX_CLUSTER": "{bad"}, ["list"], "ZEROSERVICE_MAX_CLUSTER='{bad': not JSON"),
        ({"ZEROSERVICE_MAX_CLUSTER": '{"CPU": "x"}'}, ["list"], "not an object of resource"),
        ({}, ["status", ""], "'' is not a job id"),
        ({}, ["status", ".."], "'..' is not a job id"),
        ({}, ["cancel", "."], "'.' is not a job id"),
    ]
    for env, argv, message in cases:
        monkeypatch.setenv("ZEROSERVICE_URL", "http://127.0.0.1:9")
        monkeypatch.setenv("ZEROSERVICE_TOKEN", "zs_x")
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        assert main(argv) in (1, 2), argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, (env, argv, err)
        monkeypatch.undo()
    client = Client("http://127.0.0.1:9", "zs_x")
    for job_id in ("../../openapi.json", "a#b", "a?b"):
        request = client.http.build_request("GET", f"/v1/jobs/{_segment(job_id)}")
        assert request.url.raw_path.count(b"/") == 3, request.url  # one segment under /v1/jobs
    assert str(ApiError(0, "down")) == "down" and str(ApiError(404, "gone")) == "HTTP 404: gone"


def test_events_pages_through_every_event(monkeypatch, capsys):
    """``events`` prints all of a job's events, not the first page."""
    pages = {0: [{"id": i} for i in range(1, 201)], 200: [{"id": i} for i in range(201, 253)]}

    class Paged:
        def all_events(self, job_id):
            from zscli.client import Client

            return Client.all_events(self, job_id)  # type: ignore[arg-type]

        def events(self, job_id, after=0):
            return [
                {**e, "time": "t", "kind": "k", "reason": "r", "message": str(e["id"])}
                for e in pages.get(after, [])
            ]

    monkeypatch.setattr(service_cli, "_client", Paged)
    assert main(["events", "j"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 252
