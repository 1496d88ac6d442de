"""Migrations produce exactly the declared schema, on both engines."""

from __future__ import annotations

from pathlib import Path

import pytest
import sqlalchemy as sa

from trace_core.storage.migrate import current_revision, head_revision, schema_diff, upgrade
from trace_core.storage.schema import metadata
from trace_core.storage.url import create_sync_engine, parse_database_url

SPEC_TABLES = {
    "orgs",
    "users",
    "org_roles",
    "org_role_memberships",
    "dag_versions",
    "dag_current_versions",
    "jobs",
    "datasets",
    "dataset_versions",
    "dag_version_datasets",
    "tasks",
    "outbox",
    "task_inputs",
    "column_lineage",
    "operator_state",
    "inbox_jobs",
    "job_outbox_events",
    "idempotency_keys",
}

PARTIAL_INDEXES = {
    "idx_tasks_job_dedupe": "dedupe_key IS NOT NULL",
    "idx_tasks_status": "status IN ('Queued', 'Running')",
    "idx_tasks_next_retry": "status = 'Failed'",
    "idx_tasks_lease_expiry": "status = 'Running'",
    "idx_outbox_pending": "status = 'Pending'",
}


def test_migrated_database_matches_the_declared_schema(database_url: str) -> None:
    assert current_revision(database_url) == head_revision()
    assert schema_diff(database_url) == []
    engine = create_sync_engine(parse_database_url(database_url))
    try:
        tables = set(sa.inspect(engine).get_table_names())
    finally:
        engine.dispose()
    assert tables >= SPEC_TABLES
    assert set(metadata.tables) <= tables


def test_upgrade_is_idempotent(database_url: str) -> None:
    assert upgrade(database_url) == head_revision()
    assert upgrade(database_url) == head_revision()
    assert schema_diff(database_url) == []


def test_partial_indexes_carry_their_predicates(database_url: str, engine: str) -> None:
    db = parse_database_url(database_url)
    eng = create_sync_engine(db)
    try:
        with eng.connect() as conn:
            if engine == "postgres":
                rows = conn.execute(sa.text("SELECT indexname, indexdef FROM pg_indexes"))
            else:
                rows = conn.execute(
                    sa.text("SELECT name, sql FROM sqlite_master WHERE type = 'index'")
                )
            defs = {name: (sql or "") for name, sql in rows}
    finally:
        eng.dispose()
    for name, predicate in PARTIAL_INDEXES.items():
        normalized = defs[name].replace("'::text", "'").replace("::text", "")
        words = [w.strip("()") for w in predicate.replace("'", "").split()]
        assert "WHERE" in normalized.upper(), name
        assert all(w.strip(",") in normalized.replace("'", "") for w in words), (name, defs[name])
    assert "UNIQUE" in defs["idx_tasks_job_dedupe"].upper()


def test_a_fresh_sqlite_file_is_created_and_migrated(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'sub' / 'new.db'}"
    (tmp_path / "sub").mkdir()
    assert upgrade(url) == head_revision()
    assert schema_diff(url) == []


def test_constraints_refuse_bad_rows(database_url: str) -> None:
    eng = create_sync_engine(parse_database_url(database_url))
    try:
        with pytest.raises(sa.exc.IntegrityError), eng.begin() as conn:
            conn.execute(
                sa.text(
                    "INSERT INTO outbox (kind, payload, status, available_at, attempts, "
                    "claim_version, max_attempts) VALUES ('k', '{}', 'Bogus', "
                    "'2026-01-01 00:00:00.000000', 0, 0, 1)"
                )
            )
    finally:
        eng.dispose()
