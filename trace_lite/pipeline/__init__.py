"""The example block-chain pipeline: a synthetic chain, Cryo-named Parquet partitions,
read-time ``where:`` filters, and the Spark block aggregation with its pyarrow reference."""
