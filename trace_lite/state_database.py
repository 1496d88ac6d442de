"""Where a ``trace-lite`` command's state database is, and how the command opens it.

One rule locates it, for every command: ``--db URL`` if given, else
``$TRACE_DATABASE_URL`` (the default of ``--db``), else the SQLite file
``<data dir>/trace.db``, where the data directory is ``--data-dir``
(``.trace`` by default). So ``trace-lite status chain --data-dir DIR`` reads
the database ``trace-lite run chain.yaml --data-dir DIR`` wrote.

How it is opened depends on what the command does (:class:`Use`):

- Commands that read or change a deployed system (``status``, ``datasets``,
  ``tasks``, ``explain``, ``metrics``, ``trigger``, ``dag deploy``,
  ``dag rollback``, ``dag validate --db``, ``db check``) never create a
  database: a missing SQLite file is an error naming the path looked for,
  and a database that is not at the newest schema revision is an error
  naming the exact ``trace-lite db upgrade`` command to run.
- Commands that start Trace (``run``, ``serve``, ``demo``) bring the
  embedded SQLite file to the newest revision by themselves, creating it
  (and its directory, owner-only) when it is new: that file belongs to one
  data directory, a migration of it takes well under a second, and a first
  ``trace-lite run`` or ``serve`` should just work. A Postgres database is
  shared (by several processes, possibly by several versions of Trace),
  so migrating it stays an operator's explicit step: these commands refuse
  a Postgres database that is not current and name ``trace-lite db upgrade``.
  ``trace-lite worker`` opens no database at all: it works through the HTTP
  API of ``serve``, which applies this rule.
- ``db upgrade`` creates and migrates either engine.
"""

from __future__ import annotations

import enum
import os
import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy.engine import make_url

from trace_core.errors import ConfigurationError
from trace_core.storage.migrate import SchemaState, schema_state, upgrade
from trace_core.storage.url import DatabaseURL, parse_database_url

__all__ = [
    "DATABASE_ENV",
    "DEFAULT_DATA_DIR",
    "Location",
    "StateDatabase",
    "Use",
    "locate",
    "open_state_database",
    "sqlite_file",
]

DATABASE_ENV = "TRACE_DATABASE_URL"
DEFAULT_DATA_DIR = Path(".trace")
_STATE_FILE = "trace.db"


class Use(enum.Enum):
    """How a command uses the state database (see the module docstring)."""

    NONE = "none"
    """Opens none (``worker``)."""
    OPTIONAL = "optional"
    """Only when ``--db`` or ``--data-dir`` is given, then as :attr:`READY`
    (``dag validate``)."""
    EXISTING = "existing"
    """Must exist, at any revision (``db check``)."""
    READY = "ready"
    """Must exist at the newest revision; never created or migrated."""
    START = "start"
    """Embedded SQLite: created and migrated; Postgres: must be current."""
    UPGRADE = "upgrade"
    """Created (SQLite) and migrated by the command itself (``db upgrade``)."""


@dataclass(frozen=True)
class Location:
    """The state database a command named, and how it was named."""

    url: DatabaseURL
    raw: str
    source: str
    """How it was found, for messages: ``--db``, ``$TRACE_DATABASE_URL``,
    ``--data-dir DIR`` or the default data directory."""
    data_dir: Path
    by_option: str | None
    """``--db`` or ``--data-dir`` when the location came from that option."""

    @property
    def masked(self) -> str:
        """The URL as given, with any password masked: a secret is never printed."""
        return make_url(self.raw).render_as_string(hide_password=True)

    def shown(self) -> str:
        """For messages: a SQLite file's absolute path, else the masked URL."""
        path = sqlite_file(self.url)
        return str(path.resolve()) if path is not None else self.masked

    def upgrade_command(self) -> str:
        """The exact command that migrates this database."""
        if self.by_option == "--db":
            return f"trace-lite db upgrade --db {shlex.quote(self.masked)}"
        if self.by_option == "--data-dir":
            return f"trace-lite db upgrade --data-dir {shlex.quote(str(self.data_dir))}"
        return "trace-lite db upgrade"  # the same environment finds the same database


