"""Metrics: the Prometheus text format, parsed strictly, with values checked on both engines."""

from __future__ import annotations

import math
import re

import pytest

from tests.factories import JobDef, build_dag, queue_tasks
from trace_core.clock import ManualClock
from trace_core.dispatcher.backpressure import BackpressureMonitor
from trace_core.dispatcher.concurrency import ConcurrencyGate
from trace_core.dispatcher.metrics import render_metrics
from trace_core.storage.sql import SqlRepository
from trace_core.tasks import TaskQueue

pytestmark = pytest.mark.anyio

_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_HELP = re.compile(rf"# HELP ({_NAME}) ((?:[^\\\n]|\\[\\n])*)")
_TYPE = re.compile(rf"# TYPE ({_NAME}) (counter|gauge|histogram|summary|untyped)")
_SAMPLE = re.compile(rf"({_NAME})(?:\{{(.*)\}})? (\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\\n]|\\["\\n])*)"(,|$)')
_VALUE = re.compile(r"[+-]?(?:\d+(?:\.\d*)?(?:[eE][+-]?\d+)?|Inf|NaN)")

Samples = dict[str, dict[frozenset[tuple[str, str]], float]]


def _unescape(value: str) -> str:
    return re.sub(r"\\(.)", lambda m: "\n" if m.group(1) == "n" else m.group(1), value)


def parse(text: str) -> tuple[Samples, dict[str, str]]:
    """Parse the exposition format strictly: families announced once by HELP then
    TYPE, their samples right after, each label set once; everything else fails."""
    assert text.endswith("\n") and "\n\n" not in text
    samples: Samples = {}
    types: dict[str, str] = {}
    lines = text[:-1].split("\n")
    current: str | None = None
    i = 0
    while i < len(lines):
        help_line = _HELP.fullmatch(lines[i])
        assert help_line, f"expected HELP at line {i}: {lines[i]!r}"
        name = help_line.group(1)
        assert name not in samples, f"family {name} repeated"
        type_line = _TYPE.fullmatch(lines[i + 1])
        assert type_line and type_line.group(1) == name
        types[name] = type_line.group(2)
        samples[name] = {}
        current = name
        i += 2
        while i < len(lines) and not lines[i].startswith("#"):
            match = _SAMPLE.fullmatch(lines[i])
            assert match and match.group(1) == current, f"bad sample line {lines[i]!r}"
            labels: list[tuple[str, str]] = []
            body = match.group(2) or ""
            pos = 0
            while pos < len(body):
                label = _LABEL.match(body, pos)
                assert label, f"bad labels in {lines[i]!r}"
                labels.append((label.group(1), _unescape(label.group(2))))
                pos = label.end()
            assert _VALUE.fullmatch(match.group(3)), f"bad value in {lines[i]!r}"
            key = frozenset(labels)
            assert len(key) == len(labels)
            assert key not in samples[current], f"duplicate series {lines[i]!r}"
            samples[current][key] = float(match.group(3))
            i += 1
    return samples, types


def series(samples: Samples, name: str, **labels: str) -> float:
    return samples[name][frozenset(labels.items())]


WEIRD = 'we"ird\\job\nname'


async def test_metrics_report_queues_pauses_operators_and_statuses(
    repo: SqlRepository, clock: ManualClock
) -> None:
    jobs = [
        JobDef("src", outputs=("raw",), operator="ingest"),
        JobDef(
            "agg",
            inputs=("raw",),
            outputs=("totals",),
            backpressure={"max_queue_depth": 2},
            operator="aggregate",
        ),
        JobDef(WEIRD, inputs=("totals",), operator="aggregate"),
    ]
    ids = await build_dag(repo, clock.now(), jobs)
    tq = TaskQueue(repo, clock=clock)
    gate = ConcurrencyGate(tq)
    first, *_ = await queue_tasks(tq, ids["agg"], 3)
    clock.advance(30)
    await queue_tasks(tq, ids["agg"], 1)
    await queue_tasks(tq, ids[WEIRD], 1)
    assert (await gate.claim(first, "w1")).claimed
    [done] = await queue_tasks(tq, ids["src"], 1)
    lease = (await gate.claim(done, "w1")).lease
    assert lease is not None
    await tq.complete(lease.fence)
    await BackpressureMonitor(repo, clock=clock).run_once()
    clock.advance(15)

    samples, types = parse(await render_metrics(repo, clock))

    assert set(types.values()) == {"gauge"}
    assert set(types) == {
        "trace_job_queue_depth",
        "trace_job_queue_age_seconds",
        "trace_job_paused",
        "trace_operator_in_flight",
        "trace_tasks",
    }
    assert series(samples, "trace_job_queue_depth", dag="dex", job="agg") == 3
    assert series(samples, "trace_job_queue_age_seconds", dag="dex", job="agg") == 45
    assert series(samples, "trace_job_queue_depth", dag="dex", job="src") == 0
    assert series(samples, "trace_job_queue_age_seconds", dag="dex", job="src") == 0
    assert series(samples, "trace_job_queue_depth", dag="dex", job=WEIRD) == 1
    assert series(samples, "trace_job_queue_age_seconds", dag="dex", job=WEIRD) == 15
    assert series(samples, "trace_job_paused", dag="dex", job="src") == 1
    assert series(samples, "trace_job_paused", dag="dex", job="agg") == 0
    assert samples["trace_operator_in_flight"] == {
        frozenset({("operator", "aggregate")}): 1,
        frozenset({("operator", "ingest")}): 0,
    }
    assert {dict(k)["status"]: v for k, v in samples["trace_tasks"].items()} == {
        "Queued": 4,
        "Running": 1,
        "Completed": 1,
        "Failed": 0,
        "Canceled": 0,
    }


async def test_two_live_versions_of_a_job_are_one_series(
    repo: SqlRepository, clock: ManualClock
) -> None:
    jobs = [JobDef("agg", outputs=("totals",))]
    current = await build_dag(repo, clock.now(), jobs)
    building = await build_dag(repo, clock.now(), jobs, status="building")
    tq = TaskQueue(repo, clock=clock)
    await queue_tasks(tq, current["agg"], 2)
    clock.advance(10)
    await queue_tasks(tq, building["agg"], 3)
    samples, _ = parse(await render_metrics(repo, clock))
    assert samples["trace_job_queue_depth"] == {frozenset({("dag", "dex"), ("job", "agg")}): 5}
    assert series(samples, "trace_job_queue_age_seconds", dag="dex", job="agg") == 10


async def test_an_empty_database_still_reports_every_status(
    repo: SqlRepository, clock: ManualClock
) -> None:
    text = await render_metrics(repo, clock)
    samples, _ = parse(text)
    assert samples["trace_job_queue_depth"] == {}
    assert sum(samples["trace_tasks"].values()) == 0
    assert len(samples["trace_tasks"]) == 5


def test_the_parser_rejects_malformed_documents() -> None:
    good = '# HELP m A help.\n# TYPE m gauge\nm{a="x"} 1\n'
    assert parse(good)[0] == {"m": {frozenset({("a", "x")}): 1.0}}
    for bad in (
        good.rstrip("\n"),
        good.replace("# TYPE m gauge\n", ""),
        good + 'm{a="x"} 2\n',
        good.replace('"x"', '"x\ny"'),
        good.replace(" 1\n", " one\n"),
        good + "# HELP m again\n# TYPE m gauge\n",
    ):
        with pytest.raises(AssertionError):
            parse(bad)
    assert math.isinf(parse("# HELP i x\n# TYPE i gauge\ni +Inf\n")[0]["i"][frozenset()])
