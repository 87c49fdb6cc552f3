"""Decoding encoded audio (files or in-memory bytes) to mono float32 samples.

Everything goes through soundfile (libsndfile: FLAC, WAV, OGG, MP3); unusable audio raises
AudioError whose `reason` is the skip reason counted in the store's report:
  missing_audio_file       no file at the path (or a dataset row without audio)
  zero_length_audio        an empty file, or no samples
  unreadable_audio         libsndfile cannot decode it (corrupt, or cut inside a FLAC)
  truncated_audio          fewer samples or bytes than the file declares (a cut-off copy)
  unsupported_audio_format a container whose cut-off copies cannot be told (UNCHECKED_FORMATS)
  implausible_sample_rate  a sample rate outside MIN_SAMPLE_RATE..MAX_SAMPLE_RATE
  implausible_length       a declared length above MAX_SECONDS, or too large to allocate
  nonfinite_audio          a NaN or infinite sample (float files)
  implausible_amplitude    a float sample beyond MAX_ABS_SAMPLE
"""

from __future__ import annotations

import io
import math
import os
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from typing import BinaryIO

import numpy as np
import soundfile as sf

# Under this fraction of the declared samples (a WAV's: data bytes) a file is a cut-off copy: one
# rule for every format, loose enough for MP3's estimated frame counts (FLAC's, WAV's are exact).
TRUNCATION_TOLERANCE = 0.98
# Telephone speech is sampled at 8 kHz, studio recordings at most at 192 kHz; a rate outside half
# the one to the other is a corrupt header (1 Hz hangs the resampler, 100 Hz turns 3 s of samples
# into a 480 s utterance).
MIN_SAMPLE_RATE, MAX_SAMPLE_RATE = 4_000, 192_000
# Utterances last seconds (LibriSpeech's longest ~35 s, Common Voice's at most 10 s) and even an
# unsegmented talk lasts minutes: a declared hour is a corrupt header, and reading it would
# allocate from the claim (an hour of 48 kHz stereo float32 is 1.4 GB).
MAX_SECONDS = 3_600
# Float files store samples unscaled, and a float mix may well exceed 1.0: any scale up to an
# unscaled int32 file's is a recording (the features are normalized per utterance, so a louder
# copy differs only where its quiet bins meet the log floor). Beyond that no scaling makes the
# values samples (1e30 overflows the log-mel power to inf).
MAX_ABS_SAMPLE = 2.0**31

WAV_FORMATS = {"WAV", "WAVEX", "RF64"}  # libsndfile's names of RIFF WAVE files
# A writer that cannot seek back (a stream) leaves the data size unknown: 0 or all ones.
WAV_UNKNOWN_DATA_SIZES = {0, 0xFFFF_FFFF, 0xFFFF_FFFF_FFFF_FFFF}
# Sony Wave64's chunk GUIDs: the file's ("riff" + suffix) and the data chunk's.
W64_RIFF = b"riff" + bytes.fromhex("2e91cf11a5d628db04c10000")
W64_DATA = b"data" + bytes.fromhex("f3acd3118cd100c04f8edb8a")
NIST_SIZE_FIELDS = (b"sample_count", b"sample_n_bytes", b"channel_count")
# Containers libsndfile reads whose cut-off copies it reads as whole (their frame counts come from
# the file's length) and whose headers pflbench does not parse: a shortened utterance under its
# full transcript would pass unseen, so they are refused. Speech corpora ship none of them.
UNCHECKED_FORMATS = {"AVR", "SVX", "MAT4", "MAT5", "MPC2K", "PAF", "PVF", "IRCAM", "VOC", "WVE"}
OGG_PAGE_HEADER = 27  # bytes before a page's segment table
OGG_END_OF_STREAM = 0x04  # header-type flag of a stream's last page


