"""Column lineage derived from a Spark DataFrame's analyzed logical plan.

:func:`derive_lineage` walks ``df._jdf.queryExecution().analyzed()`` (a
classic session: the plan is a JVM object reached through Py4J) from the
leaves up. Every attribute of the plan has an ``exprId``; each node's output
attributes get the set of input columns they are computed from:

- an attribute of one of the given input DataFrames is that input's column
  (``IDENTITY``), wherever in the plan it appears;
- an ``Alias`` (``select(... .alias())``, ``withColumn``, ``withColumnRenamed``,
  ``agg``) is computed from the columns its expression references:
  ``IDENTITY`` for a bare rename, ``AGGREGATION`` when it holds an aggregate
  function, else ``TRANSFORMATION``; an aggregate of no column (``count(*)``)
  depends on the rows of every input under it (input column ``*``);
- a passed-through attribute keeps its sources (``Filter``, ``Sort``,
  ``SubqueryAlias``, a ``Join``'s sides, ``Project`` of a plain column);
- a ``Union``'s output i comes from output i of every child.

Columns that decide which rows exist (a ``Filter``'s condition, a ``Join``'s
condition, an ``Aggregate``'s grouping, a ``Sort``'s order, a ``Window``'s
partitioning) are indirect dependencies of the whole output: they are
returned with the output column :data:`~trace_core.dag.lineage.DATASET_WIDE`
and the kinds of OpenLineage's column-lineage facet.

Spark Connect: the client holds no JVM plan (``df._jdf`` does not exist) and
the ``AnalyzePlan`` RPC answers a schema or an explain string, not the
analyzed tree with its ``exprId``s, so lineage is not derived there:
:func:`derive_lineage` raises :class:`LineageUnavailable` and the operator
declares its lineage (:func:`trace_core.dag.lineage.parse_declared`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from trace_core.dag.lineage import DATASET_WIDE, DIRECT_KINDS, ColumnEdge, merge_edges
from trace_core.errors import TraceError

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

__all__ = ["LineageUnavailable", "derive_lineage"]

# One source: (input dataset, input column, kind).
_Source = tuple[str, str, str]

_INDIRECT_BY_NODE = {
    "Filter": "FILTER",
    "Join": "JOIN",
    "Aggregate": "GROUP_BY",
    "Sort": "SORT",
    "Window": "WINDOW",
}


class LineageUnavailable(TraceError):
    """The session gives no analyzed plan to derive lineage from (Spark Connect)."""


def derive_lineage(output: DataFrame, inputs: Mapping[str, DataFrame]) -> list[ColumnEdge]:
    """The column lineage of ``output`` over ``inputs`` (dataset name → the
    DataFrame the operator read it as, before its own filters).

    Columns of leaves that are none of ``inputs`` (a literal table, a file
    read some other way) are not lineage of a Trace dataset and are left out.
    """
    jdf = getattr(output, "_jdf", None)
    if jdf is None:
        raise LineageUnavailable(
            "column lineage needs a classic Spark session's analyzed plan; "
            "on Spark Connect declare the operator's lineage instead"
        )
    known: dict[int, _Source] = {}
    for name, frame in inputs.items():
        plan = frame._jdf.queryExecution().analyzed()
        for attr in _seq(plan.output()):
            known[_id(attr)] = (name, str(attr.name()), "IDENTITY")
    walk = _Walk(known)
    env = walk.node(jdf.queryExecution().analyzed())
    root = jdf.queryExecution().analyzed()
    edges = [
        ColumnEdge(str(attr.name()), ds, col, kind)
        for attr in _seq(root.output())
        for ds, col, kind in env.get(_id(attr), frozenset())
    ]
    edges += [ColumnEdge(DATASET_WIDE, ds, col, kind) for ds, col, kind in walk.indirect]
    return merge_edges(edges)


@dataclass
class _Walk:
    known: Mapping[int, _Source]
    indirect: set[_Source] = field(default_factory=set)

    def node(self, plan: Any) -> dict[int, frozenset[_Source]]:
        """exprId → sources, for every attribute visible at ``plan``'s output."""
        kind = plan.getClass().getSimpleName()
        children = [self.node(child) for child in _seq(plan.children())]
        env: dict[int, frozenset[_Source]] = {}
        for child in children:
            env.update(child)
        if kind == "Union":
            outs = [_seq(c.output()) for c in _seq(plan.children())]
            for i, attr in enumerate(outs[0]):
                env[_id(attr)] = frozenset().union(*(env.get(_id(o[i]), frozenset()) for o in outs))
        rows = frozenset((ds, "*", "AGGREGATION") for srcs in env.values() for ds, _, _ in srcs)
        if kind == "Aggregate":
            self._indirect(env, _seq(plan.groupingExpressions()), "GROUP_BY")
            expressions = _seq(plan.aggregateExpressions())
        else:
            expressions = _seq(plan.expressions())
        for expr in expressions:
            name = expr.getClass().getSimpleName()
            if name == "Alias":
                env[_id(expr)] = self._defined(env, expr, rows)
            elif kind not in ("Project", "Aggregate"):
                self._indirect(env, [expr], _INDIRECT_BY_NODE.get(kind, "CONDITIONAL"))
        for attr in _seq(plan.output()):
            if (source := self.known.get(_id(attr))) is not None:
                env[_id(attr)] = frozenset({source})
        return env

    def _defined(
        self, env: Mapping[int, frozenset[_Source]], alias: Any, rows: frozenset[_Source]
    ) -> frozenset[_Source]:
        child = alias.child()
        if child.getClass().getSimpleName() == "AttributeReference":
            own = "IDENTITY"
        elif any(_is_aggregate(e) for e in _tree(child)):
            own = "AGGREGATION"
        else:
            own = "TRANSFORMATION"
        refs = [_id(a) for a in _seq(alias.references().toSeq())]
        if not refs and own == "AGGREGATION":
            return rows  # count(*), count(lit(1)): the rows as such
        return frozenset(
            (ds, col, _stronger(own, kind)) for r in refs for ds, col, kind in env.get(r, ())
        )

    def _indirect(self, env: Mapping[int, frozenset[_Source]], exprs: list[Any], kind: str) -> None:
        for expr in exprs:
            for attr in _seq(expr.references().toSeq()):
                self.indirect |= {(ds, col, kind) for ds, col, _ in env.get(_id(attr), ())}


def _stronger(a: str, b: str) -> str:
    return max(a, b, key=DIRECT_KINDS.index)


def _is_aggregate(expr: Any) -> bool:
    return bool(expr.getClass().getSimpleName() == "AggregateExpression")


def _tree(expr: Any) -> Iterator[Any]:
    yield expr
    for child in _seq(expr.children()):
        yield from _tree(child)


def _seq(seq: Any) -> list[Any]:
    """A Scala ``Seq`` (through Py4J) as a list."""
    return [seq.apply(i) for i in range(seq.size())]


def _id(named: Any) -> int:
    return int(named.exprId().id())
