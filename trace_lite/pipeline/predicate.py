"""Read-time ``where:`` filters: a small, closed subset of SQL predicates.

A filter such as ``value > 0``, ``severity = 'critical'`` or
``tx_count > 100 AND success_count >= 2`` is parsed by :func:`parse_where`
into a :class:`Predicate` that can be evaluated two independent ways: as
canonical Spark SQL (:attr:`Predicate.sql`, for ``DataFrame.where``) and as a
``pyarrow.compute`` expression (:meth:`Predicate.to_arrow`, used by the
reference). Both follow SQL's three-valued logic: a comparison with NULL is
unknown, AND/OR are Kleene, NOT of unknown is unknown, and a row is kept only
when the predicate is true (Arrow's filter drops nulls like ``WHERE`` does).

The grammar, keywords case-insensitive::

    expr       := and_expr ("OR" and_expr)*
    and_expr   := not_expr ("AND" not_expr)*
    not_expr   := "NOT" not_expr | "(" expr ")" | predicate
    predicate  := column op literal | literal op column
                | column "IS" ["NOT"] "NULL"
                | column ["NOT"] "IN" "(" literal ("," literal)* ")"
                | column ["NOT"] "BETWEEN" literal "AND" literal
    op         := "=" | "!=" | "<>" | "<" | "<=" | ">" | ">="
    literal    := integer | decimal | 'string' ('' escapes a quote) | TRUE | FALSE
    column     := [A-Za-z_][A-Za-z0-9_]* | "double-quoted" ("" escapes a quote)

Nothing else is accepted: no functions, arithmetic, subqueries, comments,
statement separators, column-to-column comparisons, or NULL outside
``IS [NOT] NULL``. The parser is a small hand-written recursive descent: no
well-kept tiny library parses exactly this subset, and a full SQL parser would
accept far more than we can evaluate on both paths.

Column names are matched exactly (case-sensitive) by :meth:`Predicate.check_columns`;
Spark itself resolves them case-insensitively, Arrow does not, so checking
first keeps the two paths in agreement.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from trace_core.errors import InvalidInput

__all__ = [
    "MAX_WHERE_LENGTH",
    "And",
    "Between",
    "Comparison",
    "InList",
    "IsNull",
    "LiteralValue",
    "Node",
    "Not",
    "Or",
    "Predicate",
    "parse_where",
]

MAX_WHERE_LENGTH = 4096
"""The longest filter text accepted."""

_MAX_DEPTH = 64  # nesting of NOT and parentheses (keeps recursion far from Python's limit)
_MAX_DECIMAL_DIGITS = 38  # Spark's and Arrow's decimal128 precision
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1

LiteralValue = bool | int | Decimal | str
"""A literal value: ``TRUE``/``FALSE``, an int64 integer, a decimal or a string."""

_KEYWORDS = frozenset({"AND", "OR", "NOT", "IS", "NULL", "IN", "BETWEEN", "TRUE", "FALSE"})
_OPERATORS = ("<=", ">=", "<>", "!=", "=", "<", ">")  # longest first
_FLIPPED = {"=": "=", "!=": "!=", "<": ">", "<=": ">=", ">": "<", ">=": "<="}
_ARROW_COMPARISONS = {
    "=": pc.equal,
    "!=": pc.not_equal,
    "<": pc.less,
    "<=": pc.less_equal,
    ">": pc.greater,
    ">=": pc.greater_equal,
}
_NUMBER = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)")
_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_NUMBER_FOLLOWER = re.compile(r"[A-Za-z0-9_.\"']")  # '1e5', '1.2.3', '5abc' are refused


# --- the syntax tree ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Comparison:
    """``column op value``; ``op`` is one of ``= != < <= > >=`` (``<>`` becomes ``!=``)."""

    column: str
    op: str
    value: LiteralValue


@dataclass(frozen=True, slots=True)
class IsNull:
    """``column IS NULL`` (``IS NOT NULL`` when ``negated``)."""

    column: str
    negated: bool


@dataclass(frozen=True, slots=True)
class InList:
    """``column IN (values)`` (``NOT IN`` when ``negated``)."""

    column: str
    values: tuple[LiteralValue, ...]
    negated: bool


@dataclass(frozen=True, slots=True)
class Between:
    """``column BETWEEN low AND high``, both ends included (``NOT BETWEEN`` when ``negated``)."""

    column: str
    low: LiteralValue
    high: LiteralValue
    negated: bool


@dataclass(frozen=True, slots=True)
class Not:
    """``NOT item``."""

    item: Node


@dataclass(frozen=True, slots=True)
class And:
    """All of ``items`` (at least two; nested ANDs are flattened)."""

    items: tuple[Node, ...]


@dataclass(frozen=True, slots=True)
class Or:
    """Any of ``items`` (at least two; nested ORs are flattened)."""

    items: tuple[Node, ...]


Node = Comparison | IsNull | InList | Between | Not | And | Or
"""A node of a parsed predicate."""


# --- the predicate --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Predicate:
    """A parsed filter; equal filters (up to spelling) have equal predicates and ``sql``."""

    root: Node

    @property
    def columns(self) -> frozenset[str]:
        """Every column the filter references."""
        return frozenset(_columns(self.root))

    @property
    def sql(self) -> str:
        """Canonical Spark SQL: backtick-quoted identifiers, escaped literals.

        Assumes Spark's default ``spark.sql.parser.escapedStringLiterals=false``
        (backslash escapes in string literals are interpreted).
        """
        return _sql(self.root)

    def __str__(self) -> str:
        return self.sql

    def to_arrow(self) -> pc.Expression:
        """The same filter as a ``pyarrow.compute`` expression (for ``Table.filter``)."""
        return _arrow(self.root)

    def check_columns(self, available: Iterable[str], field: str = "where") -> None:
        """Raise :class:`InvalidInput` naming ``field`` if a column is not in ``available``."""
        names = set(available)
        unknown = sorted(self.columns - names)
        if unknown:
            raise InvalidInput(
                field,
                f"unknown column{'s' if len(unknown) > 1 else ''} "
                f"{', '.join(repr(c) for c in unknown)}; available: "
                f"{', '.join(sorted(names)) or '(none)'}",
            )

    def check_schema(self, schema: pa.Schema, field: str = "where") -> None:
        """:meth:`check_columns`, then that each literal fits its column's Arrow type.

        Numbers go with integer, floating-point and decimal columns, strings
        with string columns, TRUE/FALSE with boolean columns; ``IS NULL``
        with anything. A mismatch would fail (or be cast differently) on
        either evaluation path, so it is refused up front.
        """
        self.check_columns(schema.names, field)
        for column, value in _literals(self.root):
            column_type = schema.field(column).type
            if not _fits(value, column_type):
                raise InvalidInput(
                    field,
                    f"column {column!r} is {column_type}; it cannot be compared with "
                    f"{_sql_literal(value)}",
                )


def parse_where(text: str, *, field: str = "where") -> Predicate:
    """Parse a filter; :class:`InvalidInput` naming ``field``, the reason and the position.

    Positions count characters from 1.
    """
    if not isinstance(text, str):
        raise InvalidInput(field, f"must be a string, got {type(text).__name__}")
    if len(text) > MAX_WHERE_LENGTH:
        raise InvalidInput(field, f"longer than {MAX_WHERE_LENGTH} characters")
    if not text.strip():
        raise InvalidInput(field, "empty filter")
    return Predicate(_Parser(text, field).parse())


# --- tokens ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Token:
    kind: str  # "keyword", "column", "literal", "op", "(", ")", ",", "end"
    value: Any
    position: int  # 0-based offset
    text: str


def _tokens(text: str, field: str) -> list[_Token]:
    tokens: list[_Token] = []
    i, n = 0, len(text)
    while i < n:
        ch = text[i]
        if ch.isspace():
            i += 1
            continue
        start = i
        if text.startswith("--", i) or text.startswith("/*", i):
            raise _error(field, "comments are not allowed", start)
        if ch == ";":
            raise _error(field, "';' is not allowed (a filter is a single predicate)", start)
        if ch in "(),":
            tokens.append(_Token(ch, ch, start, ch))
            i += 1
            continue
        op = next((o for o in _OPERATORS if text.startswith(o, i)), None)
        if op is not None:
            tokens.append(_Token("op", "!=" if op == "<>" else op, start, op))
            i += len(op)
            continue
        if ch == "'":
            value, i = _quoted(text, i, "'", field, "string literal")
            tokens.append(_Token("literal", value, start, text[start:i]))
            continue
        if ch == '"':
            value, i = _quoted(text, i, '"', field, "quoted identifier")
            if not value:
                raise _error(field, "empty quoted identifier", start)
            tokens.append(_Token("column", value, start, text[start:i]))
            continue
        number = _NUMBER.match(text, i)
        if number is not None:
            i = number.end()
            if i < n and _NUMBER_FOLLOWER.match(text, i):
                raise _error(field, f"malformed number {text[start : i + 1]!r}", start)
            tokens.append(
                _Token("literal", _number(number.group(), field, start), start, text[start:i])
            )
            continue
        word = _WORD.match(text, i)
        if word is not None:
            i = word.end()
            upper = word.group().upper()
            if upper in _KEYWORDS:
                tokens.append(_Token("keyword", upper, start, word.group()))
            else:
                tokens.append(_Token("column", word.group(), start, word.group()))
            continue
        raise _error(field, f"unexpected character {ch!r}", start)
    tokens.append(_Token("end", None, n, "end of input"))
    return tokens


def _quoted(text: str, i: int, quote: str, field: str, what: str) -> tuple[str, int]:
    """The body of a quoted token starting at ``i`` (doubled quotes unescaped), and its end."""
    parts: list[str] = []
    j = i + 1
    while True:
        k = text.find(quote, j)
        if k < 0:
            raise _error(field, f"unterminated {what}", i)
        parts.append(text[j:k])
        if text.startswith(quote * 2, k):
            parts.append(quote)
            j = k + 2
            continue
        return "".join(parts), k + 1


def _number(token: str, field: str, position: int) -> int | Decimal:
    if "." not in token:
        value = int(token)
        if not _INT64_MIN <= value <= _INT64_MAX:
            raise _error(field, f"integer {token} is outside the 64-bit range", position)
        return value
    decimal = Decimal(token)
    if len(decimal.as_tuple().digits) > _MAX_DECIMAL_DIGITS:
        raise _error(field, f"decimal {token} has more than {_MAX_DECIMAL_DIGITS} digits", position)
    return decimal


def _error(field: str, reason: str, position: int) -> InvalidInput:
    return InvalidInput(field, f"{reason} at position {position + 1}")


# --- the parser -----------------------------------------------------------------------


class _Parser:
    def __init__(self, text: str, field: str) -> None:
        self._field = field
        self._tokens = _tokens(text, field)
        self._i = 0
        self._depth = 0

    def parse(self) -> Node:
        node = self._or()
        token = self._peek()
        if token.kind != "end":
            raise self._unexpected(token, "AND, OR or the end of the filter")
        return node

    def _peek(self, ahead: int = 0) -> _Token:
        return self._tokens[min(self._i + ahead, len(self._tokens) - 1)]

    def _next(self) -> _Token:
        token = self._peek()
        self._i += 1
        return token

    def _keyword(self, *words: str) -> bool:
        token = self._peek()
        if token.kind == "keyword" and token.value in words:
            self._i += 1
            return True
        return False

    def _expect(self, kind: str, value: str, wanted: str) -> None:
        token = self._next()
        if token.kind != kind or token.value != value:
            raise self._unexpected(token, wanted)

    def _unexpected(self, token: _Token, wanted: str) -> InvalidInput:
        found = "the end of the filter" if token.kind == "end" else repr(token.text)
        return _error(self._field, f"expected {wanted}, found {found}", token.position)

    def _or(self) -> Node:
        items = [self._and()]
        while self._keyword("OR"):
            items.append(self._and())
        return items[0] if len(items) == 1 else Or(_flatten(items, Or))

    def _and(self) -> Node:
        items = [self._not()]
        while self._keyword("AND"):
            items.append(self._not())
        return items[0] if len(items) == 1 else And(_flatten(items, And))

    def _not(self) -> Node:
        token = self._peek()
        self._depth += 1
        if self._depth > _MAX_DEPTH:
            raise _error(self._field, f"nested deeper than {_MAX_DEPTH} levels", token.position)
        try:
            if self._keyword("NOT"):
                return Not(self._not())
            if token.kind == "(":
                self._i += 1
                node = self._or()
                self._expect(")", ")", "')'")
                return node
            return self._predicate()
        finally:
            self._depth -= 1

    def _predicate(self) -> Node:
        token = self._next()
        if token.kind == "column":
            if self._peek().kind == "(":
                raise _error(self._field, "function calls are not allowed", token.position)
            return self._after_column(token.value)
        if token.kind == "literal" or (
            token.kind == "keyword" and token.value in ("TRUE", "FALSE", "NULL")
        ):
            value = self._literal_value(token)
            op = self._next()
            if op.kind != "op":
                raise self._unexpected(op, "a comparison operator after a literal")
            column = self._next()
            if column.kind != "column":
                if column.kind == "literal" or column.kind == "keyword":
                    raise _error(
                        self._field,
                        "a comparison needs a column on one side",
                        column.position,
                    )
                raise self._unexpected(column, "a column")
            if self._peek().kind == "(":
                raise _error(self._field, "function calls are not allowed", column.position)
            return Comparison(column.value, _FLIPPED[op.value], value)
        raise self._unexpected(token, "a column, a literal, NOT or '('")

    def _after_column(self, column: str) -> Node:
        token = self._peek()
        if token.kind == "op":
            self._i += 1
            right = self._peek()
            if right.kind == "column" and self._peek(1).kind != "(":
                raise _error(
                    self._field,
                    "comparing two columns is not supported; compare a column with a literal",
                    right.position,
                )
            return Comparison(column, token.value, self._literal())
        if self._keyword("IS"):
            negated = self._keyword("NOT")
            if not self._keyword("NULL"):
                raise self._unexpected(self._peek(), "NULL after IS" + (" NOT" if negated else ""))
            return IsNull(column, negated)
        negated = self._keyword("NOT")
        if self._keyword("IN"):
            self._expect("(", "(", "'(' after IN")
            values = [self._literal()]
            while self._peek().kind == ",":
                self._i += 1
                values.append(self._literal())
            self._expect(")", ")", "',' or ')' in the IN list")
            return InList(column, tuple(values), negated)
        if self._keyword("BETWEEN"):
            low = self._literal()
            if not self._keyword("AND"):
                raise self._unexpected(self._peek(), "AND in BETWEEN")
            return Between(column, low, self._literal(), negated)
        wanted = "IN or BETWEEN after NOT" if negated else "a comparison, IS, IN or BETWEEN"
        raise self._unexpected(self._peek(), wanted)

    def _literal(self) -> LiteralValue:
        return self._literal_value(self._next())

    def _literal_value(self, token: _Token) -> LiteralValue:
        if token.kind == "literal":
            value: LiteralValue = token.value
            return value
        if token.kind == "keyword" and token.value in ("TRUE", "FALSE"):
            return bool(token.value == "TRUE")
        if token.kind == "keyword" and token.value == "NULL":
            raise _error(
                self._field,
                "NULL is only allowed in IS NULL / IS NOT NULL (a comparison with NULL "
                "is never true)",
                token.position,
            )
        if token.kind == "column":
            if self._peek().kind == "(":
                raise _error(self._field, "function calls are not allowed", token.position)
            raise _error(
                self._field,
                f"expected a literal, found the column {token.text!r}",
                token.position,
            )
        raise self._unexpected(token, "a literal")


def _flatten(items: list[Node], kind: type[And] | type[Or]) -> tuple[Node, ...]:
    flat: list[Node] = []
    for item in items:
        if isinstance(item, kind):
            flat.extend(item.items)
        else:
            flat.append(item)
    return tuple(flat)


# --- evaluation -----------------------------------------------------------------------


def _columns(node: Node) -> Iterable[str]:
    if isinstance(node, Comparison | IsNull | InList | Between):
        yield node.column
    elif isinstance(node, Not):
        yield from _columns(node.item)
    else:
        for item in node.items:
            yield from _columns(item)


def _literals(node: Node) -> Iterable[tuple[str, LiteralValue]]:
    if isinstance(node, Comparison):
        yield node.column, node.value
    elif isinstance(node, InList):
        for value in node.values:
            yield node.column, value
    elif isinstance(node, Between):
        yield node.column, node.low
        yield node.column, node.high
    elif isinstance(node, Not):
        yield from _literals(node.item)
    elif isinstance(node, And | Or):
        for item in node.items:
            yield from _literals(item)


def _fits(value: LiteralValue, column_type: pa.DataType) -> bool:
    if isinstance(value, bool):
        return bool(pa.types.is_boolean(column_type))
    if isinstance(value, int | Decimal):
        return bool(
            pa.types.is_integer(column_type)
            or pa.types.is_floating(column_type)
            or pa.types.is_decimal(column_type)
        )
    return bool(
        pa.types.is_string(column_type)
        or pa.types.is_large_string(column_type)
        or pa.types.is_string_view(column_type)
    )


def _sql_identifier(name: str) -> str:
    return "`" + name.replace("`", "``") + "`"


def _sql_literal(value: LiteralValue) -> str:
    if isinstance(value, bool):
        return "TRUE" if value else "FALSE"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, Decimal):
        return format(value, "f")
    # Spark interprets backslash escapes in string literals, so both the
    # backslash and the quote are escaped with one.
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _sql(node: Node) -> str:
    if isinstance(node, Comparison):
        return f"{_sql_identifier(node.column)} {node.op} {_sql_literal(node.value)}"
    if isinstance(node, IsNull):
        return f"{_sql_identifier(node.column)} IS {'NOT ' if node.negated else ''}NULL"
    if isinstance(node, InList):
        values = ", ".join(_sql_literal(v) for v in node.values)
        return f"{_sql_identifier(node.column)} {'NOT ' if node.negated else ''}IN ({values})"
    if isinstance(node, Between):
        return (
            f"{_sql_identifier(node.column)} {'NOT ' if node.negated else ''}BETWEEN "
            f"{_sql_literal(node.low)} AND {_sql_literal(node.high)}"
        )
    if isinstance(node, Not):
        return f"NOT ({_sql(node.item)})"
    joiner = " AND " if isinstance(node, And) else " OR "
    # Parentheses around every compound or BETWEEN operand: the text never
    # depends on precedence rules (or BETWEEN's own AND).
    return joiner.join(
        f"({_sql(item)})" if isinstance(item, And | Or | Between) else _sql(item)
        for item in node.items
    )


def _arrow_literal(value: LiteralValue) -> pa.Scalar:
    if isinstance(value, bool):
        return pa.scalar(value, pa.bool_())
    if isinstance(value, int):
        return pa.scalar(value, pa.int64())
    if isinstance(value, Decimal):
        return pa.scalar(value)  # decimal128 of the literal's own precision, like Spark
    return pa.scalar(value, pa.string())


def _arrow(node: Node) -> pc.Expression:
    if isinstance(node, Comparison):
        return _ARROW_COMPARISONS[node.op](pc.field(node.column), _arrow_literal(node.value))
    if isinstance(node, IsNull):
        column = pc.field(node.column)
        return pc.is_valid(column) if node.negated else pc.is_null(column)
    if isinstance(node, InList):
        # An OR of equalities rather than is_in: is_in says false for a null
        # input, SQL says unknown (which matters under NOT IN).
        column = pc.field(node.column)
        found = functools.reduce(
            pc.or_kleene, [pc.equal(column, _arrow_literal(v)) for v in node.values]
        )
        return pc.invert(found) if node.negated else found
    if isinstance(node, Between):
        column = pc.field(node.column)
        inside = pc.and_kleene(
            pc.greater_equal(column, _arrow_literal(node.low)),
            pc.less_equal(column, _arrow_literal(node.high)),
        )
        return pc.invert(inside) if node.negated else inside
    if isinstance(node, Not):
        return pc.invert(_arrow(node.item))
    combine = pc.and_kleene if isinstance(node, And) else pc.or_kleene
    return functools.reduce(combine, [_arrow(item) for item in node.items])
