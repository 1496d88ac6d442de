"""The table ``trace-lite`` dispatches through, and the options its commands share.

Every subcommand is one :class:`Command`: its words (``("dag", "deploy")``),
its help, how it uses the state database (:class:`~trace_lite.state_database.Use`),
a function adding its own arguments and the function running it.
:func:`build_parser` turns the table into the argparse tree; the shared
options (``--db`` and ``--data-dir`` for every command with a state
database, ``--data-db`` for those reading buffered tables) are declared once
here and attached as argparse parents, so they read and behave the same
everywhere.
"""

from __future__ import annotations

import argparse
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field

import anyio

from trace_lite.state_database import StateDatabase, Use

__all__ = [
    "Command",
    "Runner",
    "build_parser",
    "in_event_loop",
    "port",
    "positive_int",
]

Runner = Callable[[argparse.Namespace, StateDatabase], int]
"""Runs a command: its parsed arguments and its state database; the exit code."""

DB_HELP = (
    "state database URL (sqlite:///path or postgresql://user@host/db); "
    "default $TRACE_DATABASE_URL, else <data-dir>/trace.db"
)
DATA_DIR_HELP = (
    "data directory (default .trace/): the state database trace.db unless --db, "
    "the data database data.db unless --data-db, objects/, keys/"
)
DATA_DB_HELP = "data database URL of buffered tables (default sqlite:///<data-dir>/data.db)"


def _no_arguments(parser: argparse.ArgumentParser) -> None:
    """For a command with no arguments of its own."""


@dataclass(frozen=True)
class Command:
    """One ``trace-lite`` subcommand."""

    words: tuple[str, ...]
    help: str
    database: Use
    run: Runner
    arguments: Callable[[argparse.ArgumentParser], None] = field(default=_no_arguments)
    description: str | None = None
    data_database: bool = False
    """Whether it takes ``--data-db`` (it reads or writes buffered tables)."""


def in_event_loop(run: Callable[[argparse.Namespace, StateDatabase], Awaitable[int]]) -> Runner:
    """A :data:`Runner` for an async command: the database is opened (checked,
    or prepared) before the event loop starts, then ``run`` runs in it."""

    def runner(args: argparse.Namespace, db: StateDatabase) -> int:
        db.url()
        return anyio.run(run, args, db)

    return runner


def positive_int(option: str) -> Callable[[str], int]:
    """An argparse ``type`` for an integer >= 1 whose errors name ``option``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{option} must be an integer, got {text!r}") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"{option} must be >= 1, got {value}")
        return value

    return parse


def port(text: str) -> int:
    """An argparse ``type`` for ``--port``: 1..65535."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--port must be an integer, got {text!r}") from None
    if not 0 < value < 65536:
        raise argparse.ArgumentTypeError(f"--port must be within 1..65535, got {value}")
    return value


def _state_options() -> argparse.ArgumentParser:
    options = argparse.ArgumentParser(add_help=False)
    options.add_argument("--db", help=DB_HELP)
    options.add_argument("--data-dir", help=DATA_DIR_HELP)
    return options


def _data_options() -> argparse.ArgumentParser:
    options = argparse.ArgumentParser(add_help=False)
    options.add_argument("--data-db", help=DATA_DB_HELP)
    return options


def build_parser(
    prog: str, description: str, commands: Sequence[Command], groups: Mapping[str, str]
) -> argparse.ArgumentParser:
    """The argparse tree of ``commands``; each leaf's ``command`` default is its entry.

    ``groups`` gives the help of each group of commands, by its words
    (``db``, ``dag``, ``euterpe key``).
    """
    parser = argparse.ArgumentParser(
        prog=prog, description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    top = parser.add_subparsers(dest="words", required=True, metavar="COMMAND")
    state, data = _state_options(), _data_options()
    nested: dict[tuple[str, ...], argparse._SubParsersAction[argparse.ArgumentParser]] = {}
    for command in commands:
        where = top
        for depth, word in enumerate(command.words[:-1]):
            path = command.words[: depth + 1]
            if path not in nested:
                # A group's help is keyed by its words (``euterpe key``), or its one word.
                group = where.add_parser(word, help=groups.get(" ".join(path)) or groups[word])
                nested[path] = group.add_subparsers(
                    dest=f"words_{depth + 1}", required=True, metavar="COMMAND"
                )
            where = nested[path]
        parents = [state] if command.database is not Use.NONE else []
        if command.data_database:
            parents.append(data)
        leaf = where.add_parser(
            command.words[-1],
            help=command.help,
            description=command.description or command.help,
            parents=parents,
        )
        command.arguments(leaf)
        leaf.set_defaults(command=command)
    return parser
