"""Job attempts: one row per execution attempt of a task

``job_attempts`` (worker-control-plane-v1.md, "JobAttempt") is opened by the
claim and closed with the attempt's final status, its ``result`` or its
structured ``error``, in the same statement or transaction as the task row.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-27 01:37:14
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

import trace_core.storage.column_types

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def _json() -> sa.types.TypeEngine[Any]:
    return sa.JSON(none_as_null=True).with_variant(
        postgresql.JSONB(none_as_null=True, astext_type=sa.Text()), "postgresql"
    )


def upgrade() -> None:
    op.create_table(
        "job_attempts",
        sa.Column("attempt_id", trace_core.storage.column_types.Uuid(), nullable=False),
        sa.Column("task_id", trace_core.storage.column_types.Uuid(), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("worker_id", sa.Text(), nullable=False),
        sa.Column("stream", sa.Text(), nullable=True),
        sa.Column("message_id", sa.Text(), nullable=True),
        sa.Column("status", sa.Text(), nullable=False),
        sa.Column(
            "started_at", trace_core.storage.column_types.UTCDateTime(timezone=True), nullable=False
        ),
        sa.Column(
            "ended_at", trace_core.storage.column_types.UTCDateTime(timezone=True), nullable=True
        ),
        sa.Column("result", _json(), nullable=True),
        sa.Column("error", _json(), nullable=True),
        sa.CheckConstraint(
            "status IN ('Running', 'Completed', 'Failed', 'Expired', 'TimedOut', 'Canceled')",
            name=op.f("ck_job_attempts_status"),
        ),
        sa.CheckConstraint("attempt >= 1", name=op.f("ck_job_attempts_attempt")),
        sa.ForeignKeyConstraint(
            ["task_id"], ["tasks.id"], name=op.f("fk_job_attempts_task_id_tasks")
        ),
        sa.PrimaryKeyConstraint("attempt_id", name=op.f("pk_job_attempts")),
        sa.UniqueConstraint("task_id", "attempt", name=op.f("uq_job_attempts_task_id_attempt")),
    )


def downgrade() -> None:
    op.drop_table("job_attempts")
