"""Writes the Grafana dashboards (training-job.json, control-plane.json) from one
description, so that panels, queries and the datasource uid stay consistent.

    python dashboards/generate.py        # rewrite the JSON files
    python dashboards/generate.py --check   # exit 1 if they differ from the committed ones
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).parent
DATASOURCE = {"type": "prometheus", "uid": "zeroservice-prometheus"}
JOB = 'job_id="$job"'
RANKS = f'{JOB},rank=~"$rank"'


def _target(expr: str, legend: str, ref: str) -> dict:
    return {"datasource": DATASOURCE, "expr": expr, "legendFormat": legend, "refId": ref}


def _panel(
    pid: int,
    title: str,
    targets: list[tuple[str, str]],
    unit: str,
    x: int,
    y: int,
    w: int = 12,
    h: int = 8,
    stack: bool = False,
    kind: str = "timeseries",
    description: str = "",
    unstacked: str = "",
) -> dict:
    """``unstacked``: a regular expression of the series drawn as lines over a stacked
    panel's stack (a formula, a limit), not stacked onto it."""
    refs = "ABCDEFGH"
    panel = {
        "id": pid,
        "type": kind,
        "title": title,
        "description": description,
        "datasource": DATASOURCE,
        "gridPos": {"x": x, "y": y, "w": w, "h": h},
        "targets": [_target(e, legend, refs[i]) for i, (e, legend) in enumerate(targets)],
        "fieldConfig": {
            "defaults": {
                "unit": unit,
                "custom": {"stacking": {"mode": "normal" if stack else "none", "group": "A"}},
            },
            "overrides": [
                {
                    "matcher": {"id": "byRegexp", "options": unstacked},
                    "properties": [{"id": "custom.stacking", "value": {"mode": "none"}}],
                }
            ]
            if unstacked
            else [],
        },
        "options": {"legend": {"displayMode": "table", "placement": "right"}},
    }
    return panel


def _variable(name: str, query: str, multi: bool) -> dict:
    return {
        "name": name,
        "type": "query",
        "datasource": DATASOURCE,
        "query": {"query": query, "refId": name},
        "definition": query,
        "refresh": 2,
        "multi": multi,
        "includeAll": multi,
        "allValue": ".*" if multi else None,
        "current": {},
        "sort": 3,
    }


def _dashboard(uid: str, title: str, panels: list[dict], variables: list[dict], annotations):
    return {
        "uid": uid,
        "title": title,
        "tags": ["zeroservice"],
        "timezone": "utc",
        "schemaVersion": 39,
        "version": 1,
        "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {"list": variables},
        "annotations": {"list": annotations},
        "panels": panels,
    }


