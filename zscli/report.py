"""``zeroservice report JOB`` and ``zeroservice compare A B``: charts of a job for
people without Grafana, and a one-page HTML report beside them.

From what the control plane stores for a job (``GET /v1/jobs/{id}/metrics``, every
page of its per-step history):

    loss.png        loss and gradient norm per step
    throughput.png  tokens/s (all replicas) and seconds per step, from zero
    schedule.png    learning rate and loss scale per step
    memory.png      memory by kind per rank beside the paper's formula; peak per step
    bandwidth.png   bus bandwidth per step-phase (op/tag) and rank, training steps only
    index.html      the job's summary and the charts

Every chart says what it shows in its title, its units on its axes, and keeps its
legend off the data (beside the axes).
"""

from __future__ import annotations

import html
import math
from pathlib import Path
from typing import Any

KINDS = (
    ("params", "parameters"),
    ("grads", "gradients"),
    ("master", "fp32 master"),
    ("optimizer_states", "optimizer states"),
    ("activations", "activations"),
    ("comm_buffers", "comm. buffers"),
)
FORMULA = {
    # (stage, mixed precision): model-state bytes per rank (Adam, K = 12)
    (0, True): "16Ψ",
    (1, True): "4Ψ + 12Ψ/N_d",
    (2, True): "2Ψ + 14Ψ/N_d",
    (3, True): "16Ψ/N_d",
    (0, False): "16Ψ",
    (1, False): "8Ψ + 8Ψ/N_d",
    (2, False): "4Ψ + 12Ψ/N_d",
    (3, False): "16Ψ/N_d",
}
VOLUME = {0: "2Ψ", 1: "2Ψ", 2: "2Ψ", 3: "3Ψ"}
"""Gradient + parameter elements each rank moves per step (docs/architecture.md)."""
MIB = 2**20
COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b")


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def label(job: dict[str, Any]) -> str:
    return f"{job['name']} ({job['id'][:8]})"


def summary(job: dict[str, Any], metrics: dict[str, Any]) -> list[tuple[str, str]]:
    """The job's figures as (name, value) rows, for the report's page and its subtitle."""
    spec = job.get("spec") or {}
    engine = spec.get("engine", {})
    model = spec.get("model", {})
    history = metrics.get("history", [])
    losses = [p["loss"] for p in history if p.get("loss") is not None]
    rates = [p["tokens_per_second"] for p in history if p.get("tokens_per_second")]
    seconds = [p["step_seconds"] for p in history if p.get("step_seconds")]
    rows = [
        ("job", f"{job['name']} ({job['id']})"),
        ("status", f"{job['status']}: {job.get('reason', '')} {job.get('message', '')}".strip()),
        ("steps", f"{job['step']} of {job.get('steps', '?')}"),
        ("ZeRO stage", f"{engine.get('stage', 'default')}, {engine.get('precision', 'fp32')}"),
        (
            "model",
            f"{model.get('kind', 'gpt')}: {model.get('n_layer', '')} layers, dim "
            f"{model.get('dim', '')}, seq {model.get('seq_len', '')}"
            if model.get("kind", "gpt") == "gpt"
            else str(model.get("kind")),
        ),
        ("ranks", f"dp {job.get('current_dp', '')} × mp {spec.get('resources', {}).get('mp', 1)}"),
        ("restarts", str(job.get("attempts", 0))),
    ]
    if losses:
        rows.append(("loss", f"{losses[0]:.4f} at the start, {losses[-1]:.4f} at the end"))
    if rates:
        rows.append(("tokens/s", f"{sum(rates) / len(rates):,.0f} mean, {max(rates):,.0f} best"))
    if seconds:
        rows.append(("step time", f"{1000 * sorted(seconds)[len(seconds) // 2]:,.1f} ms median"))
    stride = metrics.get("history_stride", 1)
    rows.append(("history", f"{len(history)} points, {stride} step(s) each"))
    return rows


