"""DAG files without a database: format, every validation rule, hashing, coverage, CLI validate."""

from __future__ import annotations

import itertools
import textwrap
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

import trace_core.dag
from trace_core.dag import (
    Coverage,
    DagValidationError,
    covers,
    dataset_version_hashes,
    job_config_hashes,
    load_dag,
    merge_ranges,
    parse_dag,
    parse_duration,
    yaml_hash,
)
from trace_core.limits import MAX_RANGE_BOUND
from trace_lite.cli import main

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
F = "dag.yaml"

# Line numbers in the assertions below count from the first line of BASE.
BASE = """\
dag: chain
jobs:
  - name: follow
    activation: source
    runtime: dispatcher
    operator: block_follower
    source: { kind: always_on }
    outputs:
      - dataset: blocks
      - dataset: transactions
  - name: aggregate
    activation: reactive
    runtime: dispatcher
    operator: range_aggregator
    execution_strategy: PerPartition
    inputs:
      - from: { job: follow, output_index: 0 }
      - from: { dataset: transactions }
        where: "value > 0"
    outputs: [{ dataset: range_aggregates }]
"""


def problems(text: str, **kwargs: object) -> list[str]:
    """The rendered problems of ``text`` (which must be invalid)."""
    with pytest.raises(DagValidationError) as info:
        parse_dag(textwrap.dedent(text), file=F, **kwargs)  # type: ignore[arg-type]
    return [str(p) for p in info.value.problems]


def edit(old: str, new: str, text: str = BASE) -> str:
    assert old in text, old
    return text.replace(old, new, 1)


# --- examples ---------------------------------------------------------------


@pytest.mark.parametrize("name", ["chain_pipeline.yaml", "cron_report.yaml"])
def test_examples_validate_clean(name: str) -> None:
    doc = load_dag(EXAMPLES / name)
    assert doc.warnings == ()
    assert doc.spec.jobs


def test_chain_example_has_the_promised_shape() -> None:
    spec = load_dag(EXAMPLES / "chain_pipeline.yaml").spec
    follow, aggregate, alerts = spec.jobs
    assert follow.source is not None and follow.source.kind == "always_on"
    assert [o.dataset for o in follow.outputs] == ["blocks", "transactions"]
    assert aggregate.execution_strategy == "PerPartition"
    assert aggregate.inputs[1].where == "value > 0"
    assert alerts.inputs[0].where and alerts.outputs[0].dataset == "alerts"
    assert alerts.update_strategy == "append" and alerts.unique_key == ("org_id", "dedupe_key")
    assert aggregate.timeout_seconds == 900 and aggregate.heartbeat_timeout_seconds == 30
    assert aggregate.backpressure is not None and aggregate.backpressure.max_queue_age == 600


INVALID_EXPECTED = {
    "cycle.yaml": ["cycle.yaml:15: jobs[1].inputs: cycle: left -> right -> left"],
    "references.yaml": [
        "references.yaml:10: jobs[1].name: duplicate job name 'follow'",
        "references.yaml:15: jobs[1].outputs[0].dataset: dataset 'blocks' is already produced",
        "references.yaml:22: jobs[2].inputs[0].from.job: unknown job 'folow' (did you mean "
        "'follow'?)",
        "references.yaml:23: jobs[2].inputs[1].from.output_index: output_index 3 is out of range",
        "references.yaml:25: jobs[2].update_strategy: append needs unique_key",
    ],
    "bad_fields.yaml": [
        "bad_fields.yaml:10: jobs[0].max_attempts: 0 is too small — must be > 0",
        "bad_fields.yaml:11: jobs[0].timeout_seconds: bad duration 'soon'",
        "bad_fields.yaml:19: jobs[1].inputs[0].where: must not contain ';'",
        "bad_fields.yaml:21: jobs[1].scalling: unknown field 'scalling' (did you mean 'scaling'?)",
    ],
    "syntax.yaml": ["syntax.yaml:6: YAML syntax error: expected ',' or ']'"],
}


