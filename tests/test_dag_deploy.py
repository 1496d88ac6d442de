"""Deploy, activation, rollback and live jobs, on both engines."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from tests.factories import set_progress
from trace_core.clock import ManualClock
from trace_core.dag import (
    DagDocument,
    DagValidationError,
    DeployResult,
    dataset_version_hashes,
    deploy,
    job_config_hashes,
    live_jobs,
    parse_dag,
    promote_if_caught_up,
    rollback,
    yaml_hash,
)
from trace_core.errors import ConfigurationError
from trace_core.storage import schema
from trace_core.storage.protocol import NewTask
from trace_core.storage.sql import SqlRepository
from trace_core.tasks import TaskQueue
from trace_lite.cli import main

pytestmark = pytest.mark.anyio

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
CHAIN = (EXAMPLES / "chain_pipeline.yaml").read_text()


def _edited(old: str, new: str) -> str:
    """The example with ``old`` replaced; fails loudly if the example changed."""
    assert old in CHAIN, f"examples/chain_pipeline.yaml no longer has {old!r}"
    return CHAIN.replace(old, new)


# A change of the aggregate's input filter: a new version of range_aggregates
# and (downstream) alerts; blocks and transactions are untouched.
CHAIN_FILTER_CHANGED = _edited('where: "value > 0"', 'where: "value > 1"')
CHAIN_SCALED = _edited("max_concurrency: 2", "max_concurrency: 8")

REPORTS = """\
dag: reports
jobs:
  - name: daily
    activation: reactive
    runtime: lambda
    operator: report_builder
    execution_strategy: PerUpdate
    inputs:
      - from: { dataset: range_aggregates }
        where: "tx_count > 0"
    outputs: [{ dataset: daily_reports }]
