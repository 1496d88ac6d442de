"""The lite object store hands a task a handle confined to its prefixes."""

from __future__ import annotations

from pathlib import Path

import pytest

from trace_core.clock import ManualClock
from trace_core.security.minting import LocalCredentialMinter
from trace_core.security.scopes import S3Prefix, Scope
from trace_lite.object_store import AccessDenied, LocalObjectStore, ScopedObjectStore

pytestmark = pytest.mark.anyio

READ = "s3://lake/default/dataset/a/version/1/"
WRITE = "s3://lake/default/dataset/b/version/2/"
OTHER = "s3://lake/default/dataset/b/version/20/"  # shares a string prefix with WRITE


async def _handles(
    tmp_path: Path,
) -> tuple[ScopedObjectStore, ScopedObjectStore, LocalObjectStore, ManualClock]:
    clock = ManualClock()
    minter = LocalCredentialMinter(clock=clock)
    store = LocalObjectStore(tmp_path / "objects", minter)
    mine = await minter.mint(
        Scope(
            read=(S3Prefix.parse(READ, field="read"),), write=(S3Prefix.parse(WRITE, field="w"),)
        ),
        session_name="task-1",
        duration_seconds=900,
    )
    admin = await minter.mint(
        Scope(read=(), write=(S3Prefix.parse("s3://lake/default/", field="w"),)),
        session_name="seed",
        duration_seconds=900,
    )
    return store.handle(mine), store.handle(admin), store, clock


async def test_reads_and_writes_inside_the_scope_work(tmp_path: Path) -> None:
    task, admin, _, _ = await _handles(tmp_path)
    admin.put(READ + "blocks_000_099.parquet", b"input")
    assert task.get(READ + "blocks_000_099.parquet") == b"input"
    task.put(WRITE + "out_000_099.parquet", b"output")
    assert task.list(WRITE) == [WRITE + "out_000_099.parquet"]
    assert not list((tmp_path / "objects").rglob(".put-*"))  # no temporary file left


@pytest.mark.parametrize(
    ("action", "uri"),
    [
        ("get", OTHER + "secret.parquet"),  # t1/ never matches t10/
        ("get", WRITE + "out.parquet"),  # the output prefix is write-only
        ("put", READ + "tampered.parquet"),  # inputs are read-only
        ("put", "s3://lake/default/dataset/c/x.parquet"),
        ("get", READ + "../../b/version/20/secret.parquet"),  # traversal
        ("get", READ + "%2e%2e/x"),
        ("list", "s3://lake/default/"),
        ("list", OTHER),
    ],
)
async def test_everything_outside_the_scope_fails(tmp_path: Path, action: str, uri: str) -> None:
    task, admin, _, _ = await _handles(tmp_path)
    admin.put(OTHER + "secret.parquet", b"not yours")
    with pytest.raises(AccessDenied):
        if action == "get":
            task.get(uri)
        elif action == "put":
            task.put(uri, b"x")
        else:
            task.list(uri)
    assert admin.list("s3://lake/default/dataset/c/") == []


async def test_expired_credentials_open_nothing(tmp_path: Path) -> None:
    task, admin, _, clock = await _handles(tmp_path)
    admin.put(READ + "x.parquet", b"x")
    clock.advance(901)
    with pytest.raises(AccessDenied):
        task.get(READ + "x.parquet")
