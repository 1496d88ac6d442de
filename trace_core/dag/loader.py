"""Reading a DAG file: YAML with line numbers, then the models, then the rules.

PyYAML's safe loader composes the node tree; walking it records the line of
every field path and rejects duplicate mapping keys (which PyYAML would
otherwise resolve silently, last one wins). The constructed value is then
validated by the pydantic models, and each pydantic error location is mapped
back to the line of its YAML node. Only a structurally valid file gets the
semantic rules of :mod:`trace_core.dag.validate` (they need whole jobs), so a
file with type errors may reveal more problems once those are fixed.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pydantic
import yaml

from trace_core.dag.problems import (
    DagValidationError,
    FieldPath,
    LineMap,
    Problem,
    format_field,
)
from trace_core.dag.spec import DEFAULT_OPERATORS, DEFAULT_RUNTIMES, DagSpec
from trace_core.dag.validate import check_dag, did_you_mean

__all__ = ["DagDocument", "load_dag", "parse_dag"]

_MERGE_TAG = "tag:yaml.org,2002:merge"
_RECURSIVE = "recursive alias — a DAG file is a tree"
_TYPE_NAMES = {
    "int_type": "an integer",
    "string_type": "a string",
    "bool_type": "a boolean",
    "dict_type": "a mapping",
    "model_type": "a mapping",
    "tuple_type": "a list",
}


@dataclass(frozen=True)
class DagDocument:
    """A parsed, valid DAG file: the spec plus what is needed to report on it."""

    file: str
    """The name problems are reported under (the path as given)."""
    text: str
    """The YAML as written (kept in ``dag_versions.yaml_text``)."""
    spec: DagSpec
    lines: LineMap
    warnings: tuple[Problem, ...] = ()

    def recheck(
        self,
        *,
        operators: Collection[str] = DEFAULT_OPERATORS,
        runtimes: Collection[str] = DEFAULT_RUNTIMES,
        known_datasets: Collection[str] | None = None,
    ) -> list[Problem]:
        """The semantic rules again, e.g. with the registry's dataset names."""
        return check_dag(
            self.spec,
            file=self.file,
            lines=self.lines,
            operators=operators,
            runtimes=runtimes,
            known_datasets=known_datasets,
        )


def load_dag(
    path: str | Path,
    *,
    operators: Collection[str] = DEFAULT_OPERATORS,
    runtimes: Collection[str] = DEFAULT_RUNTIMES,
    known_datasets: Collection[str] | None = None,
) -> DagDocument:
    """Read and validate a DAG file; :class:`DagValidationError` lists every problem."""
    name = str(path)
    try:
        text = Path(path).read_bytes().decode("utf-8")
    except OSError as exc:
        raise DagValidationError(
            [Problem(name, None, "", f"cannot read file: {exc.strerror or exc}")]
        ) from None
    except UnicodeDecodeError as exc:
        raise DagValidationError(
            [Problem(name, None, "", f"not UTF-8 text (byte {exc.start}) — a DAG file is UTF-8")]
        ) from None
    return parse_dag(
        text, file=name, operators=operators, runtimes=runtimes, known_datasets=known_datasets
    )


def parse_dag(
    text: str,
    *,
    file: str = "<string>",
    operators: Collection[str] = DEFAULT_OPERATORS,
    runtimes: Collection[str] = DEFAULT_RUNTIMES,
    known_datasets: Collection[str] | None = None,
) -> DagDocument:
    """Validate DAG YAML given as text; ``file`` names it in problems."""
    data, lines, problems = _compose(text, file)
    if data is None and not problems:
        problems.append(Problem(file, None, "", "empty file — a DAG file declares dag: and jobs:"))
    spec: DagSpec | None = None
    if data is not None:
        try:
            spec = DagSpec.model_validate(data)
        except pydantic.ValidationError as exc:
            problems.extend(_structure_problems(exc, file, lines))
    if spec is not None and not problems:
        problems.extend(
            check_dag(
                spec,
                file=file,
                lines=lines,
                operators=operators,
                runtimes=runtimes,
                known_datasets=known_datasets,
            )
        )
    if spec is None or any(p.severity == "error" for p in problems):
        raise DagValidationError(problems)
    return DagDocument(file, text, spec, lines, tuple(problems))


