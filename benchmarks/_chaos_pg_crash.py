"""Scenario ``pg-crash-restart`` of ``benchmarks.chaos`` (:mod:`benchmarks._chaos_postgres`)."""

from benchmarks._chaos_postgres import CRASH_RESTART as SCENARIO

__all__ = ["SCENARIO"]
