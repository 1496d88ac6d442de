"""Column lineage derived from a Spark DataFrame's analyzed logical plan.

:func:`derive_lineage` fills the plan model of :mod:`trace_lite.lineage_plan`
(whose walker says what each output column is computed from) from one of
two front ends:

- a classic session: ``df._jdf.queryExecution().analyzed()``, the JVM plan
  reached through Py4J (this module). An input DataFrame's columns are
  recognised by ``exprId``: the output's plan embeds the inputs' analyzed
  plans with their attributes; an input the plan holds twice (a self-join)
  is re-instanced with new exprIds, so inputs are also recognised by
  the shape of their plan, as on Connect.
- a Spark Connect session: the client holds no JVM plan, but the server
  explains one: the analyzed plan's text (``AnalyzePlan``'s explain, as
  ``df.explain(extended=True)`` prints it), parsed by
  :mod:`trace_lite.lineage_plan_text`. The server analyzes every request
  anew, so the inputs' exprIds differ between the inputs' and the
  output's analysis: an input is recognised by the shape of its plan.

Where no plan can be had (a Connect session whose server refuses the
explain, a plan the text front end cannot read), :class:`LineageUnavailable`
is raised and the operator declares its lineage
(:func:`trace_core.dag.lineage.parse_declared`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from trace_core.dag.lineage import ColumnEdge
from trace_lite.lineage_plan import (
    LineageUnavailable,
    PlanAttribute,
    PlanExpression,
    PlanNode,
    plan_lineage,
)
from trace_lite.lineage_plan_text import derive_connect_lineage, inputs_by_shape

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

__all__ = ["LineageUnavailable", "derive_lineage", "jvm_plan"]


def derive_lineage(output: DataFrame, inputs: Mapping[str, DataFrame]) -> list[ColumnEdge]:
    """The column lineage of ``output`` over ``inputs`` (dataset name → the
    DataFrame the operator read it as, before its own filters), on a classic
    or a Spark Connect session.

    Columns of leaves that are none of ``inputs`` (a literal table, a file
    read some other way) are not lineage of a Trace dataset and are left out.
    """
    jdf = getattr(output, "_jdf", None)
    if jdf is None:
        return derive_connect_lineage(output, inputs)
    analyzed = jdf.queryExecution().analyzed()
    known: dict[int, tuple[str, str]] = {}
    shapes = {}
    for name, frame in inputs.items():
        plan = frame._jdf.queryExecution().analyzed()
        shapes[name] = str(plan.treeString())
        for attr in _seq(plan.output()):
            known[_id(attr)] = (name, str(attr.name()))
    # An input read twice (a self-join, a union with itself) is re-instanced
    # with new exprIds: its shape still says which it is. Without a readable
    # text, the exprIds alone (the inputs as the plan first holds them).
    with contextlib.suppress(LineageUnavailable):
        known |= inputs_by_shape(str(analyzed.treeString()), shapes)
    return plan_lineage(jvm_plan(analyzed), known)


def jvm_plan(plan: Any) -> PlanNode:
    """The model of a JVM ``LogicalPlan`` (a classic session's, through Py4J)."""
    kind = str(plan.getClass().getSimpleName())
    grouping: tuple[PlanExpression, ...] = ()
    if kind == "Aggregate":
        grouping = tuple(_expression(e) for e in _seq(plan.groupingExpressions()))
        expressions = _seq(plan.aggregateExpressions())
    else:
        expressions = _seq(plan.expressions())
    return PlanNode(
        kind,
        tuple(PlanAttribute(str(a.name()), _id(a)) for a in _seq(plan.output())),
        tuple(jvm_plan(child) for child in _seq(plan.children())),
        tuple(_expression(e) for e in expressions),
        grouping,
    )


def _expression(expr: Any) -> PlanExpression:
    references = tuple(_id(a) for a in _seq(expr.references().toSeq()))
    if expr.getClass().getSimpleName() != "Alias":
        return PlanExpression(references)
    child = expr.child()
    if child.getClass().getSimpleName() == "AttributeReference":
        kind = "IDENTITY"
    elif any(e.getClass().getSimpleName() == "AggregateExpression" for e in _tree(child)):
        kind = "AGGREGATION"
    else:
        kind = "TRANSFORMATION"
    return PlanExpression(references, _id(expr), kind)


def _tree(expr: Any) -> Iterator[Any]:
    yield expr
    for child in _seq(expr.children()):
        yield from _tree(child)


def _seq(seq: Any) -> list[Any]:
    """A Scala ``Seq`` (through Py4J) as a list."""
    return [seq.apply(i) for i in range(seq.size())]


def _id(named: Any) -> int:
    return int(named.exprId().id())
