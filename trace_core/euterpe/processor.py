"""The processor port: what turns a downloaded source into one output per preset.

A :class:`Processor` is given the local source file, the presets the request
names, an empty output directory and a *stop* signal; it writes one file per
preset (at :func:`output_path`) and returns them described by
:func:`describe_output` (size and sha256, what the ``succeeded`` event
reports). When ``stop`` is set (the lease was lost, the worker is stopping)
it must end its work at once (the ffmpeg processor kills ffmpeg); the worker
also cancels the call. A processor reports a failure the requester should see
as :class:`ProcessingFailed` with a normalized error; any other exception is
an unexpected crash, retried while attempts remain.

Implementations: :class:`~trace_lite.euterpe_ffmpeg.FfmpegProcessor` (the
default, a real transcode) and
:class:`~trace_core.euterpe.copy_processor.CopyProcessor` (no transcoding, for
tests and benchmarks).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import anyio
import anyio.to_thread

from trace_core.errors import TraceError
from trace_core.euterpe.events import NormalizedError
from trace_core.euterpe.presets import Preset

__all__ = [
    "ProcessingFailed",
    "Processor",
    "ProducedOutput",
    "describe_output",
    "output_path",
]

_CHUNK = 1024 * 1024


@dataclass(frozen=True)
class ProducedOutput:
    """One output file a processor wrote."""

    preset: str
    path: Path
    size: int
    sha256: str
    """Lowercase hex digest of the file's bytes."""


class ProcessingFailed(TraceError):
    """The processor could not produce the outputs; ``error`` says why to the requester."""

    def __init__(self, error: NormalizedError) -> None:
        super().__init__(f"{error.code}: {error.message}")
        self.error = error


class Processor(Protocol):
    """Produces one output file per preset from a local source (module docstring)."""

    async def process(
        self,
        source: Path,
        presets: Sequence[Preset],
        output_dir: Path,
        stop: anyio.Event,
    ) -> list[ProducedOutput]:
        """Write one output per preset into ``output_dir`` and describe them,
        in the order of ``presets``; stop at once when ``stop`` is set."""
        ...


def output_path(output_dir: Path, preset: Preset) -> Path:
    """Where the output of ``preset`` is written: ``<dir>/<name>.<extension>``
    (preset names are fixed registry names, never requester text)."""
    return output_dir / f"{preset.name}.{preset.extension}"


def _digest(path: Path) -> tuple[int, str]:
    sha = hashlib.sha256()
    size = 0
    with path.open("rb") as fh:
        while chunk := fh.read(_CHUNK):
            sha.update(chunk)
            size += len(chunk)
    return size, sha.hexdigest()


async def describe_output(preset: Preset, path: Path) -> ProducedOutput:
    """``path`` as the output of ``preset``: its size and sha256, read off the loop."""
    size, sha = await anyio.to_thread.run_sync(_digest, path)
    return ProducedOutput(preset.name, path, size, sha)
