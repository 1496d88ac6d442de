"""The tests' pool of Postgres databases lends each test an empty, migrated one."""

from __future__ import annotations

import psycopg
import pytest

from trace_testing.postgres import PostgresServer

_INSERT = "INSERT INTO outbox (kind, payload, available_at) VALUES ('k', '{}', now()) RETURNING id"


def _rows_and_next_id(url: str) -> tuple[int, int]:
    with psycopg.connect(url, autocommit=True) as conn:
        count = conn.execute("SELECT count(*) FROM outbox").fetchone()
        inserted = conn.execute(_INSERT).fetchone()
        assert count is not None and inserted is not None
        return int(count[0]), int(inserted[0])


def test_a_database_given_back_is_lent_again_empty_with_sequences_restarted(
    postgres_server: PostgresServer,
) -> None:
    url = postgres_server.acquire()
    assert _rows_and_next_id(url) == (0, 1)
    assert _rows_and_next_id(url) == (1, 2)
    held = psycopg.connect(url, autocommit=True)  # left open by a careless test
    try:
        postgres_server.release(url)
        again = postgres_server.acquire()
        try:
            assert again == url  # emptied and lent again, not copied anew
            assert _rows_and_next_id(again) == (0, 1)
        finally:
            postgres_server.release(again)
        with pytest.raises(psycopg.OperationalError):  # it was ended, not left to write
            held.execute("SELECT 1")
    finally:
        held.close()


def test_a_database_whose_schema_changed_is_dropped_not_lent_again(
    postgres_server: PostgresServer,
) -> None:
    url = postgres_server.acquire()
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("CREATE TABLE leftover (id int)")
    postgres_server.release(url)
    again = postgres_server.acquire()
    try:
        assert again != url
        with psycopg.connect(again) as conn:
            found = conn.execute("SELECT to_regclass('leftover') IS NULL").fetchone()
            assert found == (True,)
    finally:
        postgres_server.release(again)
    with psycopg.connect(postgres_server.url("postgres")) as conn:
        name = url.rpartition("/")[2]
        gone = conn.execute("SELECT count(*) FROM pg_database WHERE datname = %s", (name,))
        assert gone.fetchone() == (0,)
