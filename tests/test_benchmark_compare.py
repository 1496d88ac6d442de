"""Smoke tests of ``benchmarks.compare``'s floor pairs and the floors they read, at tiny sizes.

They check the output contract (one JSON row per pair and run with its
figures and targets, then a summary per pair and engine with medians and
whether each target is met) and that every side's work was verified, not any
speed. The peer pairs need the peers' virtualenv and are not run here.
"""

from __future__ import annotations

import json
import subprocess
from typing import Any

import pytest

from benchmarks import api, compare, enqueue, queue
from benchmarks._compare_floors import ROOT
from trace_testing.postgres import PostgresServer


def _lines(out: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def _worktrees() -> str:
    listed = subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "list", "--porcelain"],
        capture_output=True,
        text=True,
        check=True,
    )
    return listed.stdout


def test_http_baseline_reads_both_trees_and_the_floor(
    postgres_server: PostgresServer, capsys: pytest.CaptureFixture[str]
) -> None:
    """The baseline is this very commit here (a clone's history may be short):
    what is checked is the pair's machinery, the worktree made and removed."""
    before = _worktrees()
    argv = ["--db", postgres_server.url("postgres"), "--pairs", "http-baseline", "--runs", "1"]
    argv += ["--baseline", "HEAD", "--http-paths", "internal"]
    assert compare.main([*argv, "--http-tasks", "6", "--http-workers", "2"]) == 0
    row, summary = _lines(capsys.readouterr().out)

    assert (row["pair"], row["engine"], row["first"], row["baseline"]) == (
        "http-baseline",
        "postgres",
        "new",
        "HEAD",
    )
    # Both sides ran the same client: the baseline tree's copy, with its own revision.
    [base] = row["base_rows"]
    assert base["path"] == "internal" and base["verified"] is True
    floor, new = row["new_rows"]
    assert (floor["path"], new["path"]) == ("floor", "internal")
    assert floor["verified"] is True and new["verified"] is True
    figures = row["figures"]
    assert figures["internal_ratio"] == pytest.approx(
        new["round_trips_per_s"] / base["round_trips_per_s"], abs=0.001
    )
    assert figures["internal_new_cpu_ms"] == new["server_cpu_ms_per_triple"]
    assert figures["floor_per_s"] == floor["round_trips_per_s"] > 0
    assert figures["internal_share_of_floor"] == pytest.approx(
        new["round_trips_per_s"] / floor["round_trips_per_s"], abs=0.001
    )
    assert row["targets"] == {
        "internal_ratio": {"at_least": 5.0},
        "internal_new_cpu_ms": {"at_most": 1.5},
    }

    assert summary["summary"] is True and summary["runs"] == 1
    assert summary["figures_median"]["internal_ratio"] == figures["internal_ratio"]
    ratio = summary["targets"]["internal_ratio"]
    assert ratio["median"] == figures["internal_ratio"]
    assert ratio["met"] is (figures["internal_ratio"] >= 5.0)
    assert _worktrees() == before  # the throwaway worktree is gone


def _floor_pair(
    server: PostgresServer, capsys: pytest.CaptureFixture[str], pair: str, *size: str
) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """Run ``pair`` once on both engines; (row, summary) per engine, Postgres first."""
    argv = ["--db", server.url("postgres"), "--runs", "1", "--engines", "postgres,sqlite"]
    assert compare.main([*argv, "--pairs", pair, *size]) == 0
    rows = _lines(capsys.readouterr().out)
    runs = [r for r in rows if not r.get("summary")]
    summaries = {r["engine"]: r for r in rows if r.get("summary")}
    assert [(r["pair"], r["engine"]) for r in runs] == [(pair, "postgres"), (pair, "sqlite")]
    return [(row, summaries[row["engine"]]) for row in runs]


def test_routing_floor_on_both_engines(
    postgres_server: PostgresServer, capsys: pytest.CaptureFixture[str]
) -> None:
    for row, summary in _floor_pair(
        postgres_server, capsys, "routing-floor", "--routing-events", "60"
    ):
        figures, trace = row["figures"], row["trace_row"]
        assert trace["verified"] is True and trace["floor_rows_ok"] is True
        assert figures["ratio"] == trace["share_of_ceiling"] > 0
        assert figures["ceiling_events_per_s"] == trace["events_per_s_ceiling"]
        target = summary["targets"]["ratio"]
        assert target["at_least"] == 0.8 and target["median"] == figures["ratio"]
        assert target["met"] is (figures["ratio"] >= 0.8)


def test_handoff_floor_on_both_engines(
    postgres_server: PostgresServer, capsys: pytest.CaptureFixture[str]
) -> None:
    for row, summary in _floor_pair(postgres_server, capsys, "handoff-floor", "--samples", "5"):
        figures = row["figures"]
        assert row["trace_row"]["scenario"] == "in-process-handoff"
        assert row["trace_row"]["samples"] == 5
        assert figures["floor_median_ms"] == row["floor_row"]["durable_insert_median_ms"]
        assert figures["ratio"] == pytest.approx(
            figures["handoff_median_ms"] / figures["floor_median_ms"], abs=0.002
        )
        target = summary["targets"]["ratio"]
        assert target["at_most"] == 1.2 and target["median"] == figures["ratio"]
        assert target["met"] is (figures["ratio"] <= 1.2)
        # SQLite's hand-off runs on the event loop: also read against the insert on the loop.
        inline = summary["targets"].get("ratio_to_inline_floor")
        assert (inline is not None) is (row["engine"] == "sqlite")
        if inline is not None:
            assert (
                figures["inline_floor_median_ms"] == (row["floor_row"]["inline_insert_median_ms"])
            )
            assert inline["at_most"] == 1.2
            assert inline["median"] == figures["ratio_to_inline_floor"]


