"""Decoding audio: cut-off WAV, AIFF, W64, AU, NIST and Ogg copies, implausible headers and
samples are skip reasons, containers whose cut-off copies cannot be told are refused; whole files
(streamed WAVs and .au files of unknown length among them) decode to libsndfile's samples."""

from __future__ import annotations

import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from pflbench.data.audio import (
    MAX_SECONDS,
    AudioError,
    decode_audio_bytes,
    read_audio_file,
)

RATE = 16_000
SPEECH = (0.1 * np.random.default_rng(0).standard_normal(3 * RATE)).astype(np.float32)


def reason(path: Path) -> str | None:
    try:
        read_audio_file(str(path))
    except AudioError as err:
        return err.reason
    return None


def write(path: Path, samples: np.ndarray, rate: int = RATE, **kwargs: str) -> bytes:
    sf.write(path, samples, rate, **kwargs)
    return path.read_bytes()


def cut(path: Path, data: bytes, fraction: float) -> Path:
    """An interrupted copy: the first `fraction` of the file's bytes."""
    path.write_bytes(data[: int(fraction * len(data))])
    return path


def set_flac_total_samples(path: Path, total: int) -> None:
    """Rewrites STREAMINFO's 36-bit total sample count (the low bits of bytes 18-25)."""
    data = bytearray(path.read_bytes())
    assert data[:4] == b"fLaC"
    fields = int.from_bytes(data[18:26], "big") & ~((1 << 36) - 1)
    data[18:26] = (fields | total).to_bytes(8, "big")
    path.write_bytes(bytes(data))


WAV_KINDS = [  # RIFF, float (with fact and PEAK chunks), WAVE_FORMAT_EXTENSIBLE, RF64, RIFX
    ("WAV", "PCM_16", "FILE"), ("WAV", "FLOAT", "FILE"), ("WAVEX", "PCM_24", "FILE"),
    ("RF64", "PCM_16", "FILE"), ("WAV", "PCM_16", "BIG"),
]  # fmt: skip


# Containers whose cut-off copies libsndfile reads as whole, as it does WAV's: AIFF and AIFC
# (float), Sony Wave64, Sun .au in both byte orders, NIST SPHERE (TIMIT's).
CHUNKED_KINDS = [
    ("AIFF", "PCM_16", "FILE"), ("AIFF", "FLOAT", "FILE"), ("W64", "PCM_16", "FILE"),
    ("AU", "PCM_16", "FILE"), ("AU", "PCM_16", "LITTLE"), ("NIST", "PCM_16", "FILE"),
]  # fmt: skip


@pytest.mark.parametrize("fraction", [0.15, 0.5, 0.9])
@pytest.mark.parametrize(("container", "subtype", "endian"), WAV_KINDS + CHUNKED_KINDS)
def test_cut_off_wav_aiff_w64_au_and_nist_are_truncated(
    tmp_path: Path, container: str, subtype: str, endian: str, fraction: float
) -> None:
    data = write(tmp_path / "full.snd", SPEECH, format=container, subtype=subtype, endian=endian)
    with sf.SoundFile(cut(tmp_path / "cut.snd", data, fraction)) as f:
        assert f.frames < fraction * len(SPEECH) + 1  # libsndfile's count: the cut-off length
    assert reason(tmp_path / "cut.snd") == "truncated_audio"
    with pytest.raises(AudioError, match="truncated_audio"):
        decode_audio_bytes(data[: int(fraction * len(data))])


def test_au_of_unknown_data_size_is_not_truncated(tmp_path: Path) -> None:
    """A .au written to a pipe declares its data size as all ones: read to the end."""
    data = bytearray(write(tmp_path / "whole.au", SPEECH, format="AU", subtype="PCM_16"))
    data[8:12] = struct.pack(">I", 0xFFFF_FFFF)
    (tmp_path / "streamed.au").write_bytes(bytes(data))
    wave, _ = read_audio_file(str(tmp_path / "streamed.au"))
    np.testing.assert_array_equal(wave, sf.read(tmp_path / "whole.au", dtype="float32")[0])


@pytest.mark.parametrize("container", ["VOC", "IRCAM", "PAF", "SVX"])
def test_containers_whose_cut_off_copies_cannot_be_told_are_refused(
    tmp_path: Path, container: str
) -> None:
    write(tmp_path / "whole.snd", SPEECH, format=container, subtype="PCM_16")
    assert reason(tmp_path / "whole.snd") == "unsupported_audio_format"


@pytest.mark.parametrize("fraction", [0.5, 0.9, 0.999])
@pytest.mark.parametrize("subtype", ["VORBIS", "OPUS"])
def test_cut_off_ogg_is_truncated(tmp_path: Path, subtype: str, fraction: float) -> None:
    data = write(tmp_path / "full.ogg", SPEECH, format="OGG", subtype=subtype)
    assert reason(cut(tmp_path / "cut.ogg", data, fraction)) == "truncated_audio"


def test_ogg_cut_between_pages_is_truncated(tmp_path: Path) -> None:
    """Cut where a page ends: every page whole, but none flagged end-of-stream."""
    data = write(tmp_path / "full.ogg", SPEECH, format="OGG", subtype="VORBIS")
    last_page = data.rindex(b"OggS")
    assert data[last_page + 5] & 0x04  # the end-of-stream flag, on the last page only
    assert reason(cut(tmp_path / "cut.ogg", data, last_page / len(data))) == "truncated_audio"


