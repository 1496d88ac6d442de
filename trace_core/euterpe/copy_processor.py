"""A processor that does not transcode: each output is a copy of the source.

For tests and benchmarks (``python -m benchmarks.euterpe`` measures Euterpe's
own steps with it), never for requesters: the "outputs" are the source bytes
under each preset's file name.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path

import anyio
import anyio.to_thread

from trace_core.euterpe.presets import Preset
from trace_core.euterpe.processor import ProducedOutput, describe_output, output_path

__all__ = ["CopyProcessor"]


class CopyProcessor:
    """:class:`~trace_core.euterpe.processor.Processor` copying the source per preset."""

    async def process(
        self,
        source: Path,
        presets: Sequence[Preset],
        output_dir: Path,
        stop: anyio.Event,
    ) -> list[ProducedOutput]:
        """Copy ``source`` to each preset's output path; stops between copies
        when ``stop`` is set
        (what it returns then is discarded)."""
        produced = []
        for preset in presets:
            if stop.is_set():
                break  # the worker discards a stopped job's outputs
            target = output_path(output_dir, preset)
            await anyio.to_thread.run_sync(shutil.copyfile, source, target)
            produced.append(await describe_output(preset, target))
        return produced