def test_enqueue_floor_is_measured_beside_each_run(
    postgres_server: PostgresServer, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--engine", "postgres", "--db", postgres_server.url("postgres"), "--floor"]
    assert enqueue.main([*argv, "--tasks", "250", "--batch", "100", "--runs", "2"]) == 0
    rows = _lines(capsys.readouterr().out)
    floors = [r for r in rows if r["mode"] == "enqueue-floor" and not r.get("summary")]
    runs = [r for r in rows if r["mode"] == "enqueue" and not r.get("summary")]
    assert [f["floor_first"] for f in floors] == [False, True]  # alternating by run
    for floor, run in zip(floors, runs, strict=True):
        assert floor["verified"] is True and run["verified"] is True
        assert run["floor_tasks_per_s"] == floor["tasks_per_s"] > 0
        assert run["share_of_floor"] == pytest.approx(
            run["tasks_per_s"] / floor["tasks_per_s"], abs=0.001
        )
        # The same rows without the foreign key, in a copy of the table.
        assert run["floor_no_fk_tasks_per_s"] == floor["no_fk_tasks_per_s"] > 0
    summaries = {r["mode"]: r for r in rows if r.get("summary")}
    assert summaries["enqueue-floor"]["all_verified"] is True
    assert "median_share_of_floor" in summaries["enqueue"]


@pytest.mark.parametrize(
    ("module", "argv", "message"),
    [
        (compare, ["--pairs", "http-baseline,nope"], "--pairs: unknown nope"),
        (compare, ["--engines", "mysql"], "--engines: unknown mysql"),
        (compare, ["--http-tasks", "0"], "--http-tasks must be >= 1"),
        (enqueue, ["--engine", "sqlite", "--floor"], "--floor: the floor runs on Postgres only"),
        (
            queue,
            ["--engine", "sqlite", "--mode", "latency", "--scenarios", "cross-process"],
            "cross-process runs on Postgres only",
        ),
        (queue, ["--engine", "postgres", "--scenarios", "fast"], "--scenarios: unknown fast"),
        (api, ["--engine", "sqlite", "--path", "floor"], "the floor runs on Postgres only"),
        (api, ["--engine", "postgres", "--path", "all,v2"], "--path: unknown path 'v2'"),
    ],
)
def test_bad_arguments_are_refused_by_name(
    module: Any, argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        module.main(argv)
    assert message in capsys.readouterr().err


class _FixedSides:
    """Sides that answer fixed rows: the arithmetic of a peer pair's row and
    summary, without the peers' virtualenv."""

    def __init__(self, trace: dict[str, Any], peer: dict[str, Any]) -> None:
        self.rows = {"trace": trace, "peer": peer}

    def trace(self, pair: str) -> dict[str, Any]:
        return self.rows["trace"]

    def peer(self, pair: str) -> dict[str, Any]:
        return self.rows["peer"]

    def settle(self) -> None:
        return None


def test_the_enqueue_pair_divides_each_figure_by_its_own_base() -> None:
    trace = {
        "tasks_per_s": 30.0,
        "dedupe_tasks_per_s": 24.0,
        "floor_tasks_per_s": 60.0,
        "dedupe_floor_tasks_per_s": 48.0,
        "floor_no_fk_tasks_per_s": 120.0,
    }
    sides = _FixedSides(trace, {"median_jobs_per_s": 40.0, "dedupe_jobs_per_s": 16.0})
    rows = [compare._measure("postgres-enqueue", run, sides) for run in (0, 1)]  # type: ignore[arg-type]
    assert [r["first"] for r in rows] == ["trace", "peer"]
    row = rows[0]
    # With dedupe keys, against PgQueuer's run with dedupe keys too.
    assert row["ratio"] == 0.75 and row["ratio_dedupe"] == 1.5
    assert row["peer_dedupe_jobs_per_s"] == 16.0
    assert row["ratio_floor"] == 0.5 and row["ratio_dedupe_floor"] == 0.5
    assert row["ratio_floor_peer"] == 1.5 and row["ratio_floor_no_fk_peer"] == 3.0
    assert row["floor_no_fk_tasks_per_s"] == 120.0 and row["dedupe_tasks_per_s"] == 24.0
    summary = compare._peer_summary("postgres-enqueue", rows)
    assert summary["ratio_floor_no_fk_peer_median"] == 3.0
    assert summary["floor_tasks_per_s_median"] == 60.0
    assert summary["ratios_floor_peer"] == [1.5, 1.5]
    assert summary["peer_dedupe_jobs_per_s_median"] == 16.0
    assert summary["dedupe_tasks_per_s_median"] == 24.0
