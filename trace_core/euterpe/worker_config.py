"""Settings of a Euterpe worker (euterpe-contract.md §11, §12), validated at construction."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from trace_core.errors import ConfigurationError

__all__ = ["GB", "WorkerConfig"]

GB = 1_000_000_000
"""One gigabyte as §11 counts it ("when source > 1GB")."""


@dataclass(frozen=True)
class WorkerConfig:
    """How a worker polls, how much it runs at once, and its disk-safety limits."""

    poll_min_seconds: float = 0.5
    """Shortest wait between polls that found nothing (jittered up to the max)."""
    poll_max_seconds: float = 1.5
    batch_size: int = 2
    """Jobs claimed per poll (each is heartbeated from its claim on)."""
    concurrency: int = 2
    """Jobs worked on at once; a poll claims no more than the free slots."""
    heartbeat_seconds: float = 10.0
    """Time between heartbeats of a job; must be shorter than the lease."""
    max_source_bytes: int = 20 * GB
    """Largest source accepted: checked from its size before the download and
    enforced while streaming (§11)."""
    output_limit_threshold_bytes: int = GB
    """Above this source size, each output may be at most ``max_output_ratio``
    times the source (§11: 200 % when the source is over 1 GB)."""
    max_output_ratio: float = 2.0
    temp_dir: Path | None = None
    """Where each job's temporary directory is made (None: the system's)."""

    def __post_init__(self) -> None:
        if not 0 < self.poll_min_seconds <= self.poll_max_seconds:
            raise ConfigurationError(
                "WorkerConfig.poll_min_seconds must be > 0 and <= poll_max_seconds"
            )
        if not 1 <= self.batch_size <= 25:
            raise ConfigurationError("WorkerConfig.batch_size must be within 1..25")
        if not 1 <= self.concurrency <= 64:
            raise ConfigurationError("WorkerConfig.concurrency must be within 1..64")
        if self.heartbeat_seconds <= 0:
            raise ConfigurationError("WorkerConfig.heartbeat_seconds must be > 0")
        for name in ("max_source_bytes", "output_limit_threshold_bytes"):
            if getattr(self, name) < 1:
                raise ConfigurationError(f"WorkerConfig.{name} must be >= 1")
        if self.max_output_ratio <= 0:
            raise ConfigurationError("WorkerConfig.max_output_ratio must be > 0")
        if self.temp_dir is not None and not Path(self.temp_dir).is_dir():
            raise ConfigurationError("WorkerConfig.temp_dir must be an existing directory")

    def output_limit(self, source_size: int) -> int | None:
        """The largest output allowed for a source of ``source_size`` bytes;
        None when the source is not over the threshold (no limit)."""
        if source_size <= self.output_limit_threshold_bytes:
            return None
        return int(source_size * self.max_output_ratio)
