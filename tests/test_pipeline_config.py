"""The pipeline operators' configuration and the ``run`` command's DAG rewrites
(no Spark, no database)."""

from __future__ import annotations

import pytest
import yaml

from tests.lite_pipeline import EXAMPLE
from trace_core.errors import ConfigurationError, InvalidInput
from trace_lite.pipeline.operators import AlertRule, _chain_head, alert_rules
from trace_lite.run_command import with_block_count, with_rematerialization


def test_alert_rules_long_and_short_forms() -> None:
    assert alert_rules({"threshold": 100, "severity": "critical"}) == [
        AlertRule("threshold", "tx_count", 100.0, "critical")
    ]
    rules = alert_rules({"rules": [{"name": "busy", "metric": "failed_count", "above": 3}]})
    assert rules == [AlertRule("busy", "failed_count", 3.0, "warning")]


@pytest.mark.parametrize(
    ("config", "field"),
    [
        ({}, "config.rules"),
        ({"rules": []}, "config.rules"),
        ({"rules": ["x"]}, "config.rules[0]"),
        ({"rules": [{"metric": "tx_count", "above": 1}]}, "config.rules[0].name"),
        ({"rules": [{"name": "a", "metric": "colour", "above": 1}]}, "config.rules[0].metric"),
        ({"rules": [{"name": "a", "metric": "tx_count", "above": True}]}, "config.rules[0].above"),
        (
            {"rules": [{"name": "a", "metric": "tx_count", "above": 1, "severity": ""}]},
            "config.rules[0].severity",
        ),
    ],
)
def test_bad_alert_rules_name_the_field(config: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidInput) as caught:
        alert_rules(config)
    assert caught.value.field == field


def test_chain_head_with_history_or_growing_live() -> None:
    # A chain with history: the head is past the range by the confirmation depth.
    assert _chain_head({"confirmations": 5}, 0, 999, elapsed=0.0) == 1004
    # A live chain grows from the range start at blocks_per_second.
    assert _chain_head({"blocks_per_second": 10}, 100, 999, elapsed=0.0) == 100
    assert _chain_head({"blocks_per_second": 10}, 100, 999, elapsed=2.5) == 125
    with pytest.raises(InvalidInput, match="blocks_per_second"):
        _chain_head({"blocks_per_second": 0}, 0, 9, elapsed=1.0)


def test_block_count_and_rematerialization_rewrite_the_dag() -> None:
    text = EXAMPLE.read_text()
    doc = yaml.safe_load(with_block_count(text, 5000))
    follow = next(j for j in doc["jobs"] if j["name"] == "follow")
    assert [o["range"] for o in follow["outputs"]] == [{"start": 0, "end": 4999}] * 2

    doc = yaml.safe_load(with_rematerialization(text, "range_aggregates", "t1"))
    aggregate = next(j for j in doc["jobs"] if j["name"] == "aggregate")
    assert aggregate["config"] == {"rematerialize": "t1"}
    with pytest.raises(ConfigurationError, match="no job of the DAG produces 'nope'"):
        with_rematerialization(text, "nope", "t1")
    with pytest.raises(ConfigurationError, match="--blocks must be >= 1"):
        with_block_count(text, 0)
