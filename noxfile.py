"""Nox sessions: the same checks as ``./dev lint`` and ``./dev test``, in isolated venvs.

``./dev`` is the everyday entry point; nox is for checking against a clean
environment (or another interpreter) before a release.
"""

from __future__ import annotations

import nox

nox.needs_version = ">=2024.4"
nox.options.sessions = ["lint", "typecheck", "tests"]
# Rebuilding venvs on every run costs minutes and buys nothing for local checks;
# `nox -R`/`--no-reuse-existing-virtualenvs` forces a fresh one.
nox.options.reuse_venv = "yes"

PACKAGES = ["trace_core", "trace_lite", "trace_aws", "trace_testing"]
# mypy must see every optional dependency, or imports in adapters become `Any`.
ALL_EXTRAS = ".[dev,postgres,spark,aws,http]"


@nox.session
def lint(session: nox.Session) -> None:
    """Run ruff's linter and formatter check."""
    session.install("ruff>=0.6")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def typecheck(session: nox.Session) -> None:
    """Run mypy in strict mode on the three import packages."""
    session.install("-e", ALL_EXTRAS)
    session.run("mypy", "--strict", *PACKAGES)


@nox.session
def tests(session: nox.Session) -> None:
    """Run the test suite on three workers, as ``./dev test`` does; each starts
    its own throwaway Postgres."""
    session.install("-e", ".[dev]")
    session.run("pytest", "-n", "3", "-p", "xdist", *session.posargs)
