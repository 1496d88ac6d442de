"""The version promoter on both engines: building versions swap in once caught up."""

from __future__ import annotations

import logging
import uuid
from pathlib import Path

import pytest
import sqlalchemy as sa

from tests.factories import set_progress
from trace_core.clock import ManualClock
from trace_core.dag import DeployResult, deploy, parse_dag
from trace_core.dispatcher.periodic import PeriodicService
from trace_core.dispatcher.promoter import PromoterConfig, VersionPromoter
from trace_core.errors import ConfigurationError
from trace_core.storage import schema
from trace_core.storage.sql import SqlRepository

pytestmark = pytest.mark.anyio

CHAIN = (Path(__file__).resolve().parents[1] / "examples" / "chain_pipeline.yaml").read_text()
# A change of the aggregate's input filter: new versions of range_aggregates
# and (downstream) alerts; the version stays 'building' until they catch up.
CHAIN_FILTER_CHANGED = CHAIN.replace('where: "value > 0"', 'where: "value > 1"')


async def first_and_building(
    repo: SqlRepository, clock: ManualClock
) -> tuple[DeployResult, DeployResult]:
    v1 = await deploy(repo, parse_dag(CHAIN, file="chain.yaml"), clock=clock)
    clock.advance(60)
    v2 = await deploy(repo, parse_dag(CHAIN_FILTER_CHANGED, file="chain.yaml"), clock=clock)
    assert v2.status == "building"
    return v1, v2


async def cover_current(
    repo: SqlRepository, result: DeployResult, changed: DeployResult, clock: ManualClock
) -> None:
    """Give ``result``'s versions of the datasets ``changed`` re-versions some progress."""
    for name, pointer in changed.datasets.items():
        if pointer.new_version:
            old = result.datasets[name]
            # range_aggregates covers block ranges; alerts only has a cursor.
            ranges, cursor = ([[0, 999]], None) if name == "range_aggregates" else ([], 50)
            await set_progress(repo, old.dataset_version, old.dataset_uuid, ranges, cursor, clock)


async def current_of(repo: SqlRepository, dag: str) -> uuid.UUID:
    c = schema.dag_current_versions
    async with repo.read() as tx:
        value = (
            await tx.connection.execute(sa.select(c.c.dag_version_id).where(c.c.dag_name == dag))
        ).scalar_one()
    return uuid.UUID(str(value))


async def status_of(repo: SqlRepository, version_id: uuid.UUID) -> str:
    dv = schema.dag_versions
    async with repo.read() as tx:
        value = (
            await tx.connection.execute(sa.select(dv.c.status).where(dv.c.id == version_id))
        ).scalar_one()
    return str(value)


async def journal_rows(repo: SqlRepository) -> int:
    async with repo.read() as tx:
        count = sa.select(sa.func.count()).select_from(schema.job_journal)
        return int((await tx.connection.execute(count)).scalar_one())


async def test_promotes_a_building_version_once_its_new_versions_cover_the_current_ones(
    repo: SqlRepository, clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    v1, v2 = await first_and_building(repo, clock)
    await cover_current(repo, v1, v2, clock)
    promoter = VersionPromoter(repo, clock=clock)
    journaled = await journal_rows(repo)

    assert await promoter.run_once() == []  # the new versions have materialized nothing
    assert await current_of(repo, "chain") == v1.dag_version_id
    assert await status_of(repo, v2.dag_version_id) == "building"

    # The new versions catch up: coverage covering the current versions'.
    agg, alerts = v2.datasets["range_aggregates"], v2.datasets["alerts"]
    await set_progress(repo, agg.dataset_version, agg.dataset_uuid, [[0, 1999]], None, clock)
    await set_progress(repo, alerts.dataset_version, alerts.dataset_uuid, [], 50, clock)
    clock.advance(5)
    with caplog.at_level(logging.INFO, logger="trace_core.dispatcher.promoter"):
        assert await promoter.run_once() == [v2.dag_version_id]
    assert await current_of(repo, "chain") == v2.dag_version_id
    assert await status_of(repo, v2.dag_version_id) == "current"
    assert await status_of(repo, v1.dag_version_id) == "superseded"
    assert any(
        str(v2.dag_version_id) in r.getMessage() and r.levelno == logging.INFO
        for r in caplog.records
    )
    assert await journal_rows(repo) == journaled  # per DAG, not per job: no journal entry

    assert await promoter.run_once() == []  # nothing is building any more


async def test_a_version_not_yet_caught_up_stays_building(
    repo: SqlRepository, clock: ManualClock
) -> None:
    v1, v2 = await first_and_building(repo, clock)
    await cover_current(repo, v1, v2, clock)
    agg = v2.datasets["range_aggregates"]
    await set_progress(repo, agg.dataset_version, agg.dataset_uuid, [[0, 499]], None, clock)
    promoter = VersionPromoter(repo, clock=clock)
    assert await promoter.run_once() == []
    assert await status_of(repo, v2.dag_version_id) == "building"
    assert await current_of(repo, "chain") == v1.dag_version_id


async def test_config_is_validated_and_the_promoter_is_a_periodic_service(
    repo: SqlRepository,
) -> None:
    with pytest.raises(ConfigurationError):
        PromoterConfig(interval_seconds=0)
    promoter = VersionPromoter(repo)
    assert isinstance(promoter, PeriodicService)
    assert promoter.config.interval_seconds == 5.0
    await promoter.stop()  # never started: returns at once