def training_job() -> dict:
    memory = f'zeroservice_memory_bytes{{{RANKS},kind!~"allocated|peak"}}'
    panels = [
        _panel(
            1,
            "Memory by kind (engine ledger) over the ranks shown, and the formula",
            [
                (f"sum by (kind) ({memory})", "{{kind}}"),
                (f"sum(zeroservice_memory_expected_bytes{{{RANKS}}})", "formula (model states)"),
            ],
            "bytes",
            0,
            0,
            w=24,
            h=10,
            stack=True,
            unstacked="^formula",
            description="params, grads, master, optimizer states, checkpointed activations, "
            "communication buffers, gathered parameters, stacked and summed over the ranks "
            "shown; the line (not stacked) is the paper's model-state formula summed over "
            "the same ranks: the params, grads, master and optimizer layers reach it",
        ),
        _panel(
            2,
            "Allocated and peak (device allocator, or the process on CPU)",
            [
                (
                    f'zeroservice_memory_bytes{{{RANKS},kind=~"allocated|peak"}}',
                    "rank {{rank}} {{kind}}",
                )
            ],
            "bytes",
            0,
            10,
        ),
        _panel(
            3,
            "Model states held vs the formula",
            [
                (f"zeroservice_model_state_bytes{{{RANKS}}}", "rank {{rank}} held"),
                (f"zeroservice_memory_expected_bytes{{{RANKS}}}", "rank {{rank}} formula"),
            ],
            "bytes",
            12,
            10,
        ),
        _panel(
            4,
            "Collective bus bandwidth per op",
            [
                (
                    f"zeroservice_collective_busbw_bytes_per_second{{{RANKS}}}",
                    "rank {{rank}} {{group}} {{op}}",
                )
            ],
            "Bps",
            0,
            18,
        ),
        _panel(
            5,
            "Collective payload per op (rate)",
            [
                (
                    f"sum by (op, group) (rate(zeroservice_collective_bytes_total{{{RANKS}}}[1m]))",
                    "{{group}} {{op}}",
                )
            ],
            "Bps",
            12,
            18,
        ),
        _panel(
            6,
            "Achieved TFLOPS per rank",
            [(f"zeroservice_tflops{{{RANKS}}}", "rank {{rank}}")],
            "none",
            0,
            26,
        ),
        _panel(
            7,
            "MFU per rank",
            [(f"zeroservice_mfu{{{RANKS}}}", "rank {{rank}}")],
            "percentunit",
            12,
            26,
        ),
        _panel(
            8,
            "Step time p50 / p95",
            [
                (
                    "histogram_quantile(0.5, sum by (le) "
                    f"(rate(zeroservice_step_seconds_bucket{{{RANKS}}}[1m])))",
                    "p50",
                ),
                (
                    "histogram_quantile(0.95, sum by (le) "
                    f"(rate(zeroservice_step_seconds_bucket{{{RANKS}}}[1m])))",
                    "p95",
                ),
            ],
            "s",
            0,
            34,
        ),
        _panel(
            9,
            "Tokens per second (all replicas)",
            [(f'sum(rate(zeroservice_tokens_total{{{JOB},mp_rank="0"}}[1m]))', "tokens/s")],
            "none",
            12,
            34,
        ),
        _panel(
            10,
            "Loss (mean over replicas)",
            [(f'avg(zeroservice_loss{{{JOB},mp_rank="0"}})', "loss")],
            "none",
            0,
            42,
        ),
        _panel(
            11,
            "Loss scale",
            [(f"max(zeroservice_loss_scale{{{JOB}}})", "scale")],
            "none",
            12,
            42,
        ),
        _panel(
            13,
            "Time in collectives per op (share of wall time, summed over the ranks shown)",
            [
                (
                    "sum by (op, group) "
                    f"(rate(zeroservice_collective_seconds_total{{{RANKS}}}[1m]))",
                    "{{group}} {{op}}",
                )
            ],
            "percentunit",
            0,
            50,
            w=24,
        ),
        _panel(
            12,
            "Workers and restarts",
            [
                (f"max(zeroservice_workers{{{JOB}}})", "workers"),
                (f"max(zeroservice_restarts{{{JOB}}})", "restarts"),
                (f"max(zeroservice_step{{{JOB}}})", "step"),
            ],
            "none",
            0,
            58,
            w=24,
            h=6,
            kind="stat",
        ),
    ]
    variables = [
        _variable("job", "label_values(zeroservice_step, job_id)", multi=False),
        _variable("rank", f"label_values(zeroservice_step{{{JOB}}}, rank)", multi=True),
    ]
    # Restarts and resizes: the job-level gauges change (a subquery, as max() has no range).
    annotations = [
        {
            "name": name,
            "datasource": DATASOURCE,
            "enable": True,
            "iconColor": color,
            "expr": f"changes(max({metric}{{{JOB}}})[1m:10s]) > 0",
            "step": "10s",
            "titleFormat": name[:-1].lower(),
        }
        for name, metric, color in (
            ("Restarts", "zeroservice_restarts", "red"),
            ("Resizes", "zeroservice_workers", "orange"),
        )
    ]
    return _dashboard(
        "zeroservice-training-job", "zeroservice: training job", panels, variables, annotations
    )


def control_plane() -> dict:
    panels = [
        _panel(1, "Jobs by status", [("zeroservice_jobs", "{{status}}")], "none", 0, 0, stack=True),
        _panel(
            2,
            "Queue wait p50 / p95",
            [
                (
                    "histogram_quantile(0.5, sum by (le) "
                    "(rate(zeroservice_job_queue_wait_seconds_bucket[5m])))",
                    "p50",
                ),
                (
                    "histogram_quantile(0.95, sum by (le) "
                    "(rate(zeroservice_job_queue_wait_seconds_bucket[5m])))",
                    "p95",
                ),
            ],
            "s",
            12,
            0,
        ),
        _panel(
            3,
            "API requests per second by route",
            [("sum by (route) (rate(zeroservice_api_requests_total[1m]))", "{{route}}")],
            "reqps",
            0,
            8,
        ),
        _panel(
            4,
            "API latency p95 by route",
            [
                (
                    "histogram_quantile(0.95, sum by (le, route) "
                    "(rate(zeroservice_api_request_seconds_bucket[5m])))",
                    "{{route}}",
                )
            ],
            "s",
            12,
            8,
        ),
        _panel(
            5,
            "API errors by route and status",
            [
                (
                    "sum by (route, status) (increase(zeroservice_api_errors_total[5m]))",
                    "{{route}} {{status}}",
                )
            ],
            "none",
            0,
            16,
        ),
        _panel(
            6,
            "Workers per job",
            [("zeroservice_job_workers", "{{job_id}}")],
            "none",
            12,
            16,
        ),
        _panel(
            7,
            "Cluster CPUs and GPUs",
            [('zeroservice_cluster_resources{resource=~"CPU|GPU"}', "{{resource}} {{state}}")],
            "none",
            0,
            24,
        ),
        _panel(
            8,
            "Cluster memory",
            [('zeroservice_cluster_resources{resource="memory"}', "{{resource}} {{state}}")],
            "bytes",
            12,
            24,
        ),
    ]
    return _dashboard("zeroservice-control-plane", "zeroservice: control plane", panels, [], [])


DASHBOARDS = {"training-job.json": training_job, "control-plane.json": control_plane}


def main(argv: list[str]) -> int:
    stale = []
    for name, build in DASHBOARDS.items():
        text = json.dumps(build(), indent=2) + "\n"
        path = HERE / name
        if "--check" in argv:
            if not path.is_file() or path.read_text() != text:
                stale.append(name)
        else:
            path.write_text(text)
    if stale:
        print(f"out of date: {', '.join(stale)} (run python dashboards/generate.py)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