@pytest.mark.parametrize("name", sorted(INVALID_EXPECTED))
def test_invalid_examples_report_every_expected_problem(name: str) -> None:
    path = EXAMPLES / "invalid" / name
    with pytest.raises(DagValidationError) as info:
        load_dag(path)
    rendered = [str(p).removeprefix(str(EXAMPLES / "invalid") + "/") for p in info.value.errors]
    assert len(rendered) == len(INVALID_EXPECTED[name]), rendered
    for line, expected in zip(rendered, INVALID_EXPECTED[name], strict=True):
        assert line.startswith(expected), (line, expected)


def test_every_invalid_example_is_covered() -> None:
    assert {p.name for p in (EXAMPLES / "invalid").glob("*.yaml")} == set(INVALID_EXPECTED)


# --- structure ----------------------------------------------------------------


def test_problem_rendering_is_file_line_field_message() -> None:
    [line] = problems(edit("{ dataset: transactions }", "{ dataset: foo }"), known_datasets=set())
    assert line == (
        "dag.yaml:18: jobs[1].inputs[1].from.dataset: unknown dataset 'foo' — an input must "
        "name a dataset produced in this DAG or already registered"
    )


def test_unknown_keys_suggest_the_close_name() -> None:
    text = edit(
        "    runtime: dispatcher\n    operator: range",
        "    runtim: dispatcher\n    operator: range",
    )
    text = edit("        where:", "        wher:", text)
    assert problems(text) == [
        "dag.yaml:11: jobs[1].runtime: missing — this field is required",
        "dag.yaml:13: jobs[1].runtim: unknown field 'runtim' (did you mean 'runtime'?) — allowed "
        "here: activation, backpressure, bootstrap, config, execution_strategy, "
        "heartbeat_timeout_seconds, idle_timeout, inputs, max_attempts, name, operator, outputs, "
        "runtime, scaling, source, timeout_seconds, unique_key, update_strategy",
        "dag.yaml:19: jobs[1].inputs[1].wher: unknown field 'wher' (did you mean 'where'?) — "
        "allowed here: from, where",
    ]


def test_unknown_top_level_key() -> None:
    [line] = problems("dag: x\njbos: []\n")
    assert line.startswith("dag.yaml:2: jbos: unknown field 'jbos' (did you mean 'jobs'?)")


def test_duplicate_mapping_keys_are_rejected() -> None:
    found = problems(
        edit("    operator: block_follower\n", "    operator: block_follower\n    operator: noop\n")
    )
    assert found == [
        "dag.yaml:7: jobs[0].operator: duplicate key 'operator' (first at line 6) — a mapping key "
        "may appear once"
    ]


def test_yaml_syntax_error_names_the_line() -> None:
    [line] = problems("dag: x\njobs:\n  - name: [unclosed\n")
    assert line.startswith("dag.yaml:4: YAML syntax error")


def test_empty_and_unreadable_files(tmp_path: Path) -> None:
    assert problems("") == ["dag.yaml: empty file — a DAG file declares dag: and jobs:"]
    with pytest.raises(DagValidationError, match=r"missing\.yaml: cannot read file"):
        load_dag(tmp_path / "missing.yaml")
    (tmp_path / "bin.yaml").write_bytes(b"dag: \xff\n")
    with pytest.raises(DagValidationError, match="not UTF-8"):
        load_dag(tmp_path / "bin.yaml")


def test_no_jobs_and_no_outputs() -> None:
    assert problems("dag: x\njobs: []\n") == [
        "dag.yaml:2: jobs: no jobs — a DAG needs at least one job"
    ]
    found = problems(edit("    outputs: [{ dataset: range_aggregates }]\n", "    outputs: []\n"))
    assert found == [
        "dag.yaml:20: jobs[1].outputs: no outputs — every job materializes at least one dataset"
    ]