"""

TABLES = (
    schema.orgs,
    schema.dag_versions,
    schema.dag_current_versions,
    schema.jobs,
    schema.datasets,
    schema.dataset_versions,
    schema.dag_version_datasets,
)


def doc(text: str, file: str = "chain.yaml") -> DagDocument:
    return parse_dag(text, file=file)


async def counts(repo: SqlRepository) -> dict[str, int]:
    async with repo.read() as tx:
        return {
            t.name: int(
                (
                    await tx.connection.execute(sa.select(sa.func.count()).select_from(t))
                ).scalar_one()
            )
            for t in TABLES
        }


async def select(repo: SqlRepository, stmt: Any) -> list[Any]:
    async with repo.read() as tx:
        return list((await tx.connection.execute(stmt)).mappings().all())


async def version_status(repo: SqlRepository, version_id: uuid.UUID) -> str:
    dv = schema.dag_versions
    [row] = await select(repo, sa.select(dv.c.status).where(dv.c.id == version_id))
    return str(row["status"])


async def current_of(repo: SqlRepository, dag: str) -> uuid.UUID:
    c = schema.dag_current_versions
    [row] = await select(repo, sa.select(c.c.dag_version_id).where(c.c.dag_name == dag))
    return uuid.UUID(str(row["dag_version_id"]))


async def task_statuses(repo: SqlRepository, ids: list[uuid.UUID]) -> list[str]:
    t = schema.tasks
    rows = {
        r["id"]: r["status"]
        for r in await select(repo, sa.select(t.c.id, t.c.status).where(t.c.id.in_(ids)))
    }
    return [rows[i] for i in ids]


async def first_and_building(
    repo: SqlRepository, clock: ManualClock
) -> tuple[DeployResult, DeployResult]:
    v1 = await deploy(repo, doc(CHAIN), clock=clock)
    clock.advance(60)
    v2 = await deploy(repo, doc(CHAIN_FILTER_CHANGED), clock=clock)
    assert v2.status == "building"
    return v1, v2


# --- deploy -------------------------------------------------------------------


async def test_first_deploy_swaps_at_once_and_fills_every_column(
    repo: SqlRepository, clock: ManualClock
) -> None:
    document = doc(CHAIN)
    result = await deploy(repo, document, clock=clock)
    assert (result.status, result.changed, result.org_slug) == ("current", True, "default")
    assert set(result.jobs) == {"follow", "aggregate", "alerts"}
    assert {n: p.new_version for n, p in result.datasets.items()} == {
        "blocks": True,
        "transactions": True,
        "range_aggregates": True,
        "alerts": True,
    }
    assert await counts(repo) == {
        "orgs": 1,
        "dag_versions": 1,
        "dag_current_versions": 1,
        "jobs": 3,
        "datasets": 4,
        "dataset_versions": 4,
        "dag_version_datasets": 4,
    }
    assert await current_of(repo, "chain") == result.dag_version_id
    dv = schema.dag_versions
    [version] = await select(repo, sa.select(dv))
    assert version["status"] == "current" and version["activated_at"] == clock.now()
    assert version["yaml_text"] == CHAIN and version["yaml_hash"] == yaml_hash(document.spec)

    ds = {n: p.dataset_uuid for n, p in result.datasets.items()}
    j = schema.jobs
    jobs = {r["name"]: r for r in await select(repo, sa.select(j))}
    hashes = job_config_hashes(document.spec)
    follow, aggregate, alerts = jobs["follow"], jobs["aggregate"], jobs["alerts"]
    assert follow["source"] == {"kind": "always_on"}
    assert follow["bootstrap"] == {"reset_outputs": False}
    assert follow["config"] == {
        "chain_id": 1,
        "seed": 7,
        "partition_size": 10000,
        "confirmations": 12,
        "mean_txs_per_block": 20,
    }
    assert follow["output_datasets"] == [str(ds["blocks"]), str(ds["transactions"])]
    assert follow["input_datasets"] == []
    assert (follow["timeout_seconds"], follow["heartbeat_timeout_seconds"]) == (3600, 60)
    assert follow["execution_strategy"] is None and follow["idle_timeout"] is None
    assert aggregate["activation"] == "reactive" and aggregate["runtime"] == "dispatcher"
    assert aggregate["operator"] == "range_aggregator"
    assert aggregate["execution_strategy"] == "PerPartition"
    assert aggregate["idle_timeout"] == "5m"
    assert aggregate["input_datasets"] == [str(ds["blocks"]), str(ds["transactions"])]
    assert aggregate["config"] == {"inputs_where": {str(ds["transactions"]): "value > 0"}}
    assert aggregate["scaling"] == {"max_concurrency": 2}
    assert aggregate["backpressure"] == {"max_queue_depth": 1000, "max_queue_age_seconds": 600}
    assert aggregate["priority_tier"] == "normal"
    assert (aggregate["timeout_seconds"], aggregate["heartbeat_timeout_seconds"]) == (900, 30)
    assert alerts["update_strategy"] == "append"
    assert alerts["unique_key"] == ["org_id", "dedupe_key"]
    assert alerts["max_attempts"] == 5 and alerts["idle_timeout"] == "never"
    assert {n: r["config_hash"] for n, r in jobs.items()} == hashes
    assert all(r["created_at"] == clock.now() for r in jobs.values())

    d = schema.datasets
    registry = {r["name"]: r for r in await select(repo, sa.select(d))}
    assert (
        registry["transactions"]["producer_dag_name"],
        registry["transactions"]["producer_job_name"],
        registry["transactions"]["producer_output_index"],
    ) == ("chain", "follow", 1)
    assert registry["alerts"]["storage"] == {"kind": "postgres_table"}
    assert registry["blocks"]["storage"] == {"kind": "parquet"}

    v = schema.dataset_versions
    versions = {r["id"]: r for r in await select(repo, sa.select(v))}
    blocks = versions[result.datasets["blocks"].dataset_version]
    assert blocks["storage_location"] == (
        f"s3://trace-lite/default/dataset/{ds['blocks']}/version/{blocks['id']}/"
    )
    assert (blocks["range_start"], blocks["range_end"]) == (0, 99999)
    alert_version = versions[result.datasets["alerts"].dataset_version]
    assert alert_version["storage_location"] == (
        f"postgres_table:dataset_{ds['alerts'].hex}_{alert_version['id'].hex[:8]}"
    )
    expected_hashes = dataset_version_hashes(document.spec)
    assert {
        n: versions[p.dataset_version]["config_hash"] for n, p in result.datasets.items()
    } == expected_hashes


async def test_redeploying_the_same_yaml_changes_nothing(
    repo: SqlRepository, clock: ManualClock
) -> None:
    first = await deploy(repo, doc(CHAIN), clock=clock)
    before = await counts(repo)
    clock.advance(10)
    again = await deploy(repo, doc(CHAIN), clock=clock)
    assert not again.changed and again.status == "current"
    assert again.dag_version_id == first.dag_version_id
    assert again.jobs == first.jobs
    assert {n: p.dataset_version for n, p in again.datasets.items()} == {
        n: p.dataset_version for n, p in first.datasets.items()
    }
    assert await counts(repo) == before


async def test_whitespace_and_comment_edits_are_not_a_new_version(
    repo: SqlRepository, clock: ManualClock
) -> None:
    first = await deploy(repo, doc(CHAIN), clock=clock)
    before = await counts(repo)
    edited = "# reformatted\n\n" + CHAIN.replace("  - name: aggregate", "\n  - name:   aggregate")
    again = await deploy(repo, doc(edited), clock=clock)
    assert not again.changed and again.dag_version_id == first.dag_version_id
    assert await counts(repo) == before


async def test_config_change_builds_new_versions_downstream_only(
    repo: SqlRepository, clock: ManualClock
) -> None:
    v1, v2 = await first_and_building(repo, clock)
    assert v2.changed and v2.dag_version_id != v1.dag_version_id
    assert {n: p.new_version for n, p in v2.datasets.items()} == {
        "blocks": False,
        "transactions": False,
        "range_aggregates": True,
        "alerts": True,
    }
    for name in ("blocks", "transactions"):
        assert v2.datasets[name].dataset_version == v1.datasets[name].dataset_version
    for name in ("range_aggregates", "alerts"):
        assert v2.datasets[name].dataset_version != v1.datasets[name].dataset_version
        assert v2.datasets[name].dataset_uuid == v1.datasets[name].dataset_uuid
    assert await counts(repo) == {
        "orgs": 1,
        "dag_versions": 2,
        "dag_current_versions": 1,
        "jobs": 6,
        "datasets": 4,
        "dataset_versions": 6,
        "dag_version_datasets": 8,
    }
    # Readers keep the current version while the new one builds.
    assert await current_of(repo, "chain") == v1.dag_version_id
    assert await version_status(repo, v1.dag_version_id) == "current"
    assert await version_status(repo, v2.dag_version_id) == "building"


async def test_scaling_only_change_swaps_at_once_with_the_same_dataset_versions(
    repo: SqlRepository, clock: ManualClock
) -> None:
    v1 = await deploy(repo, doc(CHAIN), clock=clock)
    clock.advance(60)
    v2 = await deploy(repo, doc(CHAIN_SCALED), clock=clock)
    assert (v2.status, v2.changed) == ("current", True)
    assert v2.datasets == {
        n: type(p)(p.dataset_uuid, p.dataset_version, False) for n, p in v1.datasets.items()
    }
    assert await current_of(repo, "chain") == v2.dag_version_id
    assert await version_status(repo, v1.dag_version_id) == "superseded"
    assert (await counts(repo))["dataset_versions"] == 4
    assert v2.jobs["aggregate"] != v1.jobs["aggregate"]


async def test_a_second_producer_is_rejected_and_nothing_is_written(
    repo: SqlRepository, clock: ManualClock
) -> None:
    await deploy(repo, doc(CHAIN), clock=clock)
    before = await counts(repo)
    other = (
        "dag: other\n"
        "jobs:\n"
        "  - name: copy\n"
        "    activation: source\n"
        "    runtime: dispatcher\n"
        "    operator: block_follower\n"
        "    source: { kind: manual }\n"
        "    outputs: [{ dataset: fresh }, { dataset: blocks }]\n"
    )
    with pytest.raises(DagValidationError) as info:
        await deploy(repo, doc(other, "other.yaml"), clock=clock)
    assert [str(p) for p in info.value.problems] == [
        "other.yaml:8: jobs[0].outputs[1].dataset: dataset 'blocks' is already produced by "
        "chain/follow[0] — a dataset has a single producer, and other/copy[1] is not it"
    ]
    assert await counts(repo) == before


async def test_an_output_slot_keeps_its_dataset(repo: SqlRepository, clock: ManualClock) -> None:
    await deploy(repo, doc(CHAIN), clock=clock)
    before = await counts(repo)
    with pytest.raises(DagValidationError, match=r"output chain/follow\[0\] is registered as"):
        await deploy(repo, doc(CHAIN.replace("dataset: blocks", "dataset: headers")), clock=clock)
    assert await counts(repo) == before


async def test_inputs_from_other_dags_need_the_registry(
    repo: SqlRepository, clock: ManualClock
) -> None:
    with pytest.raises(DagValidationError) as info:
        await deploy(repo, doc(REPORTS, "reports.yaml"), clock=clock, org_slug="acme")
    assert [str(p) for p in info.value.problems] == [
        "reports.yaml:9: jobs[0].inputs[0].from.dataset: unknown dataset 'range_aggregates' — "
        "an input must name a dataset produced in this DAG or already registered"
    ]
    assert await counts(repo) == dict.fromkeys((t.name for t in TABLES), 0)


async def test_inputs_from_other_dags_follow_the_producers_current_version(
    repo: SqlRepository, clock: ManualClock
) -> None:
    v1, v2 = await first_and_building(repo, clock)
    reports = await deploy(repo, doc(REPORTS, "reports.yaml"), clock=clock)
    assert reports.status == "current"
    aggregates = v1.datasets["range_aggregates"]
    p = schema.dag_version_datasets
    stmt = sa.select(p.c.dataset_version).where(
        p.c.dag_version_id == reports.dag_version_id,
        p.c.dataset_uuid == aggregates.dataset_uuid,
    )
    assert [r["dataset_version"] for r in await select(repo, stmt)] == [aggregates.dataset_version]
    [job] = [j for j in await live_jobs_of(repo) if j.dag_name == "reports"]
    assert job.input_datasets == (aggregates.dataset_uuid,)
    assert job.where == {aggregates.dataset_uuid: "tx_count > 0"}
    # When the producer swaps, its consumers follow in the same transaction.
    await cover_everything(repo, v1, v2)
    assert await promote_if_caught_up(repo, v2.dag_version_id, clock=clock)
    assert [r["dataset_version"] for r in await select(repo, stmt)] == [
        v2.datasets["range_aggregates"].dataset_version
    ]


async def test_org_override_and_file_org(repo: SqlRepository, clock: ManualClock) -> None:
    text = CHAIN.replace("org: default", "org: acme")
    assert (await deploy(repo, doc(text), clock=clock)).org_slug == "acme"
    other = await deploy(repo, doc(text), clock=clock, org_slug="beta")
    assert other.org_slug == "beta" and other.changed  # another org: its own registry
    o = schema.orgs
    assert sorted(r["slug"] for r in await select(repo, sa.select(o.c.slug))) == ["acme", "beta"]


# --- activation ---------------------------------------------------------------


async def cover_everything(repo: SqlRepository, v1: DeployResult, v2: DeployResult) -> None:
    clock = ManualClock()
    for pointer in v2.datasets.values():
        if pointer.new_version:
            await set_progress(
                repo, pointer.dataset_version, pointer.dataset_uuid, [[0, 10**9]], 10**9, clock
            )


async def live_jobs_of(repo: SqlRepository) -> list[Any]:
    async with repo.read() as tx:
        return await live_jobs(tx)


async def test_promote_waits_until_the_new_versions_cover_the_current_ones(
    repo: SqlRepository, clock: ManualClock
) -> None:
    v1, v2 = await first_and_building(repo, clock)
    old_agg, new_agg = v1.datasets["range_aggregates"], v2.datasets["range_aggregates"]
    old_alerts, new_alerts = v1.datasets["alerts"], v2.datasets["alerts"]
    await set_progress(
        repo, old_agg.dataset_version, old_agg.dataset_uuid, [[0, 999], [1000, 1999]], None, clock
    )
    await set_progress(repo, old_alerts.dataset_version, old_alerts.dataset_uuid, [], 50, clock)
    # The new versions have materialized nothing yet (no progress rows).
    assert not await promote_if_caught_up(repo, v2.dag_version_id, clock=clock)
    await set_progress(
        repo, new_agg.dataset_version, new_agg.dataset_uuid, [[0, 1499]], None, clock
    )
    await set_progress(repo, new_alerts.dataset_version, new_alerts.dataset_uuid, [], 60, clock)
    assert not await promote_if_caught_up(repo, v2.dag_version_id, clock=clock)  # 1500-1999 missing
    await set_progress(
        repo, new_agg.dataset_version, new_agg.dataset_uuid, [[0, 1499], [1500, 2999]], 7, clock
    )
    await set_progress(repo, new_alerts.dataset_version, new_alerts.dataset_uuid, [], 49, clock)
    assert not await promote_if_caught_up(repo, v2.dag_version_id, clock=clock)  # cursor behind
    await set_progress(repo, new_alerts.dataset_version, new_alerts.dataset_uuid, [], 50, clock)
    assert await current_of(repo, "chain") == v1.dag_version_id
    clock.advance(30)
    assert await promote_if_caught_up(repo, v2.dag_version_id, clock=clock)
    assert await current_of(repo, "chain") == v2.dag_version_id
    assert await version_status(repo, v1.dag_version_id) == "superseded"
    dv = schema.dag_versions
    [row] = await select(
        repo, sa.select(dv.c.status, dv.c.activated_at).where(dv.c.id == v2.dag_version_id)
    )
    assert (row["status"], row["activated_at"]) == ("current", clock.now())
    assert await promote_if_caught_up(repo, v2.dag_version_id, clock=clock)  # already current
    assert not await promote_if_caught_up(repo, v1.dag_version_id, clock=clock)


async def test_promote_swaps_at_once_when_the_current_version_has_nothing(
    repo: SqlRepository, clock: ManualClock
) -> None:
    _, v2 = await first_and_building(repo, clock)
    assert await promote_if_caught_up(repo, v2.dag_version_id, clock=clock)
    assert await current_of(repo, "chain") == v2.dag_version_id


async def test_live_jobs_are_current_plus_the_building_jobs_of_new_versions(
    repo: SqlRepository, clock: ManualClock
) -> None:
    v1, v2 = await first_and_building(repo, clock)
    live = await live_jobs_of(repo)
    roles = sorted((j.role, j.job_name, j.dag_version_id == v2.dag_version_id) for j in live)
    assert roles == [
        ("building", "aggregate", True),
        ("building", "alerts", True),
        ("current", "aggregate", False),
        ("current", "alerts", False),
        ("current", "follow", False),
    ]
    by_key = {(j.role, j.job_name): j for j in live}
    building = by_key[("building", "aggregate")]
    ds = {n: p.dataset_uuid for n, p in v2.datasets.items()}
    assert building.job_id == v2.jobs["aggregate"]
    assert building.input_datasets == (ds["blocks"], ds["transactions"])
    assert building.input_pointers == {
        ds["blocks"]: v1.datasets["blocks"].dataset_version,
        ds["transactions"]: v1.datasets["transactions"].dataset_version,
    }
    assert building.output_pointers == {
        ds["range_aggregates"]: v2.datasets["range_aggregates"].dataset_version
    }
    assert building.where == {ds["transactions"]: "value > 1"}
    assert by_key[("building", "alerts")].input_pointers == {
        ds["range_aggregates"]: v2.datasets["range_aggregates"].dataset_version
    }
    current = by_key[("current", "aggregate")]
    assert current.where == {ds["transactions"]: "value > 0"}
    assert current.scaling == {"max_concurrency": 2}
    assert current.backpressure == {"max_queue_depth": 1000, "max_queue_age_seconds": 600}
    assert (current.priority_tier, current.max_attempts) == ("normal", 3)
    assert (current.timeout_seconds, current.heartbeat_timeout_seconds) == (900, 30)
    assert by_key[("current", "follow")].source == {"kind": "always_on"}

    await cover_everything(repo, v1, v2)
    assert await promote_if_caught_up(repo, v2.dag_version_id, clock=clock)
    after = await live_jobs_of(repo)
    assert {(j.role, j.dag_version_id) for j in after} == {("current", v2.dag_version_id)}
    assert len(after) == 3


# --- rollback -----------------------------------------------------------------


async def make_tasks(
    repo: SqlRepository, clock: ManualClock, job_id: uuid.UUID, prefix: str
) -> dict[str, uuid.UUID]:
    """One task per state: queued, running, completed, failed with a retry due."""
    tq = TaskQueue(repo, clock=clock)
    created = await tq.create(
        [NewTask(job_id=job_id, dedupe_key=f"{prefix}:{k}") for k in range(4)]
    )
    ids = [c.task_id for c in created]
    running = await tq.claim(ids[1], "w-1")
    done = await tq.claim(ids[2], "w-1")
    failed = await tq.claim(ids[3], "w-1")
    assert running.lease and done.lease and failed.lease
    await tq.complete(done.lease.fence)
    outcome = await tq.fail(failed.lease.fence, "boom")
    assert outcome.retrying
    return {"queued": ids[0], "running": ids[1], "completed": ids[2], "failed": ids[3]}


async def test_rollback_of_a_building_version_cancels_its_unfinished_tasks(
    repo: SqlRepository, clock: ManualClock
) -> None:
    v1, v2 = await first_and_building(repo, clock)
    building = await make_tasks(repo, clock, v2.jobs["aggregate"], "agg2")
    current = await make_tasks(repo, clock, v1.jobs["aggregate"], "agg1")
    # v2's follow writes v1's dataset versions: its work stays useful.
    shared = await make_tasks(repo, clock, v2.jobs["follow"], "follow2")
    calls: list[tuple[list[uuid.UUID], str]] = []
    queue = TaskQueue(repo, clock=clock)

    async def cancel(task_ids: list[uuid.UUID], reason: str) -> Any:
        calls.append((task_ids, reason))
        return await queue.cancel(task_ids, reason)

    result = await rollback(repo, "chain", org_slug="default", clock=clock, cancel=cancel)
    assert result.current_version_id == v1.dag_version_id
    assert result.abandoned_version_ids == (v2.dag_version_id,)
    expected = {building["queued"], building["running"], building["failed"]}
    assert set(result.canceled_task_ids) == expected
    assert len(calls) == 1 and set(calls[0][0]) == expected and "rollback" in calls[0][1]
    order = ["queued", "running", "completed", "failed"]
    assert await task_statuses(repo, [building[k] for k in order]) == [
        "Canceled",
        "Canceled",
        "Completed",
        "Canceled",
    ]
    untouched = ["Queued", "Running", "Completed", "Failed"]
    assert await task_statuses(repo, [current[k] for k in order]) == untouched
    assert await task_statuses(repo, [shared[k] for k in order]) == untouched
    assert await version_status(repo, v2.dag_version_id) == "abandoned"
    assert await current_of(repo, "chain") == v1.dag_version_id


async def test_rollback_restores_the_previous_current_version(
    repo: SqlRepository, clock: ManualClock
) -> None:
    v1 = await deploy(repo, doc(CHAIN), clock=clock)
    clock.advance(60)
    v2 = await deploy(repo, doc(CHAIN_SCALED), clock=clock)
    tasks = await make_tasks(repo, clock, v2.jobs["aggregate"], "agg2")
    clock.advance(60)
    result = await rollback(repo, "chain", clock=clock)
    assert result.current_version_id == v1.dag_version_id
    assert result.abandoned_version_ids == (v2.dag_version_id,)
    # v2's jobs wrote the very dataset versions v1 points at: nothing to cancel.
    assert result.canceled_task_ids == ()
    assert await task_statuses(repo, [tasks["queued"]]) == ["Queued"]
    assert await current_of(repo, "chain") == v1.dag_version_id
    assert await version_status(repo, v1.dag_version_id) == "current"
    assert await version_status(repo, v2.dag_version_id) == "abandoned"
    with pytest.raises(ConfigurationError, match="no earlier version to roll back to"):
        await rollback(repo, "chain", clock=clock)


async def test_a_new_deploy_abandons_the_building_version(
    repo: SqlRepository, clock: ManualClock
) -> None:
    v1, v2 = await first_and_building(repo, clock)
    tasks = await make_tasks(repo, clock, v2.jobs["alerts"], "alerts2")
    clock.advance(60)
    v3 = await deploy(
        repo, doc(CHAIN.replace('where: "value > 0"', 'where: "value > 2"')), clock=clock
    )
    assert v3.status == "building"
    assert v3.abandoned_version_ids == (v2.dag_version_id,)
    assert set(v3.canceled_task_ids) == {tasks["queued"], tasks["running"], tasks["failed"]}
    assert await task_statuses(repo, [tasks["queued"], tasks["completed"]]) == [
        "Canceled",
        "Completed",
    ]
    assert await version_status(repo, v2.dag_version_id) == "abandoned"
    assert await current_of(repo, "chain") == v1.dag_version_id


async def test_redeploying_a_superseded_yaml_reactivates_that_version(
    repo: SqlRepository, clock: ManualClock
) -> None:
    v1 = await deploy(repo, doc(CHAIN), clock=clock)
    clock.advance(60)
    v2 = await deploy(repo, doc(CHAIN_SCALED), clock=clock)
    before = await counts(repo)
    clock.advance(60)
    again = await deploy(repo, doc(CHAIN), clock=clock)
    assert (again.dag_version_id, again.status, again.changed) == (
        v1.dag_version_id,
        "current",
        True,
    )
    assert again.jobs == v1.jobs
    assert await version_status(repo, v2.dag_version_id) == "superseded"
    assert await counts(repo) == before


# --- CLI ----------------------------------------------------------------------


def test_cli_deploy_and_rollback(
    database_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    chain = str(EXAMPLES / "chain_pipeline.yaml")
    assert main(["dag", "deploy", chain, "--db", database_url]) == 0
    assert "(current)" in capsys.readouterr().out
    assert main(["dag", "deploy", chain, "--db", database_url]) == 0
    assert "unchanged" in capsys.readouterr().out
    scaled = tmp_path / "scaled.yaml"
    scaled.write_text(CHAIN_SCALED)
    assert main(["dag", "deploy", str(scaled), "--db", database_url]) == 0
    assert main(["dag", "rollback", "chain", "--db", database_url]) == 0
    out = capsys.readouterr().out
    assert "is current" in out and "canceled 0 unfinished task(s)" in out
    # Validation against the registry: a second producer is caught before deploy.
    other = tmp_path / "other.yaml"
    other.write_text(
        "dag: other\njobs:\n  - name: copy\n    activation: source\n    runtime: dispatcher\n"
        "    operator: noop\n    source: { kind: manual }\n    outputs: [{ dataset: blocks }]\n"
    )
    assert main(["dag", "validate", str(other)]) == 0
    capsys.readouterr()
    assert main(["dag", "validate", str(other), "--db", database_url]) == 1
    assert "already produced by chain/follow[0]" in capsys.readouterr().out
    assert main(["dag", "deploy", str(other), "--db", database_url]) == 1
    assert "already produced by chain/follow[0]" in capsys.readouterr().out
    reports = tmp_path / "reports.yaml"
    reports.write_text(REPORTS)
    assert main(["dag", "validate", str(reports), "--db", database_url]) == 0
    assert capsys.readouterr().out == f"{reports}: ok (1 jobs, 1 datasets)\n"
