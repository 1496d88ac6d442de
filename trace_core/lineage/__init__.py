"""Column lineage: which input dataset columns each output column is computed from.

Pure values and the declared form; no Spark, no SQL. Spark operators derive
their edges from the analyzed plan (``trace_lite.lineage_spark``); other
operators declare them (:func:`parse_declared`). Storage is the ``lineage``
area of the repository port.
"""

from trace_core.lineage.model import (
    DATASET_WIDE,
    DIRECT_KINDS,
    INDIRECT_KINDS,
    ColumnEdge,
    merge_edges,
    parse_declared,
)

__all__ = [
    "DATASET_WIDE",
    "DIRECT_KINDS",
    "INDIRECT_KINDS",
    "ColumnEdge",
    "merge_edges",
    "parse_declared",
]