def test_strict_scalars_are_not_coerced() -> None:
    found = problems(
        edit(
            "    source: { kind: always_on }\n",
            '    source: { kind: always_on }\n    max_attempts: "3"\n',
        )
    )
    assert found == [
        "dag.yaml:8: jobs[0].max_attempts: '3' is not an integer — expected an integer"
    ]


def test_all_problems_are_collected() -> None:
    text = edit("activation: reactive", "activation: sometimes")
    text = edit(
        "    source: { kind: always_on }\n",
        "    source: { kind: always_on }\n    max_attempts: 0\n"
        "    scaling: { max_concurrency: -1 }\n",
        text,
    )
    text = edit('"value > 0"', '""', text)
    found = problems(text)
    fields = [p.split(": ")[1] for p in found]
    assert fields == [
        "jobs[0].max_attempts",
        "jobs[0].scaling.max_concurrency",
        "jobs[1].activation",
        "jobs[1].inputs[1].where",
    ]


# --- semantic rules -----------------------------------------------------------


def test_duplicate_job_names() -> None:
    found = problems(edit("  - name: aggregate", "  - name: follow"))
    assert (
        "dag.yaml:11: jobs[1].name: duplicate job name 'follow' — job names are unique in a "
        "DAG (first defined at line 3)" in found
    )


def test_unknown_operator_is_checked_against_the_given_set() -> None:
    found = problems(BASE, operators={"block_follower", "range_aggregater"})
    assert found == [
        "dag.yaml:14: jobs[1].operator: unknown operator 'range_aggregator' (did you mean "
        "'range_aggregater'?) — the operator must be one of: block_follower, range_aggregater"
    ]


def test_unknown_runtime_default_and_given_sets() -> None:
    found = problems(
        edit(
            "    runtime: dispatcher\n    operator: range",
            "    runtime: lamda\n    operator: range",
        )
    )
    assert found == [
        "dag.yaml:13: jobs[1].runtime: unknown runtime 'lamda' (did you mean 'lambda'?) — the "
        "runtime must be one of: dispatcher, ecs_platform, ecs_udf, lambda"
    ]
    assert problems(BASE, runtimes={"lambda"})[0].startswith(
        "dag.yaml:5: jobs[0].runtime: unknown runtime 'dispatcher'"
    )


SELFISH = textwrap.indent(
    textwrap.dedent(
        """\
        - name: selfish
          activation: reactive
          runtime: dispatcher
          operator: noop
          execution_strategy: PerUpdate
          inputs: [{ from: { dataset: own } }]
          outputs: [{ dataset: own }]
        """
    ),
    "  ",
)


def test_cycle_names_the_path_including_self_loops() -> None:
    assert problems(BASE + SELFISH) == [
        "dag.yaml:26: jobs[2].inputs: cycle: selfish -> selfish — jobs must form a DAG"
    ]


def test_input_job_must_exist_and_output_index_be_in_range() -> None:
    found = problems(edit("{ job: follow, output_index: 0 }", "{ job: follow, output_index: 2 }"))
    assert found == [
        "dag.yaml:17: jobs[1].inputs[0].from.output_index: output_index 2 is out of range — "
        "job 'follow' has 2 output(s) (0..1)"
    ]
    found = problems(edit("{ job: follow, output_index: 0 }", "{ job: nobody }"))
    assert found == [
        "dag.yaml:17: jobs[1].inputs[0].from.job: unknown job 'nobody' — an input must name a "
        "job of this DAG"
    ]


