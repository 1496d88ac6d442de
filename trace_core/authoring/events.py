"""The wire shape of upstream events, as operators and workers build them.

An event says that a dataset version materialized one unit of work: a cursor
position or a partition (``{start}-{end}``, inclusive, for block ranges;
dispatcher.md, "Event Model"). Values are checked where they enter: an event
that does not fit its columns is refused here, naming the field, not by the
database later. The Dispatcher's acceptance of events
(:mod:`trace_core.dispatcher.events`) takes these values.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from trace_core.errors import InvalidInput
from trace_core.limits import MAX_BIGINT, MAX_RANGE_BOUND

__all__ = ["AcceptResult", "DatasetEvent", "parse_events"]

_MAX_TEXT = 256


def _as_uuid(value: object, field: str) -> uuid.UUID:
    if isinstance(value, uuid.UUID):
        return value
    if not isinstance(value, str):
        raise InvalidInput(field, "must be a UUID string")
    try:
        return uuid.UUID(value)
    except ValueError:
        raise InvalidInput(field, f"{value[:64]!r} is not a UUID") from None


def _as_int(value: object, field: str, top: int = MAX_BIGINT) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidInput(field, "must be an integer")
    if not 0 <= value <= top:
        raise InvalidInput(field, f"must be within 0..{top}")
    return value


@dataclass(frozen=True)
class DatasetEvent:
    """One materialized unit of a dataset version: a cursor or a partition."""

    dataset_uuid: uuid.UUID
    dataset_version: uuid.UUID
    cursor: int | str | None = None
    partition_key: str | None = None
    start: int | None = None
    end: int | None = None

    def __post_init__(self) -> None:
        self.validate("event")

    def validate(self, field: str) -> None:
        """Check the shape; raises :class:`InvalidInput` naming ``field``'s member."""
        if (self.cursor is None) == (self.partition_key is None):
            raise InvalidInput(field, "needs exactly one of 'cursor' or 'partition_key'")
        if isinstance(self.cursor, bool):
            raise InvalidInput(f"{field}.cursor", "must be an integer or a string")
        if isinstance(self.cursor, str) and not 0 < len(self.cursor) <= _MAX_TEXT:
            raise InvalidInput(f"{field}.cursor", f"must be 1..{_MAX_TEXT} characters")
        if isinstance(self.cursor, int):
            _as_int(self.cursor, f"{field}.cursor")
        if (self.start is None) != (self.end is None):
            raise InvalidInput(field, "'start' and 'end' go together")
        if self.partition_key is not None:
            if not 0 < len(self.partition_key) <= _MAX_TEXT:
                raise InvalidInput(f"{field}.partition_key", f"must be 1..{_MAX_TEXT} characters")
            if self.start is not None and self.end is not None:
                _as_int(self.start, f"{field}.start", MAX_RANGE_BOUND)
                _as_int(self.end, f"{field}.end", MAX_RANGE_BOUND)
                if self.start > self.end:
                    raise InvalidInput(f"{field}.end", "must be >= start")
                if self.partition_key != f"{self.start}-{self.end}":
                    raise InvalidInput(
                        f"{field}.partition_key",
                        f"must be '{{start}}-{{end}}' = '{self.start}-{self.end}' for a range",
                    )
        elif self.start is not None:
            raise InvalidInput(field, "'start'/'end' need a 'partition_key'")

    @property
    def unit_key(self) -> str:
        """The unit of work: ``cursor:{cursor}`` or ``partition:{partition_key}``."""
        if self.partition_key is not None:
            return f"partition:{self.partition_key}"
        return f"cursor:{self.cursor}"

    @classmethod
    def parse(cls, doc: object, field: str) -> DatasetEvent:
        """Build an event from its JSON object; errors name ``field`` and the member."""
        if not isinstance(doc, Mapping):
            raise InvalidInput(field, "must be an object")
        known = {"dataset_uuid", "dataset_version", "cursor", "partition_key", "start", "end"}
        for key in doc:
            if key not in known:
                raise InvalidInput(f"{field}.{key}", "is not an event field")
        for key in ("dataset_uuid", "dataset_version"):
            if key not in doc:
                raise InvalidInput(f"{field}.{key}", "is required")
        cursor = doc.get("cursor")
        if cursor is not None and (isinstance(cursor, bool) or not isinstance(cursor, int | str)):
            raise InvalidInput(f"{field}.cursor", "must be an integer or a string")
        key = doc.get("partition_key")
        if key is not None and not isinstance(key, str):
            raise InvalidInput(f"{field}.partition_key", "must be a string")
        start, end = doc.get("start"), doc.get("end")
        event = object.__new__(cls)
        for name, value in (
            ("dataset_uuid", _as_uuid(doc["dataset_uuid"], f"{field}.dataset_uuid")),
            ("dataset_version", _as_uuid(doc["dataset_version"], f"{field}.dataset_version")),
            ("cursor", cursor),
            ("partition_key", key),
            ("start", None if start is None else _as_int(start, f"{field}.start", MAX_RANGE_BOUND)),
            ("end", None if end is None else _as_int(end, f"{field}.end", MAX_RANGE_BOUND)),
        ):
            object.__setattr__(event, name, value)
        event.validate(field)
        return event

    def to_json(self) -> dict[str, Any]:
        """The wire shape (dispatcher.md, "Event Model")."""
        doc: dict[str, Any] = {
            "dataset_uuid": str(self.dataset_uuid),
            "dataset_version": str(self.dataset_version),
        }
        if self.partition_key is not None:
            doc["partition_key"] = self.partition_key
            if self.start is not None:
                doc["start"], doc["end"] = self.start, self.end
        else:
            doc["cursor"] = self.cursor
        return doc


def parse_events(docs: object, field: str = "events") -> list[DatasetEvent]:
    """Parse the ``events`` array of a request (single, partitioned or batch shape)."""
    if not isinstance(docs, list) or not docs:
        raise InvalidInput(field, "must be a non-empty array")
    return [DatasetEvent.parse(doc, f"{field}[{i}]") for i, doc in enumerate(docs)]


@dataclass(frozen=True)
class AcceptResult:
    """Outcome of an acceptance: the stored event id of each event, in order."""

    event_ids: list[uuid.UUID]
    new: int
    duplicates: int
