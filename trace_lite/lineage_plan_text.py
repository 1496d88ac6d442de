"""Column lineage on Spark Connect: the analyzed logical plan read from its text.

A Connect client holds no JVM plan, but the server explains one:
``AnalyzePlan``'s explain (``df._explain_string(extended=True)``, what
``df.explain(True)`` prints) has an ``== Analyzed Logical Plan ==`` section
whose tree names every attribute as ``name#exprId``. :func:`parse_analyzed`
reads that tree into the plan model of :mod:`trace_lite.lineage_plan`, so
the classic and the Connect path share one walker.

What the text gives and what it does not:

- ``Project``, ``Aggregate`` (grouping and aggregate lists), ``Window``,
  ``Filter``, ``Join`` (type and condition), ``Sort``, ``Union``,
  ``Deduplicate`` / ``RepartitionByExpression`` keys and leaves with their
  attributes (``LocalRelation``, ``Relation``, ``LogicalRDD`` ...) are read;
  any other node passes its first child's attributes through, and its
  expressions are not read (the classic path counts them as
  ``CONDITIONAL``).
- An aggregate is recognised by the aggregate's rule (an ``Aggregate``'s
  output that reads a column outside the grouping) or by the name of a
  built-in aggregate function (``count(1)``, a window's ``sum``); a
  user-defined aggregate of no column is taken for a transformation.
- The server analyzes each request anew, so an input DataFrame's
  exprIds in its own plan differ from those in the output's. An input
  is recognised by the shape of its plan instead (the subtree that prints
  like the input's plan, exprIds renumbered); two inputs whose plans
  print alike (same columns read the same way: ``Relation`` text carries no
  path) cannot be told apart and raise :class:`LineageUnavailable`.
- A plan printed with ``... N more fields`` (wider than
  ``spark.sql.debug.maxToStringFields``) or with subquery expressions (an
  inner plan) raises :class:`LineageUnavailable`: raise that setting, or
  declare the operator's lineage.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from trace_core.dag.lineage import ColumnEdge
from trace_lite.lineage_plan import (
    LineageUnavailable,
    PlanAttribute,
    PlanExpression,
    PlanNode,
    plan_lineage,
)

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

__all__ = ["analyzed_section", "derive_connect_lineage", "inputs_by_shape", "parse_analyzed"]

_HEADER = "== Analyzed Logical Plan =="
_REF = re.compile(r"#(\d+)L?")
_ATTR = re.compile(r"^(?P<name>.+?)#(?P<id>\d+)L?$", re.S)
_ALIAS = re.compile(r"^(?P<expr>.*) AS (?P<name>.+?)#(?P<id>\d+)L?$", re.S)
_BRANCH = re.compile(r"^((?:[: ]  )*)[+:]- ")
_TRUNCATED = re.compile(r"\.\.\. \d+ more fields")
_AGGREGATE_CALL = re.compile(
    r"\b(?:count|count_if|sum|try_sum|avg|try_avg|mean|min|max|min_by|max_by|first|"
    r"first_value|last|last_value|any_value|collect_list|collect_set|array_agg|"
    r"approx_count_distinct|approx_percentile|percentile\w*|median|mode|stddev\w*|std|"
    r"variance|var_pop|var_samp|covar_pop|covar_samp|corr|kurtosis|skewness|bool_and|"
    r"bool_or|every|bit_and|bit_or|bit_xor|listagg|string_agg|histogram_numeric|regr_\w+|"
    r"hll_\w+)\("
)
_LEFT_ONLY_JOINS = ("LeftSemi", "LeftAnti", "ExistenceJoin")
_KEYED = ("Deduplicate", "RepartitionByExpression", "RebalancePartitions")


def derive_connect_lineage(output: DataFrame, inputs: Mapping[str, DataFrame]) -> list[ColumnEdge]:
    """The column lineage of ``output`` (a Spark Connect DataFrame) over
    ``inputs``, from the analyzed plans the server explains."""
    tree = _Tree.parse(_analyzed_text(output))
    shapes = {name: _analyzed_text(frame) for name, frame in inputs.items()}
    return plan_lineage(tree.node, _known_by_shape(tree, shapes))


def inputs_by_shape(plan_text: str, inputs: Mapping[str, str]) -> dict[int, tuple[str, str]]:
    """``exprId`` → (input name, column) of the attributes of every subtree of
    ``plan_text`` that prints like one of ``inputs`` (name → its plan text),
    exprIds aside. Raises :class:`LineageUnavailable` for two inputs
    that print alike, or text it cannot read."""
    return _known_by_shape(_Tree.parse(plan_text), inputs)


def _known_by_shape(tree: _Tree, inputs: Mapping[str, str]) -> dict[int, tuple[str, str]]:
    signatures: dict[str, str] = {}
    known: dict[int, tuple[str, str]] = {}
    for name, text in inputs.items():
        own = _Tree.parse(text)
        signature = own.signature()
        clash = [other for other, s in signatures.items() if s == signature]
        if clash:
            raise LineageUnavailable(
                f"inputs {clash[0]!r} and {name!r} have plans that print alike "
                "and cannot be told apart; declare the operator's lineage"
            )
        signatures[name] = signature
        columns = [a.name for a in own.node.output]
        for match in tree.subtrees():
            if match.signature() == signature:
                for attr, column in zip(match.node.output, columns, strict=False):
                    known[attr.expr_id] = (name, column)
    return known


def _analyzed_text(frame: DataFrame) -> str:
    explain = getattr(frame, "_explain_string", None)
    if explain is None:
        raise LineageUnavailable("the DataFrame explains no plan (neither classic nor Connect)")
    try:
        text = str(explain(extended=True))
    except Exception as exc:  # the server refused or is gone: lineage is best effort
        raise LineageUnavailable(f"the Spark Connect server explained no plan: {exc}") from exc
    return analyzed_section(text)


def analyzed_section(explained: str) -> str:
    """The tree of the ``== Analyzed Logical Plan ==`` section of an extended
    explain (without the schema line that heads it)."""
    _, found, rest = explained.partition(_HEADER)
    if not found:
        raise LineageUnavailable("the explained plan has no analyzed logical plan")
    lines = []
    for line in rest.splitlines():
        if line.startswith("== "):
            break
        if line.strip():
            lines.append(line)
    # the schema line and the root are the unindented lines: the root is the last
    roots = [i for i, line in enumerate(lines) if not _BRANCH.match(line)]
    if not roots:
        raise LineageUnavailable("the analyzed logical plan is empty")
    return "\n".join(lines[roots[-1] :])


def parse_analyzed(text: str) -> PlanNode:
    """The plan model of an analyzed logical plan's tree text (the section's
    tree, as :func:`analyzed_section` returns it)."""
    return _Tree.parse(text).node


@dataclass
class _Tree:
    """A node of the text tree: its line, children and the model built from it."""

    line: str
    children: list[_Tree] = field(default_factory=list)
    node: PlanNode = field(default_factory=lambda: PlanNode("", ()))

    @classmethod
    def parse(cls, text: str) -> _Tree:
        if _TRUNCATED.search(text):
            raise LineageUnavailable(
                "the analyzed plan is printed with fields left out: raise "
                "spark.sql.debug.maxToStringFields, or declare the operator's lineage"
            )
        stack: list[_Tree] = []
        root: _Tree | None = None
        for line in text.splitlines():
            branch = _BRANCH.match(line)
            depth = len(branch.group(0)) // 3 if branch else 0
            item = cls(line[branch.end() :] if branch else line.strip())
            if depth == 0:
                if root is not None:
                    raise LineageUnavailable("the analyzed plan has more than one root")
                root = item
            elif depth > len(stack):
                # an inner plan (a subquery expression) is printed one level deeper
                raise LineageUnavailable(
                    "the analyzed plan holds a subquery, which the Connect path does not follow"
                )
            else:
                stack[depth - 1].children.append(item)
            del stack[depth:]
            stack.append(item)
        if root is None:
            raise LineageUnavailable("the analyzed logical plan is empty")
        root.build()
        return root

    def build(self) -> None:
        for child in self.children:
            child.build()
        kind, _, args = self.line.partition(" ")
        self.node = _node(kind, args.strip(), tuple(c.node for c in self.children))

    def subtrees(self) -> Iterator[_Tree]:
        yield self
        for child in self.children:
            yield from child.subtrees()

    def signature(self) -> str:
        """The subtree's text with exprIds numbered in order of appearance."""
        numbers: dict[str, str] = {}

        def renumber(match: re.Match[str]) -> str:
            return "#" + numbers.setdefault(match.group(1), str(len(numbers)))

        lines = []
        pending = [(0, self)]
        while pending:
            depth, item = pending.pop()
            lines.append(f"{depth} {_REF.sub(renumber, item.line)}")
            pending += [(depth + 1, c) for c in reversed(item.children)]
        return "\n".join(lines)


