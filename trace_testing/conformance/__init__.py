"""The ownership protocol's conformance suite, collected from the package.

Run it against your own database, on each engine::

    pytest --pyargs trace_testing.conformance --trace-engines=sqlite,postgres
    pytest --pyargs trace_testing.conformance --trace-engines=postgres \\
        --trace-postgres-url=postgresql://ci@db.internal/trace_ci

It proves, through the public API only (``TaskQueue``, ``LeaseQueue``,
``OutboxRelay``, ``IdempotencyStore``), the guarantees Trace's control plane
rests on (orchestration-data-model.md, the lease protocol):

- :mod:`.test_claims`: a queued item is leased to one claimer at a time,
  however many claim at once, each on its own connections;
- :mod:`.test_leases`: a lease that expires is reclaimed and retried (or
  dead-lettered once its attempts run out), on a
  :class:`~trace_core.clock.ManualClock`;
- :mod:`.test_fencing`: every write (heartbeat, complete, fail and their batch
  forms) is refused under a stale fence, and a finished attempt's fence
  changes nothing, on the task and the outbox queues;
- :mod:`.test_outbox`: an outbox row exists exactly when its transaction
  commits, and the relay performs each committed row at least once;
- :mod:`.test_idempotency`: one owner per idempotency key, replays of the
  stored response, conflicts for another request, expiry.

Every test takes the plugin's fixtures (``trace_engine``, ``trace_repository``,
``trace_clock``), so the plugin must be loaded: it is where the package is
installed (the ``pytest11`` entry point), or pass ``-p trace_testing.plugin``.
"""