def history_pages(client: Any, job_id: str, page: int = 1000) -> dict[str, Any]:
    """The job's metrics with every page of its history."""
    metrics = client.metrics(job_id, after=-1, limit=page)
    points = list(metrics["history"])
    while metrics.get("next_after") is not None:
        metrics = client.metrics(job_id, after=metrics["next_after"], limit=page)
        points += metrics["history"]
    metrics["history"] = points
    return metrics


def render(job: dict[str, Any], metrics: dict[str, Any], out: str | Path) -> list[Path]:
    """Write the charts and index.html under ``out``; returns their paths."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    ranks = metrics.get("ranks", {})
    history = metrics.get("history", [])
    if not ranks and not history:
        raise ValueError(f"job {job['id']}: no metrics recorded yet (status {job['status']})")
    written = []
    if history:
        written.append(_loss(job, metrics, out / "loss.png"))
        written.append(_throughput(job, metrics, out / "throughput.png"))
        written.append(_schedule(job, metrics, out / "schedule.png"))
    if ranks or history:
        written.append(_memory(job, metrics, out / "memory.png"))
    if any(r.get("phases") for r in ranks.values()):
        written.append(_bandwidth(job, metrics, out / "bandwidth.png"))
    written.append(_page(job, metrics, written, out / "index.html"))
    return written


def compare(runs: list[tuple[dict[str, Any], dict[str, Any]]], path: str | Path) -> Path:
    """Two (or more) jobs' loss and throughput per step on one chart."""
    plt = _plt()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6.5), sharex=True)
    for i, (job, metrics) in enumerate(runs):
        history = metrics.get("history", [])
        steps = [p["step"] for p in history]
        color = COLORS[i % len(COLORS)]
        top.plot(steps, _values(history, "loss"), color=color, label=label(job))
        bottom.plot(steps, _values(history, "tokens_per_second"), color=color, label=label(job))
    top.set(ylabel="loss (mean over replicas)", title="Loss per step")
    bottom.set(xlabel="optimizer step", ylabel="tokens/s (all replicas)", title="Throughput")
    bottom.set_ylim(bottom=0)
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    top.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    fig.suptitle("Comparison: " + " vs ".join(label(job) for job, _ in runs), fontsize=11)
    return _save(fig, Path(path))


# -- the charts ---------------------------------------------------------------------------
def _values(history: list[dict[str, Any]], key: str, scale: float = 1.0) -> list[float]:
    """A series with gaps (NaN) where a point has no value."""
    return [p[key] * scale if p.get(key) is not None else math.nan for p in history]


def _unit(largest: float) -> tuple[str, float]:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if largest >= scale:
            return unit, scale
    return "bytes", 1


def _size(n: float) -> str:
    unit, scale = _unit(n)
    return f"{n / scale:,.1f} {unit}"


def _resolution(metrics: dict[str, Any]) -> str:
    stride = metrics.get("history_stride", 1)
    return "every step" if stride == 1 else f"each point: mean of {stride} steps"


def _loss(job: dict[str, Any], metrics: dict[str, Any], path: Path) -> Path:
    plt = _plt()
    history = metrics["history"]
    steps = [p["step"] for p in history]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    top.plot(steps, _values(history, "loss"), color=COLORS[0])
    top.set(ylabel="loss (cross-entropy, nats/token)", title="Training loss")
    bottom.plot(steps, _values(history, "grad_norm"), color=COLORS[1])
    bottom.set(xlabel="optimizer step", ylabel="global L2 norm", title="Gradient norm")
    bottom.set_ylim(bottom=0)
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    fig.suptitle(f"{label(job)}: loss per step ({_resolution(metrics)})", fontsize=11)
    return _save(fig, path)