def test_input_shape_rules() -> None:
    found = problems(edit("{ job: follow, output_index: 0 }", "{ job: follow, dataset: blocks }"))
    assert found == [
        "dag.yaml:17: jobs[1].inputs[0].from: both job and dataset — an input names "
        "{job, output_index} or {dataset}"
    ]
    found = problems(edit("{ job: follow, output_index: 0 }", "{}"))
    assert found == [
        "dag.yaml:17: jobs[1].inputs[0].from: empty — an input names {job, output_index} or "
        "{dataset}"
    ]
    found = problems(
        edit("{ dataset: transactions }", "{ dataset: transactions, output_index: 1 }")
    )
    assert found[0].startswith(
        "dag.yaml:18: jobs[1].inputs[1].from.output_index: output_index goes with job"
    )
    found = problems(edit("{ job: follow, output_index: 0 }", "{ job: follow, output_index: 1 }"))
    assert found == [
        "dag.yaml:18: jobs[1].inputs[1].from: dataset 'transactions' is already an input of this "
        "job (inputs[0]) — read each dataset once"
    ]


def test_dataset_inputs_outside_the_dag_warn_without_registry_and_fail_with_it() -> None:
    text = edit("{ dataset: transactions }", "{ dataset: prices }")
    doc = parse_dag(text, file=F)
    assert [str(w) for w in doc.warnings] == [
        "dag.yaml:18: warning: jobs[1].inputs[1].from.dataset: dataset 'prices' is not produced "
        "in this DAG — it must be registered by another DAG when this one is deployed"
    ]
    assert parse_dag(text, file=F, known_datasets={"prices"}).warnings == ()
    [line] = problems(text, known_datasets={"price"})
    assert line.startswith(
        "dag.yaml:18: jobs[1].inputs[1].from.dataset: unknown dataset 'prices' "
        "(did you mean 'price'?)"
    )


def test_two_producers_of_one_dataset() -> None:
    found = problems(edit("[{ dataset: range_aggregates }]", "[{ dataset: blocks }]"))
    assert found == [
        "dag.yaml:20: jobs[1].outputs[0].dataset: dataset 'blocks' is already produced by job "
        "'follow' (outputs[0]) — a dataset has a single producer"
    ]


def test_append_needs_unique_key() -> None:
    text = edit(
        "    outputs: [{ dataset: range_aggregates }]\n",
        "    outputs: [{ dataset: range_aggregates }]\n    update_strategy: append\n",
    )
    assert problems(text) == [
        "dag.yaml:21: jobs[1].update_strategy: append needs unique_key — appended rows are "
        "deduplicated on it"
    ]
    parse_dag(text + "    unique_key: [id]\n", file=F)
    assert problems(text + "    unique_key: []\n") == [
        "dag.yaml:22: jobs[1].unique_key: empty — unique_key names at least one column"
    ]


def test_source_jobs_take_no_inputs_strategy_or_idle_timeout() -> None:
    text = edit(
        "    source: { kind: always_on }\n",
        "    source: { kind: always_on }\n    execution_strategy: PerUpdate\n    idle_timeout: 5m\n"
        "    inputs: [{ from: { dataset: range_aggregates } }]\n",
    )
    found = problems(text)
    assert found[:3] == [
        "dag.yaml:8: jobs[0].execution_strategy: not allowed on a source job — execution_strategy "
        "is for reactive jobs",
        "dag.yaml:9: jobs[0].idle_timeout: not allowed on a source job — idle_timeout is for "
        "reactive jobs",
        "dag.yaml:10: jobs[0].inputs: a source job has no inputs — only reactive jobs read inputs",
    ]
    found = problems(edit("    source: { kind: always_on }\n", ""))
    assert found == [
        "dag.yaml:3: jobs[0].source: missing source — a source job needs source: "
        "{kind: always_on | cron | manual}"
    ]


