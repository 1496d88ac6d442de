"""Column lineage per dataset version, with each edge's kind

``column_lineage`` gains ``dataset_version`` (the version the lineage was
recorded for: a rematerialization records its own instead of overwriting the
version still being read) and ``kind`` (OpenLineage's subtype: ``IDENTITY``,
``TRANSFORMATION``, ``AGGREGATION``, ``FILTER``, ``JOIN``, ...). Both join the
primary key (one input column can be a JOIN and a GROUP_BY key of the same
output); an index on the input serves downstream reads.

Backfill: a row recorded before this revision belongs to the version its
dataset's producer currently points at, else to the dataset's newest version;
a row of a dataset without any version (no version ever committed, so no
lineage can have been recorded through a completion) is dropped. Its kind
was never kept: ``DIRECT`` or ``INDIRECT`` (the output ``*``), OpenLineage's
types without a subtype, until the version's next completion records it anew.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-27 04:20:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

import trace_core.storage.column_types

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

_OLD_KEY = ["output_dataset_uuid", "output_column", "input_dataset_uuid", "input_column"]
_NEW_KEY = [
    "output_dataset_uuid",
    "dataset_version",
    "output_column",
    "input_dataset_uuid",
    "input_column",
    "kind",
]

# Portable SQL (correlated subqueries): the producer's current pointer, else
# the newest version of the dataset.
_BACKFILL_VERSION = """
UPDATE column_lineage SET dataset_version = COALESCE(
    (SELECT p.dataset_version
       FROM datasets d
       JOIN dag_current_versions c
         ON c.org_id = d.org_id AND c.dag_name = d.producer_dag_name
       JOIN dag_version_datasets p
         ON p.dag_version_id = c.dag_version_id AND p.dataset_uuid = d.id
      WHERE d.id = column_lineage.output_dataset_uuid),
    (SELECT v.id FROM dataset_versions v
      WHERE v.dataset_uuid = column_lineage.output_dataset_uuid
      ORDER BY v.created_at DESC, v.id DESC LIMIT 1))
"""

_BACKFILL_KIND = """
UPDATE column_lineage
   SET kind = CASE WHEN output_column = '*' THEN 'INDIRECT' ELSE 'DIRECT' END
"""


def upgrade() -> None:
    with op.batch_alter_table("column_lineage") as batch:
        batch.add_column(
            sa.Column("dataset_version", trace_core.storage.column_types.Uuid(), nullable=True)
        )
        batch.add_column(sa.Column("kind", sa.Text(), nullable=True))
    op.execute(_BACKFILL_VERSION)
    op.execute(_BACKFILL_KIND)
    op.execute("DELETE FROM column_lineage WHERE dataset_version IS NULL")
    with op.batch_alter_table("column_lineage") as batch:
        batch.alter_column("dataset_version", nullable=False)
        batch.alter_column("kind", nullable=False)
        batch.drop_constraint("pk_column_lineage", type_="primary")
        batch.create_primary_key("pk_column_lineage", _NEW_KEY)
        batch.create_foreign_key(
            op.f("fk_column_lineage_dataset_version_dataset_versions"),
            "dataset_versions",
            ["dataset_version"],
            ["id"],
        )
        batch.create_index("idx_column_lineage_input", ["input_dataset_uuid", "input_column"])


def downgrade() -> None:
    # Only one version's lineage per dataset fits the old key: keep the rows
    # of each dataset's newest version, one per (output, input) pair.
    op.execute(
        """
        DELETE FROM column_lineage WHERE dataset_version <> (
            SELECT v.id FROM column_lineage l
              JOIN dataset_versions v ON v.id = l.dataset_version
             WHERE l.output_dataset_uuid = column_lineage.output_dataset_uuid
             ORDER BY v.created_at DESC, v.id DESC LIMIT 1)
        """
    )
    op.execute(
        """
        DELETE FROM column_lineage WHERE kind <> (
            SELECT MIN(l.kind) FROM column_lineage l
             WHERE l.output_dataset_uuid = column_lineage.output_dataset_uuid
               AND l.output_column = column_lineage.output_column
               AND l.input_dataset_uuid = column_lineage.input_dataset_uuid
               AND l.input_column = column_lineage.input_column)
        """
    )
    with op.batch_alter_table("column_lineage") as batch:
        batch.drop_index("idx_column_lineage_input")
        batch.drop_constraint(
            op.f("fk_column_lineage_dataset_version_dataset_versions"), type_="foreignkey"
        )
        batch.drop_constraint("pk_column_lineage", type_="primary")
        batch.create_primary_key("pk_column_lineage", _OLD_KEY)
        batch.drop_column("kind")
        batch.drop_column("dataset_version")
