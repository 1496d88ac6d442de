"""``./dev run --aws`` as a test: the chain pipeline on moto, Postgres, serve and two workers."""

from __future__ import annotations

import io
import os
import sys
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

import anyio
import pytest
import yaml

from trace_aws.rehearsal import EXAMPLE, RehearsalOptions, rehearse, with_runtime
from trace_aws.rehearsal_aws import moto_server
from trace_core.authoring.context import OperatorError, OperatorResult, TaskContext
from trace_core.authoring.events import AcceptResult, DatasetEvent
from trace_core.authoring.operators import OperatorSpec
from trace_core.errors import ConfigurationError

BLOCKS = 300


@pytest.mark.parametrize("engine", ["postgres"])
def test_the_rehearsal_runs_the_chain_pipeline_to_the_reference(
    database_url: str, tmp_path: Path
) -> None:
    out = io.StringIO()
    result = rehearse(
        RehearsalOptions(
            blocks=BLOCKS,
            work_dir=tmp_path,
            database_url=database_url,
            timeout_seconds=600,
            spark_memory="512m",
        ),
        out,
    )
    printed = out.getvalue()
    assert result.summary.finished, printed
    assert result.mismatches == [], printed
    datasets = {d["dataset"]: d for d in result.summary.datasets}
    assert set(datasets) == {"blocks", "transactions", "range_aggregates", "alerts"}
    assert all(d["dag_version"] == "current" for d in datasets.values()), printed
    assert datasets["blocks"]["rows"] == BLOCKS
    assert datasets["range_aggregates"]["rows"] == BLOCKS
    # The alert rows equal the reference's count (checked among the mismatches).
    assert result.summary.alerts == datasets["alerts"]["rows"]
    assert result.ok
    # The lines of `./dev run`: progress, then the summary, then the check.
    assert f"blocks {BLOCKS}/{BLOCKS} (100.0%)" in printed
    assert "chain: finished" in printed
    assert "outputs equal the pyarrow reference" in printed
    # serve and both workers ran as processes, wrote their logs, and are gone.
    assert {p.name for p in tmp_path.glob("*.log")} >= {
        "migrate.log",
        "serve.log",
        "worker-1.log",
        "worker-2.log",
    }
    assert len(result.pids) == 3
    for pid in result.pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_the_jobs_move_to_the_worker_queue_runtime_and_nothing_else_changes() -> None:
    text = EXAMPLE.read_text()
    moved = yaml.safe_load(with_runtime(text, "ecs_platform"))
    original = yaml.safe_load(text)
    assert [j["runtime"] for j in moved["jobs"]] == ["ecs_platform"] * 3
    for job in (*moved["jobs"], *original["jobs"]):
        job.pop("runtime")
    assert moved == original


def test_without_moto_the_error_names_the_dev_dependency(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "moto.server", None)  # import fails as if absent
    refused = pytest.raises(ConfigurationError, match=r"moto's server, a dev dependency.*\[dev\]")
    with refused, moto_server():
        pass


def test_blocks_below_one_are_refused_before_anything_starts(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="--blocks must be >= 1"):
        rehearse(RehearsalOptions(blocks=0, work_dir=tmp_path), io.StringIO())
    assert list(tmp_path.iterdir()) == []


# --- the operators' S3 files: uploaded before the event, never after a failure ------

CREDENTIALS = {
    "access_key_id": "testing",
    "secret_access_key": "testing",
    "session_token": "testing",
}


class _Control:
    """The attempt's side of the wrapper, recording what each emit found in S3."""

    def __init__(self, seen_at_emit: Callable[[], bool]) -> None:
        self.lost: str | None = None
        self.seen: list[bool] = []
        self._seen_at_emit = seen_at_emit

    async def emit(self, events: Sequence[DatasetEvent]) -> AcceptResult:
        self.seen.append(self._seen_at_emit())
        return AcceptResult([uuid.uuid4() for _ in events], len(events), 0)

    async def directive(self) -> str:
        return "run"


def _run(spec: OperatorSpec, work: Path, control: _Control) -> None:
    from trace_aws.rehearsal_operators import committing_operator

    payload = {"task_id": str(uuid.uuid4()), "attempt": 1, "job": {}, "config": {}}
    ctx = TaskContext(payload, control, credentials=CREDENTIALS)
    operator = committing_operator(spec, work).run

    async def main() -> None:
        await anyio.to_thread.run_sync(operator, ctx)

    anyio.run(main)


def test_written_files_reach_s3_before_their_event_and_a_failed_attempt_uploads_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import boto3
    from moto import mock_aws

    from trace_aws.rehearsal_operators import S3FileStore
    from trace_aws.s3 import S3ObjectStore

    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.setenv(name, "testing")
    uri = "s3://bucket/out/part_0_9.parquet"
    with mock_aws():
        s3 = boto3.client("s3", region_name="us-east-1")
        s3.create_bucket(Bucket="bucket")
        store = S3FileStore(S3ObjectStore(region="us-east-1"))

        def stored() -> bool:
            return "Contents" in s3.list_objects_v2(Bucket="bucket", Prefix="out/")

        def writes_then_emits(ctx: TaskContext) -> OperatorResult:
            path = store.handle_for(ctx.credentials).local_path(uri, "write")
            path.write_bytes(b"partition")
            assert not stored()  # a local file until the attempt announces it
            ctx.emit_blocking([DatasetEvent(uuid.uuid4(), uuid.uuid4(), partition_key="0-9")])
            return OperatorResult()

        def writes_then_fails(ctx: TaskContext) -> OperatorResult:
            store.handle_for(ctx.credentials).local_path(uri, "write").write_bytes(b"half")
            raise OperatorError("failed after writing")

        control = _Control(stored)
        with pytest.raises(OperatorError, match="failed after writing"):
            _run(OperatorSpec("fails", writes_then_fails), tmp_path, control)
        assert not stored()
        _run(OperatorSpec("emits", writes_then_emits), tmp_path, control)
        assert control.seen == [True]  # the object existed when the event went out
        assert s3.get_object(Bucket="bucket", Key="out/part_0_9.parquet")["Body"].read() == (
            b"partition"
        )
        # Outside an operator the store refuses: no attempt would commit the files.
        with pytest.raises(OperatorError, match="outside a rehearsal operator"):
            store.handle_for(CREDENTIALS)
    assert list(tmp_path.iterdir()) == []  # every attempt's scratch is gone