@pytest.mark.parametrize(
    ("container", "subtype", "endian"),
    WAV_KINDS + CHUNKED_KINDS + [
        ("OGG", "VORBIS", "FILE"), ("OGG", "OPUS", "FILE"), ("FLAC", "PCM_16", "FILE"),
        ("MP3", "MPEG_LAYER_III", "FILE"), ("CAF", "PCM_16", "FILE"),
    ],
)  # fmt: skip
def test_whole_files_decode_as_libsndfile_reads_them(
    tmp_path: Path, container: str, subtype: str, endian: str
) -> None:
    """From a path and from bytes: the container checks leave the bytes where libsndfile reads.
    (Not sf.read: it seeks to the start first, and a seek changes MP3's decoded samples.)"""
    path = tmp_path / "whole.audio"
    stereo = np.stack([SPEECH, -SPEECH / 2], axis=1)
    data = write(path, stereo, format=container, subtype=subtype, endian=endian)
    with sf.SoundFile(path) as f:
        expected = f.read(dtype="float32", always_2d=True).mean(axis=1)
    for wave, rate in (read_audio_file(str(path)), decode_audio_bytes(data)):
        assert rate == RATE
        np.testing.assert_array_equal(wave, expected)


@pytest.mark.parametrize(("riff_size", "data_size"), [(0xFFFF_FFFF, 0xFFFF_FFFF), (8, 0)])
def test_streamed_wav_of_unknown_length_is_not_truncated(
    tmp_path: Path, riff_size: int, data_size: int
) -> None:
    """A writer that cannot seek back leaves the sizes unknown: all ones (ffmpeg to a pipe), or
    0 (a recorder stopped before closing the file, which libsndfile reads to the end)."""
    data = bytearray(write(tmp_path / "whole.wav", SPEECH, subtype="PCM_16"))
    assert data[36:40] == b"data"
    data[4:8], data[40:44] = struct.pack("<I", riff_size), struct.pack("<I", data_size)
    (tmp_path / "streamed.wav").write_bytes(bytes(data))
    wave, _ = read_audio_file(str(tmp_path / "streamed.wav"))
    np.testing.assert_array_equal(wave, sf.read(tmp_path / "whole.wav", dtype="float32")[0])


def test_flac_declaring_2_to_36_samples_is_implausible_not_a_memory_error(tmp_path: Path) -> None:
    sf.write(tmp_path / "huge.flac", SPEECH, RATE, format="FLAC")
    set_flac_total_samples(tmp_path / "huge.flac", (1 << 36) - 1)
    assert reason(tmp_path / "huge.flac") == "implausible_length"


def test_flac_declaring_just_over_an_hour_is_implausible(tmp_path: Path) -> None:
    sf.write(tmp_path / "hour.flac", SPEECH, RATE, format="FLAC")
    set_flac_total_samples(tmp_path / "hour.flac", MAX_SECONDS * RATE + 1)
    assert reason(tmp_path / "hour.flac") == "implausible_length"


def test_plausible_length_too_large_to_allocate_is_implausible(tmp_path: Path) -> None:
    """Just under an hour of 8 channels at 192 kHz is 22 GB of float32: under a 4 GB address
    space soundfile's allocation fails, in a process of its own."""
    rate, channels = 192_000, 8
    path = tmp_path / "wide.flac"
    sf.write(path, np.zeros((rate, channels), np.float32), rate, format="FLAC")
    set_flac_total_samples(path, (MAX_SECONDS - 1) * rate)
    probe = (
        "import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))\n"
        "from pflbench.data.audio import AudioError, read_audio_file\n"
        "try: read_audio_file(sys.argv[1])\n"
        "except AudioError as err: print(err.reason)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe, str(path)], capture_output=True, text=True, timeout=120
    )
    assert done.stdout.strip() == "implausible_length", done.stderr[-2000:]


@pytest.mark.parametrize("rate", [1, 100, 3_999, 192_001, 384_000])
def test_implausible_sample_rate(tmp_path: Path, rate: int) -> None:
    sf.write(tmp_path / "rate.wav", SPEECH, rate)
    assert reason(tmp_path / "rate.wav") == "implausible_sample_rate"


@pytest.mark.parametrize("rate", [4_000, 8_000, 48_000, 192_000])
def test_plausible_sample_rate(tmp_path: Path, rate: int) -> None:
    sf.write(tmp_path / "rate.wav", SPEECH, rate)
    assert read_audio_file(str(tmp_path / "rate.wav"))[1] == rate


@pytest.mark.parametrize(
    ("bad", "channel"),
    [(np.nan, 0), (np.inf, 0), (-np.inf, 0), (np.nan, 1)],
)
def test_nonfinite_float_samples(tmp_path: Path, bad: float, channel: int) -> None:
    samples = np.stack([SPEECH, SPEECH], axis=1)
    samples[1000, channel] = bad
    sf.write(tmp_path / "bad.wav", samples, RATE, subtype="FLOAT")
    assert reason(tmp_path / "bad.wav") == "nonfinite_audio"


def test_float_samples_beyond_any_full_scale_are_implausible(tmp_path: Path) -> None:
    sf.write(tmp_path / "huge.wav", SPEECH * 1e30, RATE, subtype="FLOAT")
    assert reason(tmp_path / "huge.wav") == "implausible_amplitude"


@pytest.mark.parametrize("peak", [1.5, 32_767.0, 2.0**31])
def test_float_samples_above_one_at_a_plausible_scale_decode(tmp_path: Path, peak: float) -> None:
    """A float mix over 0 dBFS, or integer samples stored unscaled, are still audio."""
    samples = SPEECH / np.abs(SPEECH).max() * np.float32(peak)
    sf.write(tmp_path / "loud.wav", samples, RATE, subtype="FLOAT")
    np.testing.assert_array_equal(read_audio_file(str(tmp_path / "loud.wav"))[0], samples)
