"""Decoding encoded audio (files or in-memory bytes) to mono float32 samples.

Everything goes through soundfile (libsndfile: FLAC, WAV, OGG, MP3); unusable audio raises
AudioError whose `reason` is the skip reason counted in the store's report.
"""

from __future__ import annotations

import io
import os

import numpy as np
import soundfile as sf

TRUNCATION_TOLERANCE = 0.98  # MP3 frame counts are estimates; FLAC's are exact


class AudioError(Exception):
    """Audio that cannot be used; `reason` is the skip reason."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def decode_audio(source: str | io.BytesIO) -> tuple[np.ndarray, int]:
    """Mono float32 samples and the sample rate of an encoded file (path or in-memory bytes);
    truncated or corrupt data raise AudioError."""
    try:
        with sf.SoundFile(source) as f:
            declared, rate = f.frames, f.samplerate
            data = f.read(dtype="float32", always_2d=True)
    except (sf.LibsndfileError, RuntimeError, EOFError):
        raise AudioError("unreadable_audio") from None
    if declared > 0 and len(data) < TRUNCATION_TOLERANCE * declared:
        raise AudioError("truncated_audio")
    return data.mean(axis=1), rate


def decode_audio_bytes(data: bytes) -> tuple[np.ndarray, int]:
    if not data:
        raise AudioError("zero_length_audio")
    return decode_audio(io.BytesIO(data))


def read_audio_file(path: str) -> tuple[np.ndarray, int]:
    if not os.path.isfile(path):
        raise AudioError("missing_audio_file")
    if os.path.getsize(path) == 0:
        raise AudioError("zero_length_audio")
    return decode_audio(path)
