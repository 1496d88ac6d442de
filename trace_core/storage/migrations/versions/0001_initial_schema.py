"""initial schema

Revision ID: 0001
Revises:
Create Date: 2026-11-25 21:57:07.596245
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

import trace_core.storage.column_types

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:

    op.create_table(
        "idempotency_keys",
        sa.Column("scope", sa.Text(), nullable=False),
        sa.Column("key", sa.Text(), nullable=False),
        sa.Column("request_hash", sa.Text(), nullable=False),
        sa.Column("status", sa.Text(), nullable=False),
        sa.Column(
            "response",
            sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql"),
            nullable=True,
        ),
        sa.Column(
            "created_at", trace_core.storage.column_types.UTCDateTime(timezone=True), nullable=False
        ),
        sa.Column(
            "completed_at",
            trace_core.storage.column_types.UTCDateTime(timezone=True),
            nullable=True,
        ),
        sa.Column(
            "expires_at", trace_core.storage.column_types.UTCDateTime(timezone=True), nullable=False
        ),
        sa.CheckConstraint(
            "status IN ('in_flight', 'completed')", name=op.f("ck_idempotency_keys_status")
        ),
        sa.PrimaryKeyConstraint("scope", "key", name=op.f("pk_idempotency_keys")),
    )
    with op.batch_alter_table("idempotency_keys", schema=None) as batch_op:
        batch_op.create_index("idx_idempotency_keys_expiry", ["expires_at"], unique=False)

    op.create_table(
        "inbox_jobs",
        sa.Column("id", sa.Uuid(), nullable=False),
        sa.Column("requester_id", sa.Text(), nullable=False),
        sa.Column("status", sa.Text(), server_default="queued", nullable=False),
        sa.Column(
            "request",
            sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql"),
            server_default=sa.text("'{}'"),
            nullable=False,
        ),
        sa.Column("status_webhook_url", sa.Text(), nullable=True),
        sa.Column("refresh_url", sa.Text(), nullable=True),
        sa.Column("attempt_count", sa.Integer(), server_default="0", nullable=False),
        sa.Column("max_attempts", sa.Integer(), server_default="5", nullable=False),
        sa.Column("credential_refresh_count", sa.Integer(), server_default="0", nullable=False),
        sa.Column("credential_version", sa.Integer(), server_default="0", nullable=False),
        sa.Column("storage_creds_encrypted", sa.LargeBinary(), nullable=True),
        sa.Column("storage_creds_dek_wrapped", sa.LargeBinary(), nullable=True),
        sa.Column("storage_creds_kek_id", sa.Text(), nullable=True),
        sa.Column("storage_creds_encryption_version", sa.Integer(), nullable=True),
        sa.Column("worker_id", sa.Text(), nullable=True),
        sa.Column("lease_token", sa.Uuid(), nullable=True),
        sa.Column(
            "lease_expires_at",
            trace_core.storage.column_types.UTCDateTime(timezone=True),
            nullable=True,
        ),
        sa.Column(
            "heartbeat_at",
            trace_core.storage.column_types.UTCDateTime(timezone=True),
            nullable=True,
        ),
        sa.Column("claim_version", sa.BigInteger(), server_default="0", nullable=False),
        sa.Column(
            "available_at",
            trace_core.storage.column_types.UTCDateTime(timezone=True),
            nullable=False,
        ),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column(
            "outputs",
            sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql"),
            nullable=True,
        ),
        sa.Column(
            "created_at", trace_core.storage.column_types.UTCDateTime(timezone=True), nullable=True
        ),
        sa.Column(
            "updated_at", trace_core.storage.column_types.UTCDateTime(timezone=True), nullable=True
        ),
        sa.Column(
            "finished_at", trace_core.storage.column_types.UTCDateTime(timezone=True), nullable=True
        ),
        sa.CheckConstraint(
            "status IN ('queued', 'claimed', 'fetching', 'processing', 'uploading', 'succeeded', 'failed', 'dead_letter')",
            name=op.f("ck_inbox_jobs_status"),
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_inbox_jobs")),
    )
    with op.batch_alter_table("inbox_jobs", schema=None) as batch_op:
        batch_op.create_index(
            "idx_inbox_jobs_lease_expiry",
            ["lease_expires_at"],
            unique=False,
            postgresql_where=sa.text(
                "status IN ('claimed', 'fetching', 'processing', 'uploading')"
            ),
            sqlite_where=sa.text("status IN ('claimed', 'fetching', 'processing', 'uploading')"),
        )
        batch_op.create_index(
            "idx_inbox_jobs_ready",
            ["available_at"],
            unique=False,
            postgresql_where=sa.text("status = 'queued'"),
            sqlite_where=sa.text("status = 'queued'"),
        )
        batch_op.create_index(
            "idx_inbox_jobs_requester", ["requester_id", "created_at"], unique=False
        )
        batch_op.create_index(
            "idx_inbox_jobs_retry",
            ["available_at"],
            unique=False,
            postgresql_where=sa.text("status = 'failed'"),
            sqlite_where=sa.text("status = 'failed'"),
        )

    op.create_table(
        "orgs",
        sa.Column("id", sa.Uuid(), nullable=False),
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("slug", sa.Text(), nullable=False),
        sa.Column(
            "settings",
            sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql"),
            server_default=sa.text("'{}'"),
            nullable=False,
        ),
        sa.Column(
            "created_at", trace_core.storage.column_types.UTCDateTime(timezone=True), nullable=True
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_orgs")),
        sa.UniqueConstraint("slug", name=op.f("uq_orgs_slug")),
    )
    op.create_table(
        "outbox",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("kind", sa.Text(), nullable=False),
        sa.Column(
            "payload",
            sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql"),
            nullable=False,
        ),
        sa.Column("status", sa.Text(), server_default="Pending", nullable=False),
        sa.Column(
            "available_at",
            trace_core.storage.column_types.UTCDateTime(timezone=True),
            nullable=False,
        ),
        sa.Column("attempts", sa.Integer(), server_default="0", nullable=False),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column(
            "created_at", trace_core.storage.column_types.UTCDateTime(timezone=True), nullable=True
        ),
        sa.Column(
            "processed_at",
            trace_core.storage.column_types.UTCDateTime(timezone=True),
            nullable=True,
        ),
        sa.Column("worker_id", sa.Text(), nullable=True),
        sa.Column("lease_token", sa.Uuid(), nullable=True),
        sa.Column(
            "lease_expires_at",
            trace_core.storage.column_types.UTCDateTime(timezone=True),
            nullable=True,
        ),
        sa.Column(
            "heartbeat_at",
            trace_core.storage.column_types.UTCDateTime(timezone=True),
            nullable=True,
        ),
        sa.Column("claim_version", sa.BigInteger(), server_default="0", nullable=False),
        sa.Column("max_attempts", sa.Integer(), server_default="10", nullable=False),
        sa.CheckConstraint(
            "status IN ('Pending', 'Processing', 'Done', 'Failed')", name=op.f("ck_outbox_status")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_outbox")),
    )
    with op.batch_alter_table("outbox", schema=None) as batch_op:
        batch_op.create_index(
            "idx_outbox_lease_expiry",
            ["lease_expires_at"],
            unique=False,
            postgresql_where=sa.text("status = 'Processing'"),
            sqlite_where=sa.text("status = 'Processing'"),
        )
        batch_op.create_index(
            "idx_outbox_pending",
            ["status", "available_at"],
            unique=False,
            postgresql_where=sa.text("status = 'Pending'"),
            sqlite_where=sa.text("status = 'Pending'"),
        )

    op.create_table(
        "dag_versions",
        sa.Column("id", sa.Uuid(), nullable=False),
        sa.Column("org_id", sa.Uuid(), nullable=False),
        sa.Column("dag_name", sa.Text(), nullable=False),
        sa.Column("yaml_hash", sa.Text(), nullable=False),
        sa.Column(
            "created_at", trace_core.storage.column_types.UTCDateTime(timezone=True), nullable=True
        ),
        sa.ForeignKeyConstraint(["org_id"], ["orgs.id"], name=op.f("fk_dag_versions_org_id_orgs")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_dag_versions")),
        sa.UniqueConstraint(
            "org_id",
            "dag_name",
            "yaml_hash",
            name=op.f("uq_dag_versions_org_id_dag_name_yaml_hash"),
        ),
    )
    op.create_table(
        "datasets",
        sa.Column("id", sa.Uuid(), nullable=False),
        sa.Column("org_id", sa.Uuid(), nullable=False),
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("producer_dag_name", sa.Text(), nullable=False),
        sa.Column("producer_job_name", sa.Text(), nullable=False),
        sa.Column("producer_output_index", sa.Integer(), nullable=False),
        sa.Column(
            "storage",
            sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql"),
            server_default=sa.text("'{}'"),
            nullable=False,
        ),
        sa.Column(
            "read_roles",
            trace_core.storage.column_types.StringArray(),
            server_default=trace_core.storage.column_types.EmptyArray(),
            nullable=False,
        ),
        sa.Column(
            "created_at", trace_core.storage.column_types.UTCDateTime(timezone=True), nullable=True
        ),
        sa.Column(
            "updated_at", trace_core.storage.column_types.UTCDateTime(timezone=True), nullable=True
        ),
        sa.ForeignKeyConstraint(["org_id"], ["orgs.id"], name=op.f("fk_datasets_org_id_orgs")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_datasets")),
        sa.UniqueConstraint("org_id", "name", name=op.f("uq_datasets_org_id_name")),
        sa.UniqueConstraint(
            "org_id",
            "producer_dag_name",
            "producer_job_name",
            "producer_output_index",
            name=op.f(
                "uq_datasets_org_id_producer_dag_name_producer_job_name_producer_output_index"
            ),
        ),
    )
    op.create_table(
        "job_outbox_events",
        sa.Column("id", sa.Uuid(), nullable=False),
        sa.Column("job_id", sa.Uuid(), nullable=False),
        sa.Column("event_type", sa.Text(), nullable=False),
        sa.Column(
            "payload",
            sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql"),
            server_default=sa.text("'{}'"),
            nullable=False,
        ),
        sa.Column("status", sa.Text(), server_default="pending", nullable=False),
        sa.Column("attempts", sa.Integer(), server_default="0", nullable=False),
        sa.Column("max_attempts", sa.Integer(), server_default="10", nullable=False),
        sa.Column("worker_id", sa.Text(), nullable=True),
        sa.Column("lease_token", sa.Uuid(), nullable=True),
        sa.Column(
            "lease_expires_at",
            trace_core.storage.column_types.UTCDateTime(timezone=True),
            nullable=True,
        ),
        sa.Column(
            "heartbeat_at",
            trace_core.storage.column_types.UTCDateTime(timezone=True),
            nullable=True,
        ),
        sa.Column("claim_version", sa.BigInteger(), server_default="0", nullable=False),
        sa.Column(
            "available_at",
            trace_core.storage.column_types.UTCDateTime(timezone=True),
            nullable=False,
        ),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column(
            "created_at", trace_core.storage.column_types.UTCDateTime(timezone=True), nullable=True
        ),
        sa.Column(
            "delivered_at",
            trace_core.storage.column_types.UTCDateTime(timezone=True),
            nullable=True,
        ),
        sa.CheckConstraint(
            "status IN ('pending', 'delivering', 'delivered', 'dead_letter')",
            name=op.f("ck_job_outbox_events_status"),
        ),
        sa.ForeignKeyConstraint(
            ["job_id"], ["inbox_jobs.id"], name=op.f("fk_job_outbox_events_job_id_inbox_jobs")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_job_outbox_events")),
    )
    with op.batch_alter_table("job_outbox_events", schema=None) as batch_op:
        batch_op.create_index("idx_job_outbox_events_job", ["job_id"], unique=False)
        batch_op.create_index(
            "idx_job_outbox_events_lease_expiry",
            ["lease_expires_at"],
            unique=False,
            postgresql_where=sa.text("status = 'delivering'"),
            sqlite_where=sa.text("status = 'delivering'"),
        )
        batch_op.create_index(
            "idx_job_outbox_events_pending",
            ["available_at"],
            unique=False,
            postgresql_where=sa.text("status = 'pending'"),
            sqlite_where=sa.text("status = 'pending'"),
        )

    op.create_table(
        "org_roles",
        sa.Column("id", sa.Uuid(), nullable=False),
        sa.Column("org_id", sa.Uuid(), nullable=False),
        sa.Column("slug", sa.Text(), nullable=False),
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column(
            "created_at", trace_core.storage.column_types.UTCDateTime(timezone=True), nullable=True
        ),
        sa.ForeignKeyConstraint(["org_id"], ["orgs.id"], name=op.f("fk_org_roles_org_id_orgs")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_org_roles")),
        sa.UniqueConstraint("org_id", "slug", name=op.f("uq_org_roles_org_id_slug")),
    )
    op.create_table(
        "users",
        sa.Column("id", sa.Uuid(), nullable=False),
        sa.Column("org_id", sa.Uuid(), nullable=False),
        sa.Column("external_id", sa.Text(), nullable=False),
        sa.Column("email", sa.Text(), nullable=True),
        sa.Column("role", sa.Text(), nullable=False),
        sa.Column(
            "created_at", trace_core.storage.column_types.UTCDateTime(timezone=True), nullable=True
        ),
        sa.CheckConstraint("role IN ('reader', 'writer', 'admin')", name=op.f("ck_users_role")),
        sa.ForeignKeyConstraint(["org_id"], ["orgs.id"], name=op.f("fk_users_org_id_orgs")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_users")),
        sa.UniqueConstraint("external_id", name=op.f("uq_users_external_id")),
    )
    op.create_table(
        "dag_current_versions",
        sa.Column("org_id", sa.Uuid(), nullable=False),
        sa.Column("dag_name", sa.Text(), nullable=False),
        sa.Column("dag_version_id", sa.Uuid(), nullable=False),
        sa.Column(
            "updated_at", trace_core.storage.column_types.UTCDateTime(timezone=True), nullable=True
        ),
        sa.ForeignKeyConstraint(
            ["dag_version_id"],
            ["dag_versions.id"],
            name=op.f("fk_dag_current_versions_dag_version_id_dag_versions"),
        ),
        sa.ForeignKeyConstraint(
            ["org_id"], ["orgs.id"], name=op.f("fk_dag_current_versions_org_id_orgs")
        ),
        sa.PrimaryKeyConstraint("org_id", "dag_name", name=op.f("pk_dag_current_versions")),
    )
    op.create_table(
        "dataset_versions",
        sa.Column("id", sa.Uuid(), nullable=False),
        sa.Column("dataset_uuid", sa.Uuid(), nullable=False),
        sa.Column(
            "created_at", trace_core.storage.column_types.UTCDateTime(timezone=True), nullable=True
        ),
        sa.Column("storage_location", sa.Text(), nullable=False),
        sa.Column("config_hash", sa.Text(), nullable=False),
        sa.Column("schema_hash", sa.Text(), nullable=True),
        sa.Column("range_start", sa.BigInteger(), nullable=True),
        sa.Column("range_end", sa.BigInteger(), nullable=True),
        sa.ForeignKeyConstraint(
            ["dataset_uuid"],
            ["datasets.id"],
            name=op.f("fk_dataset_versions_dataset_uuid_datasets"),
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_dataset_versions")),
        sa.UniqueConstraint(
            "dataset_uuid",
            "config_hash",
            "range_start",
            "range_end",
            name=op.f("uq_dataset_versions_dataset_uuid_config_hash_range_start_range_end"),
        ),
    )
    op.create_table(
        "jobs",
        sa.Column("id", sa.Uuid(), nullable=False),
        sa.Column("org_id", sa.Uuid(), nullable=False),
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("dag_name", sa.Text(), nullable=False),
        sa.Column("dag_version_id", sa.Uuid(), nullable=False),
        sa.Column("activation", sa.Text(), nullable=False),
        sa.Column("runtime", sa.Text(), nullable=False),
        sa.Column("operator", sa.Text(), nullable=False),
        sa.Column(
            "source",
            sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql"),
            nullable=True,
        ),
        sa.Column(
            "bootstrap",
            sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql"),
            nullable=True,
        ),
        sa.Column("execution_strategy", sa.Text(), nullable=True),
        sa.Column("idle_timeout", sa.Text(), nullable=True),
        sa.Column(
            "config",
            sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql"),
            server_default=sa.text("'{}'"),
            nullable=False,
        ),
        sa.Column("config_hash", sa.Text(), nullable=False),
        sa.Column("input_datasets", trace_core.storage.column_types.StringArray(), nullable=True),
        sa.Column("output_datasets", trace_core.storage.column_types.StringArray(), nullable=True),
        sa.Column("update_strategy", sa.Text(), nullable=False),
        sa.Column("unique_key", trace_core.storage.column_types.StringArray(), nullable=True),
        sa.Column(
            "scaling",
            sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql"),
            nullable=True,
        ),
        sa.Column("timeout_seconds", sa.Integer(), nullable=True),
        sa.Column("heartbeat_timeout_seconds", sa.Integer(), nullable=True),
        sa.Column("max_attempts", sa.Integer(), server_default="3", nullable=True),
        sa.Column(
            "created_at", trace_core.storage.column_types.UTCDateTime(timezone=True), nullable=True
        ),
        sa.Column(
            "updated_at", trace_core.storage.column_types.UTCDateTime(timezone=True), nullable=True
        ),
        sa.CheckConstraint("activation IN ('source', 'reactive')", name=op.f("ck_jobs_activation")),
        sa.CheckConstraint(
            "execution_strategy IS NULL OR execution_strategy IN ('PerUpdate', 'PerPartition')",
            name=op.f("ck_jobs_execution_strategy"),
        ),
        sa.CheckConstraint(
            "update_strategy <> 'append' OR unique_key IS NOT NULL",
            name=op.f("ck_jobs_append_unique_key"),
        ),
        sa.CheckConstraint(
            "update_strategy IN ('append', 'replace')", name=op.f("ck_jobs_update_strategy")
        ),
        sa.ForeignKeyConstraint(
            ["dag_version_id"],
            ["dag_versions.id"],
            name=op.f("fk_jobs_dag_version_id_dag_versions"),
        ),
        sa.ForeignKeyConstraint(["org_id"], ["orgs.id"], name=op.f("fk_jobs_org_id_orgs")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_jobs")),
        sa.UniqueConstraint("dag_version_id", "name", name=op.f("uq_jobs_dag_version_id_name")),
    )
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.create_index("idx_jobs_dag_version", ["dag_version_id"], unique=False)

    op.create_table(
        "org_role_memberships",
        sa.Column("role_id", sa.Uuid(), nullable=False),
        sa.Column("user_id", sa.Uuid(), nullable=False),
        sa.Column(
            "created_at", trace_core.storage.column_types.UTCDateTime(timezone=True), nullable=True
        ),
        sa.ForeignKeyConstraint(
            ["role_id"], ["org_roles.id"], name=op.f("fk_org_role_memberships_role_id_org_roles")
        ),
        sa.ForeignKeyConstraint(
            ["user_id"], ["users.id"], name=op.f("fk_org_role_memberships_user_id_users")
        ),
        sa.PrimaryKeyConstraint("role_id", "user_id", name=op.f("pk_org_role_memberships")),
    )
    with op.batch_alter_table("org_role_memberships", schema=None) as batch_op:
        batch_op.create_index("idx_org_role_memberships_user", ["user_id"], unique=False)

    op.create_table(
        "column_lineage",
        sa.Column("output_dataset_uuid", sa.Uuid(), nullable=False),
        sa.Column("output_column", sa.Text(), nullable=False),
        sa.Column("input_dataset_uuid", sa.Uuid(), nullable=False),
        sa.Column("input_column", sa.Text(), nullable=False),
        sa.Column("job_id", sa.Uuid(), nullable=True),
        sa.ForeignKeyConstraint(
            ["input_dataset_uuid"],
            ["datasets.id"],
            name=op.f("fk_column_lineage_input_dataset_uuid_datasets"),
        ),
        sa.ForeignKeyConstraint(
            ["job_id"], ["jobs.id"], name=op.f("fk_column_lineage_job_id_jobs")
        ),
        sa.ForeignKeyConstraint(
            ["output_dataset_uuid"],
            ["datasets.id"],
            name=op.f("fk_column_lineage_output_dataset_uuid_datasets"),
        ),
        sa.PrimaryKeyConstraint(
            "output_dataset_uuid",
            "output_column",
            "input_dataset_uuid",
            "input_column",
            name=op.f("pk_column_lineage"),
        ),
    )
    op.create_table(
        "dag_version_datasets",
        sa.Column("dag_version_id", sa.Uuid(), nullable=False),
        sa.Column("dataset_uuid", sa.Uuid(), nullable=False),
        sa.Column("dataset_version", sa.Uuid(), nullable=False),
        sa.ForeignKeyConstraint(
            ["dag_version_id"],
            ["dag_versions.id"],
            name=op.f("fk_dag_version_datasets_dag_version_id_dag_versions"),
        ),
        sa.ForeignKeyConstraint(
            ["dataset_uuid"],
            ["datasets.id"],
            name=op.f("fk_dag_version_datasets_dataset_uuid_datasets"),
        ),
        sa.ForeignKeyConstraint(
            ["dataset_version"],
            ["dataset_versions.id"],
            name=op.f("fk_dag_version_datasets_dataset_version_dataset_versions"),
        ),
        sa.PrimaryKeyConstraint(
            "dag_version_id", "dataset_uuid", name=op.f("pk_dag_version_datasets")
        ),
    )
    op.create_table(
        "operator_state",
        sa.Column("org_id", sa.Uuid(), nullable=False),
        sa.Column("job_id", sa.Uuid(), nullable=False),
        sa.Column("state_key", sa.Text(), server_default="default", nullable=False),
        sa.Column(
            "state",
            sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql"),
            server_default=sa.text("'{}'"),
            nullable=False,
        ),
        sa.Column(
            "updated_at", trace_core.storage.column_types.UTCDateTime(timezone=True), nullable=True
        ),
        sa.ForeignKeyConstraint(
            ["job_id"], ["jobs.id"], name=op.f("fk_operator_state_job_id_jobs")
        ),
        sa.ForeignKeyConstraint(
            ["org_id"], ["orgs.id"], name=op.f("fk_operator_state_org_id_orgs")
        ),
        sa.PrimaryKeyConstraint("org_id", "job_id", "state_key", name=op.f("pk_operator_state")),
    )
    op.create_table(
        "tasks",
        sa.Column("id", sa.Uuid(), nullable=False),
        sa.Column("job_id", sa.Uuid(), nullable=False),
        sa.Column("dedupe_key", sa.Text(), nullable=True),
        sa.Column("status", sa.Text(), server_default="Queued", nullable=False),
        sa.Column("attempt", sa.Integer(), server_default="1", nullable=False),
        sa.Column("partitions", trace_core.storage.column_types.StringArray(), nullable=True),
        sa.Column(
            "input_versions",
            sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql"),
            nullable=True,
        ),
        sa.Column("worker_id", sa.Text(), nullable=True),
        sa.Column("lease_token", sa.Uuid(), nullable=True),
        sa.Column(
            "lease_expires_at",
            trace_core.storage.column_types.UTCDateTime(timezone=True),
            nullable=True,
        ),
        sa.Column(
            "last_heartbeat",
            trace_core.storage.column_types.UTCDateTime(timezone=True),
            nullable=True,
        ),
        sa.Column("claim_version", sa.BigInteger(), server_default="0", nullable=False),
        sa.Column("max_attempts", sa.Integer(), server_default="3", nullable=False),
        sa.Column(
            "started_at", trace_core.storage.column_types.UTCDateTime(timezone=True), nullable=True
        ),
        sa.Column(
            "completed_at",
            trace_core.storage.column_types.UTCDateTime(timezone=True),
            nullable=True,
        ),
        sa.Column(
            "next_retry_at",
            trace_core.storage.column_types.UTCDateTime(timezone=True),
            nullable=True,
        ),
        sa.Column("error_message", sa.Text(), nullable=True),
        sa.Column(
            "outputs",
            sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql"),
            nullable=True,
        ),
        sa.Column(
            "created_at", trace_core.storage.column_types.UTCDateTime(timezone=True), nullable=True
        ),
        sa.CheckConstraint(
            "status IN ('Queued', 'Running', 'Completed', 'Failed', 'Canceled')",
            name=op.f("ck_tasks_status"),
        ),
        sa.CheckConstraint("attempt >= 1", name=op.f("ck_tasks_attempt")),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], name=op.f("fk_tasks_job_id_jobs")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_tasks")),
    )
    with op.batch_alter_table("tasks", schema=None) as batch_op:
        batch_op.create_index(
            "idx_tasks_claim",
            ["created_at"],
            unique=False,
            postgresql_where=sa.text("status = 'Queued'"),
            sqlite_where=sa.text("status = 'Queued'"),
        )
        batch_op.create_index(
            "idx_tasks_job_dedupe",
            ["job_id", "dedupe_key"],
            unique=True,
            postgresql_where=sa.text("dedupe_key IS NOT NULL"),
            sqlite_where=sa.text("dedupe_key IS NOT NULL"),
        )
        batch_op.create_index(
            "idx_tasks_lease_expiry",
            ["lease_expires_at"],
            unique=False,
            postgresql_where=sa.text("status = 'Running'"),
            sqlite_where=sa.text("status = 'Running'"),
        )
        batch_op.create_index(
            "idx_tasks_next_retry",
            ["next_retry_at"],
            unique=False,
            postgresql_where=sa.text("status = 'Failed'"),
            sqlite_where=sa.text("status = 'Failed'"),
        )
        batch_op.create_index(
            "idx_tasks_status",
            ["status"],
            unique=False,
            postgresql_where=sa.text("status IN ('Queued', 'Running')"),
            sqlite_where=sa.text("status IN ('Queued', 'Running')"),
        )

    op.create_table(
        "task_inputs",
        sa.Column("task_id", sa.Uuid(), nullable=False),
        sa.Column("input_dataset_uuid", sa.Uuid(), nullable=False),
        sa.Column("input_partition_key", sa.Text(), nullable=False),
        sa.Column(
            "input_version",
            trace_core.storage.column_types.UTCDateTime(timezone=True),
            nullable=False,
        ),
        sa.ForeignKeyConstraint(
            ["input_dataset_uuid"],
            ["datasets.id"],
            name=op.f("fk_task_inputs_input_dataset_uuid_datasets"),
        ),
        sa.ForeignKeyConstraint(
            ["task_id"], ["tasks.id"], name=op.f("fk_task_inputs_task_id_tasks")
        ),
        sa.PrimaryKeyConstraint(
            "task_id", "input_dataset_uuid", "input_partition_key", name=op.f("pk_task_inputs")
        ),
    )


def downgrade() -> None:

    op.drop_table("task_inputs")
    with op.batch_alter_table("tasks", schema=None) as batch_op:
        batch_op.drop_index(
            "idx_tasks_status",
            postgresql_where=sa.text("status IN ('Queued', 'Running')"),
            sqlite_where=sa.text("status IN ('Queued', 'Running')"),
        )
        batch_op.drop_index(
            "idx_tasks_next_retry",
            postgresql_where=sa.text("status = 'Failed'"),
            sqlite_where=sa.text("status = 'Failed'"),
        )
        batch_op.drop_index(
            "idx_tasks_lease_expiry",
            postgresql_where=sa.text("status = 'Running'"),
            sqlite_where=sa.text("status = 'Running'"),
        )
        batch_op.drop_index(
            "idx_tasks_job_dedupe",
            postgresql_where=sa.text("dedupe_key IS NOT NULL"),
            sqlite_where=sa.text("dedupe_key IS NOT NULL"),
        )
        batch_op.drop_index(
            "idx_tasks_claim",
            postgresql_where=sa.text("status = 'Queued'"),
            sqlite_where=sa.text("status = 'Queued'"),
        )

    op.drop_table("tasks")
    op.drop_table("operator_state")
    op.drop_table("dag_version_datasets")
    op.drop_table("column_lineage")
    with op.batch_alter_table("org_role_memberships", schema=None) as batch_op:
        batch_op.drop_index("idx_org_role_memberships_user")

    op.drop_table("org_role_memberships")
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_index("idx_jobs_dag_version")

    op.drop_table("jobs")
    op.drop_table("dataset_versions")
    op.drop_table("dag_current_versions")
    op.drop_table("users")
    op.drop_table("org_roles")
    with op.batch_alter_table("job_outbox_events", schema=None) as batch_op:
        batch_op.drop_index(
            "idx_job_outbox_events_pending",
            postgresql_where=sa.text("status = 'pending'"),
            sqlite_where=sa.text("status = 'pending'"),
        )
        batch_op.drop_index(
            "idx_job_outbox_events_lease_expiry",
            postgresql_where=sa.text("status = 'delivering'"),
            sqlite_where=sa.text("status = 'delivering'"),
        )
        batch_op.drop_index("idx_job_outbox_events_job")

    op.drop_table("job_outbox_events")
    op.drop_table("datasets")
    op.drop_table("dag_versions")
    with op.batch_alter_table("outbox", schema=None) as batch_op:
        batch_op.drop_index(
            "idx_outbox_pending",
            postgresql_where=sa.text("status = 'Pending'"),
            sqlite_where=sa.text("status = 'Pending'"),
        )
        batch_op.drop_index(
            "idx_outbox_lease_expiry",
            postgresql_where=sa.text("status = 'Processing'"),
            sqlite_where=sa.text("status = 'Processing'"),
        )

    op.drop_table("outbox")
    op.drop_table("orgs")
    with op.batch_alter_table("inbox_jobs", schema=None) as batch_op:
        batch_op.drop_index(
            "idx_inbox_jobs_retry",
            postgresql_where=sa.text("status = 'failed'"),
            sqlite_where=sa.text("status = 'failed'"),
        )
        batch_op.drop_index("idx_inbox_jobs_requester")
        batch_op.drop_index(
            "idx_inbox_jobs_ready",
            postgresql_where=sa.text("status = 'queued'"),
            sqlite_where=sa.text("status = 'queued'"),
        )
        batch_op.drop_index(
            "idx_inbox_jobs_lease_expiry",
            postgresql_where=sa.text(
                "status IN ('claimed', 'fetching', 'processing', 'uploading')"
            ),
            sqlite_where=sa.text("status IN ('claimed', 'fetching', 'processing', 'uploading')"),
        )

    op.drop_table("inbox_jobs")
    with op.batch_alter_table("idempotency_keys", schema=None) as batch_op:
        batch_op.drop_index("idx_idempotency_keys_expiry")

    op.drop_table("idempotency_keys")
