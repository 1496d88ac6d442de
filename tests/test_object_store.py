"""The lite object store hands a task a handle confined to its prefixes."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trace_core.clock import ManualClock
from trace_core.errors import InvalidInput
from trace_core.security.minting import LocalCredentialMinter
from trace_core.security.scopes import S3Prefix, Scope, parse_object_uri
from trace_lite.object_store import (
    AccessDenied,
    KeyConflict,
    LocalObjectStore,
    NoSuchKey,
    ScopedObjectStore,
    key_of_path,
    key_path,
)

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


# --- keys map to files one to one (issue 14, section 4) --------------------------

ROOT = "s3://lake/default/"


async def _admin(tmp_path: Path) -> tuple[ScopedObjectStore, Path]:
    """A handle that reads, writes and lists everything under ROOT."""
    minter = LocalCredentialMinter(clock=ManualClock())
    prefix = S3Prefix.parse(ROOT, field="p")
    creds = await minter.mint(
        Scope(read=(prefix,), write=(prefix,)), session_name="admin", duration_seconds=900
    )
    return LocalObjectStore(tmp_path / "objects", minter).handle(creds), tmp_path / "objects"


async def test_keys_a_file_system_cannot_spell_are_stored_distinctly(tmp_path: Path) -> None:
    store, root = await _admin(tmp_path)
    long_segment = "s" * 300  # over a file name's 255 bytes
    keys = {
        ROOT + long_segment: b"long",
        ROOT + "é" * 200 + "/x": b"long multi-byte folder",
        ROOT + "folder/": b"folder marker",
        ROOT + ".hidden": b"dot name",
        ROOT + "ordinary/blocks_000_099.parquet": b"plain",
    }
    for uri, data in keys.items():
        store.put(uri, data)
    for uri, data in keys.items():
        assert store.get(uri) == data, uri
    assert store.list(ROOT) == sorted(keys)
    # An ordinary key is its own path: Spark and the query service read it there.
    plain = root / "lake" / "default" / "ordinary" / "blocks_000_099.parquet"
    assert plain.read_bytes() == b"plain"
    assert not list(root.rglob(".put-*"))


async def test_a_folder_marker_and_an_object_of_the_same_name_do_not_collide(
    tmp_path: Path,
) -> None:
    store, _ = await _admin(tmp_path)
    store.put(ROOT + "x/", b"marker")
    with pytest.raises(KeyConflict) as info:
        store.put(ROOT + "x", b"object")
    assert info.value.field == "key"
    assert store.get(ROOT + "x/") == b"marker"
    with pytest.raises(NoSuchKey):
        store.get(ROOT + "x")  # a folder, not an object
    store.put(ROOT + "y", b"object")
    with pytest.raises(KeyConflict):
        store.put(ROOT + "y/", b"marker")
    with pytest.raises(KeyConflict):
        store.put(ROOT + "y/z", b"under an object")
    assert store.list(ROOT) == [ROOT + "x/", ROOT + "y"]


async def test_missing_and_oversized_keys_are_clear_errors(tmp_path: Path) -> None:
    store, _ = await _admin(tmp_path)
    with pytest.raises(NoSuchKey):
        store.get(ROOT + "nothing-here")
    with pytest.raises(AccessDenied):  # over S3's 1024 bytes: no policy grants it
        store.put(ROOT + "k" * 1100, b"x")
    with pytest.raises(InvalidInput) as info:  # and the mapping refuses it on its own
        key_path("k" * 1025)
    assert info.value.field == "key"
    # 1024 bytes of key in all, bucket excluded: the largest S3 accepts.
    longest = ROOT + "k" * (1024 - len("default/"))
    store.put(longest, b"x")
    assert store.get(longest) == b"x"


_SEGMENT = st.one_of(
    st.text(alphabet="ab.é-_~ 中", min_size=1, max_size=4),
    st.text(alphabet="ab.é中", min_size=250, max_size=420),
)


def _canonical(key: str) -> bool:
    try:
        parse_object_uri(ROOT + key, field="key")
    except InvalidInput:
        return False
    return len(("default/" + key).encode()) <= 1024


_KEYS = st.builds(
    lambda segments, slash: "/".join(segments) + ("/" if slash else ""),
    st.lists(_SEGMENT, min_size=1, max_size=3),
    st.booleans(),
).filter(_canonical)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(keys=st.lists(_KEYS, min_size=1, max_size=6, unique=True))
def test_distinct_keys_never_collide(
    tmp_path_factory: pytest.TempPathFactory, keys: list[str]
) -> None:
    """Every key is stored on its own or refused with KeyConflict (only next to a
    stored key that is a folder of it, or it of them); get returns what put
    stored, and list returns exactly the stored keys, in S3 order."""
    store, _ = anyio.run(_admin, tmp_path_factory.mktemp("keys"))
    stored: dict[str, bytes] = {}
    for n, key in enumerate(keys):
        uri = ROOT + key
        data = f"{n}".encode()
        try:
            store.put(uri, data)
        except KeyConflict:
            path = key_path("default/" + key)
            assert any(_nested(path, key_path("default/" + other)) for other in stored), (
                key,
                list(stored),
            )
            continue
        stored[key] = data
    for key, data in stored.items():
        assert store.get(ROOT + key) == data
    assert store.list(ROOT) == sorted(ROOT + key for key in stored)
    for key in stored:
        assert key_of_path(key_path(key)) == key


def _nested(a: list[str], b: list[str]) -> bool:
    """Whether one path is a proper folder of the other."""
    shorter, longer = (a, b) if len(a) < len(b) else (b, a)
    return len(shorter) < len(longer) and longer[: len(shorter)] == shorter
