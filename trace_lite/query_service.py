"""The lite profile's Query Service: Spark SQL over a task's input datasets.

:class:`SparkQueryService` implements :class:`~trace_core.api.query.QueryService`
on the process's Spark session (:class:`~trace_lite.spark.SparkSessionProvider`,
classic local or cluster mode; Spark Connect is refused) and the lite object
store's files. Each query runs in a worker thread, in a fresh
``spark.newSession()`` of its own: its temporary views, SQL settings and
function registry are seen by nothing else and vanish with it.

What a query may read is decided in three independent layers, each failing
closed:

1. **The parsed statement** (before anything is attached or run): it must
   parse as exactly one statement (``;``-separated statements do not), be a
   query, and contain only query clauses (an allow-list of plan nodes: no
   DDL, DML, ``SET``, ``CACHE``, ``EXPLAIN``, ``EXECUTE IMMEDIATE``,
   ``IDENTIFIER(<expression>)`` tables, time travel, streaming or
   table-valued functions such as ``range(...)`` or ``read_files(...)``).
   Every table reference must be one plain name that is one of the task's
   views (or a ``WITH`` name of the query); anything else — another
   dataset's ``ds_<hex>``, ``db.table``, ``global_temp.x``,
   ``parquet.`/path``` — is a 403 ``not_attached``, whether or not it
   exists. Functions must be plain names of built-in functions.
2. **The session**: ``spark.sql.runSQLOnFiles`` is off (no ``format.`path```
   relations), ``spark.sql.variable.substitute`` is off (``${env:...}`` and
   ``${spark.conf}`` stay literal text), and the functions that reach
   outside the rows are dropped from the session's registry: ``reflect``,
   ``java_method`` and ``try_reflect`` (arbitrary static Java methods),
   ``input_file_name`` and ``input_file_block_*`` (file paths),
   ``from_protobuf``/``to_protobuf`` (descriptor files),
   ``from_avro``/``to_avro``/``schema_of_avro`` and
   ``from_xml``/``schema_of_xml`` (options naming schema files).
3. **The analyzed plan** (before it runs): every relation it reads must be
   one of the temporary views attached for this query; a catalog table, a
   global temporary view or any other leaf relation — say, a name a ``WITH``
   defines only in an inner scope, referenced outside it — is a 403.

Only the views the query references are attached, each filtered by its
input's ``where`` (:func:`~trace_lite.pipeline.predicate.parse_where`,
applied in Spark): the query never sees the rows the filter drops.

* An **S3 input**'s view reads the Parquet objects under its prefix
  (``*.parquet`` files at any depth, as the lite store maps
  ``s3://bucket/key`` to ``<root>/bucket/key``; names starting with ``.`` or
  ``_``, symbolic links and anything else are not objects), passed to Spark
  as explicit files (never globs). Without objects yet it cannot be
  attached: a query referencing it is a 400.
* A **buffered Postgres-table input** (``postgres_table:<table>``, written by
  the sink of :mod:`trace_lite.buffered` into the data database) is read by
  :class:`~trace_lite.query_tables.TableViews`: a fixed SQLAlchemy ``SELECT``
  of the rows whose ``org_id`` is the querying task's org (its job's, found
  in the state database by the verified token's ``task_id``; never anything
  the request says), into Arrow, then a DataFrame. The view's columns are
  the table's columns but ``org_id`` (hidden: the view holds one org's rows,
  so no query can select or filter on it); ``dedupe_key`` (the producer's
  record key) and ``created_at`` (when the sink wrote the row, UTC) are
  shown. The ``where`` terms SQL evaluates exactly as Spark are also pushed
  into the ``SELECT`` (see that module), so fewer rows are loaded; more than
  ``max_table_rows`` loaded rows is a 400 naming the view and the limit,
  never a truncated view. A table not written yet, or holding no row of the
  org, is a 400 like an S3 input without objects (the same answer whether
  or not another org has rows); rows the filter drops all give an empty
  view. Without a data database (``data``/``state`` not given), such an
  input cannot be attached: a 400.

The data database is never reachable from the query itself: the rows are
handed to Spark as data (Arrow) inside the view, and layers 1 and 3 keep
refusing any other name (the table's own, the buffer's, ``jdbc.`...```).

Results: at most ``limit`` rows (``truncated`` when more exist, or when the
rendered rows exceed ``max_result_bytes``), each rendered by Spark's
``to_json`` in UTC: numbers and decimals as JSON numbers, NaN and infinities
as the strings ``"NaN"``/``"Infinity"``/``"-Infinity"``, timestamps and dates
as ISO 8601 strings, binary as base64, intervals as SQL interval strings,
arrays, maps and structs as JSON arrays and objects.

Errors quote Spark's message (its condition, and the query position) with
every local path of the object store rewritten as its ``s3://`` URI; nothing
but the query's own views is ever attached, so no message can name another
dataset's location. A query running longer than ``timeout_seconds`` is
interrupted (its Spark jobs cancelled) and answered 400. Spark stops a
cancelled task only where it polls its kill flag (between input rows and
shuffle blocks); a plan that reads no input, e.g. a cross join of generated
rows, runs its task to the end after the answer (docs/http-api.md).
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread

from trace_core.api.query import (
    MAX_QUERY_LIMIT,
    NotAttached,
    QueryColumn,
    QueryResult,
    dataset_views,
)
from trace_core.dispatcher.bounded import BoundedMemo
from trace_core.errors import ConfigurationError, InvalidInput
from trace_core.security.claims import CapabilityClaims, DatasetInput
from trace_core.storage.sql import SqlRepository
from trace_lite.buffered import DataDatabase
from trace_lite.object_store import LocalObjectStore
from trace_lite.pipeline.predicate import parse_where
from trace_lite.query_tables import DEFAULT_MAX_TABLE_ROWS, TableViews
from trace_lite.spark import SparkSessionProvider

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

__all__ = ["DENIED_FUNCTIONS", "SESSION_CONF", "SparkQueryService"]

log = logging.getLogger("trace_lite.query")

SESSION_CONF: Mapping[str, str] = {
    "spark.sql.runSQLOnFiles": "false",
    "spark.sql.variable.substitute": "false",
    "spark.sql.caseSensitive": "false",
    "spark.sql.session.timeZone": "UTC",
    "spark.sql.jsonGenerator.ignoreNullFields": "false",
    "spark.sql.pyspark.jvmStacktrace.enabled": "false",
}
"""SQL settings of every query's session (layer 2 of the module docstring)."""

