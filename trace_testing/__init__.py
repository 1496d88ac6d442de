"""Trace's test kit: prove, in your own CI, that your handlers and your
database keep the ownership protocol's guarantees (docs/testing.md).

- :mod:`trace_testing.plugin`: the pytest plugin (``trace_*`` fixtures,
  ``--trace-engines``, ``--trace-postgres-url``), loaded by the ``pytest11``
  entry point;
- :mod:`trace_testing.conformance`: the protocol's conformance suite
  (``pytest --pyargs trace_testing.conformance``);
- :mod:`trace_testing.drain`: tasks for a handler under test and concurrent
  workers that drain them;
- :mod:`trace_testing.history`: the effect ledger and the history checker
  (lost, duplicated, out-of-fence effects);
- :mod:`trace_testing.faults`: SIGKILL, SIGSTOP/SIGCONT, Postgres crash
  restarts, snapshot-holding idle transactions, full disks;
- :mod:`trace_testing.workers`: a task worker process for the fault tools;
  :mod:`trace_testing.outage_workers`: the same, carried through database outages;
  :mod:`trace_testing.process_target`: what such process targets share (their
  config's first fields, crash report, wait for the stop flag);
- :mod:`trace_testing.chaos_workers`, :mod:`trace_testing.relay_chaos`:
  whole chaos scenarios (workers SIGKILLed during a drain, a worker paused
  past its lease, the outbox relay SIGKILLed mid-batch) and their reports;
  :mod:`trace_testing.probe`: the stale holder of the pause scenario;
- :mod:`trace_testing.postgres`: the run's Postgres server and its pool of
  migrated databases; :mod:`trace_testing.dispatcher`,
  :mod:`trace_testing.lite`: a Dispatcher run until idle, the lite platform;
- :mod:`trace_testing.lite_reference`: the example chain pipeline scaled
  down and the pyarrow reference its outputs and alerts are checked against.

Nothing in ``trace_core``, ``trace_lite`` or ``trace_aws`` imports this
package (the layer contract in ``pyproject.toml``).
"""
