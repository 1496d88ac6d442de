"""A test run's PostgreSQL: one throwaway server per test process and a pool of
migrated databases that tests borrow and give back clean.

``CREATE DATABASE … TEMPLATE`` costs about 0.3 s here, a third of a typical
Postgres test. A database given back is emptied instead (every table but
``alembic_version``, sequences restarted: a few milliseconds) and lent again,
so each test still starts on a freshly migrated, empty database. One that a
test changed beyond its rows (a table, index, constraint, function, type or
setting added, dropped or altered, the Alembic revision moved) is dropped, and
the next borrower gets a new copy of the template.

The server is for tests only: ``fsync``, ``synchronous_commit`` and
``full_page_writes`` are off (nothing here must survive a machine crash).
Benchmarks start their own clusters with the durable defaults.

The cluster itself (:class:`~trace_lite.pgcluster.PostgresCluster`) stays in
the runtime package: ``trace-aws rehearse`` and the benchmarks start one
outside any test run. What only tests need lives here: the choice of the
user's own server (``TRACE_TEST_POSTGRES_URL`` or ``--trace-postgres-url``),
the non-durable settings, the migrated template and the pool.
"""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
from psycopg import sql

from trace_lite.pgcluster import PostgresCluster

__all__ = [
    "EXTERNAL_URL_ENV",
    "NON_DURABLE",
    "PostgresCluster",
    "PostgresServer",
    "external_postgres_url",
]

EXTERNAL_URL_ENV = "TRACE_TEST_POSTGRES_URL"
"""The environment variable naming a server of the user's own to test on."""

NON_DURABLE = {"fsync": "off", "synchronous_commit": "off", "full_page_writes": "off"}
"""Server settings of the tests' throwaway cluster."""


def external_postgres_url() -> str | None:
    """Return the server URL from ``TRACE_TEST_POSTGRES_URL``, or None if it is unset or empty.

    Callers that find a URL here use that server instead of starting a cluster.
    """
    return os.environ.get(EXTERNAL_URL_ENV) or None


# Everything about a database's schema that a test could change, as one digest:
# relations with their columns, defaults, constraints, routines, types,
# triggers, extensions, schemas, database settings and the Alembic revision.
_FINGERPRINT = """
WITH ours AS (SELECT oid FROM pg_namespace
              WHERE nspname NOT IN ('pg_catalog', 'information_schema', 'pg_toast')
                AND nspname NOT LIKE 'pg_temp_%' AND nspname NOT LIKE 'pg_toast_temp_%')
SELECT md5(coalesce(string_agg(item, E'\\n' ORDER BY item), '')) FROM (
    SELECT 'rel ' || c.oid::regclass::text || ' ' || c.relkind::text || ' '
           || coalesce(string_agg(a.attname || ' ' || format_type(a.atttypid, a.atttypmod)
                                  || ' ' || a.attnotnull::text || ' '
                                  || coalesce(pg_get_expr(d.adbin, d.adrelid), ''),
                                  '; ' ORDER BY a.attnum), '') AS item
      FROM pg_class c
      LEFT JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped
      LEFT JOIN pg_attrdef d ON d.adrelid = c.oid AND d.adnum = a.attnum
     WHERE c.relnamespace IN (SELECT oid FROM ours)
     GROUP BY c.oid, c.relkind
    UNION ALL
    SELECT 'index ' || indexrelid::regclass::text || ' ' || pg_get_indexdef(indexrelid)
      FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
     WHERE c.relnamespace IN (SELECT oid FROM ours)
    UNION ALL
    SELECT 'constraint ' || conname || ' ' || pg_get_constraintdef(oid)
      FROM pg_constraint WHERE connamespace IN (SELECT oid FROM ours)
    UNION ALL
    SELECT 'routine ' || p.oid::regprocedure::text || ' ' || md5(p.prosrc)
      FROM pg_proc p WHERE p.pronamespace IN (SELECT oid FROM ours)
    UNION ALL
    SELECT 'type ' || t.oid::regtype::text || ' ' || t.typtype::text
      FROM pg_type t WHERE t.typnamespace IN (SELECT oid FROM ours) AND t.typtype <> 'b'
    UNION ALL
    SELECT 'trigger ' || tgname || ' ' || tgrelid::regclass::text
      FROM pg_trigger WHERE NOT tgisinternal
    UNION ALL SELECT 'extension ' || extname FROM pg_extension
    UNION ALL SELECT 'schema ' || nspname FROM pg_namespace WHERE oid IN (SELECT oid FROM ours)
    UNION ALL
    SELECT 'setting ' || array_to_string(setconfig, ',') FROM pg_db_role_setting
     WHERE setdatabase = (SELECT oid FROM pg_database WHERE datname = current_database())
    UNION ALL SELECT 'alembic ' || version_num FROM alembic_version
) AS items
"""

