"""Column lineage values without Spark: the declared form, the result form an
operator reports, alert_evaluate's lineage and the OpenLineage run event."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any

import pytest

from trace_core.dag.lineage import (
    DIRECT_KINDS,
    INDIRECT_KINDS,
    ColumnEdge,
    lineage_output,
    parse_declared,
    take_lineage,
)
from trace_core.errors import InvalidInput
from trace_core.storage.ports import LineageRow
from trace_lite.lineage_openlineage import openlineage_events
from trace_lite.pipeline.operators import alert_lineage, alert_rules

# The required fields of the published schemas: OpenLineage.json (RunEvent,
# Run, Job, Dataset, BaseFacet) and ColumnLineageDatasetFacet.json 1-2-0.
RUN_EVENT = ("eventTime", "producer", "schemaURL", "run", "job")
FACET = ("_producer", "_schemaURL", "fields")
INPUT_FIELD = ("namespace", "name", "field")


def check_run_event(event: dict[str, Any]) -> None:
    """``event`` has every field the spec requires, with the right types."""
    assert all(k in event for k in RUN_EVENT), event.keys()
    assert event["eventType"] in ("START", "RUNNING", "COMPLETE", "ABORT", "FAIL", "OTHER")
    datetime.fromisoformat(event["eventTime"])
    uuid.UUID(event["run"]["runId"])
    assert isinstance(event["job"]["namespace"], str) and isinstance(event["job"]["name"], str)
    for dataset in [*event["inputs"], *event["outputs"]]:
        assert isinstance(dataset["namespace"], str) and isinstance(dataset["name"], str)
    for output in event["outputs"]:
        facet = output["facets"]["columnLineage"]
        assert all(k in facet for k in FACET)
        assert facet["_schemaURL"].endswith(
            "ColumnLineageDatasetFacet.json#/$defs/ColumnLineageDatasetFacet"
        )
        sources = [f for field in facet["fields"].values() for f in field["inputFields"]]
        for source in [*sources, *facet.get("dataset", [])]:
            assert all(isinstance(source[k], str) for k in INPUT_FIELD)
            for t in source.get("transformations", []):
                assert t["type"] in ("DIRECT", "INDIRECT")
                assert t.get("subtype", "") in ("", *DIRECT_KINDS, *INDIRECT_KINDS)
                subtypes = DIRECT_KINDS if t["type"] == "DIRECT" else INDIRECT_KINDS
                assert "subtype" not in t or t["subtype"] in subtypes


def test_declared_lineage_is_validated_naming_the_field() -> None:
    edges = parse_declared(
        {
            "total": ["orders.amount", {"from": "orders.*", "kind": "AGGREGATION"}],
            "*": [{"from": "orders.status", "kind": "FILTER"}],
        },
        inputs=["orders"],
    )
    assert edges == [
        ColumnEdge("*", "orders", "status", "FILTER"),
        ColumnEdge("total", "orders", "*", "AGGREGATION"),
        ColumnEdge("total", "orders", "amount", "TRANSFORMATION"),
    ]
    bad = [
        ({"x": ["customers.id"]}, "lineage.x[0]", "not an input"),
        ({"x": "orders.id"}, "lineage.x", "non-empty list"),
        ({"x": ["orders"]}, "lineage.x[0]", "dataset.column"),
        ({"x": [{"from": "orders.id", "kind": "MAGIC"}]}, "lineage.x[0].kind", "must be one of"),
        ({"*": ["orders.id"]}, "lineage.*[0]", "indirect"),
        ({"x": [{"from": "orders.id", "kind": "FILTER"}]}, "lineage.x[0].from", "under '*'"),
    ]
    for raw, field, reason in bad:
        with pytest.raises(InvalidInput) as caught:
            parse_declared(raw, inputs=["orders"])
        assert caught.value.field == field and reason in str(caught.value), raw


def test_the_result_form_round_trips_and_leaves_the_outputs_clean() -> None:
    ids = {"orders": uuid.uuid4()}
    out = uuid.uuid4()
    rows = lineage_output([ColumnEdge("total", "orders", "amount", "AGGREGATION")], ids)
    kept, found = take_lineage([{"rows": 3, "lineage": rows}], [out])
    assert kept == [{"rows": 3}]
    (item,) = found
    assert item.dataset_uuid == out
    assert item.edges == (ColumnEdge("total", str(ids["orders"]), "amount", "AGGREGATION"),)
    with pytest.raises(InvalidInput, match="the task has 0 outputs"):
        take_lineage([{"lineage": rows}], [])
    with pytest.raises(InvalidInput) as caught:
        take_lineage([{"lineage": [["total", "not-a-uuid", "amount", "IDENTITY"]]}], [out])
    assert caught.value.field == "outputs[0].lineage[0][1]"


def test_alert_lineage_follows_the_rules_and_the_where() -> None:
    rules = alert_rules(
        {
            "rules": [
                {"name": "busy", "metric": "tx_count", "above": 5},
                {"name": "gas", "metric": "max_gas_price", "above": 9},
            ]
        }
    )
    got = {
        (e.output_column, e.input_column) for e in alert_lineage("agg", rules, "success_count > 1")
    }
    assert got == {
        ("block_number", "block_number"),
        ("dedupe_key", "block_number"),
        ("value", "tx_count"),
        ("value", "max_gas_price"),
        ("*", "tx_count"),
        ("*", "max_gas_price"),
        ("*", "success_count"),
    }


def test_the_openlineage_event_has_the_facet_shape() -> None:
    ds_in, ds_out, job, version = uuid.uuid4(), uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    rows = [
        LineageRow(
            1, "agg", "total", "orders", "amount", ds_out, ds_in, job, "AGGREGATION", version
        ),
        LineageRow(1, "agg", "*", "orders", "status", ds_out, ds_in, job, "FILTER", version),
        LineageRow(1, "agg", "*", "orders", "day", ds_out, ds_in, job, "GROUP_BY", version),
        LineageRow(1, "agg", "*", "orders", "day", ds_out, ds_in, job, "JOIN", version),
        # recorded before kinds were kept: a type without subtype
        LineageRow(1, "agg", "count", "orders", "id", ds_out, ds_in, job, "DIRECT", version),
    ]
    (event,) = openlineage_events(
        rows, org="acme", jobs={job: "shop.aggregate"}, event_time=datetime.now(UTC)
    )
    check_run_event(event)
    facets = event["outputs"][0]["facets"]
    facet = facets["columnLineage"]
    source = {"namespace": "trace://acme", "name": "orders"}
    assert facet["fields"] == {
        "total": {
            "inputFields": [
                {
                    **source,
                    "field": "amount",
                    "transformations": [{"type": "DIRECT", "subtype": "AGGREGATION"}],
                }
            ]
        },
        "count": {
            "inputFields": [{**source, "field": "id", "transformations": [{"type": "DIRECT"}]}]
        },
    }
    # one entry per input field, with each of its kinds
    assert facet["dataset"] == [
        {
            **source,
            "field": "day",
            "transformations": [
                {"type": "INDIRECT", "subtype": "GROUP_BY"},
                {"type": "INDIRECT", "subtype": "JOIN"},
            ],
        },
        {
            **source,
            "field": "status",
            "transformations": [{"type": "INDIRECT", "subtype": "FILTER"}],
        },
    ]
    assert facets["version"]["datasetVersion"] == str(version)
    assert facets["version"]["_schemaURL"].endswith("DatasetVersionDatasetFacet")
    assert event["job"]["name"] == "shop.aggregate"
    assert event["inputs"] == [{"namespace": "trace://acme", "name": "orders"}]
