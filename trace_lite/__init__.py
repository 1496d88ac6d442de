"""trace_lite: all of Trace in one process (SQLite or Postgres, local keys, threads, Spark)."""
