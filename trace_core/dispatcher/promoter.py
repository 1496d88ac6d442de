"""The version promoter: building DAG versions become current once caught up.

A deploy that changes a job's configuration leaves the new DAG version
``building`` next to the current one while its new dataset versions catch
up. Each pass of :class:`VersionPromoter` asks
:func:`trace_core.dag.promote_if_caught_up` about every ``building`` version
(oldest first, each in its own transaction under that DAG's lock); the ones
whose new dataset versions cover the current ones are swapped in.

Promotion is per DAG, not per job, so nothing is journaled (the job journal
is per job); each promotion is logged at INFO, and its transaction notifies
:data:`~trace_core.dag.LIVE_JOBS_CHANNEL` (a running Dispatcher wakes the
services that act on live jobs). A version whose check fails is logged and
retried next pass, without holding back the other DAGs.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass

from trace_core.clock import Clock
from trace_core.dag import promote_if_caught_up
from trace_core.dispatcher.periodic import DispatcherService, require_positive
from trace_core.storage.protocol import Repository

__all__ = ["PromoterConfig", "VersionPromoter"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PromoterConfig:
    """Version promoter settings."""

    interval_seconds: float = 5.0
    """Time between passes: how late past catching up a version becomes current."""

    def __post_init__(self) -> None:
        require_positive("PromoterConfig.interval_seconds", self.interval_seconds)


class VersionPromoter(DispatcherService):
    """Promotes caught-up ``building`` DAG versions; see the module docstring."""

    def __init__(
        self,
        repo: Repository,
        *,
        clock: Clock | None = None,
        config: PromoterConfig | None = None,
    ) -> None:
        self.config = config or PromoterConfig()
        super().__init__(repo, self.config.interval_seconds, clock=clock)

    async def run_once(self) -> list[uuid.UUID]:
        """Promote every caught-up ``building`` version; the ids now current.

        A version another Dispatcher promoted since the scan is reported too
        (:func:`~trace_core.dag.promote_if_caught_up` says it is current).
        """
        async with self.repo.read() as tx:
            building = await tx.deploy.building_versions()
        promoted: list[uuid.UUID] = []
        for version in building:
            version_id, dag_name = version.version_id, version.dag_name
            try:
                if not await promote_if_caught_up(self.repo, version_id, clock=self.clock):
                    continue
            except Exception:
                log.exception(
                    "dag %s: checking version %s for promotion failed", dag_name, version_id
                )
                continue
            log.info("dag %s: version %s caught up and is now current", dag_name, version_id)
            promoted.append(version_id)
        return promoted
