"""Users can be disabled: ``users.disabled_at``

A person's access ends without deleting the row (memberships, audit); the
people-token path answers 401 for a disabled user (docs/people.md).

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-27 02:20:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

import trace_core.storage.column_types

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("users") as batch:
        batch.add_column(
            sa.Column(
                "disabled_at",
                trace_core.storage.column_types.UTCDateTime(timezone=True),
                nullable=True,
            )
        )


def downgrade() -> None:
    with op.batch_alter_table("users") as batch:
        batch.drop_column("disabled_at")
