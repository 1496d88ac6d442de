"""Rematerializing a dataset: the DAG YAML that rebuilds it.

A rematerialization is a deploy like any other: the producing job's config
gets a fresh ``rematerialize`` token, which changes its config hash, so that
job and everything downstream get new dataset versions, built beside the
current ones from the inputs' history and swapped in atomically once caught
up (orchestration-data-model.md). Both ways in, ``trace-lite run
--rematerialize`` and ``POST /v1/datasets/{name}/rematerialize``, rewrite the
YAML here and then deploy it.
"""

from __future__ import annotations

import yaml

from trace_core.errors import ConfigurationError

__all__ = ["with_rematerialization"]


def with_rematerialization(text: str, dataset: str, token: str) -> str:
    """The DAG YAML with ``config.rematerialize = token`` on ``dataset``'s producer.

    Raises :class:`~trace_core.errors.ConfigurationError` when no job of the
    DAG produces ``dataset``.
    """
    doc = yaml.safe_load(text)
    for job in doc.get("jobs", []) if isinstance(doc, dict) else []:
        outputs = job.get("outputs", []) if isinstance(job, dict) else []
        if any(isinstance(o, dict) and o.get("dataset") == dataset for o in outputs):
            job["config"] = {**(job.get("config") or {}), "rematerialize": token}
            return str(yaml.safe_dump(doc, sort_keys=False))
    raise ConfigurationError(f"--rematerialize: no job of the DAG produces {dataset!r}")
