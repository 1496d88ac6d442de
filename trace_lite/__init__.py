"""trace_lite: the whole of Trace in one process (SQLite or Postgres, local keys, threads, Spark)."""