def locate(db: str | None, data_dir: str | None, environ: Mapping[str, str]) -> Location:
    """Apply the one rule: ``--db``, else ``$TRACE_DATABASE_URL``, else
    ``<data dir>/trace.db``. Raises :class:`ConfigurationError` naming a bad URL."""
    directory = Path(data_dir) if data_dir else DEFAULT_DATA_DIR
    if db:
        return Location(parse_database_url(db), db, "--db", directory, "--db")
    from_env = environ.get(DATABASE_ENV, "").strip()
    if from_env:
        try:
            url = parse_database_url(from_env)
        except ConfigurationError as exc:
            raise ConfigurationError(f"${DATABASE_ENV}: {exc}") from None
        return Location(url, from_env, f"${DATABASE_ENV}", directory, None)
    raw = f"sqlite:///{directory / _STATE_FILE}"
    if data_dir:
        source = f"--data-dir {data_dir}"
        return Location(parse_database_url(raw), raw, source, directory, "--data-dir")
    source = f"the default data directory {DEFAULT_DATA_DIR}/; pass --data-dir or --db"
    return Location(parse_database_url(raw), raw, source, directory, None)


def sqlite_file(url: DatabaseURL) -> Path | None:
    """The file of a SQLite URL (``None`` for Postgres)."""
    if url.engine != "sqlite":
        return None
    return Path(str(url.sync_url.database))


def open_state_database(location: Location, use: Use) -> str:
    """Check (and for :attr:`Use.START`/:attr:`Use.UPGRADE` prepare) the database
    as ``use`` requires; the URL to open.

    Raises :class:`ConfigurationError` naming the path looked for, or the
    command that migrates the database; nothing is created unless ``use``
    allows it.
    """
    url, path = location.url, sqlite_file(location.url)
    if use is Use.NONE:
        return location.raw
    if path is not None and not path.exists():
        if use in (Use.START, Use.UPGRADE):
            # Owner-only, like the rest of the data directory (keys live beside it).
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        else:
            raise ConfigurationError(
                f"no state database at {location.shown()} (from {location.source}); "
                "nothing was created. Use the --data-dir (or --db) that `trace-lite run` "
                f"or `serve` used, or create an empty one: `{location.upgrade_command()}`"
            )
    state = schema_state(url)
    if use is Use.EXISTING:
        return location.raw  # ``db check`` reports any revision, even an unknown one
    if state.status == "unknown":
        raise ConfigurationError(_unknown_revision(location, state))
    if use is Use.START and path is not None:
        if state.status != "current":
            upgrade(url)
    elif use in (Use.READY, Use.OPTIONAL, Use.START) and state.status != "current":
        raise ConfigurationError(
            f"the state database {location.shown()} is at schema revision "
            f"{state.revision or 'none (never migrated)'}, not the newest ({state.head}): "
            f"run `{location.upgrade_command()}` first"
        )
    return location.raw


def _unknown_revision(location: Location, state: SchemaState) -> str:
    return (
        f"the state database {location.shown()} is at schema revision {state.revision}, "
        f"which this trace-lite does not know (its newest is {state.head}): a newer "
        "version of Trace migrated it; use that version"
    )


class StateDatabase:
    """A command's state database, opened on first use as its :class:`Use` says.

    Lazy, so that a command checks its own arguments (a token, a file)
    before anything is created or migrated.
    """

    def __init__(
        self,
        use: Use,
        db: str | None,
        data_dir: str | None,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        self.use = use
        self._db, self._data_dir = db, data_dir
        self._environ = os.environ if environ is None else environ
        self._location: Location | None = None
        self._url: str | None = None

    @property
    def named(self) -> bool:
        """Whether ``--db`` or ``--data-dir`` was given on the command line."""
        return bool(self._db or self._data_dir)

    @property
    def data_dir(self) -> Path:
        """The data directory (``--data-dir``, ``.trace`` by default)."""
        return Path(self._data_dir) if self._data_dir else DEFAULT_DATA_DIR

    @property
    def location(self) -> Location:
        """Where the database is (validates the URL; opens nothing)."""
        if self._location is None:
            self._location = locate(self._db, self._data_dir, self._environ)
        return self._location

    def url(self) -> str:
        """The database URL, checked (or prepared) once as the command's use says."""
        if self._url is None:
            self._url = open_state_database(self.location, self.use)
        return self._url