def _throughput(job: dict[str, Any], metrics: dict[str, Any], path: Path) -> Path:
    plt = _plt()
    history = metrics["history"]
    steps = [p["step"] for p in history]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    top.plot(steps, _values(history, "tokens_per_second"), color=COLORS[2])
    top.set(ylabel="tokens/s", title="Throughput: tokens of all replicas per second")
    bottom.plot(steps, _values(history, "step_seconds", 1000.0), color=COLORS[3])
    bottom.set(xlabel="optimizer step", ylabel="ms per step", title="Step time (the slowest rank)")
    pairs = zip(history, history[1:], strict=False)
    changes = [b["step"] for a, b in pairs if a.get("dp") != b.get("dp")]
    for ax in (top, bottom):
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        for step in changes:
            ax.axvline(step, color="grey", linestyle=":", linewidth=1)
    if changes:
        top.text(0.01, 0.03, "dotted: data-parallel degree changed", transform=top.transAxes)
    fig.suptitle(f"{label(job)}: throughput per step ({_resolution(metrics)})", fontsize=11)
    return _save(fig, path)


def _schedule(job: dict[str, Any], metrics: dict[str, Any], path: Path) -> Path:
    plt = _plt()
    history = metrics["history"]
    steps = [p["step"] for p in history]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    left.plot(steps, _values(history, "lr"), color=COLORS[4])
    left.set(xlabel="optimizer step", ylabel="learning rate", title="Learning rate")
    left.set_ylim(bottom=0)
    left.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
    right.plot(steps, _values(history, "loss_scale"), color=COLORS[5], drawstyle="steps-post")
    right.set(xlabel="optimizer step", ylabel="loss scale (×)", title="Loss scale (fp16)")
    scales = [x for x in _values(history, "loss_scale") if not math.isnan(x)]
    if scales and max(scales) > 1:
        right.set_yscale("log", base=2)
    else:
        right.text(
            0.5,
            0.75,
            "1 throughout (no fp16 scaling)",
            transform=right.transAxes,
            ha="center",
            color="grey",
        )
    for ax in (left, right):
        ax.grid(alpha=0.3)
    fig.suptitle(f"{label(job)}: schedule per step", fontsize=11)
    return _save(fig, path)


def _memory(job: dict[str, Any], metrics: dict[str, Any], path: Path) -> Path:
    plt = _plt()
    ranks = metrics.get("ranks", {})
    history = metrics.get("history", [])
    order = sorted(ranks, key=int)
    fig, (bars, peak) = plt.subplots(
        1, 2, figsize=(12, 4.8), gridspec_kw={"width_ratios": [max(2, len(order)) + 2, 5]}
    )
    bottoms = [0.0] * len(order)
    x = list(range(len(order)))
    totals = [sum(ranks[r].get("ledger", {}).get(k, 0) for k, _ in KINDS) for r in order]
    unit, scale = _unit(max(totals, default=0))
    for (kind, name), color in zip(KINDS, COLORS, strict=True):
        values = [ranks[r].get("ledger", {}).get(kind, 0) / scale for r in order]
        if any(values):
            bars.bar(x, values, bottom=bottoms, label=name, color=color, width=0.6)
            bottoms = [b + v for b, v in zip(bottoms, values, strict=True)]
    ledger = ranks[order[0]].get("ledger", {}) if order else {}
    expected = [ranks[r].get("ledger", {}).get("expected_padded") for r in order]
    if any(e is not None for e in expected):
        formula = FORMULA.get(
            (int(ledger.get("stage", 0)), ledger.get("precision", "fp32") != "fp32"), "?"
        )
        psi = ledger.get("psi_padded", 0)
        bars.hlines(
            [(e or 0) / scale for e in expected],
            [i - 0.4 for i in x],
            [i + 0.4 for i in x],
            colors="black",
            linewidth=2,
            label=f"paper's model states:\n{formula} (Ψ = {psi:,}, N_d = {ledger.get('n_d', '?')})",
        )
    bars.set_xticks(x, [f"rank {r}" for r in order])
    bars.set(ylabel=unit, title="Held by the engine, per rank")
    largest = ledger.get("comm_buffer_largest", 0)
    if largest:
        bars.text(
            0.0,
            -0.2,
            f"comm. buffers: a constant size (the largest {_size(largest)} = bucket_elements ×"
            " dtype bytes),\nwhatever the model's size: a large share only of a small model",
            transform=bars.transAxes,
            fontsize=8,
            color="dimgrey",
            va="top",
        )
    bars.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    steps = [p["step"] for p in history]
    peak.plot(steps, _values(history, "memory_peak_bytes", 1 / MIB), color=COLORS[3])
    peak.set(
        xlabel="optimizer step",
        ylabel="MiB (GPU: allocator peak; CPU: peak RSS)",
        title="Peak memory per step (the largest rank)",
    )
    peak.set_ylim(bottom=0)
    peak.grid(alpha=0.3)
    fig.suptitle(f"{label(job)}: memory", fontsize=11)
    return _save(fig, path)


