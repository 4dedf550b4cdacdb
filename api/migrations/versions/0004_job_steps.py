"""Per-step history of jobs (job_steps), replacing the per-chunk list kept in the
job's metrics JSON: each stored chunk becomes one point.

Revision ID: 0004
Revises: 0003
"""

from __future__ import annotations

import math

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    steps = op.create_table(
        "job_steps",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("job_id", sa.String(36), sa.ForeignKey("jobs.id"), nullable=False),
        sa.Column("step", sa.Integer, nullable=False),
        sa.Column("steps", sa.Integer, nullable=False),
        sa.Column("loss", sa.Float, nullable=True),
        sa.Column("grad_norm", sa.Float, nullable=True),
        sa.Column("loss_scale", sa.Float, nullable=True),
        sa.Column("lr", sa.Float, nullable=True),
        sa.Column("step_seconds", sa.Float, nullable=True),
        sa.Column("tokens_per_second", sa.Float, nullable=True),
        sa.Column("memory_peak_bytes", sa.BigInteger, nullable=True),
        sa.Column("dp", sa.Integer, nullable=False),
    )
    op.create_index("ix_job_steps_job_step", "job_steps", ["job_id", "step"])
    jobs = sa.table("jobs", sa.column("id", sa.String), sa.column("metrics", sa.JSON))
    bind = op.get_bind()
    rows = []
    for job_id, metrics in bind.execute(sa.select(jobs.c.id, jobs.c.metrics)):
        previous = 0
        for chunk in sorted((metrics or {}).get("history", []), key=lambda c: c["step"]):
            step = int(chunk["step"])
            if step <= previous:
                continue
            rows.append(
                {
                    "job_id": job_id,
                    "step": step,
                    "steps": step - previous,
                    "loss": _finite(chunk.get("loss")),
                    "grad_norm": None,
                    "loss_scale": None,
                    "lr": None,
                    "step_seconds": None,
                    "tokens_per_second": _finite(chunk.get("tokens_per_second")),
                    "memory_peak_bytes": None,
                    "dp": int(chunk.get("dp") or 0),
                }
            )
            previous = step
    if rows:
        op.bulk_insert(steps, rows)


def _finite(value) -> float | None:
    return float(value) if value is not None and math.isfinite(float(value)) else None


def downgrade() -> None:
    op.drop_index("ix_job_steps_job_step", table_name="job_steps")
    op.drop_table("job_steps")