def _compose(text: str, file: str) -> tuple[Any, LineMap, list[Problem]]:
    problems: list[Problem] = []
    lines: dict[FieldPath, int] = {}
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None, LineMap(), problems
        _walk(node, (), lines, problems, file, set())
        if any(p.message == _RECURSIVE for p in problems):
            return None, LineMap(lines), problems
        # Duplicate keys are reported, but the rest is still checked (last one wins).
        return loader.construct_document(node), LineMap(lines), problems
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark is not None else None
        what = exc.problem or exc.context or "invalid YAML"
        problems.append(Problem(file, line, "", f"YAML syntax error: {what}"))
        return None, LineMap(lines), problems
    except yaml.YAMLError as exc:
        problems.append(Problem(file, None, "", f"YAML error: {exc}"))
        return None, LineMap(lines), problems
    finally:
        loader.dispose()


def _walk(
    node: yaml.Node,
    path: FieldPath,
    lines: dict[FieldPath, int],
    problems: list[Problem],
    file: str,
    active: set[int],
) -> None:
    lines.setdefault(path, node.start_mark.line + 1)
    if id(node) in active:  # an alias of an enclosing node: a recursive structure
        problems.append(Problem(file, node.start_mark.line + 1, format_field(path), _RECURSIVE))
        return
    active.add(id(node))
    if isinstance(node, yaml.MappingNode):
        first: dict[str, int] = {}
        for key_node, value_node in node.value:
            if key_node.tag == _MERGE_TAG or not isinstance(key_node, yaml.ScalarNode):
                continue
            key = str(key_node.value)
            key_line = key_node.start_mark.line + 1
            child = (*path, key)
            if key in first:
                problems.append(
                    Problem(
                        file,
                        key_line,
                        format_field(child),
                        f"duplicate key '{key}' (first at line {first[key]}) — "
                        "a mapping key may appear once",
                    )
                )
                continue
            first[key] = key_line
            lines[child] = key_line
            _walk(value_node, child, lines, problems, file, active)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            _walk(item, (*path, index), lines, problems, file, active)
    active.discard(id(node))


def _structure_problems(exc: pydantic.ValidationError, file: str, lines: LineMap) -> list[Problem]:
    problems = []
    for err in exc.errors(include_url=False):
        loc = tuple(err["loc"])
        kind = err["type"]
        message = str(err["msg"])
        if kind == "extra_forbidden":
            allowed = _fields_at(loc[:-1])
            name = str(loc[-1])
            message = f"unknown field '{name}'{did_you_mean(name, allowed)}" + (
                f" — allowed here: {', '.join(sorted(allowed))}" if allowed else ""
            )
        elif kind == "missing":
            message = "missing — this field is required"
        elif kind in _TYPE_NAMES:
            message = f"{err['input']!r} is not {_TYPE_NAMES[kind]} — expected {_TYPE_NAMES[kind]}"
        elif kind in ("greater_than", "greater_than_equal"):
            bound = ">" if kind == "greater_than" else ">="
            limit = (err.get("ctx") or {}).get("gt" if kind == "greater_than" else "ge")
            message = f"{err['input']!r} is too small — must be {bound} {limit}"
        elif kind == "less_than_equal":
            limit = (err.get("ctx") or {}).get("le")
            message = f"{err['input']!r} is too large — must be <= {limit}"
        elif kind == "literal_error":
            expected = (err.get("ctx") or {}).get("expected", "")
            message = f"{err['input']!r} is not allowed — must be {expected}"
        elif message.startswith("Value error, "):
            message = message.removeprefix("Value error, ")
        problems.append(Problem(file, lines.line(loc), format_field(loc), message))
    return problems


def _fields_at(loc: FieldPath) -> list[str]:
    """The field names (aliases) allowed in the model at ``loc``."""
    model: type[pydantic.BaseModel] | None = DagSpec
    for part in loc:
        if isinstance(part, int) or model is None:
            continue
        field = next(
            (f for n, f in model.model_fields.items() if (f.alias or n) == part),
            None,
        )
        model = _model_in(field.annotation) if field is not None else None
    if model is None:
        return []
    return [f.alias or n for n, f in model.model_fields.items()]


def _model_in(annotation: Any) -> type[pydantic.BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel):
        return annotation
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is not None:
        for arg in typing.get_args(annotation):
            found = _model_in(arg)
            if found is not None:
                return found
    return None