class AudioError(Exception):
    """Audio that cannot be used; `reason` is the skip reason."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@contextmanager
def _byte_stream(source: str | io.BytesIO) -> Iterator[BinaryIO]:
    """The encoded bytes as a seekable stream; in-memory bytes are left at the position where
    libsndfile reads next."""
    if isinstance(source, str):
        with open(source, "rb") as stream:
            yield stream
        return
    position = source.tell()
    try:
        yield source
    finally:
        source.seek(position)


def _chunks(
    stream: BinaryIO,
    size: int,
    position: int,
    id_size: int,
    size_format: str,
    align: int,
    size_counts_header: bool = False,
) -> Iterator[tuple[bytes, int, bytes, int]]:
    """(id, size, first body bytes, body offset) of each chunk of a chunked container from
    `position` on, while a whole chunk header lies in the file (RIFF: 4-byte ids, sizes padded to
    2; W64: 16-byte GUIDs, sizes counting the header, padded to 8)."""
    header = id_size + struct.calcsize(size_format)
    while position + header <= size:
        stream.seek(position)
        head = stream.read(header + 16)  # the body's start: RF64's ds64 sizes
        (chunk_size,) = struct.unpack(size_format, head[id_size:header])
        yield head[:id_size], chunk_size, head[header:], position + header
        extent = chunk_size if size_counts_header else header + chunk_size
        if extent <= 0:
            return  # a W64 chunk claiming no bytes: libsndfile judges
        position += extent + (-extent % align)


def _holds_less(declared: int, available: int, unknown: set[int]) -> bool:
    """Whether `available` bytes are a cut-off copy of a declared `declared`."""
    return declared not in unknown and available < TRUNCATION_TOLERANCE * declared


def _wav_data_cut_off(stream: BinaryIO, size: int) -> bool:
    """Whether a RIFF/RIFX/RF64 WAV holds fewer data bytes than its data chunk declares.
    libsndfile takes a WAV's frame count from the file's length, so a cut-off copy looks whole."""
    riff = stream.read(12)
    if riff[:4] not in (b"RIFF", b"RIFX", b"RF64", b"BW64") or riff[8:12] != b"WAVE":
        return False
    size_format = ">I" if riff[:4] == b"RIFX" else "<I"
    ds64_data_size = None  # RF64 declares the data size here, the data chunk's is all ones
    for chunk_id, chunk_size, body, offset in _chunks(stream, size, 12, 4, size_format, 2):
        if chunk_id == b"ds64" and len(body) == 16:
            (ds64_data_size,) = struct.unpack("<Q", body[8:16])
        elif chunk_id == b"data":
            declared = chunk_size
            if chunk_size == 0xFFFF_FFFF and ds64_data_size is not None:
                declared = ds64_data_size
            return _holds_less(declared, size - offset, WAV_UNKNOWN_DATA_SIZES)
    return False  # no data chunk where the sizes lead: libsndfile judges


def _aiff_data_cut_off(stream: BinaryIO, size: int) -> bool:
    """Whether an AIFF/AIFC file holds fewer bytes than its SSND chunk declares (libsndfile, as
    for WAV, counts the frames the file's length holds)."""
    form = stream.read(12)
    if form[:4] != b"FORM" or form[8:12] not in (b"AIFF", b"AIFC"):
        return False
    for chunk_id, chunk_size, _, offset in _chunks(stream, size, 12, 4, ">I", 2):
        if chunk_id == b"SSND":
            return _holds_less(chunk_size, size - offset, WAV_UNKNOWN_DATA_SIZES)
    return False


def _w64_data_cut_off(stream: BinaryIO, size: int) -> bool:
    """Whether a Sony Wave64 file holds fewer bytes than its data chunk declares."""
    if stream.read(16) != W64_RIFF:
        return False
    for chunk_id, chunk_size, _, offset in _chunks(stream, size, 40, 16, "<Q", 8, True):
        if chunk_id == W64_DATA:
            return _holds_less(chunk_size - 24, size - offset, {0})
    return False


def _au_data_cut_off(stream: BinaryIO, size: int) -> bool:
    """Whether a Sun/NeXT .au file holds fewer bytes than its header's data size (all ones:
    unknown, a stream's)."""
    header = stream.read(12)
    if len(header) < 12 or header[:4] not in (b".snd", b"dns."):
        return False
    offset, declared = struct.unpack(">II" if header[:4] == b".snd" else "<II", header[4:12])
    return _holds_less(declared, size - offset, {0xFFFF_FFFF})


def _nist_data_cut_off(stream: BinaryIO, size: int) -> bool:
    """Whether a NIST SPHERE file (TIMIT's, Switchboard's) holds fewer sample bytes than its
    header's sample_count × sample_n_bytes × channel_count."""
    head = stream.read(1024)
    if not head.startswith(b"NIST_1A\n"):
        return False
    lines = head.split(b"\n")
    fields = dict(line.split(b" ", 1) for line in lines[2:] if line.count(b" ") >= 2)
    try:
        header_size = int(lines[1])
        values = [int(fields[k].split(b" ", 1)[1]) for k in NIST_SIZE_FIELDS]
    except (KeyError, ValueError, IndexError):
        return False  # a header without the sizes: libsndfile judges
    return _holds_less(math.prod(values), size - header_size, {0})


def _ogg_cut_off(stream: BinaryIO, size: int) -> bool:
    """Whether an Ogg file ends inside a page or on a page not flagged end-of-stream. No Ogg
    header declares the total length, and libsndfile counts frames up to the last whole page, so
    the pages themselves are the only evidence of a cut-off copy."""
    position, last_flags = 0, None
    while True:
        stream.seek(position)
        header = stream.read(OGG_PAGE_HEADER)
        if header[:4] != b"OggS":
            break  # the end, or bytes after the last page (a tag): judged by that page
        segment_sizes = stream.read(header[26]) if len(header) == OGG_PAGE_HEADER else b""
        position += OGG_PAGE_HEADER + len(segment_sizes) + sum(segment_sizes)
        if len(header) < OGG_PAGE_HEADER or len(segment_sizes) < header[26] or position > size:
            return True
        last_flags = header[5]
    return last_flags is not None and not last_flags & OGG_END_OF_STREAM


# libsndfile's format name -> the check of its declared length against the file's.
CUT_OFF_CHECKS = {
    **{name: _wav_data_cut_off for name in WAV_FORMATS},
    "OGG": _ogg_cut_off,
    "AIFF": _aiff_data_cut_off,
    "W64": _w64_data_cut_off,
    "AU": _au_data_cut_off,
    "NIST": _nist_data_cut_off,
}


def _cut_off(source: str | io.BytesIO, container: str) -> bool:
    """Whether a container declares more than it holds; AudioError for one whose cut-off copies
    libsndfile reads as whole and pflbench does not parse (UNCHECKED_FORMATS)."""
    if container in UNCHECKED_FORMATS:
        raise AudioError("unsupported_audio_format")
    check = CUT_OFF_CHECKS.get(container)
    if check is None:  # FLAC and MP3 declare their lengths to libsndfile, compared after
        return False  # reading; CAF, HTK, SD2, SDS and XI copies fail to decode when cut
    with _byte_stream(source) as stream:
        size = stream.seek(0, io.SEEK_END)
        stream.seek(0)
        return check(stream, size)


def _check_samples(data: np.ndarray) -> None:
    if data.size == 0:
        return  # zero_length_audio, the store's to say
    # min and max propagate NaN and keep ±inf: two fast passes without a temporary array.
    low, high = float(data.min()), float(data.max())
    if not (math.isfinite(low) and math.isfinite(high)):
        raise AudioError("nonfinite_audio")
    if max(high, -low) > MAX_ABS_SAMPLE:
        raise AudioError("implausible_amplitude")


def check_decoded(samples: np.ndarray, rate: int) -> None:
    """decode_audio's checks of a file's rate, length and samples, for audio stored decoded (a
    Hugging Face dataset's {array, sampling_rate} cells)."""
    if not MIN_SAMPLE_RATE <= rate <= MAX_SAMPLE_RATE:
        raise AudioError("implausible_sample_rate")
    if len(samples) > MAX_SECONDS * rate:
        raise AudioError("implausible_length")
    _check_samples(samples)


def decode_audio(source: str | io.BytesIO) -> tuple[np.ndarray, int]:
    """Mono float32 samples and the sample rate of an encoded file (path or in-memory bytes);
    truncated, corrupt or implausible audio raises AudioError."""
    try:
        with sf.SoundFile(source) as f:
            declared, rate = f.frames, f.samplerate
            if not MIN_SAMPLE_RATE <= rate <= MAX_SAMPLE_RATE:
                raise AudioError("implausible_sample_rate")
            if declared > MAX_SECONDS * rate:  # before reading: soundfile allocates `declared`
                raise AudioError("implausible_length")
            if _cut_off(source, f.format):
                raise AudioError("truncated_audio")
            data = f.read(dtype="float32", always_2d=True)
    except (sf.LibsndfileError, RuntimeError, EOFError):
        raise AudioError("unreadable_audio") from None
    except MemoryError:  # a plausible length, times channels, still too large for this machine
        raise AudioError("implausible_length") from None
    if declared > 0 and len(data) < TRUNCATION_TOLERANCE * declared:
        raise AudioError("truncated_audio")
    _check_samples(data)
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
