"""The preset registry: each preset's ffmpeg arguments run with the real
ffmpeg (installed by ``./dev``) on a one-second clip made from ffmpeg's own
test sources, and produce the container and streams the preset promises."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from trace_core.errors import InvalidInput
from trace_core.euterpe.presets import PRESETS, Preset, get_preset

_FORMATS = {
    "mp4": "mov,mp4,m4a,3gp,3g2,mj2",
    "m4a": "mov,mp4,m4a,3gp,3g2,mj2",
    "webm": "matroska,webm",
}


@pytest.fixture(scope="module")
def clip(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("clip") / "source.mkv"
    subprocess.run(
        [
            "ffmpeg",
            "-nostdin",
            "-hide_banner",
            "-loglevel",
            "error",
            "-f",
            "lavfi",
            "-i",
            "testsrc=duration=1:size=320x240:rate=15",
            "-f",
            "lavfi",
            "-i",
            "sine=frequency=440:duration=1",
            "-c:v",
            "ffv1",
            "-c:a",
            "pcm_s16le",
            "-shortest",
            str(path),
        ],
        check=True,
        timeout=60,
    )
    return path


def probe(path: Path) -> dict[str, Any]:
    out = subprocess.run(
        [
            "ffprobe",
            "-v",
            "error",
            "-print_format",
            "json",
            "-show_format",
            "-show_streams",
            str(path),
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    probed: dict[str, Any] = json.loads(out.stdout)
    return probed


@pytest.mark.parametrize("preset", list(PRESETS.values()), ids=list(PRESETS))
def test_each_preset_transcodes_with_ffmpeg(preset: Preset, clip: Path, tmp_path: Path) -> None:
    output = tmp_path / f"out.{preset.extension}"
    subprocess.run(
        [
            "ffmpeg",
            "-nostdin",
            "-hide_banner",
            "-loglevel",
            "error",
            "-i",
            str(clip),
            *preset.ffmpeg_args,
            str(output),
        ],
        check=True,
        timeout=120,
    )
    probed = probe(output)
    assert probed["format"]["format_name"] == _FORMATS[preset.extension]
    streams = {s["codec_type"]: s for s in probed["streams"]}
    assert "audio" in streams
    if preset.name.startswith("audio-"):
        assert "video" not in streams and streams["audio"]["codec_name"] == "aac"
    else:
        height = int(preset.name.rsplit("-", 1)[1].removesuffix("p"))
        assert streams["video"]["height"] == height
        assert streams["video"]["codec_name"] == {"mp4": "h264", "webm": "vp9"}[preset.extension]


def test_an_unknown_preset_is_named_without_echoing_it() -> None:
    assert get_preset("mp4-h264-720p").extension == "mp4"
    with pytest.raises(InvalidInput) as caught:
        get_preset("rm -rf /", field="presets[3]")
    assert caught.value.field == "presets[3]"
    assert "rm -rf" not in str(caught.value) and "mp4-h264-360p" in str(caught.value)
    with pytest.raises(InvalidInput):
        get_preset(None)
