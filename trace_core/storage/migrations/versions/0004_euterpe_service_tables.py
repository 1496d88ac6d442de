"""Euterpe service tables: API keys, job history, tombstones, webhook receipts

``euterpe_api_keys`` binds hashed API keys to requesters; ``inbox_job_history``
records every status an inbox job passes through (written with its transition);
``inbox_job_tombstones`` remembers pruned jobs so that their status reads
answer 410; ``webhook_nonces`` and ``webhook_events_seen`` back the receiver
helper's replay window and event-id dedupe. ``job_outbox_events.sequence``
orders one job's webhooks.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-27 01:05:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

import trace_core.storage.column_types

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "euterpe_api_keys",
        sa.Column("id", trace_core.storage.column_types.Uuid(), nullable=False),
        sa.Column("requester_id", sa.Text(), nullable=False),
        sa.Column("key_digest", sa.Text(), nullable=False),
        sa.Column("label", sa.Text(), nullable=True),
        sa.Column(
            "created_at", trace_core.storage.column_types.UTCDateTime(timezone=True), nullable=True
        ),
        sa.Column(
            "revoked_at", trace_core.storage.column_types.UTCDateTime(timezone=True), nullable=True
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_euterpe_api_keys")),
        sa.UniqueConstraint("key_digest", name=op.f("uq_euterpe_api_keys_key_digest")),
    )
    with op.batch_alter_table("euterpe_api_keys", schema=None) as batch_op:
        batch_op.create_index("idx_euterpe_api_keys_requester", ["requester_id"], unique=False)

    op.create_table(
        "inbox_job_tombstones",
        sa.Column("job_id", trace_core.storage.column_types.Uuid(), nullable=False),
        sa.Column("requester_id", sa.Text(), nullable=False),
        sa.Column("final_status", sa.Text(), nullable=False),
        sa.Column(
            "pruned_at", trace_core.storage.column_types.UTCDateTime(timezone=True), nullable=False
        ),
        sa.PrimaryKeyConstraint("job_id", name=op.f("pk_inbox_job_tombstones")),
    )
    op.create_table(
        "webhook_events_seen",
        sa.Column("event_id", trace_core.storage.column_types.Uuid(), nullable=False),
        sa.Column(
            "received_at",
            trace_core.storage.column_types.UTCDateTime(timezone=True),
            nullable=False,
        ),
        sa.PrimaryKeyConstraint("event_id", name=op.f("pk_webhook_events_seen")),
    )
    with op.batch_alter_table("webhook_events_seen", schema=None) as batch_op:
        batch_op.create_index("idx_webhook_events_seen_received", ["received_at"], unique=False)

    op.create_table(
        "webhook_nonces",
        sa.Column("nonce", sa.Text(), nullable=False),
        sa.Column(
            "expires_at", trace_core.storage.column_types.UTCDateTime(timezone=True), nullable=False
        ),
        sa.PrimaryKeyConstraint("nonce", name=op.f("pk_webhook_nonces")),
    )
    with op.batch_alter_table("webhook_nonces", schema=None) as batch_op:
        batch_op.create_index("idx_webhook_nonces_expiry", ["expires_at"], unique=False)

    op.create_table(
        "inbox_job_history",
        sa.Column("id", trace_core.storage.column_types.Uuid(), nullable=False),
        sa.Column("job_id", trace_core.storage.column_types.Uuid(), nullable=False),
        sa.Column("from_status", sa.Text(), nullable=True),
        sa.Column("to_status", sa.Text(), nullable=False),
        sa.Column("claim_version", sa.BigInteger(), nullable=False),
        sa.Column("attempt_count", sa.Integer(), nullable=False),
        sa.Column("worker_id", sa.Text(), nullable=True),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column(
            "created_at", trace_core.storage.column_types.UTCDateTime(timezone=True), nullable=True
        ),
        sa.ForeignKeyConstraint(
            ["job_id"], ["inbox_jobs.id"], name=op.f("fk_inbox_job_history_job_id_inbox_jobs")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_inbox_job_history")),
    )
    with op.batch_alter_table("inbox_job_history", schema=None) as batch_op:
        batch_op.create_index("idx_inbox_job_history_job", ["job_id", "created_at"], unique=False)

    with op.batch_alter_table("job_outbox_events", schema=None) as batch_op:
        batch_op.add_column(sa.Column("sequence", sa.Integer(), server_default="0", nullable=False))


def downgrade() -> None:
    with op.batch_alter_table("job_outbox_events", schema=None) as batch_op:
        batch_op.drop_column("sequence")

    with op.batch_alter_table("inbox_job_history", schema=None) as batch_op:
        batch_op.drop_index("idx_inbox_job_history_job")

    op.drop_table("inbox_job_history")
    with op.batch_alter_table("webhook_nonces", schema=None) as batch_op:
        batch_op.drop_index("idx_webhook_nonces_expiry")

    op.drop_table("webhook_nonces")
    with op.batch_alter_table("webhook_events_seen", schema=None) as batch_op:
        batch_op.drop_index("idx_webhook_events_seen_received")

    op.drop_table("webhook_events_seen")
    op.drop_table("inbox_job_tombstones")
    with op.batch_alter_table("euterpe_api_keys", schema=None) as batch_op:
        batch_op.drop_index("idx_euterpe_api_keys_requester")

    op.drop_table("euterpe_api_keys")
