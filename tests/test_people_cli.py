"""``trace-lite people …`` round trip on both engines, and errors that name the option."""

from __future__ import annotations

from pathlib import Path

import pytest

from trace_lite.cli import main

DAG = """
dag: uploads
jobs:
  - name: upload
    activation: source
    runtime: dispatcher
    operator: noop
    source: {kind: manual}
    outputs: [{dataset: doubled}]
"""


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_people_round_trip(
    database_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    db = ("--db", database_url)
    dag = tmp_path / "api.yaml"
    dag.write_text(DAG)
    assert _run(capsys, "dag", "deploy", str(dag), *db)[0] == 0

    assert _run(capsys, "people", "user", "add", "--user", "ann", "--role", "admin", *db)[0] == 0
    assert _run(capsys, "people", "user", "add", "--user", "ben", "--role", "reader", *db)[0] == 0
    other = ("--org", "other")
    assert (
        _run(capsys, "people", "user", "add", "--user", "eve", "--role", "admin", *other, *db)[0]
        == 0
    )
    assert _run(capsys, "people", "role", "add", "finance", "--name", "Finance", *db)[0] == 0
    assert (
        _run(capsys, "people", "member", "add", "--user", "ben", "--role", "finance", *db)[0] == 0
    )
    assert _run(capsys, "people", "user", "role", "--user", "ben", "--role", "writer", *db)[0] == 0
    code, out, _ = _run(
        capsys, "people", "dataset", "visibility", "doubled", "--roles", "finance", *db
    )
    assert (code, out.strip()) == (0, "doubled: finance")

    code, out, _ = _run(capsys, "people", "user", "list", *db)
    assert sorted(out.split("\n")[:-1]) == ["ann\tadmin", "ben\twriter"]
    code, out, _ = _run(capsys, "people", "role", "list", *db)
    assert out.strip() == "finance\tFinance\t1 member(s)"
    # the other org sees none of it
    assert _run(capsys, "people", "user", "list", *other, *db)[1].strip() == "eve\tadmin"
    assert _run(capsys, "people", "role", "list", *other, *db)[1] == ""

    assert (
        _run(capsys, "people", "member", "remove", "--user", "ben", "--role", "finance", *db)[0]
        == 0
    )
    assert _run(capsys, "people", "user", "disable", "--user", "ben", *db)[0] == 0
    assert "ben\twriter\tdisabled" in _run(capsys, "people", "user", "list", *db)[1]
    code, out, _ = _run(capsys, "people", "dataset", "visibility", "doubled", "--everyone", *db)
    assert out.strip() == "doubled: every member of the org"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("people", "user", "role", "--user", "eve", "--role", "admin"), "--user: no user 'eve'"),
        (("people", "member", "add", "--user", "ann", "--role", "ghost"), "--role: no role"),
        (("people", "dataset", "visibility", "nope"), "DATASET: no dataset 'nope'"),
        (("people", "role", "list", "--org", "nowhere"), "--org: no org 'nowhere'"),
        (("people", "role", "add", "Bad Slug"), "slug: must be"),
        (("people", "user", "add", "--user", "ann", "--role", "admin"), "--user: 'ann' already"),
    ],
)
def test_errors_name_the_option(
    database_url: str,
    capsys: pytest.CaptureFixture[str],
    argv: tuple[str, ...],
    message: str,
) -> None:
    db = ("--db", database_url)
    assert _run(capsys, "people", "user", "add", "--user", "ann", "--role", "admin", *db)[0] == 0
    assert (
        _run(
            capsys, "people", "user", "add", "--user", "eve", "--role", "reader", "--org", "o", *db
        )[0]
        == 0
    )
    code, _, err = _run(capsys, *argv, *db)
    assert code == 2
    assert message in err


def test_a_bad_role_is_refused_by_the_parser(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["people", "user", "add", "--user", "x", "--role", "boss"])
    assert exit_info.value.code == 2
    assert "--role" in capsys.readouterr().err
