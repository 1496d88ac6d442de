"""The transcode presets a request may name (issue 16, POST /transcode).

A small, fixed registry: each preset is a named set of ffmpeg output
arguments and the file extension of what it produces. Requests name presets,
never raw ffmpeg arguments, so no requester text ever reaches ffmpeg's
command line. The arguments go between ``-i <source>`` and the output path.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from trace_core.errors import InvalidInput

__all__ = ["PRESETS", "Preset", "get_preset"]


@dataclass(frozen=True)
class Preset:
    """One output format: ``ffmpeg -i SRC <ffmpeg_args> OUT.<extension>``."""

    name: str
    extension: str
    """Without the dot: ``mp4``, ``webm``, ``m4a``."""
    content_type: str
    ffmpeg_args: tuple[str, ...]
    description: str


_H264 = ("-c:v", "libx264", "-preset", "veryfast", "-crf", "23", "-pix_fmt", "yuv420p")
_AAC = ("-c:a", "aac", "-b:a", "128k")
_MP4 = ("-movflags", "+faststart")

_ALL = (
    Preset(
        "mp4-h264-360p",
        "mp4",
        "video/mp4",
        ("-vf", "scale=-2:360", *_H264, *_AAC, *_MP4),
        "H.264 video scaled to 360 lines, AAC 128 kb/s audio, MP4 (fast start)",
    ),
    Preset(
        "mp4-h264-720p",
        "mp4",
        "video/mp4",
        ("-vf", "scale=-2:720", *_H264, *_AAC, *_MP4),
        "H.264 video scaled to 720 lines, AAC 128 kb/s audio, MP4 (fast start)",
    ),
    Preset(
        "webm-vp9-360p",
        "webm",
        "video/webm",
        (
            "-vf",
            "scale=-2:360",
            "-c:v",
            "libvpx-vp9",
            "-b:v",
            "0",
            "-crf",
            "35",
            "-deadline",
            "realtime",
            "-cpu-used",
            "8",
            "-c:a",
            "libopus",
            "-b:a",
            "96k",
        ),
        "VP9 video scaled to 360 lines, Opus 96 kb/s audio, WebM",
    ),
    Preset(
        "audio-aac-128k",
        "m4a",
        "audio/mp4",
        ("-vn", *_AAC, *_MP4),
        "The audio track only, AAC 128 kb/s, M4A",
    ),
)

PRESETS: Mapping[str, Preset] = MappingProxyType({p.name: p for p in _ALL})
"""Every preset by name."""


def get_preset(name: object, field: str = "presets") -> Preset:
    """The preset called ``name``; :class:`InvalidInput` naming ``field`` and
    the known presets otherwise."""
    preset = PRESETS.get(name) if isinstance(name, str) else None
    if preset is None:
        # The name is not quoted back: nothing a requester sent is echoed.
        raise InvalidInput(field, f"unknown preset (known: {', '.join(PRESETS)})")
    return preset