DENIED_FUNCTIONS: frozenset[str] = frozenset(
    {
        "reflect",
        "java_method",
        "try_reflect",
        "input_file_name",
        "input_file_block_start",
        "input_file_block_length",
        "from_protobuf",
        "to_protobuf",
        "from_avro",
        "to_avro",
        "schema_of_avro",
        "from_xml",
        "schema_of_xml",
    }
)
"""Built-in functions dropped from every query's session."""

_LOGICAL = "org.apache.spark.sql.catalyst.plans.logical."
_ANALYSIS = "org.apache.spark.sql.catalyst.analysis."
_UNRESOLVED_RELATION = _ANALYSIS + "UnresolvedRelation"
_UNRESOLVED_FUNCTION = _ANALYSIS + "UnresolvedFunction"
_UNRESOLVED_GENERATOR = _ANALYSIS + "UnresolvedGenerator"
_UNRESOLVED_WITH = _LOGICAL + "UnresolvedWith"
_VIEW = _LOGICAL + "View"

_QUERY_PLANS = frozenset(
    [
        *(
            _LOGICAL + name
            for name in (
                "Aggregate",
                "Distinct",
                "Except",
                "Filter",
                "Generate",
                "GlobalLimit",
                "Intersect",
                "Join",
                "LateralJoin",
                "LocalLimit",
                "LocalRelation",
                "Offset",
                "OneRowRelation",
                "Pivot",
                "Project",
                "RepartitionByExpression",
                "Sample",
                "Sort",
                "SubqueryAlias",
                "Union",
                "Unpivot",
                "UnresolvedHint",
                "UnresolvedWith",
                "WithWindowDefinition",
            )
        ),
        *(
            _ANALYSIS + name
            for name in (
                "UnresolvedHaving",
                "UnresolvedInlineTable",
                "UnresolvedQualify",
                "UnresolvedRelation",
                "UnresolvedSubqueryColumnAliases",
            )
        ),
        "org.apache.spark.sql.catalyst.expressions.PipeOperator",
    ]
)
"""Plan nodes a parsed query may contain (layer 1); every other plan node is refused."""