def volume_note(rank: dict[str, Any]) -> str:
    """What a rank's collectives moved per step beside the paper's volume; a job of one
    rank (one data-parallel rank, no model parallelism) sends nothing (its collectives
    are local: see [Note: a group of one] in zeroservice/comm.py), so its payloads are
    not held against the paper's."""
    ledger = rank.get("ledger") or {}
    stage, psi = int(ledger.get("stage", -1)), ledger.get("psi_padded") or 0
    note = "training steps only (start-up broadcast and checkpoint gathers left out)"
    if ledger.get("n_d") == 1 and ledger.get("mp", 1) == 1:
        return note + "\none rank (N_d = 1): no collective is issued, nothing is sent"
    if stage in VOLUME:
        note += f"\ngrads + params per step and rank: paper {VOLUME[stage]} (stage {stage})"
        volume = rank.get("comm_volume_per_step")
        if volume and psi:
            note += f", measured {volume:,} elements = {volume / psi:.2f}Ψ (Ψ = {psi:,})"
    return note


def _bandwidth(job: dict[str, Any], metrics: dict[str, Any], path: Path) -> Path:
    plt = _plt()
    ranks = metrics["ranks"]
    order = sorted(ranks, key=int)
    phases = sorted({name for r in order for name in ranks[r].get("phases", {})})
    fig, ax = plt.subplots(figsize=(10, 4.8))
    width = 0.8 / max(1, len(order))
    for i, r in enumerate(order):
        got = ranks[r].get("phases", {})
        ax.bar(
            [j + i * width for j in range(len(phases))],
            [got.get(name, {}).get("busbw", 0) / 1e9 for name in phases],
            width=width,
            label=f"rank {r}",
            color=COLORS[i % len(COLORS)],
        )
    first = ranks[order[0]].get("phases", {})
    ticks = []
    for name in phases:
        p = first.get(name, {})
        per_step = p.get("bytes", 0) / max(1, p.get("steps", 1))
        ticks.append(f"{name}\n{_size(per_step)}/step")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(phases))], ticks, fontsize=8)
    ax.set(ylabel="bus bandwidth, GB/s", title="Collectives per step-phase (op/tag)")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    note = volume_note(ranks[order[0]])
    ax.text(0.0, -0.22, note, transform=ax.transAxes, fontsize=8, color="dimgrey", va="top")
    fig.suptitle(f"{label(job)}: bus bandwidth (nccl-tests definition)", fontsize=11)
    return _save(fig, path)


def _page(job: dict[str, Any], metrics: dict[str, Any], charts: list[Path], path: Path) -> Path:
    rows = "\n".join(
        f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>"
        for k, v in summary(job, metrics)
    )
    images = "\n".join(
        f'<figure><img src="{c.name}" alt="{c.stem}"><figcaption>{c.stem}</figcaption></figure>'
        for c in charts
    )
    path.write_text(
        f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<title>{html.escape(label(job))}: zeroservice report</title>
<style>
body {{ font-family: sans-serif; max-width: 1250px; margin: 1em auto; color: #222; }}
table {{ border-collapse: collapse; margin-bottom: 1em; }}
th, td {{ text-align: left; padding: 2px 12px 2px 0; vertical-align: top; }}
th {{ color: #555; font-weight: normal; }}
figure {{ display: inline-block; margin: 0 1em 1em 0; }}
img {{ max-width: 100%; border: 1px solid #ddd; }}
figcaption {{ color: #777; font-size: 0.8em; }}
</style></head><body>
<h1>{html.escape(label(job))}</h1>
<table>
{rows}
</table>
{images}
</body></html>
"""
    )
    return path


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