def _node(kind: str, args: str, children: tuple[PlanNode, ...]) -> PlanNode:
    passed = children[0].output if children else ()
    names = {a.expr_id: a.name for child in children for a in child.output}
    lists = _bracket_lists(args)
    if not children:  # a leaf: its attributes are the first list's
        return PlanNode(kind, tuple(_attributes(lists[0] if lists else "")))
    if kind == "Project" and lists:
        exprs = [_item(text, names) for text in _split(lists[0])]
        return PlanNode(kind, tuple(a for a, _ in exprs), children, tuple(e for _, e in exprs))
    if kind == "Aggregate" and lists:
        # an empty grouping list is not printed (a global aggregate)
        grouping = tuple(_refs(text) for text in _split(lists[0])) if len(lists) > 1 else ()
        keys = {r for g in grouping for r in g.references}
        exprs = [_item(text, names, aggregate_keys=keys) for text in _split(lists[-1])]
        output = tuple(a for a, _ in exprs)
        return PlanNode(kind, output, children, tuple(e for _, e in exprs), grouping)
    if kind == "Window" and lists:
        exprs = [_item(text, names, window=True) for text in _split(lists[0])]
        specs = tuple(_refs(text) for spec in lists[1:] for text in _split(spec))
        output = passed + tuple(a for a, _ in exprs)
        return PlanNode(kind, output, children, tuple(e for _, e in exprs) + specs)
    if kind == "Join":
        join_type, _, condition = args.partition(", ")
        output = passed
        if not join_type.startswith(_LEFT_ONLY_JOINS):
            output = tuple(a for child in children for a in child.output)
        return PlanNode(kind, output, children, (_refs(condition),) if condition else ())
    if kind == "Filter":
        return PlanNode(kind, passed, children, (_refs(args),))
    if kind in ("Sort", *_KEYED) and lists:
        return PlanNode(kind, passed, children, tuple(_refs(t) for t in _split(lists[0])))
    # Union (positional: the walker maps every child), SubqueryAlias, limits ...
    return PlanNode(kind, passed, children)


