"""Benchmarks of Trace: the durable task queue (``python -m benchmarks.queue``) and
event routing (``python -m benchmarks.routing``).

Not part of the installed package and not run by the test suite; each
benchmark prints one JSON object per run on stdout and logs to stderr.
"""
