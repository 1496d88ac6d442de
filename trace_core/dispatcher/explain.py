"""Explain: why a job did or did not run.

Gathers, for one job of a DAG's live (or latest) version, what users ask
about first (Dagster #13331): the last events on its inputs and what routing
decided for this job (created, a duplicate of an existing task, waiting for
other inputs, deferred by a pause, a dataset version that is not current);
its backpressure pause; its concurrency waits and other journal entries; its
tasks by status and its failed attempts with their errors. Everything is
read from what the Dispatcher stored when it decided, nothing is recomputed.
"""

from __future__ import annotations

import uuid
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from trace_core.dispatcher.journal import read_journal
from trace_core.errors import NotFound
from trace_core.storage.protocol import Repository

__all__ = ["EventDecision", "Explanation", "explain_job"]


@dataclass(frozen=True)
class EventDecision:
    """One recent input event and what routing decided for the job."""

    received_at: datetime
    dataset: str
    dataset_version: uuid.UUID
    unit: str
    deliveries: int
    route_status: str
    decision: str


@dataclass
class Explanation:
    """Everything :func:`explain_job` found, plus a summary of reasons."""

    dag_name: str
    job_name: str
    job_id: uuid.UUID
    dag_version_id: uuid.UUID
    version_status: str
    activation: str
    operator: str
    runtime: str
    paused: bool = False
    pause_reason: str | None = None
    source_status: str | None = None
    scale_state: str | None = None
    tasks_by_status: dict[str, int] = field(default_factory=dict)
    events: list[EventDecision] = field(default_factory=list)
    failures: list[dict[str, Any]] = field(default_factory=list)
    journal: list[dict[str, Any]] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)

    def render(self) -> str:
        """A plain-text report for the CLI."""
        lines = [
            f"{self.dag_name}/{self.job_name} ({self.activation}, operator {self.operator}, "
            f"runtime {self.runtime}; DAG version {self.version_status})",
            "why:",
            *[f"  - {reason}" for reason in self.reasons],
            "tasks: "
            + (", ".join(f"{k} {v}" for k, v in sorted(self.tasks_by_status.items())) or "none"),
        ]
        if self.events:
            lines.append("last input events:")
            lines += [
                f"  {e.received_at:%Y-%m-%d %H:%M:%S} {e.dataset} {e.unit}"
                f" x{e.deliveries} -> {e.decision}"
                for e in self.events
            ]
        if self.failures:
            lines.append("failed attempts:")
            lines += [
                f"  task {f['task_id']} attempt {f['attempt']} ({f['status']}): {f['error']}"
                for f in self.failures
            ]
        if self.journal:
            lines.append("journal:")
            lines += [
                f"  {j['at']:%Y-%m-%d %H:%M:%S} {j['kind']}: {j['message']}" for j in self.journal
            ]
        return "\n".join(lines)


async def explain_job(
    repo: Repository,
    dag_name: str,
    job_name: str,
    *,
    org_slug: str = "default",
    limit: int = 20,
) -> Explanation:
    """Explain ``dag_name/job_name`` (current version, else the newest one)."""
    async with repo.read() as tx:
        job = await tx.explain.find_job(org_slug, dag_name, job_name)
        if job is None:
            raise NotFound(f"no job {job_name!r} in DAG {dag_name!r} of org {org_slug!r}")
        found = Explanation(
            dag_name=dag_name,
            job_name=job_name,
            job_id=job.job_id,
            dag_version_id=job.dag_version_id,
            version_status=job.version_status,
            activation=job.activation,
            operator=job.operator,
            runtime=job.runtime,
        )
        state = await tx.explain.job_state(found.job_id)
        if state is not None:
            found.paused = state.paused
            found.pause_reason = state.pause_reason
            found.source_status = state.source_status
            found.scale_state = state.scale_state
        found.tasks_by_status = await tx.explain.task_status_counts(found.job_id)
        found.failures = [
            {
                "task_id": str(f.task_id),
                "attempt": f.attempt,
                "status": f.status,
                "error": f.error,
                "next_retry_at": f.next_retry_at,
            }
            for f in await tx.explain.failed_attempts(found.job_id, limit=limit)
        ]
        for e in await tx.explain.recent_input_events(job.input_datasets, limit=limit):
            found.events.append(
                EventDecision(
                    e.received_at,
                    e.dataset,
                    e.dataset_version,
                    e.unit,
                    e.deliveries,
                    e.route_status,
                    _decision(found.job_name, e.route_status, e.route_detail),
                )
            )
        found.journal = [dict(e) for e in await read_journal(tx, found.job_id, limit=limit)]
    found.reasons = _reasons(found)
    return found


def _decision(job_name: str, route_status: str, detail: dict[str, Any] | None) -> str:
    """What routing decided for ``job_name`` about one event, in words."""
    decision = (detail or {}).get(job_name)
    if decision is not None:
        return str(decision)
    return {
        "pending": "not routed yet",
        "not_current": "not routed: dataset version is not current",
    }.get(route_status, "not routed to this job (reads another version)")


def _reasons(found: Explanation) -> list[str]:
    reasons = []
    if found.version_status not in ("current", "building"):
        reasons.append(f"its DAG version is {found.version_status}: it gets no new work")
    if found.paused:
        reasons.append(f"paused by backpressure: {found.pause_reason}")
    decisions = Counter(e.decision for e in found.events)
    explained = {
        "created": "{n} recent events created tasks",
        "existing": "{n} recent events were duplicates of existing tasks (deduplicated)",
        "waiting_for_inputs": "{n} recent events wait for the job's other inputs",
        "paused": "{n} recent events are deferred while the job is paused",
        "not routed: dataset version is not current": (
            "{n} recent events were for a dataset version that is not current (kept for audit)"
        ),
        "not routed yet": "{n} recent events are accepted but not routed yet",
    }
    for decision, template in explained.items():
        if decisions.get(decision):
            reasons.append(template.format(n=decisions[decision]))
    if found.activation == "reactive" and not found.events:
        reasons.append("no events have arrived on its inputs")
    waits = sum(1 for j in found.journal if j["kind"] == "concurrency_wait")
    if waits:
        reasons.append(f"{waits} recent claims waited for scaling.max_concurrency")
    dead = [f for f in found.failures if f["status"] == "Failed" and f["next_retry_at"] is None]
    retrying = [f for f in found.failures if f["next_retry_at"] is not None]
    if retrying:
        reasons.append(f"{len(retrying)} tasks failed and wait for a retry")
    if dead:
        reasons.append(f"{len(dead)} tasks failed terminally (attempts exhausted)")
    if found.source_status is not None:
        reasons.append(f"source status: {found.source_status}")
    if not reasons:
        reasons.append("nothing unusual recorded")
    return reasons