def _item(
    text: str,
    names: Mapping[int, str],
    *,
    aggregate_keys: set[int] | None = None,
    window: bool = False,
) -> tuple[PlanAttribute, PlanExpression]:
    """An entry of a Project / Aggregate / Window list: the attribute it
    outputs and its expression (a definition for an alias)."""
    alias = _ALIAS.match(text)
    if alias is None:
        attr = _ATTR.match(text)
        if attr is None:
            raise LineageUnavailable(f"cannot read the plan's expression {text!r}")
        expr_id = int(attr["id"])
        return PlanAttribute(attr["name"], expr_id), PlanExpression((expr_id,))
    expr = alias["expr"]
    references = tuple(int(r) for r in _REF.findall(expr))
    bare = _ATTR.match(expr)
    if bare is not None and names.get(int(bare["id"])) == bare["name"]:
        kind = "IDENTITY"
    elif (window or aggregate_keys is not None) and _AGGREGATE_CALL.search(expr):
        kind = "AGGREGATION"
    elif aggregate_keys is not None and set(references) - aggregate_keys:
        # outside the grouping keys a column is read only through an aggregate
        kind = "AGGREGATION"
    else:
        kind = "TRANSFORMATION"
    expr_id = int(alias["id"])
    return PlanAttribute(alias["name"], expr_id), PlanExpression(references, expr_id, kind)


def _refs(text: str) -> PlanExpression:
    return PlanExpression(tuple(int(r) for r in _REF.findall(text)))


def _attributes(text: str) -> Iterator[PlanAttribute]:
    for item in _split(text):
        attr = _ATTR.match(item)
        if attr is not None:
            yield PlanAttribute(attr["name"], int(attr["id"]))


_OPEN, _CLOSE = "([{", ")]}"


def _bracket_lists(text: str) -> list[str]:
    """The contents of the top-level ``[...]`` lists of a node's arguments."""
    found, depth, start = [], 0, 0
    for i, char in enumerate(text):
        if char in _OPEN:
            if depth == 0 and char == "[":
                start = i + 1
            depth += 1
        elif char in _CLOSE:
            depth -= 1
            if depth == 0 and char == "]":
                found.append(text[start:i])
    return found


def _split(text: str) -> list[str]:
    """``text`` split at its top-level commas (not inside brackets)."""
    items, depth, start = [], 0, 0
    for i, char in enumerate(text):
        if char in _OPEN:
            depth += 1
        elif char in _CLOSE:
            depth -= 1
        elif char == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    return [item.strip() for item in items if item.strip()]
