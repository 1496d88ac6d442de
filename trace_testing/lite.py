"""The in-process lite platform for tests (the ``trace_lite_platform`` fixture)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from trace_core.authoring.operators import OperatorSpec
from trace_lite.platform import LiteConfig, TraceLite

__all__ = ["LitePlatformFactory"]


class LitePlatformFactory:
    """Starts :class:`~trace_lite.platform.TraceLite` on one state database and
    data directory: ``async with factory(operators=[...]) as lite: ...``."""

    def __init__(self, database_url: str, data_dir: Path) -> None:
        """Platforms started here keep their state in ``database_url`` and
        their files (objects, keys, data database) under ``data_dir``."""
        self.database_url = database_url
        self.data_dir = data_dir

    @asynccontextmanager
    async def __call__(
        self, *, operators: Iterable[OperatorSpec] = (), **config: Any
    ) -> AsyncIterator[TraceLite]:
        """A started platform; ``config`` is more :class:`LiteConfig` fields."""
        settings = LiteConfig(data_dir=self.data_dir, database_url=self.database_url, **config)
        async with TraceLite(settings, operators=operators) as lite:
            yield lite
