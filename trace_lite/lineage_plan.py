"""A small model of Spark's analyzed logical plan, and the column lineage it implies.

Two front ends fill the model: :mod:`trace_lite.lineage_spark` from a
classic session's JVM plan (through Py4J) and
:mod:`trace_lite.lineage_plan_text` from the analyzed plan's text (what a
Spark Connect server answers). :func:`plan_lineage` walks it from the leaves
up, once for both. Every attribute of the plan has an ``exprId``; each
node's output attributes get the set of input columns they are computed
from:

- an attribute the front end recognised as a column of one of the input
  datasets (``known``) is that column (``IDENTITY``) from the node that
  introduces it (a leaf, or an input's own projection) up;
- a definition (an ``Alias``: ``select(... .alias())``, ``withColumn``,
  ``withColumnRenamed``, ``agg``) is computed from the columns its
  expression references, as its kind: ``IDENTITY`` for a bare rename,
  ``AGGREGATION`` when it holds an aggregate function, else
  ``TRANSFORMATION``; an aggregate of no column (``count(*)``) depends on the
  rows of every input under it (input column ``*``);
- a passed-through attribute keeps its sources (``Filter``, ``Sort``,
  ``SubqueryAlias``, a ``Join``'s sides, ``Project`` of a plain column);
- a ``Union``'s output i comes from output i of every child.

Columns that decide which rows exist (a ``Filter``'s condition, a ``Join``'s
condition, an ``Aggregate``'s grouping, a ``Sort``'s order, a ``Window``'s
partitioning; ``CONDITIONAL`` for any other node's expressions, and every
column of a ``Distinct``) are
indirect dependencies of the whole output: they are returned with the
output column :data:`~trace_core.dag.lineage.DATASET_WIDE`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from trace_core.dag.lineage import DATASET_WIDE, DIRECT_KINDS, ColumnEdge, merge_edges
from trace_core.errors import TraceError

__all__ = ["LineageUnavailable", "PlanAttribute", "PlanExpression", "PlanNode", "plan_lineage"]

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
    """No analyzed plan to derive lineage from (the session gives none, or
    the plan's text cannot be read): the operator declares its lineage."""


@dataclass(frozen=True)
class PlanAttribute:
    """An output attribute of a plan node: its name and ``exprId``."""

    name: str
    expr_id: int


@dataclass(frozen=True)
class PlanExpression:
    """An expression of a plan node: the exprIds it references; for a
    definition (an ``Alias``) also the ``exprId`` it defines and its kind
    (``IDENTITY``, ``TRANSFORMATION`` or ``AGGREGATION``)."""

    references: tuple[int, ...]
    defines: int | None = None
    kind: str = "TRANSFORMATION"


@dataclass(frozen=True)
class PlanNode:
    """A logical plan node: its class name (``Project``, ``Join`` ...), output
    attributes, children, expressions and, for an ``Aggregate``, its grouping
    expressions (kept apart from the aggregate expressions)."""

    kind: str
    output: tuple[PlanAttribute, ...]
    children: tuple[PlanNode, ...] = ()
    expressions: tuple[PlanExpression, ...] = ()
    grouping: tuple[PlanExpression, ...] = ()


def plan_lineage(root: PlanNode, known: Mapping[int, tuple[str, str]]) -> list[ColumnEdge]:
    """The column lineage of ``root``'s output; ``known`` maps the ``exprId`` of
    each input column to its (dataset name, column name). Columns of leaves
    that are not ``known`` (a literal table, a file read some other way) are
    not lineage of a Trace dataset and are left out."""
    walk = _Walk({i: (ds, col, "IDENTITY") for i, (ds, col) in known.items()})
    env = walk.node(root)
    edges = [
        ColumnEdge(attr.name, ds, col, kind)
        for attr in root.output
        for ds, col, kind in env.get(attr.expr_id, frozenset())
    ]
    edges += [ColumnEdge(DATASET_WIDE, ds, col, kind) for ds, col, kind in walk.indirect]
    return merge_edges(edges)


@dataclass
class _Walk:
    known: Mapping[int, _Source]
    indirect: set[_Source] = field(default_factory=set)

    def node(self, plan: PlanNode) -> dict[int, frozenset[_Source]]:
        """exprId → sources, for every attribute visible at ``plan``'s output."""
        children = [self.node(child) for child in plan.children]
        env: dict[int, frozenset[_Source]] = {}
        for child in children:
            env.update(child)
        if plan.kind == "Union" and plan.children:
            outs = [child.output for child in plan.children]
            for i, attr in enumerate(outs[0]):
                env[attr.expr_id] = frozenset().union(
                    *(env.get(o[i].expr_id, frozenset()) for o in outs if i < len(o))
                )
        rows = frozenset((ds, "*", "AGGREGATION") for srcs in env.values() for ds, _, _ in srcs)
        self._indirect(env, plan.grouping, "GROUP_BY")
        if plan.kind == "Distinct":
            # a Deduplicate of every column (Connect plans distinct() as one)
            every = PlanExpression(tuple(a.expr_id for a in plan.output))
            self._indirect(env, [every], "CONDITIONAL")
        for expr in plan.expressions:
            if expr.defines is not None:
                env[expr.defines] = self._defined(env, expr, rows)
            elif plan.kind not in ("Project", "Aggregate"):
                self._indirect(env, [expr], _INDIRECT_BY_NODE.get(plan.kind, "CONDITIONAL"))
        # An input's column where the plan introduces it: not where a node
        # passes a child's attribute on (a Union's output reuses its first
        # child's exprIds, yet comes from every child).
        below = {a.expr_id for child in plan.children for a in child.output}
        for attr in plan.output:
            if attr.expr_id not in below and (source := self.known.get(attr.expr_id)):
                env[attr.expr_id] = frozenset({source})
        return env

    def _defined(
        self,
        env: Mapping[int, frozenset[_Source]],
        expr: PlanExpression,
        rows: frozenset[_Source],
    ) -> frozenset[_Source]:
        if not expr.references and expr.kind == "AGGREGATION":
            return rows  # count(*), count(lit(1)): the rows as such
        return frozenset(
            (ds, col, _stronger(expr.kind, kind))
            for r in expr.references
            for ds, col, kind in env.get(r, ())
        )

    def _indirect(
        self, env: Mapping[int, frozenset[_Source]], exprs: Iterable[PlanExpression], kind: str
    ) -> None:
        for expr in exprs:
            for ref in expr.references:
                self.indirect |= {(ds, col, kind) for ds, col, _ in env.get(ref, ())}


def _stronger(a: str, b: str) -> str:
    return max(a, b, key=DIRECT_KINDS.index)
