"""Scenario ``pg-idle-snapshot`` of ``benchmarks.chaos`` (:mod:`benchmarks._chaos_postgres`)."""

from benchmarks._chaos_postgres import IDLE_SNAPSHOT as SCENARIO

__all__ = ["SCENARIO"]
