"""The throwaway ``redis-server`` of :mod:`trace_lite.redis_server`: loopback,
its own directory, removed at the end; a restart loses the data unless the
server is persistent."""

from __future__ import annotations

import socket

import pytest
import redis

from trace_core.errors import ConfigurationError
from trace_lite.redis_server import HOST, RedisServer, find_redis_server

pytestmark = pytest.mark.skipif(find_redis_server() is None, reason="redis-server not installed")


def _refused(port: int) -> bool:
    try:
        socket.create_connection((HOST, port), timeout=1).close()
    except OSError:
        return True
    return False


def test_a_server_runs_on_loopback_in_its_own_directory_and_is_removed() -> None:
    server = RedisServer().start()
    directory, port = server.directory, server.port
    assert directory is not None and directory.is_dir()
    assert server.url == f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(server.url)
    try:
        assert client.ping() is True
        config = client.config_get("save")
        assert config["save"] == ""  # no snapshots
        assert client.config_get("appendonly")["appendonly"] == "no"
        assert client.config_get("bind")["bind"] == HOST
    finally:
        client.close()
    server.stop()
    server.stop()  # idempotent
    assert not directory.exists()
    assert _refused(port)
    with pytest.raises(ConfigurationError, match="not running"):
        _ = server.url


@pytest.mark.parametrize(("persistent", "kept"), [(False, None), (True, b"1")])
def test_a_restart_keeps_the_port_and_the_data_only_when_persistent(
    persistent: bool, kept: bytes | None
) -> None:
    with RedisServer(persistent=persistent) as server:
        port = server.port
        client = redis.Redis.from_url(server.url)
        try:
            client.set("k", "1")
            server.restart()
            assert server.port == port
            assert client.get("k") == kept
        finally:
            client.close()


def test_a_missing_binary_is_a_clear_error() -> None:
    with pytest.raises(ConfigurationError, match="/nonexistent/redis-server is not an executable"):
        RedisServer(binary="/nonexistent/redis-server")