def test_reactive_jobs_need_strategy_and_inputs_and_no_source() -> None:
    found = problems(edit("    execution_strategy: PerPartition\n", ""))
    assert found == [
        "dag.yaml:11: jobs[1].execution_strategy: missing execution_strategy — a reactive job "
        "needs PerUpdate or PerPartition"
    ]
    text = edit(
        "    inputs:\n      - from: { job: follow, output_index: 0 }\n"
        "      - from: { dataset: transactions }\n"
        '        where: "value > 0"\n',
        "    source: { kind: manual }\n    bootstrap: { reset_outputs: true }\n",
    )
    assert problems(text) == [
        "dag.yaml:11: jobs[1].inputs: missing inputs — a reactive job needs at least one input",
        "dag.yaml:16: jobs[1].source: not allowed on a reactive job — a reactive job runs on its "
        "inputs' events",
        "dag.yaml:17: jobs[1].bootstrap: not allowed on a reactive job — bootstrap is for sources",
    ]


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        (
            "{ kind: cron }",
            "jobs[0].source.schedule: missing schedule — a cron source needs a schedule",
        ),
        (
            '{ kind: cron, schedule: "61 * * * *" }',
            "jobs[0].source.schedule: bad cron expression '61 * * * *': Bad minute — a schedule "
            "has five fields: minute hour day-of-month month day-of-week",
        ),
        (
            '{ kind: cron, schedule: "0 0 * * * *" }',
            "jobs[0].source.schedule: bad cron expression '0 0 * * * *': wrong number of fields",
        ),
        (
            '{ kind: cron, schedule: "0 0 * * *", timezone: Mars/Olympus }',
            "jobs[0].source.timezone: unknown timezone 'Mars/Olympus' — use an IANA zone",
        ),
        (
            '{ kind: always_on, schedule: "0 0 * * *" }',
            "jobs[0].source.schedule: not allowed for a always_on source — schedule is for cron",
        ),
        (
            "{ kind: hourly }",
            "jobs[0].source.kind: 'hourly' is not allowed — must be 'always_on', 'cron' or "
            "'manual'",
        ),
    ],
)
def test_cron_sources(source: str, expected: str) -> None:
    [line] = problems(edit("{ kind: always_on }", source))
    assert line.startswith(f"dag.yaml:7: {expected}"), line


def test_valid_cron_source() -> None:
    doc = parse_dag(
        edit(
            "{ kind: always_on }", '{ kind: cron, schedule: "0 6 * * 1-5", timezone: Europe/Paris }'
        ),
        file=F,
    )
    source = doc.spec.jobs[0].source
    assert source is not None and source.timezone == "Europe/Paris"


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("timeout_seconds", "soon", "bad duration 'soon'"),
        ("timeout_seconds", "5d", "bad duration '5d'"),
        ("timeout_seconds", "0", "duration 0 must be positive"),
        ("timeout_seconds", "-5", "duration -5 is negative"),
        ("heartbeat_timeout_seconds", "true", "a duration is an integer of seconds"),
        ("idle_timeout", "5 minutes", "bad duration '5 minutes'"),
        ("max_attempts", "0", "0 is too small — must be > 0"),
        ("scaling", "{ max_concurrency: 0 }", "0 is too small — must be > 0"),
        ("backpressure", "{ max_queue_depth: -1 }", "-1 is too small — must be > 0"),
        ("backpressure", "{ max_queue_age: 0s }", "duration '0s' must be positive"),
        ("backpressure", "{ priority_tier: urgent }", "'urgent' is not allowed"),
    ],
)
def test_bad_numbers_and_durations(field: str, value: str, expected: str) -> None:
    text = edit(
        "    execution_strategy: PerPartition\n",
        f"    execution_strategy: PerPartition\n    {field}: {value}\n",
    )
    [line] = problems(text)
    assert line.startswith(f"dag.yaml:16: jobs[1].{field}"), line
    assert expected in line, line