_DENIED_EXPRESSIONS = frozenset([_ANALYSIS + "ExpressionWithUnresolvedIdentifier"])
_TABLE_FUNCTIONS = frozenset(
    [_ANALYSIS + "UnresolvedTableValuedFunction", _ANALYSIS + "UnresolvedTVFAliases"]
)

_LEAVES = frozenset(
    _LOGICAL + name
    for name in ("OneRowRelation", "LocalRelation", "CTERelationRef", "UnionLoopRef")
)
"""Leaf relations an analyzed plan may hold outside the attached views (layer 3)."""

_PLAIN_NAME = re.compile(r"\[([A-Za-z_][A-Za-z0-9_]*)\]")
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_POSITION = re.compile(r"line (\d+),? pos(?:ition)? (\d+)")
_GLOB = re.compile(r"[{}\[\]*?\\]")
_MAX_MESSAGE = 2000
_MAX_PLAN_NODES = 100_000
_SCHEMA_CACHE = 1024  # datasets
_INTERRUPT_SECONDS = 300.0
_INTERRUPT_EVERY = 0.25
_ECHO = 120
_LISTED = 32  # view names listed in an error


class _Cancelled(Exception):
    """The query was interrupted before or while it ran."""


class _Running:
    """The session of one running query, so another thread can interrupt it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._session: SparkSession | None = None
        self.cancelled = False
        self.done = False

    def started(self, session: SparkSession) -> None:
        with self._lock:
            self._session = session
            if self.cancelled:
                raise _Cancelled

    def check(self) -> None:
        if self.cancelled:
            raise _Cancelled

    def interrupt(self) -> None:
        """Cancel the query's Spark jobs, now and again until its thread ends: a
        job submitted just after one interrupt would otherwise run on."""
        with self._lock:
            self.cancelled = True
        deadline = time.monotonic() + _INTERRUPT_SECONDS
        while not self.done and time.monotonic() < deadline:
            session = self._session
            if session is not None:
                try:
                    session.interruptAll()
                except Exception:  # the query may have just ended; nothing to cancel
                    log.debug("interrupting a query session failed", exc_info=True)
            time.sleep(_INTERRUPT_EVERY)


class SparkQueryService:
    """The Query Service on Spark (see the module docstring).

    ``store`` is the lite object store (or its root directory) holding the
    datasets' Parquet objects. ``data`` (the data database, or its URL) and
    ``state`` (the state database, where a task's org is found) attach
    Postgres-table datasets, at most ``max_table_rows`` rows each; without
    them such an input cannot be attached. ``max_concurrent`` queries run at
    once (each in a worker thread), the others wait their turn within their
    timeout.
    """

    def __init__(
        self,
        spark: SparkSessionProvider,
        store: LocalObjectStore | str | os.PathLike[str],
        *,
        data: DataDatabase | str | None = None,
        state: SqlRepository | None = None,
        max_table_rows: int = DEFAULT_MAX_TABLE_ROWS,
        timeout_seconds: float = 60.0,
        max_concurrent: int = 4,
        max_result_bytes: int = 8 << 20,
    ) -> None:
        if spark.config.remote is not None:
            raise ConfigurationError(
                "SparkQueryService needs a classic Spark session (local or cluster), "
                "not Spark Connect: it isolates each query in a new session and checks "
                "its plan"
            )
        if timeout_seconds <= 0 or max_concurrent < 1 or max_result_bytes < 1024:
            raise ConfigurationError(
                "SparkQueryService: timeout_seconds must be > 0, max_concurrent >= 1 "
                "and max_result_bytes >= 1024"
            )
        root = Path(store.root if isinstance(store, LocalObjectStore) else store).absolute()
        if _GLOB.search(str(root)):
            raise ConfigurationError(
                "SparkQueryService: the object store root must not contain any of {}[]*?\\ "
                "(Spark would read them as a glob)"
            )
        if (data is None) != (state is None):
            raise ConfigurationError(
                "SparkQueryService: give both the data database and the state repository "
                "(to attach Postgres-table datasets), or neither"
            )
        self._spark = spark
        self._root = root
        self._tables = (
            None
            if data is None or state is None
            else TableViews(data, state, max_rows=max_table_rows)
        )
        self.timeout_seconds = timeout_seconds
        self.max_concurrent = max_concurrent
        self.max_result_bytes = max_result_bytes
        self._limiter: anyio.CapacityLimiter | None = None
        self._lock = threading.Lock()
        self._builtins: frozenset[str] | None = None
        self._plans: dict[str, bool] = {}
        self._schemas: BoundedMemo[tuple[str, str, int, int], str] = BoundedMemo(_SCHEMA_CACHE)
        roots = sorted({str(root), str(root.resolve())}, key=len, reverse=True)
        self._paths = re.compile(
            "(?:file:(?://)?)?(?:" + "|".join(re.escape(r) for r in roots) + ")/"
        )

    async def query(
        self,
        claims: CapabilityClaims,
        sql: str,
        *,
        limit: int,
        views: Mapping[str, DatasetInput] | None = None,
    ) -> QueryResult:
        """Run ``sql`` over the views of ``claims``' inputs (see the module docstring)."""
        if type(limit) is not int or not 1 <= limit <= MAX_QUERY_LIMIT:
            raise InvalidInput("limit", f"must be an integer within 1..{MAX_QUERY_LIMIT}")
        chosen = dataset_views(claims.inputs) if views is None else views
        granted = set(claims.inputs)
        attachable: dict[str, DatasetInput] = {}
        for name, item in chosen.items():
            if item not in granted:
                # Only a caller's bug gets here; never attach what the token lacks.
                raise NotAttached(f"view {name!r} is not an input of the capability token")
            attachable[name.lower()] = item
        # The org whose rows Postgres-table views hold: the verified token's task's.
        org = None
        if self._tables is not None and any(
            item.postgres_table is not None for item in attachable.values()
        ):
            org = await self._tables.org_of(claims.task_id)
        return await self._answer(attachable, org, sql, limit)

    async def query_views(
        self,
        views: Mapping[str, DatasetInput],
        sql: str,
        *,
        limit: int,
        org_id: uuid.UUID,
    ) -> QueryResult:
        """Run ``sql`` over exactly ``views`` (a person's visible datasets), the
        Postgres-table ones holding ``org_id``'s rows; every layer of the module
        docstring applies as to a task's query."""
        if type(limit) is not int or not 1 <= limit <= MAX_QUERY_LIMIT:
            raise InvalidInput("limit", f"must be an integer within 1..{MAX_QUERY_LIMIT}")
        attachable = {name.lower(): item for name, item in views.items()}
        return await self._answer(attachable, str(org_id), sql, limit)

    async def _answer(
        self, attachable: Mapping[str, DatasetInput], org: str | None, sql: str, limit: int
    ) -> QueryResult:
        """Run ``sql`` in a worker thread within the timeout (the views checked already)."""
        if self._limiter is None:
            self._limiter = anyio.CapacityLimiter(self.max_concurrent)
        running = _Running()
        try:
            with anyio.move_on_after(self.timeout_seconds):
                return await anyio.to_thread.run_sync(
                    self._run,
                    running,
                    attachable,
                    org,
                    sql,
                    limit,
                    limiter=self._limiter,
                    abandon_on_cancel=True,
                )
        finally:
            if not running.done:
                # Timed out or cancelled: the worker thread is abandoned; stop its jobs.
                threading.Thread(
                    target=running.interrupt, name="trace-query-interrupt", daemon=True
                ).start()
        raise InvalidInput(
            "sql",
            f"the query ran longer than {self.timeout_seconds:g} s and was cancelled",
        )

    # --- in the worker thread ---------------------------------------------------------

    def _run(
        self,
        running: _Running,
        views: Mapping[str, DatasetInput],
        org: str | None,
        sql: str,
        limit: int,
    ) -> QueryResult:
        try:
            base = self._spark.get()
            session = base.newSession()
            running.started(session)
            jvm = session._jvm
            assert jvm is not None
            sessions = getattr(jvm, "org.apache.spark.sql.classic.SparkSession")
            previous = sessions.getActiveSession()
            # The parser reads its settings (variable substitution) from the
            # thread's active session: make it this one, and restore it after.
            sessions.setActiveSession(session._jsparkSession)
            try:
                return self._query(session, running, views, org, sql, limit)
            finally:
                if previous.isDefined():
                    sessions.setActiveSession(previous.get())
                else:
                    sessions.clearActiveSession()
        except _Cancelled:
            raise InvalidInput("sql", "the query was cancelled") from None
        finally:
            running.done = True

    def _query(
        self,
        session: SparkSession,
        running: _Running,
        views: Mapping[str, DatasetInput],
        org: str | None,
        sql: str,
        limit: int,
    ) -> QueryResult:
        from pyspark.sql import DataFrame

        spark_errors = _spark_errors()
        jss = session._jsparkSession
        for key, value in SESSION_CONF.items():
            session.conf.set(key, value)
        self._harden(session)
        try:
            plan = jss.sessionState().sqlParser().parsePlan(sql)
            tree = json.loads(plan.toJSON())
        except spark_errors as exc:
            raise InvalidInput("sql", self._message(exc)) from None
        referenced = _check_parsed(
            tree, views, is_plan=lambda name: self._is_plan(session, name), builtins=self._names()
        )
        for name in sorted(referenced):
            running.check()
            self._attach(session, running, name, views[name], org)
        running.check()
        try:
            dataset = getattr(session._jvm, "org.apache.spark.sql.classic.Dataset")
            jdf = dataset.ofRows(jss, plan)
            _check_analyzed(jdf.queryExecution().analyzed(), referenced)
            frame = DataFrame(jdf, session)
            running.check()
            return self._collect(frame, limit)
        except spark_errors as exc:
            if running.cancelled:
                raise _Cancelled from None
            raise InvalidInput("sql", self._message(exc)) from None

    def _harden(self, session: SparkSession) -> None:
        """Drop :data:`DENIED_FUNCTIONS` from the session's own function registry."""
        jvm = session._jvm
        assert jvm is not None
        registry = session._jsparkSession.sessionState().functionRegistry()
        some = getattr(jvm, "scala.Some")
        identifier = getattr(jvm, "org.apache.spark.sql.catalyst.FunctionIdentifier")
        for name in sorted(DENIED_FUNCTIONS):
            registry.dropFunction(identifier(name, some("builtin"), some("system")))

    def _names(self) -> frozenset[str]:
        """The built-in function names of a hardened session (computed once)."""
        with self._lock:
            if self._builtins is None:
                session = self._spark.get().newSession()
                self._harden(session)
                found = session._jsparkSession.sessionState().functionRegistry().listFunction()
                names = set()
                iterator = found.iterator()
                while iterator.hasNext():
                    names.add(str(iterator.next().funcName()).lower())
                if names & DENIED_FUNCTIONS:
                    # Fail closed if this Spark names its functions differently.
                    raise ConfigurationError(
                        "SparkQueryService could not remove "
                        f"{', '.join(sorted(names & DENIED_FUNCTIONS))} from a query session"
                    )
                self._builtins = frozenset(names)
            return self._builtins

    def _is_plan(self, session: SparkSession, class_name: str) -> bool:
        """Whether ``class_name`` is a logical plan node (cached; unknown classes are)."""
        known = self._plans.get(class_name)
        if known is None:
            jvm = session._jvm
            assert jvm is not None
            try:
                plan = jvm.java.lang.Class.forName(_LOGICAL + "LogicalPlan")
                known = bool(plan.isAssignableFrom(jvm.java.lang.Class.forName(class_name)))
            except Exception:
                known = True  # fail closed: treated as a plan node, hence refused
            self._plans[class_name] = known
        return known

    def _attach(
        self,
        session: SparkSession,
        running: _Running,
        name: str,
        item: DatasetInput,
        org: str | None,
    ) -> None:
        """Attach ``item`` as the temporary view ``name``, filtered by its ``where``."""
        spark_errors = _spark_errors()
        field = f"view {name} filter"
        try:
            predicate = None if item.where is None else parse_where(item.where, field=field)
            if item.postgres_table is None:
                frame = self._parquet_frame(session, item)
            elif self._tables is None or org is None:
                raise InvalidInput(
                    "sql",
                    "it is a Postgres-table dataset and this Query Service has no data database",
                )
            else:
                rows = self._tables.read(
                    item.location, org, predicate, field=field, check=running.check
                )
                frame = session.createDataFrame(rows)
            if predicate is not None:
                predicate.check_columns(frame.columns, field=field)
                frame = frame.where(predicate.sql)
            frame.select(*[_quoted(column) for column in frame.columns]).createOrReplaceTempView(
                name
            )
        except InvalidInput as exc:
            raise InvalidInput("sql", f"view {name} cannot be attached: {exc.reason}") from None
        except spark_errors as exc:
            raise InvalidInput(
                "sql", f"view {name} cannot be attached: {self._message(exc)}"
            ) from None

    def _parquet_frame(self, session: SparkSession, item: DatasetInput) -> DataFrame:
        """The DataFrame of an S3 input's Parquet objects."""
        from pyspark.sql.types import StructType

        files = self._parquet_files(item)
        first = Path(files[0].removeprefix("file:")).stat()
        key = (item.location, files[0], first.st_size, first.st_mtime_ns)
        known = self._schemas.get(key)
        if known is None:
            frame = session.read.parquet(*files)
            self._schemas.put(key, frame.schema.json())
            return frame
        # Inferring a schema runs a Spark job: reuse what the same first
        # object gave (Spark infers from one object unless merging schemas).
        schema = StructType.fromJson(json.loads(known))
        return session.read.schema(schema).parquet(*files)

    def _parquet_files(self, item: DatasetInput) -> list[str]:
        """The input's Parquet objects as ``file:`` paths (never globs)."""
        prefix = item.s3_prefix
        assert prefix is not None
        directory = self._root / prefix.bucket / prefix.prefix
        missing = InvalidInput("sql", "the dataset has no Parquet objects yet")
        if not directory.is_dir():
            raise missing
        if not directory.resolve().is_relative_to(self._root.resolve()):
            raise InvalidInput("sql", "not in the object store")
        files = []
        for folder, subfolders, names in os.walk(directory):
            subfolders[:] = sorted(d for d in subfolders if not d.startswith((".", "_")))
            for file_name in sorted(names):
                path = Path(folder) / file_name
                if (
                    file_name.startswith((".", "_"))
                    or not file_name.endswith(".parquet")
                    or path.is_symlink()
                    or not path.is_file()
                ):
                    continue
                if _GLOB.search(str(path)):
                    raise InvalidInput(
                        "sql",
                        "an object key holds one of {}[]*?\\ (Spark would read it as a glob)",
                    )
                files.append(f"file:{path}")
        if not files:
            raise missing
        return files

    def _collect(self, frame: DataFrame, limit: int) -> QueryResult:
        from pyspark.sql import functions as F

        columns = tuple(
            QueryColumn(name=field.name, type=field.dataType.simpleString())
            for field in frame.schema.fields
        )
        keys = [f"c{i}" for i in range(len(columns))]
        rendered = (
            frame.toDF(*keys).limit(limit + 1).select(F.to_json(F.struct(*keys)).alias("row"))
        )
        rows: list[list[Any]] = []
        size = 0
        truncated = False
        for row in rendered.collect():
            text = row[0]
            size += len(text)
            if len(rows) == limit or size > self.max_result_bytes:
                truncated = True
                break
            values = json.loads(text, parse_constant=str)
            rows.append([values.get(key) for key in keys])
        return QueryResult(columns=columns, rows=rows, truncated=truncated)

    def _message(self, exc: BaseException) -> str:
        """Spark's message of ``exc``, local store paths as ``s3://`` URIs, capped."""
        from pyspark.errors import PySparkException

        java = getattr(exc, "java_exception", None)
        if isinstance(exc, PySparkException):
            # getMessage() is the condition and message alone; str() may add the
            # query excerpt (kept) or the analyzed plan (not: it is noise).
            full = str(exc).split("\n\nJVM stacktrace:", 1)[0]
            text = exc.getMessage() or full
            if "== SQL" in full:
                text += "\n" + full[full.index("== SQL") :].rstrip()
            elif at := _POSITION.search(full):
                text += f" (line {at.group(1)}, pos {at.group(2)})"
        elif java is not None:
            name = str(java.getClass().getSimpleName())
            if name == "StackOverflowError":
                text = "the query is nested too deeply"
            else:
                text = f"{name}: {java.getMessage()}"
        else:
            text = str(exc)
        text = text.strip().split("\n\nJVM stacktrace:", 1)[0]
        text = self._paths.sub("s3://", text)
        if len(text) > _MAX_MESSAGE:
            text = text[: _MAX_MESSAGE - 3] + "..."
        return text


def _spark_errors() -> tuple[type[Exception], ...]:
    """What a failing Spark call raises: PySpark's converted errors, or py4j's own."""
    from py4j.protocol import Py4JJavaError  # type: ignore[import-untyped]
    from pyspark.errors import PySparkException

    return (PySparkException, Py4JJavaError)


def _quoted(column: str) -> str:
    return "`" + column.replace("`", "``") + "`"


def _nodes(tree: Any) -> Iterator[dict[str, Any]]:
    """Every tree node (a JSON object with a ``class``) anywhere in ``tree``."""
    stack = [tree]
    while stack:
        value = stack.pop()
        if isinstance(value, dict):
            if "class" in value:
                yield value
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)


