"""Benchmarks of Trace's durable task queue (``python -m benchmarks.queue``).

Not part of the installed package and not run by the test suite; each
benchmark prints one JSON object per run on stdout and logs to stderr.
"""
