"""DAGs: the YAML format, validation, hashing, deploy, activation and rollback.

Read a file with :func:`load_dag` (every problem is reported at once, with
file, line and field), deploy it with :func:`deploy`, promote a building
version with :func:`promote_if_caught_up`, undo a deploy with
:func:`rollback`; the Dispatcher reads what to run with :func:`live_jobs`.
"""

from typing import TYPE_CHECKING

from trace_core.lazy_exports import attach

if TYPE_CHECKING:
    from trace_core.dag.activation import (
        CancelTasks,
        RollbackResult,
        promote_if_caught_up,
        rollback,
    )
    from trace_core.dag.coverage import Coverage, Range, covers, merge_ranges, read_coverage
    from trace_core.dag.deploy import DatasetPointer, DeployResult, deploy
    from trace_core.dag.hashing import (
        canonical_json,
        dataset_version_hashes,
        job_config_hash,
        job_config_hashes,
        yaml_hash,
    )
    from trace_core.dag.live import LIVE_JOBS_CHANNEL, LiveJob, live_jobs
    from trace_core.dag.loader import DagDocument, load_dag, parse_dag
    from trace_core.dag.problems import DagValidationError, LineMap, Problem
    from trace_core.dag.spec import (
        DEFAULT_OPERATORS,
        DEFAULT_RUNTIMES,
        BackpressureSpec,
        BootstrapSpec,
        DagSpec,
        InputRef,
        InputSpec,
        JobSpec,
        OutputSpec,
        RangeSpec,
        ScalingSpec,
        SourceSpec,
        parse_duration,
    )
    from trace_core.dag.validate import INPUTS_WHERE_KEY, check_dag

__all__ = [
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
    "promote_if_caught_up",
    "read_coverage",
    "rollback",
    "yaml_hash",
]

__getattr__, __dir__ = attach(__name__, __file__)
