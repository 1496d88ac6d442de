"""Content hashes of a DAG: the DAG version, each job, each dataset version.

All hashes are SHA-256 hex digests of canonical JSON (sorted keys, no
whitespace, UTF-8, no NaN), so they are stable across processes and engines.

- :func:`yaml_hash` hashes the *validated spec*, not the file bytes: the file
  is parsed, defaults are filled in, and the canonical JSON of the result is
  hashed. Whitespace, comments, key order, quoting style and spelling a
  default out (``max_attempts: 3``) do not create a new DAG version; any
  change of meaning does. The ``org:`` line is left out because the org is
  part of the version's identity already (and the CLI may override it).
- :func:`job_config_hash` covers what changes the data a job produces: the
  operator, its config, the execution strategy (it decides the unit of work),
  the input datasets and their ``where`` filters, the outputs' kinds and
  ranges, ``update_strategy`` and ``unique_key``. Scheduling knobs (runtime,
  scaling, backpressure, timeouts, attempts, idle timeout, cron schedule) are
  left out: changing them never rebuilds data.
- :func:`dataset_version_hashes` gives each output the hash of its producer's
  config hash, its output index, kind and range, and the hashes of the
  dataset versions the producer reads, so a change upstream cascades a new
  version to every dataset downstream in the DAG. An input produced by
  another DAG contributes its *name*, not its version: a consumer follows its
  producer's current version (the same YAML must always hash the same, since
  ``dag_versions`` is unique per ``yaml_hash``). A source with
  ``bootstrap.reset_outputs: true`` also mixes in the ``yaml_hash``, so every
  deploy that changes the YAML starts its outputs (and everything downstream)
  over in fresh versions.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

from trace_core.dag.spec import DagSpec, JobSpec

__all__ = [
    "canonical_json",
    "dataset_version_hashes",
    "job_config_hash",
    "job_config_hashes",
    "job_input_datasets",
    "yaml_hash",
]


def canonical_json(value: Any) -> str:
    """JSON with sorted keys and no whitespace; refuses NaN and infinities."""
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    )


def _sha256(value: Any) -> str:
    return hashlib.sha256(canonical_json(value).encode("utf-8")).hexdigest()


def yaml_hash(spec: DagSpec) -> str:
    """The DAG version's identity: the hash of the normalized spec (not the bytes)."""
    return _sha256(spec.model_dump(mode="json", by_alias=True, exclude={"org"}))


def job_input_datasets(spec: DagSpec, job: JobSpec) -> list[str]:
    """The dataset names a job reads, in input order (``{job, output_index}`` resolved)."""
    by_name = {j.name: j for j in spec.jobs}
    names = []
    for edge in job.inputs:
        ref = edge.from_
        if ref.job is not None:
            upstream = by_name[ref.job]
            names.append(upstream.outputs[ref.output_index or 0].dataset)
        else:
            names.append(ref.dataset or "")
    return names


def job_config_hash(job: JobSpec, input_datasets: Sequence[str]) -> str:
    """What changes the data ``job`` produces (see the module docstring)."""
    return _sha256(
        {
            "operator": job.operator,
            "config": job.config,
            "execution_strategy": job.execution_strategy,
            "inputs": [
                {"dataset": name, "where": edge.where}
                for name, edge in zip(input_datasets, job.inputs, strict=True)
            ],
            "outputs": [
                {
                    "kind": o.kind,
                    "range": None if o.range is None else [o.range.start, o.range.end],
                }
                for o in job.outputs
            ],
            "update_strategy": job.update_strategy,
            "unique_key": None if job.unique_key is None else list(job.unique_key),
        }
    )


def job_config_hashes(spec: DagSpec) -> dict[str, str]:
    """Job name -> :func:`job_config_hash` for a valid spec."""
    return {job.name: job_config_hash(job, job_input_datasets(spec, job)) for job in spec.jobs}


def dataset_version_hashes(spec: DagSpec, *, dag_yaml_hash: str | None = None) -> dict[str, str]:
    """Dataset name -> config hash of the version this spec produces, for a valid spec.

    ``dag_yaml_hash`` defaults to :func:`yaml_hash` of ``spec``; it only
    matters for sources with ``bootstrap.reset_outputs``.
    """
    reset_token = dag_yaml_hash if dag_yaml_hash is not None else yaml_hash(spec)
    jobs = {job.name: job for job in spec.jobs}
    producer = spec.produced()
    config = job_config_hashes(spec)
    out: dict[str, str] = {}

    def resolve(dataset: str, visiting: frozenset[str]) -> str:
        if dataset in out:
            return out[dataset]
        if dataset not in producer:
            return f"external:{dataset}"
        job = jobs[producer[dataset][0]]
        if job.name in visiting:  # validation rejects cycles; never loop on a bad spec
            raise ValueError(f"cycle through job '{job.name}'")
        inputs = [resolve(name, visiting | {job.name}) for name in job_input_datasets(spec, job)]
        reset = job.bootstrap is not None and job.bootstrap.reset_outputs
        for index, output in enumerate(job.outputs):
            out.setdefault(
                output.dataset,
                _sha256(
                    {
                        "job": config[job.name],
                        "output_index": index,
                        "kind": output.kind,
                        "range": (
                            None if output.range is None else [output.range.start, output.range.end]
                        ),
                        "inputs": inputs,
                        "reset": reset_token if reset else None,
                    }
                ),
            )
        return out[dataset]

    for dataset in producer:
        resolve(dataset, frozenset())
    return out
