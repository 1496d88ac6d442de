"""Tenant isolation of the ``trace-lite`` CLI on both engines, and its pause / resume /
rematerialize commands.

Two orgs hold the same DAG ``ops`` (a manual source ``kick`` writing ``kicks``,
``react`` reading it and writing ``reacted``); org B (``acme``) also holds a
DAG ``bonly`` of its own names and more tasks. Every command that reads data,
run for org A (the default), names nothing of B, and its counts are A's alone.
"""

from __future__ import annotations

import re
import uuid
from pathlib import Path

import anyio
import pytest

from tests.test_cli import MANUAL_DAG
from tests.test_people_cli import _run
from trace_core.storage.ports import NewLineageEdge
from trace_core.storage.sql import SqlRepository

OPS = MANUAL_DAG
B_ONLY = """
dag: bonly
jobs:
  - name: bkick
    activation: source
    runtime: ecs_platform
    operator: block_follower
    source: { kind: manual }
    outputs: [ { dataset: bkicks } ]
"""
B = "acme"
B_NAMES = ("bonly", "bkick", "bkicks", "bella")
_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


async def _org_state(url: str, org: str) -> dict[str, object]:
    """Ids of ``org``'s datasets, jobs, versions and tasks, and its pause states."""
    repo = SqlRepository(url)
    try:
        async with repo.read() as tx:
            org_id = await tx.registry.find_org(org)
            assert org_id is not None
            datasets = await tx.catalog.datasets(org_id)
            jobs = await tx.catalog.jobs(org_id)
            tasks = await tx.catalog.tasks(org_id, [j.job_id for j in jobs], status=None, limit=99)
            versions = [
                v.version_id
                for d in datasets
                for v in await tx.catalog.dataset_versions(org_id, d.dataset_uuid)
            ]
            pauses = {j.job_id: await tx.job_states.pause_state(j.job_id) for j in jobs}
        return {
            "org_id": org_id,
            "datasets": {d.name: d.dataset_uuid for d in datasets},
            "jobs": {f"{j.dag_name}/{j.name}": j.job_id for j in jobs},
            "versions": versions,
            "tasks": [t.task_id for t in tasks],
            "pauses": pauses,
        }
    finally:
        await repo.close()


async def _record_lineage(url: str, state: dict[str, dict[str, uuid.UUID]], b: bool) -> None:
    """``reacted.total`` comes from ``kicks.value``; in B also from ``bkicks.value``."""
    repo = SqlRepository(url)
    try:
        ds, jobs = state["datasets"], state["jobs"]
        edges = [NewLineageEdge("total", ds["kicks"], "value")]
        if b:
            edges.append(NewLineageEdge("total", ds["bkicks"], "value"))
        async with repo.transaction() as tx:
            await tx.lineage.record(ds["reacted"], jobs["ops/react"], edges)
    finally:
        await repo.close()


def _foreign(text: str, b: dict[str, object]) -> list[str]:
    """Whatever of org B appears in ``text``: its own names and its ids."""
    found = [name for name in B_NAMES if name in text]
    ids = {str(i) for key in ("versions", "tasks") for i in b[key]}  # type: ignore[attr-defined]
    ids |= {str(i) for key in ("datasets", "jobs") for i in b[key].values()}  # type: ignore[attr-defined]
    found += [i for i in _UUID.findall(text) if i in ids]
    # `status` shows versions by their first 8 hex digits. Only versions: task
    # ids are time-ordered (UUIDv7), so tasks made in the same second share them.
    found += [v for v in map(str, b["versions"]) if v[:8] in text]  # type: ignore[attr-defined]
    return found


