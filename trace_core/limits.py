"""Limits on values that the state database's columns impose.

Checked where input enters (event constructors, the HTTP models, DAG files),
so that a value out of range is refused naming its field instead of failing
as a driver error half-way through a write.
"""

from __future__ import annotations

__all__ = ["MAX_BIGINT", "MAX_OPERATOR_STATE_BYTES", "MAX_RANGE_BOUND"]

MAX_BIGINT = 2**63 - 1
"""The largest integer cursor: cursors are stored in BIGINT columns."""

MAX_RANGE_BOUND = MAX_BIGINT - 1
"""The largest bound of an inclusive block range: coverage is kept as
half-open ranges (``[start, end + 1)``, Postgres ``int8range``), so ``end + 1``
must fit in a BIGINT too."""

MAX_OPERATOR_STATE_BYTES = 256 * 1024
"""The largest operator state, as compact UTF-8 JSON: a job's bookkeeping
(a cursor, done ranges), read and rewritten whole on every change, not data."""
