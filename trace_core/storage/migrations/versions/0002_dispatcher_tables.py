"""dispatcher tables

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-26 00:05:25.115326
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

import trace_core.storage.column_types

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "dataset_version_progress",
        sa.Column("dataset_version", sa.Uuid(), nullable=False),
        sa.Column("dataset_uuid", sa.Uuid(), nullable=False),
        sa.Column(
            "ranges",
            sa.JSON(none_as_null=True).with_variant(
                postgresql.JSONB(none_as_null=True, astext_type=sa.Text()), "postgresql"
            ),
            server_default=sa.text("'[]'"),
            nullable=False,
        ),
        sa.Column("max_cursor", sa.BigInteger(), nullable=True),
        sa.Column("events", sa.BigInteger(), server_default="0", nullable=False),
        sa.Column(
            "updated_at", trace_core.storage.column_types.UTCDateTime(timezone=True), nullable=True
        ),
        sa.ForeignKeyConstraint(
            ["dataset_uuid"],
            ["datasets.id"],
            name=op.f("fk_dataset_version_progress_dataset_uuid_datasets"),
        ),
        sa.ForeignKeyConstraint(
            ["dataset_version"],
            ["dataset_versions.id"],
            name=op.f("fk_dataset_version_progress_dataset_version_dataset_versions"),
        ),
        sa.PrimaryKeyConstraint("dataset_version", name=op.f("pk_dataset_version_progress")),
    )
    op.create_table(
        "events",
        sa.Column("id", sa.Uuid(), nullable=False),
        sa.Column("dataset_uuid", sa.Uuid(), nullable=False),
        sa.Column("dataset_version", sa.Uuid(), nullable=False),
        sa.Column("unit_key", sa.Text(), nullable=False),
        sa.Column("cursor", sa.Text(), nullable=True),
        sa.Column("partition_key", sa.Text(), nullable=True),
        sa.Column("range_start", sa.BigInteger(), nullable=True),
        sa.Column("range_end", sa.BigInteger(), nullable=True),
        sa.Column("origin", sa.Text(), nullable=False),
        sa.Column("producer_task_id", sa.Uuid(), nullable=True),
        sa.Column("producer_attempt", sa.Integer(), nullable=True),
        sa.Column(
            "received_at",
            trace_core.storage.column_types.UTCDateTime(timezone=True),
            nullable=False,
        ),
        sa.Column(
            "last_received_at",
            trace_core.storage.column_types.UTCDateTime(timezone=True),
            nullable=False,
        ),
        sa.Column("deliveries", sa.Integer(), server_default="1", nullable=False),
        sa.Column("route_status", sa.Text(), server_default="pending", nullable=False),
        sa.Column(
            "routed_at", trace_core.storage.column_types.UTCDateTime(timezone=True), nullable=True
        ),
        sa.Column("tasks_created", sa.Integer(), server_default="0", nullable=False),
        sa.Column("tasks_existing", sa.Integer(), server_default="0", nullable=False),
        sa.Column(
            "route_detail",
            sa.JSON(none_as_null=True).with_variant(
                postgresql.JSONB(none_as_null=True, astext_type=sa.Text()), "postgresql"
            ),
            nullable=True,
        ),
        sa.CheckConstraint("origin IN ('task', 'manual')", name=op.f("ck_events_origin")),
        sa.CheckConstraint(
            "route_status IN ('pending', 'routed', 'not_current')",
            name=op.f("ck_events_route_status"),
        ),
        sa.ForeignKeyConstraint(
            ["dataset_uuid"], ["datasets.id"], name=op.f("fk_events_dataset_uuid_datasets")
        ),
        sa.ForeignKeyConstraint(
            ["dataset_version"],
            ["dataset_versions.id"],
            name=op.f("fk_events_dataset_version_dataset_versions"),
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_events")),
        sa.UniqueConstraint(
            "dataset_version", "unit_key", name=op.f("uq_events_dataset_version_unit_key")
        ),
    )
    with op.batch_alter_table("events", schema=None) as batch_op:
        batch_op.create_index(
            "idx_events_dataset_received", ["dataset_uuid", "received_at"], unique=False
        )

    op.create_table(
        "job_journal",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("job_id", sa.Uuid(), nullable=False),
        sa.Column("at", trace_core.storage.column_types.UTCDateTime(timezone=True), nullable=False),
        sa.Column("kind", sa.Text(), nullable=False),
        sa.Column("message", sa.Text(), nullable=False),
        sa.Column(
            "detail",
            sa.JSON(none_as_null=True).with_variant(
                postgresql.JSONB(none_as_null=True, astext_type=sa.Text()), "postgresql"
            ),
            nullable=True,
        ),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], name=op.f("fk_job_journal_job_id_jobs")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_job_journal")),
    )
    with op.batch_alter_table("job_journal", schema=None) as batch_op:
        batch_op.create_index("idx_job_journal_job_at", ["job_id", "at"], unique=False)

    op.create_table(
        "job_states",
        sa.Column("job_id", sa.Uuid(), nullable=False),
        sa.Column("paused", sa.Boolean(), server_default=sa.false(), nullable=False),
        sa.Column("pause_reason", sa.Text(), nullable=True),
        sa.Column(
            "paused_at", trace_core.storage.column_types.UTCDateTime(timezone=True), nullable=True
        ),
        sa.Column("source_status", sa.Text(), nullable=True),
        sa.Column("source_task_id", sa.Uuid(), nullable=True),
        sa.Column("source_restarts", sa.Integer(), server_default="0", nullable=False),
        sa.Column(
            "next_fire_at",
            trace_core.storage.column_types.UTCDateTime(timezone=True),
            nullable=True,
        ),
        sa.Column(
            "last_fired_at",
            trace_core.storage.column_types.UTCDateTime(timezone=True),
            nullable=True,
        ),
        sa.Column("scale_state", sa.Text(), server_default="Idle", nullable=False),
        sa.Column(
            "last_activity_at",
            trace_core.storage.column_types.UTCDateTime(timezone=True),
            nullable=True,
        ),
        sa.Column(
            "updated_at", trace_core.storage.column_types.UTCDateTime(timezone=True), nullable=True
        ),
        sa.CheckConstraint(
            "scale_state IN ('Idle', 'Running')", name=op.f("ck_job_states_scale_state")
        ),
        sa.CheckConstraint(
            "source_status IS NULL OR source_status IN ('Pending', 'Running', 'Dead', 'Draining', 'Stopped')",
            name=op.f("ck_job_states_source_status"),
        ),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], name=op.f("fk_job_states_job_id_jobs")),
        sa.ForeignKeyConstraint(
            ["source_task_id"], ["tasks.id"], name=op.f("fk_job_states_source_task_id_tasks")
        ),
        sa.PrimaryKeyConstraint("job_id", name=op.f("pk_job_states")),
    )
    with op.batch_alter_table("dag_versions", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("status", sa.Text(), server_default="building", nullable=False)
        )
        batch_op.add_column(sa.Column("yaml_text", sa.Text(), nullable=True))
        batch_op.add_column(
            sa.Column(
                "activated_at",
                trace_core.storage.column_types.UTCDateTime(timezone=True),
                nullable=True,
            )
        )

    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column(
                "backpressure",
                sa.JSON(none_as_null=True).with_variant(
                    postgresql.JSONB(none_as_null=True, astext_type=sa.Text()), "postgresql"
                ),
                nullable=True,
            )
        )
        batch_op.add_column(
            sa.Column("priority_tier", sa.Text(), server_default="normal", nullable=False)
        )

    with op.batch_alter_table("operator_state", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("version", sa.BigInteger(), server_default="0", nullable=False)
        )

    with op.batch_alter_table("tasks", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column(
                "queued_at",
                trace_core.storage.column_types.UTCDateTime(timezone=True),
                nullable=True,
            )
        )
    # existing tasks keep their order: queued when created
    op.execute("UPDATE tasks SET queued_at = created_at")
    with op.batch_alter_table("tasks", schema=None) as batch_op:
        batch_op.alter_column(
            "queued_at",
            existing_type=trace_core.storage.column_types.UTCDateTime(timezone=True),
            nullable=False,
        )
        batch_op.drop_index(
            batch_op.f("idx_tasks_claim"), sqlite_where=sa.text("status = 'Queued'")
        )
        batch_op.create_index(
            "idx_tasks_claim",
            ["queued_at"],
            unique=False,
            postgresql_where=sa.text("status = 'Queued'"),
            sqlite_where=sa.text("status = 'Queued'"),
        )


def downgrade() -> None:
    with op.batch_alter_table("tasks", schema=None) as batch_op:
        batch_op.drop_index(
            "idx_tasks_claim",
            postgresql_where=sa.text("status = 'Queued'"),
            sqlite_where=sa.text("status = 'Queued'"),
        )
        batch_op.create_index(
            batch_op.f("idx_tasks_claim"),
            ["created_at"],
            unique=False,
            sqlite_where=sa.text("status = 'Queued'"),
        )
        batch_op.drop_column("queued_at")

    with op.batch_alter_table("operator_state", schema=None) as batch_op:
        batch_op.drop_column("version")

    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_column("priority_tier")
        batch_op.drop_column("backpressure")

    with op.batch_alter_table("dag_versions", schema=None) as batch_op:
        batch_op.drop_column("activated_at")
        batch_op.drop_column("yaml_text")
        batch_op.drop_column("status")

    op.drop_table("job_states")
    with op.batch_alter_table("job_journal", schema=None) as batch_op:
        batch_op.drop_index("idx_job_journal_job_at")

    op.drop_table("job_journal")
    with op.batch_alter_table("events", schema=None) as batch_op:
        batch_op.drop_index("idx_events_dataset_received")

    op.drop_table("events")
    op.drop_table("dataset_version_progress")
