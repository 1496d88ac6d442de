"""The dataset buffer port: where producers publish records of buffered datasets.

Postgres-backed datasets can be written through a buffer and a sink
(interface-contracts.md "Buffered Postgres Datasets"): a producer task
publishes records, a platform-managed sink drains them, writes the table
idempotently and emits the dataset event. Producers never get Postgres
credentials; ``POST /v1/task/buffer-publish`` hands their records to a
:class:`DatasetBuffer`, after checking the task's capability and that the
dataset is one of the task's ``postgres_table`` outputs.

In the aws profile the buffer is an SQS queue per dataset
(``trace_aws.sqs_buffer``); the lite profile's is a table of its data database
(``trace_lite.buffered``). :class:`InMemoryDatasetBuffer` keeps the published
batches in memory for tests.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = ["BufferedBatch", "DatasetBuffer", "InMemoryDatasetBuffer"]


class DatasetBuffer(Protocol):
    """Accepts batches of records for a buffered dataset (SQS in production)."""

    async def publish(
        self,
        dataset_uuid: uuid.UUID,
        records: Sequence[Mapping[str, Any]],
        *,
        producer_task_id: uuid.UUID,
        attempt: int,
        schema_hash: str,
    ) -> None:
        """Durably accept ``records`` for ``dataset_uuid`` or raise.

        Delivery to the sink is at least once: the sink deduplicates (for
        instance on ``UNIQUE (org_id, dedupe_key)``), so a producer may
        publish the same batch again after an error. ``producer_task_id`` and
        ``attempt`` identify the producing attempt for auditing;
        ``schema_hash`` is the producer's record schema (the sink refuses a
        batch whose schema it does not know).
        """
        ...


@dataclass(frozen=True)
class BufferedBatch:
    """One published batch, as :class:`InMemoryDatasetBuffer` keeps it."""

    dataset_uuid: uuid.UUID
    schema_hash: str
    records: tuple[Mapping[str, Any], ...]
    producer_task_id: uuid.UUID
    attempt: int


class InMemoryDatasetBuffer:
    """A :class:`DatasetBuffer` that keeps every batch in memory (lite profile, tests).

    Nothing drains it yet: :meth:`batches` is how a test (or a future
    in-process sink) reads what was published. Thread-safe.
    """

    def __init__(self) -> None:
        self._batches: list[BufferedBatch] = []
        self._lock = threading.Lock()

    async def publish(
        self,
        dataset_uuid: uuid.UUID,
        records: Sequence[Mapping[str, Any]],
        *,
        producer_task_id: uuid.UUID,
        attempt: int,
        schema_hash: str,
    ) -> None:
        """Append the batch (see :meth:`DatasetBuffer.publish`)."""
        batch = BufferedBatch(dataset_uuid, schema_hash, tuple(records), producer_task_id, attempt)
        with self._lock:
            self._batches.append(batch)

    def batches(self, dataset_uuid: uuid.UUID | None = None) -> list[BufferedBatch]:
        """The published batches (of ``dataset_uuid`` only, if given), oldest first."""
        with self._lock:
            return [b for b in self._batches if dataset_uuid in (None, b.dataset_uuid)]
