"""Audio -> features: 16 kHz resampling, 80 log-mel filterbanks (25 ms window, 10 ms hop) with
per-utterance mean/variance normalization, and SpecAugment (PAPER.md, App. F).
"""

from __future__ import annotations

import numpy as np
import soxr
import torch

SAMPLE_RATE = 16000
N_MELS = 80
HOP = 160  # 10 ms
WIN = 400  # 25 ms
N_FFT = 512
LOG_FLOOR = 1e-6
FEATURE_CONFIG = {
    "sample_rate": SAMPLE_RATE, "n_mels": N_MELS, "hop": HOP, "win": WIN, "n_fft": N_FFT,
    "window": "hann-periodic", "mel": "htk-unnormalized", "log_floor": LOG_FLOOR,
    "norm": "per-utterance-mean-var", "version": 1,
}  # fmt: skip


def resample(wave: np.ndarray, sr_in: int, sr_out: int = SAMPLE_RATE) -> np.ndarray:
    """Band-limited (anti-aliased) resampling with soxr; mono float32 in and out."""
    wave = np.asarray(wave, dtype=np.float32)
    if sr_in == sr_out:
        return wave
    return soxr.resample(wave, sr_in, sr_out, quality="HQ").astype(np.float32, copy=False)


def _hz_to_mel(hz: np.ndarray) -> np.ndarray:
    return 2595.0 * np.log10(1.0 + hz / 700.0)


def _mel_to_hz(mel: np.ndarray) -> np.ndarray:
    return 700.0 * (10.0 ** (mel / 2595.0) - 1.0)


def mel_filterbank(
    n_mels: int = N_MELS, n_fft: int = N_FFT, sample_rate: int = SAMPLE_RATE
) -> np.ndarray:
    """[n_fft//2+1, n_mels] triangular filters, equally spaced on the HTK mel scale, peak 1."""
    fft_hz = np.linspace(0, sample_rate / 2, n_fft // 2 + 1)
    edges = _mel_to_hz(np.linspace(0, _hz_to_mel(np.array(sample_rate / 2)), n_mels + 2))
    lower, center, upper = edges[:-2, None], edges[1:-1, None], edges[2:, None]
    rising = (fft_hz[None] - lower) / (center - lower)
    falling = (upper - fft_hz[None]) / (upper - center)
    return np.maximum(0, np.minimum(rising, falling)).T.astype(np.float32)


_MEL = torch.from_numpy(mel_filterbank())
_WINDOW = torch.hann_window(WIN, periodic=True)


def log_mel(wave: torch.Tensor) -> torch.Tensor:
    """[frames, 80] float32 normalized log-mel features of a 16 kHz mono waveform (CPU or CUDA)."""
    wave = wave.to(torch.float32)
    if wave.numel() < N_FFT // 2 + 1:  # stft's centre padding needs this many samples
        wave = torch.nn.functional.pad(wave, (0, N_FFT // 2 + 1 - wave.numel()))
    spec = torch.stft(
        wave, N_FFT, hop_length=HOP, win_length=WIN, window=_WINDOW.to(wave.device),
        center=True, pad_mode="constant", return_complex=True,
    )  # fmt: skip
    power = spec.real.square() + spec.imag.square()  # [freq, frames]
    feats = torch.log(power.T @ _MEL.to(wave.device) + LOG_FLOOR)
    mean = feats.mean(dim=0, keepdim=True)
    std = feats.std(dim=0, keepdim=True, unbiased=False)
    return (feats - mean) / (std + 1e-5)


def spec_augment(
    feats: torch.Tensor,
    lens: torch.Tensor,
    generator: torch.Generator,
    *,
    freq_masks: int = 2,
    freq_width: int = 30,
    time_masks: int = 10,
    time_width: int = 50,
    time_ratio: float = 0.1,
    rows: list[int] | None = None,
) -> torch.Tensor:
    """SpecAugment on a padded batch [B, T, F]: `freq_masks` bands of width U[0, freq_width] and
    `time_masks` spans of width U[0, min(time_width, time_ratio·len)], all inside each item's
    length, set to 0 (the normalized mean). Randomness is drawn on CPU from `generator`.

    The masks are drawn for the batch whose lengths are `lens`; `feats` holds its items `rows`
    (default: all), so a process training on its share of a batch masks its items exactly as
    one process holding the whole batch would."""
    batch = lens.shape[0]
    frames, n_freq = feats.shape[1:]
    lens = lens.to("cpu", torch.float32)

    def spans(count: int, max_width: torch.Tensor, extent: torch.Tensor) -> torch.Tensor:
        # [B, count, 2] (start, end) with width <= max_width and end <= extent, per item.
        width = (torch.rand(batch, count, generator=generator) * (max_width[:, None] + 1)).floor()
        width = torch.minimum(width, extent[:, None])
        start = (
            torch.rand(batch, count, generator=generator) * (extent[:, None] - width + 1)
        ).floor()
        return torch.stack([start, start + width], dim=-1)

    def covered(se: torch.Tensor, size: int) -> torch.Tensor:
        pos = torch.arange(size, dtype=torch.float32)[None, None]
        inside = (pos >= se[..., :1]) & (pos < se[..., 1:])  # [B, count, size]
        return inside.any(dim=1)

    full = torch.full((batch,), float(n_freq))
    freq = covered(spans(freq_masks, torch.full((batch,), float(freq_width)), full), n_freq)
    max_time = torch.minimum(torch.full((batch,), float(time_width)), (time_ratio * lens).floor())
    time = covered(spans(time_masks, max_time, lens), frames)
    if rows is not None:
        freq, time = freq[rows], time[rows]
    mask = (freq[:, None, :] | time[:, :, None]).to(feats.device)
    return feats.masked_fill(mask, 0.0)
