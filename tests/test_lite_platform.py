"""The lite platform's wiring: keys on first start, envelope encryption, and
in-process operators confined to their attempt's scoped credentials."""

from __future__ import annotations

import stat
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.factories import wait_until
from trace_core.authoring.context import OperatorResult, TaskContext
from trace_core.authoring.operators import OperatorSpec
from trace_core.dag import parse_dag
from trace_core.errors import ConfigurationError, InvalidInput
from trace_lite.envelope import LocalKeyEncryption
from trace_lite.object_store import AccessDenied
from trace_lite.platform import LiteConfig, TraceLite
from trace_lite.secret_files import read_or_create_secret
from trace_lite.spark import SparkSessionProvider
from trace_lite.status import task_counts

pytestmark = pytest.mark.anyio

PROBE_DAG = """
dag: probe
jobs:
  - name: probe
    activation: source
    runtime: dispatcher
    operator: probe
    source: { kind: manual }
    outputs:
      - { dataset: mine, kind: parquet }
"""


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


async def test_first_start_creates_owner_only_keys_and_reuses_them(
    tmp_path: Path, database_url: str
) -> None:
    config = LiteConfig(data_dir=tmp_path / "lite", database_url=database_url)
    async with TraceLite(config) as lite:
        sealed = lite.encryption.seal(b"db password", "org:1/credential:warehouse")
        assert not lite.spark.started  # Spark starts only when an operator needs it
    data_dir = config.data_dir
    assert _mode(data_dir) == 0o700
    for key_file in ("credentials.key", "kek.key"):
        assert _mode(data_dir / key_file) == 0o600
    assert all(_mode(p) == 0o600 for p in (data_dir / "keys").glob("*.pem"))
    kek = (data_dir / "kek.key").read_bytes()

    async with TraceLite(config) as again:  # the second start reuses every key
        assert again.encryption.open(sealed, "org:1/credential:warehouse") == b"db password"
    assert (data_dir / "kek.key").read_bytes() == kek


def test_envelopes_open_only_under_their_key_and_context() -> None:
    kek = LocalKeyEncryption(b"k" * 32)
    sealed = kek.seal(b"secret", "org:1/credential:a")
    assert kek.open(sealed, "org:1/credential:a") == b"secret"
    assert b"secret" not in sealed.ciphertext and "secret" not in repr(sealed)
    assert kek.seal(b"secret", "org:1/credential:a") != sealed  # a fresh data key each time
    tampered = type(sealed)(
        sealed.wrapped_key, sealed.ciphertext[:-1] + bytes([sealed.ciphertext[-1] ^ 1])
    )
    for envelope, context in (
        (sealed, "org:2/credential:a"),  # moved to another record
        (tampered, "org:1/credential:a"),
    ):
        with pytest.raises(InvalidInput, match="envelope"):
            kek.open(envelope, context)
    with pytest.raises(InvalidInput):
        LocalKeyEncryption(b"x" * 32).open(sealed, "org:1/credential:a")
    with pytest.raises(ConfigurationError):
        LocalKeyEncryption(b"short")


def test_a_key_file_others_can_read_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "kek.key"
    key = read_or_create_secret(path, "key-encryption key")
    assert read_or_create_secret(path, "key-encryption key") == key
    path.chmod(0o644)
    with pytest.raises(ConfigurationError, match=r"key-encryption key .*kek.key.*chmod 600"):
        read_or_create_secret(path, "key-encryption key")
    path.chmod(0o600)
    path.write_bytes(b"short")
    with pytest.raises(ConfigurationError, match="exactly 32 bytes"):
        read_or_create_secret(path, "key-encryption key")


async def test_in_process_operators_only_reach_their_own_prefixes(
    tmp_path: Path, database_url: str, spark_provider: SparkSessionProvider
) -> None:
    seen: dict[str, Any] = {}
    lite = TraceLite(
        LiteConfig(data_dir=tmp_path / "lite", database_url=database_url),
        spark=spark_provider,
    )

    def probe(ctx: TaskContext) -> OperatorResult:
        store = lite.store.handle_for(ctx.credentials)
        mine = ctx.outputs[0]["location"]
        store.put(mine + "part-0.bin", b"ok")
        theirs = mine.replace(ctx.outputs[0]["dataset_uuid"], str(uuid.uuid4()))
        attempts = {
            "read own output": lambda: store.get(mine + "part-0.bin"),  # outputs are write-only
            "write elsewhere": lambda: store.put(theirs + "x.bin", b"no"),
            "list the bucket": lambda: store.list(mine.split("/dataset/")[0] + "/"),
        }
        for what, attempt in attempts.items():
            try:
                attempt()
            except AccessDenied as exc:
                seen[what] = str(exc)
        return OperatorResult()

    async with lite:
        lite.dispatcher.operators.register(OperatorSpec("probe", probe, source=True))
        await lite.deploy(parse_dag(PROBE_DAG, operators=lite.dispatcher.operators.names()))
        await lite.dispatcher.manual.create_task("probe/probe", "once")
        await wait_until(
            "the probe task to finish",
            lambda: _completed(lite),
            time.monotonic() + 60,
            describe=lambda: task_counts(lite.repo, "probe"),
        )
    assert set(seen) == {"read own output", "write elsewhere", "list the bucket"}
    assert all("outside the task's scope" in message for message in seen.values())
    written = list((tmp_path / "lite" / "objects").rglob("*.bin"))
    assert [p.name for p in written] == ["part-0.bin"]
    assert [p.read_bytes() for p in written] == [b"ok"]


async def _completed(lite: TraceLite) -> bool:
    counts = await task_counts(lite.repo, "probe")
    return counts.by_job.get("probe", {}).get("Completed", 0) == 1
