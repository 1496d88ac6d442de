"""Euterpe's default processor: a real transcode with the ``ffmpeg`` binary.

:class:`FfmpegProcessor` runs one ``ffmpeg`` per preset, as a subprocess
without a shell: ``ffmpeg -nostdin -y -hide_banner -loglevel error -i SRC
<preset args> OUT``, the arguments coming only from the preset registry
(:mod:`trace_core.euterpe.presets`), never from requester text. stdin is
closed, stdout discarded, stderr captured (bounded) and, on failure, its
tail goes into the normalized error (``transcode_failed``). ffmpeg is killed
when the worker's stop signal is set (the lease was lost, the worker is
stopping), when the call is cancelled, and when it runs past
``timeout_seconds``. Each output is described with its size and sha256.
"""

from __future__ import annotations

import logging
import shutil
import signal
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path

import anyio
import anyio.abc

from trace_core.errors import ConfigurationError
from trace_core.euterpe.events import NormalizedError
from trace_core.euterpe.presets import Preset
from trace_core.euterpe.processor import (
    ProcessingFailed,
    ProducedOutput,
    describe_output,
    output_path,
)

__all__ = ["FfmpegProcessor", "ffmpeg_command"]

_log = logging.getLogger(__name__)
_STDERR_KEEP = 64 * 1024  # bytes of stderr kept while ffmpeg runs
_STDERR_REPORT = 1500  # characters of it put in the normalized error


def ffmpeg_command(
    binary: str,
    source: Path,
    preset: Preset,
    target: Path,
    input_args: Sequence[str] = (),
) -> list[str]:
    """The argument vector of one transcode (no shell ever parses it);
    ``input_args`` are the operator's, put before ``-i``."""
    return [
        binary,
        "-nostdin",
        "-y",
        "-hide_banner",
        "-loglevel",
        "error",
        *input_args,
        "-i",
        str(source),
        *preset.ffmpeg_args,
        str(target),
    ]


class FfmpegProcessor:
    """:class:`~trace_core.euterpe.processor.Processor` running ``ffmpeg`` (module docstring).

    ``input_args`` are operator-set arguments placed before ``-i`` (``-threads
    2``; tests use ``-re`` to make a run last as long as its clip);
    ``on_start`` (tests) is called with each started process.
    """

    def __init__(
        self,
        *,
        binary: str = "ffmpeg",
        timeout_seconds: float = 3600.0,
        input_args: Sequence[str] = (),
        on_start: Callable[[anyio.abc.Process], None] | None = None,
    ) -> None:
        found = shutil.which(binary)
        if found is None:
            raise ConfigurationError(
                f"FfmpegProcessor: {binary!r} not found on PATH (./dev setup installs ffmpeg)"
            )
        if timeout_seconds <= 0:
            raise ConfigurationError("FfmpegProcessor.timeout_seconds must be > 0")
        self.binary = found
        self.timeout_seconds = timeout_seconds
        self.input_args = tuple(input_args)
        self.on_start = on_start

    async def process(
        self,
        source: Path,
        presets: Sequence[Preset],
        output_dir: Path,
        stop: anyio.Event,
    ) -> list[ProducedOutput]:
        """Transcode ``source`` once per preset, in order."""
        produced = []
        for preset in presets:
            target = output_path(output_dir, preset)
            await self._run(
                ffmpeg_command(self.binary, source, preset, target, self.input_args), preset, stop
            )
            produced.append(await describe_output(preset, target))
        return produced

    async def _run(self, command: list[str], preset: Preset, stop: anyio.Event) -> None:
        stderr = bytearray()
        process = await anyio.open_process(
            command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        if self.on_start is not None:
            self.on_start(process)
        stopped = timed_out = False
        try:
            async with anyio.create_task_group() as group:

                async def watch_stop() -> None:
                    nonlocal stopped
                    await stop.wait()
                    stopped = True
                    process.kill()

                async def drain() -> None:
                    assert process.stderr is not None
                    async for chunk in process.stderr:
                        stderr.extend(chunk)
                        del stderr[:-_STDERR_KEEP]

                group.start_soon(watch_stop)
                group.start_soon(drain)
                with anyio.move_on_after(self.timeout_seconds) as deadline:
                    await process.wait()
                if deadline.cancelled_caught:
                    timed_out = True
                    process.kill()
                group.cancel_scope.cancel()
        finally:
            if process.returncode is None:
                process.kill()  # cancelled: the worker's lease is gone or it is stopping
            with anyio.CancelScope(shield=True):
                await process.wait()
                await process.aclose()
        code = process.returncode
        if stopped:
            raise ProcessingFailed(
                NormalizedError("transcode_stopped", "ffmpeg was stopped by the worker", True)
            )
        if timed_out:
            raise ProcessingFailed(
                NormalizedError(
                    "transcode_timeout",
                    f"ffmpeg ran longer than {self.timeout_seconds:g} s for preset {preset.name}",
                    True,
                )
            )
        if code != 0:
            tail = bytes(stderr).decode("utf-8", "replace").strip()[-_STDERR_REPORT:]
            killed = code is not None and code < 0
            how = f"exited {code}"
            if code is not None and code < 0:
                how = f"was killed by signal {_signal_name(-code)}"
            _log.warning("euterpe: ffmpeg %s for preset %s", how, preset.name)
            raise ProcessingFailed(
                NormalizedError(
                    "transcode_failed",
                    f"ffmpeg {how} for preset {preset.name}: {tail or 'no error output'}",
                    killed,  # a killed ffmpeg (memory, an operator) may succeed again
                )
            )


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)
