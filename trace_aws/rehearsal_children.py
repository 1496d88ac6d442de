"""The rehearsal's child processes: ``trace-aws`` commands, each in its own
process group, stopped together (:mod:`trace_aws.rehearsal`)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

from trace_core.errors import TraceError

__all__ = ["STOP_SECONDS", "Children"]

ROOT = Path(__file__).resolve().parents[1]
STOP_SECONDS = 10.0
"""How long the children get between SIGTERM and SIGKILL."""


class Children:
    """OS processes started in their own process groups, stopped together."""

    def __init__(self, log_dir: Path, env: Mapping[str, str]) -> None:
        self.log_dir = log_dir
        self.env = dict(env)
        self.started: list[tuple[str, subprocess.Popen[bytes], IO[bytes]]] = []

    def start(self, name: str, args: list[str], env: Mapping[str, str] | None = None) -> Any:
        """Start ``trace-aws ARGS`` as ``name`` (log ``<log_dir>/<name>.log``),
        ``env`` added to the common environment."""
        out = (self.log_dir / f"{name}.log").open("wb")
        process = subprocess.Popen(
            [sys.executable, "-m", "trace_aws.cli", *args],
            env={**self.env, **(env or {})},
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            # Its own group: the stop reaches its children too (Spark's JVM).
            start_new_session=True,
        )
        self.started.append((name, process, out))
        return process

    def run(
        self,
        name: str,
        args: list[str],
        env: Mapping[str, str] | None = None,
        timeout: float = 300.0,
    ) -> None:
        """Run ``trace-aws ARGS`` to its end (``env`` added to the common one);
        raise with its log unless it exits 0."""
        with (self.log_dir / f"{name}.log").open("wb") as out:
            done = subprocess.run(
                [sys.executable, "-m", "trace_aws.cli", *args],
                env={**self.env, **(env or {})},
                cwd=ROOT,
                stdout=out,
                stderr=subprocess.STDOUT,
                timeout=timeout,
                check=False,
            )
        if done.returncode != 0:
            raise TraceError(f"trace-aws {name} failed:\n{self.log(name)[-3000:]}")

    def log(self, name: str) -> str:
        """The output of ``name`` so far."""
        return (self.log_dir / f"{name}.log").read_text(errors="replace")

    def check_alive(self) -> None:
        """Raise naming the first child that exited, with its log's tail."""
        for name, process, _ in self.started:
            if process.poll() is not None:
                tail = self.log(name)[-3000:]
                raise TraceError(f"{name} exited with {process.returncode}:\n{tail}")

    def stop(self, seconds: float = STOP_SECONDS) -> None:
        """SIGTERM every group, wait up to ``seconds``, then SIGKILL what is left."""
        for _, process, _ in reversed(self.started):
            _signal_group(process, signal.SIGTERM)
        deadline = time.monotonic() + seconds
        for _, process, out in reversed(self.started):
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(process, signal.SIGKILL)
                process.wait(timeout=30)
            # The group may outlive its leader (a JVM): make sure it is gone.
            _signal_group(process, signal.SIGKILL)
            out.close()
        self.started.clear()


def _signal_group(process: subprocess.Popen[bytes], signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signum)