_TABLES = """
SELECT c.oid::regclass::text FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
 WHERE c.relkind IN ('r', 'p') AND n.nspname = 'public' AND c.relname <> 'alembic_version'
"""

_SEQUENCES = """
SELECT c.oid::regclass::text, s.seqstart FROM pg_class c
  JOIN pg_sequence s ON s.seqrelid = c.oid JOIN pg_namespace n ON n.oid = c.relnamespace
 WHERE n.nspname = 'public'
"""


class PostgresServer:
    """A server for this test process, a migrated template and the pool of databases.

    Uses ``external_url`` (by default ``TRACE_TEST_POSTGRES_URL``) when set:
    that server's settings are its owner's, and the role needs ``CREATEDB``.
    Else starts a :class:`PostgresCluster` of its own, kept as :attr:`cluster`
    (the fault tools crash-restart it).
    """

    def __init__(self, external_url: str | None = None) -> None:
        """Start (or reach) the server, then migrate the template database."""
        from trace_core.storage.migrate import upgrade

        self._cluster: PostgresCluster | None = None
        external = external_url or external_postgres_url()
        if external is None:
            self._cluster = PostgresCluster(settings=NON_DURABLE)
            self._cluster.start()
        self._base = external
        self._prefix = f"t{os.getpid()}_{uuid.uuid4().hex[:6]}"
        self._template = f"trace_template{self._prefix}"
        self._count = 0
        self._lock = threading.Lock()
        self._idle: list[str] = []
        self.create_database(self._template)
        upgrade(self.url(self._template))
        with psycopg.connect(self.url(self._template)) as conn:
            self._fingerprint = _fingerprint(conn)

    @property
    def cluster(self) -> PostgresCluster | None:
        """The throwaway cluster this process started; None on the user's own server."""
        return self._cluster

    def url(self, dbname: str) -> str:
        """The URL of database ``dbname`` on this server."""
        if self._cluster is not None:
            return self._cluster.url(dbname)
        assert self._base is not None
        head, _, _ = self._base.rpartition("/")
        return f"{head}/{dbname}"

    def create_database(self, name: str, template: str | None = None) -> None:
        """``CREATE DATABASE name`` (a copy of ``template`` when given)."""
        with psycopg.connect(self.url("postgres"), autocommit=True) as conn:
            stmt = sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name))
            if template:
                stmt += sql.SQL(" TEMPLATE {}").format(sql.Identifier(template))
            conn.execute(stmt)

    def acquire(self) -> str:
        """The URL of an empty, migrated database that no one else holds."""
        with self._lock:
            if self._idle:
                return self.url(self._idle.pop())
            self._count += 1
            name = f"{self._prefix}_{self._count}"
        self.create_database(name, template=self._template)
        return self.url(name)

    def release(self, url: str) -> None:
        """Give a database back: emptied for the next borrower, or dropped if
        its schema is no longer the template's."""
        name = url.rpartition("/")[2]
        if self._reset(name):
            with self._lock:
                self._idle.append(name)
            return
        with psycopg.connect(self.url("postgres"), autocommit=True) as conn:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )

    @contextmanager
    def database(self) -> Iterator[str]:
        """A borrowed database for the length of the block."""
        url = self.acquire()
        try:
            yield url
        finally:
            self.release(url)

    def _reset(self, name: str) -> bool:
        """Empty ``name`` in place; False if its schema changed (it must go)."""
        with psycopg.connect(self.url(name), autocommit=True) as conn:
            # A connection the test left open must not write into the next test.
            conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
            if _fingerprint(conn) != self._fingerprint:
                return False
            tables = [row[0] for row in conn.execute(_TABLES)]
            sequences = conn.execute(_SEQUENCES).fetchall()
            with conn.transaction():
                # Foreign keys are enforced by triggers, which the replica role
                # skips: every table can be emptied in any order.
                conn.execute("SET LOCAL session_replication_role = replica")
                for table in tables:
                    conn.execute(sql.SQL("DELETE FROM {}").format(sql.SQL(table)))
                for sequence, start in sequences:
                    conn.execute("SELECT setval(%s::regclass, %s, false)", (sequence, start))
        return True

    def stop(self) -> None:
        """Stop the cluster this process started (an external server is left alone)."""
        if self._cluster is not None:
            self._cluster.stop()


def _fingerprint(conn: psycopg.Connection[tuple[object, ...]]) -> str:
    row = conn.execute(_FINGERPRINT).fetchone()
    assert row is not None
    return str(row[0])