def _simple(class_name: str) -> str:
    return class_name.rsplit(".", 1)[-1].rstrip("$")


def _echo(text: object) -> str:
    shown = str(text)
    return shown if len(shown) <= _ECHO else shown[: _ECHO - 3] + "..."


def _check_parsed(
    tree: Any,
    views: Mapping[str, DatasetInput],
    *,
    is_plan: Callable[[str], bool],
    builtins: frozenset[str],
) -> set[str]:
    """Layer 1 on the parsed plan's JSON: the view names the query references.

    Raises :class:`InvalidInput` (``sql``) for anything but one read-only
    query of allowed clauses and built-in functions, :class:`NotAttached`
    for a reference to a relation that is not a view (nor a ``WITH`` name).
    """
    if not isinstance(tree, list) or not tree or not isinstance(tree[0], dict):
        raise InvalidInput("sql", "the query could not be checked")
    root = str(tree[0].get("class"))
    if root not in _QUERY_PLANS:
        raise InvalidInput(
            "sql",
            "only a single read-only query (SELECT, WITH, VALUES, TABLE, FROM ... |>) is "
            f"allowed, not {_simple(root)}",
        )
    nodes = list(_nodes(tree))
    defined: set[str] = set()
    for node in nodes:
        if node.get("class") == _UNRESOLVED_WITH:
            relations = node.get("cteRelations")
            if not isinstance(relations, list):
                raise InvalidInput("sql", "the query's WITH clause could not be checked")
            for relation in relations:
                name = relation.get("_1") if isinstance(relation, dict) else None
                if not isinstance(name, str) or not _IDENTIFIER.fullmatch(name):
                    raise InvalidInput(
                        "sql", "a WITH name must be a plain identifier ([A-Za-z_][A-Za-z0-9_]*)"
                    )
                defined.add(name.lower())
    referenced: set[str] = set()
    for node in nodes:
        name = str(node.get("class"))
        if name == _UNRESOLVED_RELATION:
            identifier = node.get("multipartIdentifier")
            if node.get("isStreaming") is not False:
                raise InvalidInput("sql", "streaming reads are not allowed")
            plain = _PLAIN_NAME.fullmatch(identifier) if isinstance(identifier, str) else None
            view = plain.group(1).lower() if plain else None
            if view is not None and view in views:
                referenced.add(view)
            elif view is None or view not in defined:
                # Plain names are quoted back; a qualified name or path is not.
                shown = f"`{_echo(plain.group(1))}`" if plain else "a qualified name or path"
                listed = sorted(views)
                more = f" and {len(listed) - _LISTED} more" if len(listed) > _LISTED else ""
                raise NotAttached(
                    f"{shown} is not one of the task's datasets; the query can read only "
                    f"the views {', '.join(listed[:_LISTED]) or '(none)'}{more}"
                )
        elif name == _UNRESOLVED_FUNCTION:
            parts = node.get("nameParts")
            plain = _PLAIN_NAME.fullmatch(parts) if isinstance(parts, str) else None
            if plain is None or plain.group(1).lower() not in builtins:
                shown = parts[1:-1] if isinstance(parts, str) else "?"
                raise InvalidInput(
                    "sql", f"function {_echo(shown)} is not an allowed built-in function"
                )
        elif name == _UNRESOLVED_GENERATOR:
            function = node.get("name")
            named = function.get("funcName") if isinstance(function, dict) else None
            qualified = isinstance(function, dict) and (
                function.get("database") is not None or function.get("catalog") is not None
            )
            if not isinstance(named, str) or qualified or named.lower() not in builtins:
                raise InvalidInput(
                    "sql", f"function {_echo(named)} is not an allowed built-in function"
                )
        elif name in _DENIED_EXPRESSIONS:
            raise InvalidInput("sql", "IDENTIFIER(...) with a computed name is not allowed")
        elif name in _TABLE_FUNCTIONS:
            raise InvalidInput("sql", "table-valued functions are not allowed")
        elif name not in _QUERY_PLANS and is_plan(name):
            raise InvalidInput("sql", f"{_simple(name)} is not allowed in a query")
    return referenced


