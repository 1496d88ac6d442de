"""The YAML DAG format, as frozen pydantic models.

A DAG file declares one DAG (``dag:``) of jobs. Every column of the ``jobs``
table has a field here; the mapping is in :mod:`trace_core.dag.deploy`.

.. code-block:: yaml

    dag: chain                     # the dag_name
    org: default                   # optional org slug (CLI --org overrides)
    jobs:
      - name: follow
        activation: source         # source | reactive
        runtime: dispatcher        # dispatcher | lambda | ecs_platform | ecs_udf
        operator: block_follower
        source: {kind: always_on}  # | {kind: cron, schedule: "*/5 * * * *", timezone: UTC}
                                   # | {kind: manual}
        bootstrap: {reset_outputs: false}
        config: {chain_id: 1}      # operator config, any JSON
        outputs:
          - dataset: blocks
            kind: parquet          # parquet (default) | postgres_table
            range: {start: 0, end: 99999}   # optional block-range metadata
        update_strategy: replace   # replace (default) | append (needs unique_key)
        unique_key: [org_id, dedupe_key]
        timeout_seconds: 1h        # durations: 30s, 5m, 2h or an integer of seconds
        heartbeat_timeout_seconds: 60
        max_attempts: 3
      - name: aggregate
        activation: reactive
        runtime: dispatcher
        operator: range_aggregator
        execution_strategy: PerPartition   # PerUpdate | PerPartition
        idle_timeout: 5m                   # never | 0 | a duration
        inputs:
          - from: {job: follow, output_index: 0}   # output_index defaults to 0
          - from: {dataset: transactions}          # by name: this DAG or the registry
            where: "value > 0"                     # read-time SQL predicate (ADR 0007)
        outputs: [{dataset: range_aggregates}]
        scaling: {max_concurrency: 4}
        backpressure: {max_queue_depth: 1000, max_queue_age: 10m, priority_tier: normal}

Structure (types, allowed values, unknown keys, positive numbers, durations,
``where`` syntax) is checked here; rules that relate several fields or jobs
are in :mod:`trace_core.dag.validate`, and so are the "at least one" rules
(pydantic would also report those, confusingly, when an item of the list is
invalid). Scalars are strict: ``"3"`` is not an integer and ``yes`` is not a
string, so a YAML surprise is an error, not a silent coercion.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    JsonValue,
    StrictBool,
    StrictInt,
    StrictStr,
)

from trace_core.limits import MAX_RANGE_BOUND

__all__ = [
    "DEFAULT_OPERATORS",
    "DEFAULT_RUNTIMES",
    "BackpressureSpec",
    "BootstrapSpec",
    "DagSpec",
    "InputRef",
    "InputSpec",
    "JobSpec",
    "OutputSpec",
    "RangeSpec",
    "ScalingSpec",
    "SourceSpec",
    "parse_duration",
]

DEFAULT_RUNTIMES: frozenset[str] = frozenset({"dispatcher", "lambda", "ecs_platform", "ecs_udf"})
"""The runtimes the Dispatcher knows how to execute (dispatcher.md, Runtime Registry)."""

DEFAULT_OPERATORS: frozenset[str] = frozenset(
    {"alert_evaluate", "block_follower", "cron_tick", "noop", "range_aggregator", "report_builder"}
)
"""Operator names accepted when the caller passes no operator registry."""

_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_-]{0,127}")
_DURATION = re.compile(r"(\d+)([smh]?)")
_UNIT_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600}


def _name(value: str) -> str:
    if not _NAME.fullmatch(value):
        raise ValueError(
            f"invalid name {value!r} — a name starts with a letter and has only letters, "
            "digits, '_' and '-' (at most 128 characters)"
        )
    return value


Name = Annotated[StrictStr, AfterValidator(_name)]
"""A DAG, job, dataset or org name."""


def parse_duration(value: Any) -> int:
    """Seconds in a duration: an integer of seconds, or ``30s`` / ``5m`` / ``2h``."""
    if isinstance(value, bool):  # YAML `yes` must not become 1 second
        raise ValueError("a duration is an integer of seconds or a string like 30s, 5m, 2h")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"duration {value} is negative — a duration must be >= 0")
        return value
    if isinstance(value, str):
        match = _DURATION.fullmatch(value.strip())
        if match:
            return int(match.group(1)) * _UNIT_SECONDS[match.group(2)]
    raise ValueError(
        f"bad duration {value!r} — a duration is an integer of seconds or a string like 30s, 5m, 2h"
    )


def _positive_duration(value: Any) -> int:
    seconds = parse_duration(value)
    if seconds <= 0:
        raise ValueError(f"duration {value!r} must be positive")
    return seconds


def _idle_timeout(value: Any) -> str:
    # Stored as text in jobs.idle_timeout ('never', '0', '5m'): keep what the
    # author wrote, normalized, so explain output reads like the YAML.
    if value == "never":
        return "never"
    seconds = parse_duration(value)
    if seconds == 0:
        return "0"
    return value.strip() if isinstance(value, str) else f"{seconds}s"


def _where(value: str) -> str:
    if not value.strip():
        raise ValueError("empty filter — a where filter must be a non-empty SQL predicate")
    if ";" in value:
        raise ValueError(
            "must not contain ';' — a where filter is one read-time SQL predicate (ADR 0007)"
        )
    return value.strip()


Duration = Annotated[int, BeforeValidator(_positive_duration)]
"""A positive duration in seconds (``30s``, ``5m``, ``2h`` or an integer)."""
IdleTimeout = Annotated[str, BeforeValidator(_idle_timeout)]
PositiveInt = Annotated[StrictInt, Field(gt=0)]
NonNegativeInt = Annotated[StrictInt, Field(ge=0)]
Where = Annotated[StrictStr, AfterValidator(_where)]


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=False)


class SourceSpec(_Spec):
    """How a source job is started: always on, on a cron schedule, or by hand."""

    kind: Literal["always_on", "cron", "manual"]
    schedule: StrictStr | None = None
    """Five-field cron expression (cron sources only)."""
    timezone: StrictStr | None = None
    """IANA zone the schedule is read in (cron sources only; default UTC)."""


class BootstrapSpec(_Spec):
    """Source bootstrap options."""

    reset_outputs: StrictBool = False
    """Start the outputs over on every deploy that changes the YAML: each such
    deploy gets fresh dataset versions for this source and everything downstream."""


RangeBound = Annotated[StrictInt, Field(ge=0, le=MAX_RANGE_BOUND)]


class RangeSpec(_Spec):
    """Inclusive block range an output covers (``dataset_versions.range_*``)."""

    start: RangeBound
    end: RangeBound


class OutputSpec(_Spec):
    """One output of a job: a named dataset."""

    dataset: Name
    kind: Literal["parquet", "postgres_table"] = "parquet"
    range: RangeSpec | None = None


class InputRef(_Spec):
    """Where an input comes from: ``{job, output_index}`` or ``{dataset}``."""

    job: Name | None = None
    output_index: NonNegativeInt | None = None
    dataset: Name | None = None


class InputSpec(_Spec):
    """One input edge, with an optional read-time filter."""

    from_: InputRef = Field(alias="from")
    where: Where | None = None


class ScalingSpec(_Spec):
    """Concurrency limits (``jobs.scaling``)."""

    max_concurrency: PositiveInt | None = None


class BackpressureSpec(_Spec):
    """Queue thresholds that pause upstream producers (dispatcher.md, Backpressure)."""

    max_queue_depth: PositiveInt | None = None
    max_queue_age: Duration | None = None
    priority_tier: Literal["normal", "bulk"] = "normal"


class JobSpec(_Spec):
    """One job: a row of ``jobs``."""

    name: Name
    activation: Literal["source", "reactive"]
    runtime: StrictStr
    operator: StrictStr
    source: SourceSpec | None = None
    bootstrap: BootstrapSpec | None = None
    execution_strategy: Literal["PerUpdate", "PerPartition"] | None = None
    idle_timeout: IdleTimeout | None = None
    config: dict[str, JsonValue] = Field(default_factory=dict)
    inputs: tuple[InputSpec, ...] = ()
    outputs: tuple[OutputSpec, ...] = ()
    update_strategy: Literal["replace", "append"] = "replace"
    unique_key: tuple[StrictStr, ...] | None = None
    scaling: ScalingSpec | None = None
    backpressure: BackpressureSpec | None = None
    timeout_seconds: Duration | None = None
    heartbeat_timeout_seconds: Duration | None = None
    max_attempts: PositiveInt = 3


class DagSpec(_Spec):
    """A whole DAG file."""

    dag: Name
    org: Name | None = None
    jobs: tuple[JobSpec, ...] = ()

    def produced(self) -> dict[str, tuple[str, int]]:
        """Dataset name -> (job name, output index), first producer wins."""
        out: dict[str, tuple[str, int]] = {}
        for job in self.jobs:
            for index, output in enumerate(job.outputs):
                out.setdefault(output.dataset, (job.name, index))
        return out