def test_output_range_rules() -> None:
    found = problems(
        edit(
            "      - dataset: blocks\n",
            "      - dataset: blocks\n        range: { start: 10, end: 5 }\n",
        )
    )
    assert found == [
        "dag.yaml:10: jobs[0].outputs[0].range.end: end 5 is before start 10 — a range is "
        "inclusive and must have start <= end"
    ]
    found = problems(
        edit(
            "      - dataset: blocks\n",
            "      - dataset: blocks\n        range: { start: -1, end: 5 }\n",
        )
    )
    assert found[0].startswith(
        "dag.yaml:10: jobs[0].outputs[0].range.start: -1 is too small — must be >= 0"
    )
    found = problems(
        edit(
            "      - dataset: blocks\n",
            f"      - dataset: blocks\n        range: {{ start: 0, end: {MAX_RANGE_BOUND + 1} }}\n",
        )
    )
    assert found[0].startswith(
        f"dag.yaml:10: jobs[0].outputs[0].range.end: {MAX_RANGE_BOUND + 1} is too large — "
        f"must be <= {MAX_RANGE_BOUND}"
    )


@pytest.mark.parametrize(
    ("where", "expected"),
    [
        ('""', "empty filter — a where filter must be a non-empty SQL predicate"),
        ('"   "', "empty filter"),
        (
            '"a = 1; DELETE FROM jobs"',
            "must not contain ';' — a where filter is one read-time SQL predicate (ADR 0007)",
        ),
        ("3", "3 is not a string"),
    ],
)
def test_where_filters(where: str, expected: str) -> None:
    [line] = problems(edit('"value > 0"', where))
    assert line.startswith(f"dag.yaml:19: jobs[1].inputs[1].where: {expected}"), line


def test_config_must_be_json_and_not_use_the_reserved_key() -> None:
    text = edit(
        "    source: { kind: always_on }\n",
        "    source: { kind: always_on }\n    config: { inputs_where: {}, ratio: .nan }\n",
    )
    assert problems(text) == [
        "dag.yaml:8: jobs[0].config.inputs_where: reserved key — 'inputs_where' is filled from the "
        "inputs' where filters",
        "dag.yaml:8: jobs[0].config.ratio: not a finite number — config must be JSON "
        "(no .nan or .inf)",
    ]
    [line] = problems(
        edit(
            "    source: { kind: always_on }\n",
            "    source: { kind: always_on }\n    config: { since: 2020-01-01 }\n",
        )
    )
    assert line.startswith("dag.yaml:8: jobs[0].config.since:")


def test_names_must_be_identifiers() -> None:
    [line] = problems(edit("dag: chain", "dag: 'my chain'"))
    assert line.startswith("dag.yaml:1: dag: invalid name 'my chain' — a name starts with a letter")


@pytest.mark.parametrize(
    ("text", "seconds"),
    [(30, 30), ("30", 30), ("30s", 30), ("5m", 300), ("2h", 7200), (0, 0), (" 7m ", 420)],
)
def test_parse_duration(text: object, seconds: int) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize(
    ("value", "stored"), [("never", "never"), ("0", "0"), (0, "0"), ("5m", "5m"), (90, "90s")]
)
def test_idle_timeout_is_normalized_text(value: object, stored: str) -> None:
    text = edit(
        "    execution_strategy: PerPartition\n",
        f"    execution_strategy: PerPartition\n    idle_timeout: {value}\n",
    )
    assert parse_dag(text, file=F).spec.jobs[1].idle_timeout == stored


# --- hashing ------------------------------------------------------------------


def spec_of(text: str) -> trace_core.dag.DagSpec:
    return parse_dag(text, file=F).spec


def test_yaml_hash_ignores_formatting_comments_defaults_and_org() -> None:
    base = yaml_hash(spec_of(BASE))
    reformatted = "# a comment\n" + BASE.replace(
        "{ kind: always_on }", "\n      kind: always_on  # inline\n"
    )
    assert yaml_hash(spec_of(reformatted)) == base
    assert yaml_hash(spec_of(edit("dag: chain\n", "dag: chain\norg: acme\n"))) == base
    explicit = edit(
        "    source: { kind: always_on }\n",
        "    source: { kind: always_on }\n    max_attempts: 3\n    update_strategy: replace\n",
    )
    assert yaml_hash(spec_of(explicit)) == base
    assert yaml_hash(spec_of(edit("value > 0", "value > 1"))) != base


