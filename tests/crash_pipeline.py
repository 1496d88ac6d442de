"""A lite platform whose worker dies in the middle of a partition, run by
``tests/test_lite_pipeline.py``.

    python tests/crash_pipeline.py '<JSON config>'

It runs the pipeline DAG ``config["dag"]`` on ``config["url"]`` with data
directory ``config["data_dir"]``; its ``crashing_range_aggregator`` operator
runs ``range_aggregator`` for every partition but ``config["partition"]``,
where it leaves a half-written Spark staging directory in the output prefix
(as a write cut off mid-way does) and kills the process with ``SIGKILL``: no
cleanup, no lease release, no connection close. The parent sees exit status
``-SIGKILL`` only if that point was reached.
"""

from __future__ import annotations

import json
import sys
import uuid
from pathlib import Path
from typing import Any

import anyio

from tests.crash_dispatcher import die
from tests.spark_fixtures import TEST_SPARK_CONFIG
from trace_core.authoring.context import TaskContext
from trace_core.authoring.operators import OperatorSpec
from trace_core.dispatcher.reaper import ReaperConfig
from trace_core.dispatcher.service import DispatcherConfig
from trace_core.dispatcher.sources import SourceConfig
from trace_lite.buffered import SinkConfig
from trace_lite.platform import LiteConfig, TraceLite
from trace_lite.spark import SparkConfig, SparkSessionProvider

CRASHING = "crashing_range_aggregator"


def crashing_platform(
    config: dict[str, Any], partition: str | None, spark: SparkSessionProvider | None = None
) -> TraceLite:
    """A platform whose ``crashing_range_aggregator`` is ``range_aggregator``,
    except that it dies on ``partition`` (never, when ``None``)."""

    def run(ctx: TaskContext) -> Any:
        if ctx.inputs[0].get("partition_key") == partition:
            location = ctx.outputs[0]["location"].removeprefix("s3://")
            staging = lite.config.data_dir / "objects" / location / f"._staging-{uuid.uuid4()}"
            staging.mkdir(parents=True)
            (staging / "part-00000.parquet").write_bytes(b"PAR1 half written")
            die(f"mid-partition {partition}")
        return lite.dispatcher.operators.get("range_aggregator").run(ctx)

    lite = TraceLite(lite_config(config), operators=[OperatorSpec(CRASHING, run)], spark=spark)
    return lite


def lite_config(config: dict[str, Any]) -> LiteConfig:
    """The platform settings both the dying and the recovering process use."""
    return LiteConfig(
        data_dir=Path(config["data_dir"]),
        database_url=config["url"],
        workers=3,
        # The tests' JVM flags: this process's own JVM is a test JVM too.
        spark=SparkConfig(master="local[1]", conf=dict(TEST_SPARK_CONFIG.conf)),
        dispatcher=DispatcherConfig(
            sources=SourceConfig(interval_seconds=0.2),
            reaper=ReaperConfig(interval_seconds=0.5),
        ),
        sink=SinkConfig(interval_seconds=0.1),
        drain_seconds=30,
    )


async def main(config: dict[str, Any]) -> None:
    """Deploy and run until the crash point kills this process."""
    async with crashing_platform(config, config["partition"]) as lite:
        await lite.deploy(Path(config["dag"]))
        await anyio.sleep_forever()


if __name__ == "__main__":
    anyio.run(main, json.loads(sys.argv[1]))
