"""The throwaway PostgreSQL cluster used by the test suite, tested against a real server."""

from __future__ import annotations

import os
import shutil
import socket
import struct
import tempfile
from pathlib import Path

import psycopg
import pytest

from trace_lite.pgcluster import PostgresCluster
from trace_testing.postgres import external_postgres_url

_TCP_LISTEN = "0A"


def _listening_addresses(port: int) -> set[str] | None:
    """Local addresses with a TCP socket listening on ``port``, from /proc (Linux only)."""
    found: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except FileNotFoundError:
            if table.endswith("tcp"):
                return None
            continue
        for line in lines:
            fields = line.split()
            address, port_hex = fields[1].split(":")
            if fields[3] != _TCP_LISTEN or int(port_hex, 16) != port:
                continue
            if len(address) == 8:
                # The kernel prints the IPv4 address as a host-order integer.
                found.add(socket.inet_ntoa(struct.pack("=I", int(address, 16))))
            else:
                found.add(f"ipv6:{address}")
    return found


def _process_uid(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Uid:"):
            return int(line.split()[1])
    raise AssertionError(f"no Uid line for pid {pid}")


def test_cluster_serves_loopback_only_and_leaves_nothing_behind() -> None:
    cluster = PostgresCluster()
    with cluster:
        root = cluster.socket_dir
        data_dir = cluster.data_dir
        port = cluster.port
        assert data_dir.is_dir()
        assert cluster.url("app") == f"postgresql://trace@127.0.0.1:{port}/app"

        cluster.create_database("app")
        with psycopg.connect(cluster.url("app")) as conn:
            assert conn.execute("SELECT 1").fetchone() == (1,)
            row = conn.execute(
                "SELECT current_user, inet_server_addr()::text,"
                " current_setting('listen_addresses'), current_setting('fsync'),"
                " current_setting('max_connections'), pg_backend_pid()"
            ).fetchone()
            assert row is not None
            user, server_addr, listen, fsync, max_connections, backend_pid = row
            assert (user, listen, fsync, max_connections) == ("trace", "127.0.0.1", "on", "200")
            assert server_addr.split("/")[0] == "127.0.0.1"
            # Postgres refuses root; as root the cluster must drop to another user.
            backend_uid = _process_uid(backend_pid)
            if os.geteuid() == 0:
                assert backend_uid != 0
            else:
                assert backend_uid == os.geteuid()

        addresses = _listening_addresses(port)
        if addresses is not None:
            assert addresses == {"127.0.0.1"}
        assert (root / f".s.PGSQL.{port}").is_socket()

        # A template copy works even while someone is connected to the template.
        with psycopg.connect(cluster.url("app")) as holder:
            holder.execute("CREATE TABLE marker (id int)")
            holder.commit()
            cluster.create_database("app_copy", template="app")
        with psycopg.connect(cluster.url("app_copy")) as conn:
            assert conn.execute("SELECT count(*) FROM marker").fetchone() == (0,)
        cluster.drop_database("app_copy")
        cluster.drop_database("app_copy")  # IF EXISTS: a second drop is harmless

    assert not data_dir.exists()
    assert not root.exists()
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=2):
        pass
    cluster.stop()  # idempotent


def test_failed_start_cleans_up() -> None:
    # A private base directory, so a cluster started by a parallel test cannot
    # be mistaken for a leftover; it must be traversable by the server user.
    base = Path(tempfile.mkdtemp(prefix="trace-pg-test-"))
    try:
        base.chmod(0o755)
        cluster = PostgresCluster(base_dir=base, shared_buffers="not-a-size")
        with pytest.raises(RuntimeError, match="shared_buffers"):
            cluster.start()
        assert list(base.iterdir()) == []
        with pytest.raises(RuntimeError, match="not running"):
            cluster.url()
        cluster.stop()
    finally:
        shutil.rmtree(base)


def test_external_postgres_url(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRACE_TEST_POSTGRES_URL", raising=False)
    assert external_postgres_url() is None
    monkeypatch.setenv("TRACE_TEST_POSTGRES_URL", "")
    assert external_postgres_url() is None
    monkeypatch.setenv("TRACE_TEST_POSTGRES_URL", "postgresql://u@db:5432/x")
    assert external_postgres_url() == "postgresql://u@db:5432/x"
