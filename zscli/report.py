"""``zeroservice report JOB``: PNG plots of a job for users without Grafana.

Four figures from what the control plane stored for the job: memory by kind per rank
beside the paper's formula, the loss curve, the throughput, and the collectives' bus
bandwidth per op and rank.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

KINDS = ("params", "grads", "master", "optimizer_states", "activations", "comm_buffers")


def _figure():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def render(job: dict[str, Any], metrics: dict[str, Any], out: str | Path) -> list[Path]:
    """Write memory.png, loss.png, throughput.png, bandwidth.png under ``out``."""
    plt = _figure()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    ranks = metrics.get("ranks", {})
    history = metrics.get("history", [])
    if not ranks and not history:
        raise ValueError(f"job {job['id']}: no metrics recorded yet (status {job['status']})")
    title = f"{job['name']} ({job['id'][:8]}), {job['status']} at step {job['step']}"
    written = []

    order = sorted(ranks, key=int)
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(order) + 3), 4.5))
    bottoms = [0.0] * len(order)
    for kind in KINDS:
        values = [ranks[r].get("ledger", {}).get(kind, 0) / 2**20 for r in order]
        ax.bar(order, values, bottom=bottoms, label=kind)
        bottoms = [b + v for b, v in zip(bottoms, values, strict=True)]
    formula = [ranks[r].get("ledger", {}).get("expected_padded") or 0 for r in order]
    ax.scatter(order, [f / 2**20 for f in formula], marker="_", s=900, c="black", label="formula")
    ax.set(xlabel="rank", ylabel="MiB", title=f"Memory by kind per rank: {title}")
    ax.legend(fontsize=8)
    written.append(_save(fig, out / "memory.png"))

    steps = [h["step"] for h in history]
    for name, key, ylabel in (
        ("loss.png", "loss", "loss"),
        ("throughput.png", "tokens_per_second", "tokens/s (all replicas)"),
    ):
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot(steps, [h.get(key) for h in history], marker="o")
        ax.set(xlabel="step", ylabel=ylabel, title=title)
        ax.grid(alpha=0.3)
        written.append(_save(fig, out / name))

    fig, ax = plt.subplots(figsize=(8, 4.5))
    ops = sorted({op for r in order for op in ranks[r].get("busbw", {})})
    width = 0.8 / max(1, len(order))
    for i, r in enumerate(order):
        bw = ranks[r].get("busbw", {})
        ax.bar(
            [j + i * width for j in range(len(ops))],
            [bw.get(op, 0) / 1e9 for op in ops],
            width=width,
            label=f"rank {r}",
        )
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(ops))], ops, rotation=20, fontsize=8)
    ax.set(ylabel="GB/s (bus bandwidth)", title=f"Collectives: {title}")
    ax.legend(fontsize=8)
    written.append(_save(fig, out / "bandwidth.png"))
    return written


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
