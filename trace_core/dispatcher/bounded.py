"""A bounded memo for facts that never change once written.

Jobs rows, a task's job and a job's org are immutable, so the Dispatcher
reads them once and keeps them; the bound only caps memory (when full, the
memo starts over, which costs one read per entry at worst).
"""

from __future__ import annotations

from typing import Generic, TypeVar

__all__ = ["BoundedMemo"]

K = TypeVar("K")
V = TypeVar("V")


class BoundedMemo(Generic[K, V]):
    """A dict of at most ``bound`` entries of immutable facts."""

    def __init__(self, bound: int) -> None:
        if bound < 1:
            raise ValueError("BoundedMemo bound must be >= 1")
        self._bound = bound
        self._values: dict[K, V] = {}

    def get(self, key: K) -> V | None:
        """The remembered value, or ``None``."""
        return self._values.get(key)

    def put(self, key: K, value: V) -> V:
        """Remember ``value`` (starting over when full); returns it."""
        if key not in self._values and len(self._values) >= self._bound:
            self._values.clear()
        self._values[key] = value
        return value

    def __contains__(self, key: object) -> bool:
        return key in self._values

    def __len__(self) -> int:
        return len(self._values)