def test_every_read_command_of_org_a_shows_and_counts_nothing_of_org_b(
    database_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    db = ("--db", database_url)
    ops, bonly = tmp_path / "ops.yaml", tmp_path / "bonly.yaml"
    ops.write_text(OPS)
    bonly.write_text(B_ONLY)
    assert _run(capsys, "dag", "deploy", str(ops), *db)[0] == 0
    for f in (ops, bonly):
        assert _run(capsys, "dag", "deploy", str(f), "--org", B, *db)[0] == 0
    assert _run(capsys, "people", "user", "add", "--user", "ann", "--role", "admin", *db)[0] == 0
    for user in ("bella", "bob"):
        code = _run(capsys, "people", "user", "add", "--user", user, "--role", "writer",
                    "--org", B, *db)[0]  # fmt: skip
        assert code == 0
    assert _run(capsys, "people", "role", "add", "bellarole", "--org", B, *db)[0] == 0
    # One task in A; three more of the same job, and one of bonly, in B.
    assert _run(capsys, "trigger", "kick", "--key", "a1", *db)[0] == 0
    for key in ("b1", "b2", "b3"):
        assert _run(capsys, "trigger", "ops/kick", "--key", key, "--org", B, *db)[0] == 0
    assert _run(capsys, "trigger", "bkick", "--key", "b4", "--org", B, *db)[0] == 0
    a = anyio.run(_org_state, database_url, "default")
    b = anyio.run(_org_state, database_url, B)
    anyio.run(_record_lineage, database_url, a, False)  # type: ignore[arg-type]
    anyio.run(_record_lineage, database_url, b, True)  # type: ignore[arg-type]
    assert len(a["tasks"]) == 1 and len(b["tasks"]) == 4  # type: ignore[arg-type]

    outputs = {}
    for argv in (
        ("status", "ops"),
        ("datasets", "ops"),
        ("tasks", "ops", "--attempts"),
        ("explain", "ops", "kick"),
        ("explain", "ops", "react"),
        ("lineage", "reacted"),
        ("lineage", "kicks", "--direction", "down"),
        ("people", "user", "list"),
        ("people", "role", "list"),
    ):
        code, out, err = _run(capsys, *argv, *db)
        assert code == 0, (argv, err)
        assert _foreign(out + err, b) == [], argv
        outputs[argv[0] + " " + argv[1]] = out

    # The detector sees B where B is asked for (so an empty answer above means something).
    for argv in (("tasks", "ops"), ("lineage", "reacted"), ("people", "user", "list")):
        code, out, _ = _run(capsys, *argv, "--org", B, *db)
        assert code == 0 and _foreign(out, b) != [], argv

    # Counts are A's alone: one queued kick, one task listed, one upstream edge.
    (kick_row,) = [line for line in outputs["status ops"].splitlines() if " kick " in line]
    assert kick_row.split()[1:3] == ["1", "0"], kick_row  # Queued 1, Running 0
    assert [str(t) for t in a["tasks"]] == _UUID.findall(outputs["tasks ops"])  # type: ignore[attr-defined]
    assert "kicks.value" in outputs["lineage reacted"]
    assert outputs["people user"].split() == ["ann", "admin"]
    assert outputs["people role"] == ""

    # B's own DAG, job and dataset do not exist for A.
    assert _run(capsys, "status", "bonly", *db)[1].strip() == "bonly: not deployed"
    assert _run(capsys, "tasks", "bonly", *db)[1].count("\n") <= 2  # the header alone
    code, _, err = _run(capsys, "explain", "bonly", "bkick", *db)
    assert code == 1 and "of org 'default'" in err
    code, _, err = _run(capsys, "lineage", "bkicks", *db)
    assert code == 1 and "no dataset 'bkicks' in org 'default'" in err
    code, _, err = _run(capsys, "trigger", "bkick", "--key", "x", *db)
    assert code == 1 and "bkick" in err and _foreign(err.replace("'bkick'", ""), b) == []
    assert anyio.run(_org_state, database_url, B)["tasks"] == b["tasks"]


def test_pause_resume_and_rematerialize_act_on_the_named_org_only(
    database_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    db = ("--db", database_url)
    ops = tmp_path / "ops.yaml"
    ops.write_text(OPS)
    for org in ("default", B):
        assert _run(capsys, "dag", "deploy", str(ops), "--org", org, *db)[0] == 0
    b_before = anyio.run(_org_state, database_url, B)

    code, out, _ = _run(capsys, "pause", "ops", "react", "--by", "ann", *db)
    assert code == 0 and out.strip().endswith("paused (manual by ann)")
    a = anyio.run(_org_state, database_url, "default")
    react = a["jobs"]["ops/react"]  # type: ignore[index]
    assert a["pauses"][react] == (True, "manual by ann")  # type: ignore[index]
    code, out, _ = _run(capsys, "pause", "ops", "react", "--by", "other", *db)
    assert out.strip().endswith("paused (manual by ann) (unchanged)")
    code, out, _ = _run(capsys, "resume", "ops", "react", "--by", "ann", *db)
    assert code == 0 and out.strip().endswith("running")
    code, _, err = _run(capsys, "pause", "ops", "nope", *db)
    assert code == 1 and "no job 'nope' in DAG 'ops' of org 'default'" in err

    code, out, _ = _run(capsys, "rematerialize", "reacted", *db)
    assert code == 0, out
    assert "ops: deployed version" in out
    assert re.search(r"dataset reacted: \S+ \(new version\)", out)
    assert re.search(r"dataset kicks: \S+ \(kept\)", out)
    code, _, err = _run(capsys, "rematerialize", "nope", *db)
    assert code == 1 and "no dataset 'nope'" in err
    code, _, err = _run(capsys, "pause", "ops", "react", "--org", "nosuch", *db)
    assert code == 2 and "--org: no org 'nosuch'" in err

    after = anyio.run(_org_state, database_url, "default")
    assert len(after["versions"]) == len(a["versions"]) + 1  # type: ignore[arg-type]
    # Nothing of B moved: no pause, no new version.
    assert anyio.run(_org_state, database_url, B) == b_before


@pytest.mark.parametrize(
    "argv",
    [["pause", "ops", "react"], ["resume", "ops", "react"], ["rematerialize", "reacted"]],
    ids=" ".join,
)
def test_the_control_commands_never_create_a_database(
    argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "nested" / "x.db"
    code, _, err = _run(capsys, *argv, "--db", f"sqlite:///{missing}")
    assert code == 2 and f"no state database at {missing.resolve()}" in err
    assert list(tmp_path.iterdir()) == []