def test_job_config_hash_covers_data_not_scheduling() -> None:
    base = job_config_hashes(spec_of(BASE))
    scaled = edit(
        "    execution_strategy: PerPartition\n",
        "    execution_strategy: PerPartition\n    scaling: { max_concurrency: 9 }\n"
        "    timeout_seconds: 5m\n    runtime: lambda\n",
        edit("    runtime: dispatcher\n    operator: range", "    operator: range"),
    )
    assert job_config_hashes(spec_of(scaled)) == base
    configured = edit(
        "    source: { kind: always_on }\n",
        "    source: { kind: always_on }\n    config: { chain_id: 2 }\n",
    )
    changed = job_config_hashes(spec_of(configured))
    assert changed["follow"] != base["follow"] and changed["aggregate"] == base["aggregate"]
    filtered = job_config_hashes(spec_of(edit("value > 0", "value > 1")))
    assert filtered["aggregate"] != base["aggregate"] and filtered["follow"] == base["follow"]


def test_dataset_version_hashes_cascade_downstream_only() -> None:
    text = BASE + textwrap.indent(
        textwrap.dedent(
            """\
            - name: alerts
              activation: reactive
              runtime: dispatcher
              operator: alert_evaluate
              execution_strategy: PerUpdate
              inputs: [{ from: { dataset: range_aggregates } }]
              outputs: [{ dataset: alerts }]
            """
        ),
        "  ",
    )
    base = dataset_version_hashes(spec_of(text))
    changed = dataset_version_hashes(spec_of(edit("value > 0", "value > 5", text)))
    assert changed["blocks"] == base["blocks"]
    assert changed["transactions"] == base["transactions"]
    assert changed["range_aggregates"] != base["range_aggregates"]
    assert changed["alerts"] != base["alerts"]
    assert len(set(base.values())) == 4


def test_reset_outputs_gives_fresh_versions_on_every_yaml_change() -> None:
    plain = dataset_version_hashes(spec_of(BASE))
    scaled = edit(
        "    execution_strategy: PerPartition\n",
        "    execution_strategy: PerPartition\n    scaling: { max_concurrency: 2 }\n",
    )
    assert dataset_version_hashes(spec_of(scaled)) == plain
    reset = edit(
        "    source: { kind: always_on }\n",
        "    source: { kind: always_on }\n    bootstrap: { reset_outputs: true }\n",
    )
    first = dataset_version_hashes(spec_of(reset))
    second = dataset_version_hashes(
        spec_of(
            edit(
                "    execution_strategy: PerPartition\n",
                "    execution_strategy: PerPartition\n    scaling: { max_concurrency: 2 }\n",
                reset,
            )
        )
    )
    assert all(first[name] != second[name] for name in first)
    assert dataset_version_hashes(spec_of(reset)) == first  # same YAML, same versions


# --- coverage -----------------------------------------------------------------


def as_set(ranges: list[tuple[int, int]]) -> set[int]:
    return {n for start, end in ranges for n in range(start, end + 1)}


small_ranges = st.lists(
    st.tuples(st.integers(0, 60), st.integers(0, 15)).map(lambda t: (t[0], t[0] + t[1])),
    max_size=8,
)


def test_merge_ranges_examples() -> None:
    assert merge_ranges([[0, 9], [10, 19], [30, 39], [35, 50]]) == [(0, 19), (30, 50)]
    assert merge_ranges([]) == []
    with pytest.raises(ValueError, match="ends before it starts"):
        merge_ranges([[5, 4]])


