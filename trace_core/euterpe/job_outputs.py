"""The outputs a succeeded job reports (euterpe-contract.md §8: ``succeeded``
carries them): each ``{key, size, sha256, preset}``, checked field by field."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from trace_core.errors import InvalidInput

__all__ = ["MAX_OUTPUTS", "validate_outputs"]

MAX_OUTPUTS = 64
"""More outputs than presets a request may name; a bound on the event's size."""

_SHA256 = re.compile(r"[0-9a-f]{64}")
_FIELDS = ("key", "size", "sha256", "preset")


def validate_outputs(outputs: object) -> list[dict[str, Any]]:
    """The outputs as plain JSON objects with exactly the four fields;
    :class:`InvalidInput` naming the first bad field (``outputs[1].sha256``)."""
    if isinstance(outputs, (str, bytes)) or not isinstance(outputs, Sequence):
        raise InvalidInput("outputs", "must be a list")
    if not outputs:
        raise InvalidInput("outputs", "a succeeded job has at least one output")
    if len(outputs) > MAX_OUTPUTS:
        raise InvalidInput("outputs", f"at most {MAX_OUTPUTS}, got {len(outputs)}")
    checked: list[dict[str, Any]] = []
    for i, out in enumerate(outputs):
        where = f"outputs[{i}]"
        if not isinstance(out, Mapping):
            raise InvalidInput(where, "must be an object")
        extra = sorted(set(out) - set(_FIELDS))
        if extra:
            raise InvalidInput(f"{where}.{extra[0]}", "is not a field of an output")
        for name in _FIELDS:
            if name not in out:
                raise InvalidInput(f"{where}.{name}", "is required")
        key, size, sha, preset = (out[name] for name in _FIELDS)
        if not isinstance(key, str) or not key or len(key) > 1024:
            raise InvalidInput(f"{where}.key", "must be a non-empty string of at most 1024")
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise InvalidInput(f"{where}.size", "must be an integer >= 0")
        if not isinstance(sha, str) or not _SHA256.fullmatch(sha):
            raise InvalidInput(f"{where}.sha256", "must be 64 lowercase hex digits")
        if not isinstance(preset, str) or not preset:
            raise InvalidInput(f"{where}.preset", "must be a non-empty string")
        checked.append({"key": key, "size": size, "sha256": sha, "preset": preset})
    return checked
