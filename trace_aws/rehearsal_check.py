"""The rehearsal's outputs: rows per dataset for the summary, and the check
against the pyarrow reference (:mod:`trace_aws.rehearsal`)."""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

import anyio
import yaml

from trace_aws.rehearsal_aws import aws_client
from trace_lite.run_command import RunSummary

__all__ = ["check_outputs", "rows_of"]


def rows_of(endpoint: str, database_url: str) -> Callable[[Any], Any]:
    """``rows(status)`` for the summary: Parquet footers in S3, or the table's count."""
    import pyarrow.parquet as pq

    from trace_lite.buffered import DataDatabase
    from trace_lite.status import table_rows

    s3 = aws_client("s3", endpoint)

    def object_rows(location: str) -> int:
        bucket, _, prefix = location.removeprefix("s3://").partition("/")
        rows = 0
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            for item in page.get("Contents", []):
                if item["Key"].endswith(".parquet"):
                    body = s3.get_object(Bucket=bucket, Key=item["Key"])["Body"].read()
                    rows += pq.read_metadata(io.BytesIO(body)).num_rows
        return rows

    async def rows(status: Any) -> int:
        if status.location.startswith("s3://"):
            return await anyio.to_thread.run_sync(object_rows, status.location)
        data = DataDatabase(database_url)
        try:
            return await table_rows(data, status.location)
        finally:
            await data.close()

    return rows


def check_outputs(
    endpoint: str, dag_text: str, summary: RunSummary, statuses: list[Any]
) -> list[str]:
    """What differs from the pyarrow reference: each partition of the Parquet
    datasets (exactly the Cryo-named objects, no other), and the alert count."""
    import pyarrow.parquet as pq

    from trace_lite.pipeline.chain import BLOCK_SCHEMA, TRANSACTION_SCHEMA, SyntheticChain, conform
    from trace_lite.pipeline.cryo import partition_ranges, partition_uri
    from trace_lite.pipeline.operators import alert_records, alert_rules
    from trace_lite.pipeline.predicate import parse_where
    from trace_lite.pipeline.reference import reference_aggregates
    from trace_lite.pipeline.transforms import AGGREGATE_SCHEMA

    jobs = {j["name"]: j for j in yaml.safe_load(dag_text)["jobs"]}
    follow, aggregate, alerts = jobs["follow"], jobs["aggregate"], jobs["alerts"]
    config = follow["config"]
    chain = SyntheticChain(
        seed=config["seed"],
        chain_id=config["chain_id"],
        mean_txs_per_block=config["mean_txs_per_block"],
    )
    span = follow["outputs"][0]["range"]
    ranges = partition_ranges(int(span["start"]), int(span["end"]), int(config["partition_size"]))
    where = aggregate["inputs"][1]["where"]
    s3 = aws_client("s3", endpoint)
    current = {s.name: s for s in statuses if s.dag_version_status == "current"}
    mismatches: list[str] = []
    schemas = {
        "blocks": BLOCK_SCHEMA,
        "transactions": TRANSACTION_SCHEMA,
        "range_aggregates": AGGREGATE_SCHEMA,
    }
    for name in schemas:
        if name not in current:
            mismatches.append(f"{name}: no current version")
            continue
        location = current[name].location
        bucket, _, prefix = location.removeprefix("s3://").partition("/")
        listed = s3.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])
        expected_keys = sorted(
            partition_uri(location, name, a, b).removeprefix(f"s3://{bucket}/") for a, b in ranges
        )
        if sorted(item["Key"] for item in listed) != expected_keys:
            mismatches.append(f"{name}: the objects are not one per partition")
    alert_where = parse_where(alerts["inputs"][0]["where"]).to_arrow()
    rules = alert_rules(alerts["config"])
    expected_alerts = 0
    for start, end in ranges:
        reference = reference_aggregates(chain, start, end, transactions_where=where)
        expected = {
            "blocks": chain.blocks(start, end),
            "transactions": chain.transactions(start, end),
            "range_aggregates": reference,
        }
        for name, schema in schemas.items():
            if name not in current:
                continue
            uri = partition_uri(current[name].location, name, start, end)
            bucket, _, key = uri.removeprefix("s3://").partition("/")
            try:
                body = s3.get_object(Bucket=bucket, Key=key)["Body"].read()
            except s3.exceptions.NoSuchKey:
                mismatches.append(f"{uri}: missing")
                continue
            if not conform(pq.read_table(io.BytesIO(body)), schema).equals(expected[name]):
                mismatches.append(f"{uri}: differs from the reference")
        selected = reference.filter(alert_where)
        expected_alerts += len(alert_records(selected, rules, f"{start}-{end}"))
    if summary.alerts != expected_alerts:
        mismatches.append(f"alerts: {summary.alerts} rows, the reference has {expected_alerts}")
    return mismatches