@given(small_ranges)
def test_merge_ranges_keeps_the_same_blocks_in_disjoint_sorted_intervals(
    ranges: list[tuple[int, int]],
) -> None:
    merged = merge_ranges(ranges)
    assert as_set(merged) == as_set(ranges)
    for (_, end), (start, _) in itertools.pairwise(merged):
        assert start > end + 1  # neither overlapping nor touching
    assert merge_ranges(merged) == merged


@given(small_ranges, small_ranges)
def test_covers_is_set_containment(new: list[tuple[int, int]], old: list[tuple[int, int]]) -> None:
    assert covers(Coverage(tuple(new)), Coverage(tuple(old))) == (as_set(old) <= as_set(new))


@given(st.none() | st.integers(0, 100), st.none() | st.integers(0, 100))
def test_covers_requires_the_cursor_to_have_caught_up(new: int | None, old: int | None) -> None:
    expected = old is None or (new is not None and new >= old)
    assert covers(Coverage(max_cursor=new), Coverage(max_cursor=old)) == expected


# --- public API and CLI -------------------------------------------------------


def test_public_names() -> None:
    assert sorted(trace_core.dag.__all__) == sorted(
        [
            "DEFAULT_OPERATORS",
            "DEFAULT_RUNTIMES",
            "INPUTS_WHERE_KEY",
            "LIVE_JOBS_CHANNEL",
            "BackpressureSpec",
            "BootstrapSpec",
            "CancelTasks",
            "Coverage",
            "DagDocument",
            "DagSpec",
            "DagValidationError",
            "DatasetPointer",
            "DeployResult",
            "InputRef",
            "InputSpec",
            "JobSpec",
            "LineMap",
            "LiveJob",
            "OutputSpec",
            "Problem",
            "Range",
            "RangeSpec",
            "RollbackResult",
            "ScalingSpec",
            "SourceSpec",
            "canonical_json",
            "check_dag",
            "covers",
            "dataset_version_hashes",
            "deploy",
            "job_config_hash",
            "job_config_hashes",
            "live_jobs",
            "load_dag",
            "merge_ranges",
            "parse_dag",
            "parse_duration",
            "read_coverage",
            "promote_if_caught_up",
            "rollback",
            "yaml_hash",
        ]
    )
    for name in trace_core.dag.__all__:
        assert getattr(trace_core.dag, name) is not None


def test_cli_validate_ok(capsys: pytest.CaptureFixture[str]) -> None:
    path = str(EXAMPLES / "chain_pipeline.yaml")
    assert main(["dag", "validate", path]) == 0
    assert capsys.readouterr().out == f"{path}: ok (3 jobs, 4 datasets)\n"


def test_cli_validate_reports_problems(capsys: pytest.CaptureFixture[str]) -> None:
    path = str(EXAMPLES / "invalid" / "references.yaml")
    assert main(["dag", "validate", path]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"{path}:10: jobs[1].name: duplicate job name 'follow'")
    assert out[-1] == "5 errors"


def test_cli_validate_syntax_error_and_missing_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = str(EXAMPLES / "invalid" / "syntax.yaml")
    assert main(["dag", "validate", path]) == 1
    assert capsys.readouterr().out.startswith(f"{path}:6: YAML syntax error")
    missing = str(tmp_path / "none.yaml")
    assert main(["dag", "validate", missing]) == 1
    captured = capsys.readouterr()
    assert (
        captured.out.startswith(f"{missing}: cannot read file") and "Traceback" not in captured.err
    )


def test_cli_validate_prints_warnings_but_succeeds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "ext.yaml"
    path.write_text(edit("{ dataset: transactions }", "{ dataset: prices }"))
    assert main(["dag", "validate", str(path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == [
        f"{path}:18: warning: jobs[1].inputs[1].from.dataset: dataset 'prices' is not produced in "
        "this DAG — it must be registered by another DAG when this one is deployed",
        f"{path}: ok (2 jobs, 3 datasets)",
    ]