def _items(seq: Any) -> list[Any]:
    """The elements of a Scala ``Seq`` (through py4j)."""
    iterator = seq.iterator()
    found = []
    while iterator.hasNext():
        found.append(iterator.next())
    return found


def _check_analyzed(plan: Any, attached: set[str]) -> None:
    """Layer 3: every relation the analyzed plan reads is an attached temporary view."""
    stack = [plan]
    visited = 0
    while stack:
        node = stack.pop()
        visited += 1
        if visited > _MAX_PLAN_NODES:
            raise InvalidInput("sql", "the query plan is too large")
        name = str(node.getClass().getName())
        if name == _VIEW:
            identifier = node.desc().identifier()
            table = str(identifier.table()).lower()
            if not (
                node.isTempView()
                and not identifier.database().isDefined()
                and not identifier.catalog().isDefined()
                and table in attached
            ):
                raise NotAttached("the query reads a view that is not one of the task's datasets")
            continue  # the view's own plan: the input's files, filtered
        children = _items(node.children())
        subqueries = _items(node.subqueries())
        if not children and name not in _LEAVES:
            raise NotAttached(
                f"the query reads a relation ({_simple(name)}) that is not one of the "
                "task's datasets"
            )
        stack.extend(children)
        stack.extend(subqueries)
