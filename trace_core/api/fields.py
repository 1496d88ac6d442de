"""Field types of the API's bodies and the checks behind them.

Numbers are strict where a lax conversion would hide a worker bug (``"1"``
is not an attempt, ``true`` is not ``1``) and bounded by their column's
range; every string that can reach the state database is refused when it
holds what the drivers cannot store (NUL characters, lone surrogates), and
free-form JSON also when it holds non-finite numbers or nests too deep. A
malformed request is thus always a 4xx naming the field, never a driver
error.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from trace_core.limits import MAX_BIGINT, MAX_RANGE_BOUND
from trace_core.security.tokens import DEFAULT_MAX_TOKEN_BYTES

__all__ = [
    "MAX_EVENTS",
    "MAX_WAIT_MS",
    "Attempt",
    "CapabilityToken",
    "JsonObject",
    "LongText",
    "Name",
    "Offset",
    "Request",
    "StrictBool",
    "check_cursor",
    "check_text",
]

MAX_WAIT_MS = 20_000
"""The hard cap of a v1 claim's long-poll (``max_wait_ms``); a deployment may
lower it (:class:`~trace_core.api.app.ApiConfig`), never raise it."""

MAX_EVENTS = 10_000
"""Events in one request; a larger batch is split by the worker."""

_INT4 = 2**31 - 1  # tasks.attempt is a 32-bit integer column
_MAX_TEXT = 256  # names, keys, cursors: the core's limit for event texts
_MAX_JSON_DEPTH = 32


def check_text(value: str) -> str:
    """Refuse what neither engine can store: NUL characters and lone surrogates."""
    if "\x00" in value:
        raise ValueError("must not contain NUL characters")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("must be valid Unicode text (no lone surrogates)") from None
    return value


def _not_blank(value: str) -> str:
    if not value.strip():
        raise ValueError("must not be blank")
    return check_text(value)


def _check_json(value: Any, where: str = "", depth: int = 0) -> None:
    if depth > _MAX_JSON_DEPTH:
        raise ValueError(f"nested deeper than {_MAX_JSON_DEPTH} levels at '{where or '.'}'")
    if isinstance(value, str):
        try:
            check_text(value)
        except ValueError as exc:
            raise ValueError(f"string at '{where or '.'}' {exc}") from None
    elif isinstance(value, float) and not math.isfinite(value):
        # json.loads accepts NaN/Infinity; Postgres jsonb does not.
        raise ValueError(f"number at '{where or '.'}' must be finite")
    elif isinstance(value, Mapping):
        for key, item in value.items():
            path = f"{where}.{key}" if where else str(key)
            if isinstance(key, str):
                try:
                    check_text(key)
                except ValueError as exc:
                    raise ValueError(f"key {path!r} {exc}") from None
            _check_json(item, path, depth + 1)
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            _check_json(item, f"{where}[{i}]", depth + 1)


def _json_object(value: dict[str, Any]) -> dict[str, Any]:
    _check_json(value)
    return value


def check_cursor(value: object) -> object:
    """An event cursor: a non-negative BIGINT or a 1..256 character string."""
    # Checked before the int|str union so an error names the field, not a union branch.
    if value is None or isinstance(value, str):
        if isinstance(value, str) and not 0 < len(value) <= _MAX_TEXT:
            raise ValueError(f"must be 1..{_MAX_TEXT} characters")
        return value if value is None else check_text(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError("must be an integer or a string")
    if not 0 <= value <= MAX_BIGINT:
        raise ValueError(f"must be within 0..{MAX_BIGINT}")
    return value


Name = Annotated[str, Field(min_length=1, max_length=_MAX_TEXT), AfterValidator(_not_blank)]
"""A short identifier (worker id, stream, job or DAG name, trigger key)."""
LongText = Annotated[str, AfterValidator(check_text)]
"""Free text (error messages); truncated by the handler, bounded by the body cap."""
Attempt = Annotated[int, Field(strict=True, ge=1, le=_INT4)]
"""A task attempt number (1-based)."""
Offset = Annotated[int, Field(strict=True, ge=0, le=MAX_RANGE_BOUND)]
"""A block-range bound (its ``end + 1`` fits in a BIGINT)."""
JsonObject = Annotated[dict[str, Any], AfterValidator(_json_object)]
"""Free-form JSON object, checked for what the state database cannot store."""
StrictBool = Annotated[bool, Field(strict=True)]
"""A JSON boolean (no ``1``/``"true"``)."""
CapabilityToken = Annotated[
    str, Field(min_length=1, max_length=DEFAULT_MAX_TOKEN_BYTES, pattern=r"^[A-Za-z0-9_.-]+$")
]
"""A compact JWS (checked in full by the verifier; only its shape here)."""


class Request(BaseModel):
    """A request body: unknown fields are refused (a misspelt field is a 400
    naming it, not a silently ignored value)."""

    model_config = ConfigDict(extra="forbid")
