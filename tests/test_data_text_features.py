"""Text normalization, token sets, log-mel features against librosa, SpecAugment, batching."""

from __future__ import annotations

import librosa
import numpy as np
import pytest
import torch

from pflbench.data.batching import collate, dynamic_batches
from pflbench.data.features import log_mel, mel_filterbank, resample, spec_augment
from pflbench.data.store import Utterance
from pflbench.data.text import normalize, tokenizer_for


@pytest.mark.parametrize(
    ("raw", "language", "expected"),
    [
        (
            "Hello, World! It’s a well-known “fact” — isn't it?",
            "en",
            "hello world it's a well-known fact isn't it",
        ),
        ("Café crème   São Paulo", "en", "cafe creme sao paulo"),
        ("L'été à Noël, naïve!", "fr", "l'été à noël naïve"),
        ("Größe Übung — Straße!", "de", "größe übung straße"),
        (" -- 'quoted' - ", "en", "quoted"),
        ("!!!", "en", ""),
        # Only Latin letters are spelled in ASCII; invisible formatting and lone diacritics go.
        (
            "Ｆullwidth ﬁne Øre Æther co\u00adop zero\u200bwidth q\u0303",
            "en",
            "fullwidth fine ore aether coop zerowidth q",
        ),
        ("Ñandú in Straße", "fr", "nandu in strasse"),
        # Another script's letters stay (the tokenizer rejects them: a counted skip), and a
        # symbol is removed like punctuation instead of spelled as a word ("EUR").
        ("Москва costs €", "en", "москва costs"),
        ("東京 α", "en", "東京 α"),
    ],
)
def test_normalize(raw: str, language: str, expected: str) -> None:
    assert normalize(raw, language) == expected


def test_token_sets_and_round_trip() -> None:
    en, fr, de = tokenizer_for("en"), tokenizer_for("fr"), tokenizer_for("de")
    assert en.size == 30 and en.vocab[0] == "<blank>" and en.vocab[1] == " " and en.blank == 0
    assert set("éèàçœ") <= set(fr.vocab) and set("äöüß") <= set(de.vocab)
    text = normalize("Don't stop - it's well-known", "en")
    assert en.decode(en.encode(text)) == text
    with pytest.raises(ValueError, match="'3'"):
        en.encode("route 3")


def test_mel_filterbank_matches_librosa() -> None:
    reference = librosa.filters.mel(sr=16000, n_fft=512, n_mels=80, htk=True, norm=None)
    np.testing.assert_allclose(mel_filterbank(), reference.T, atol=1e-6)


def test_log_mel_matches_librosa_reference() -> None:
    rng = np.random.default_rng(0)
    t = np.arange(16000 * 2) / 16000
    wave = (0.3 * np.sin(2 * np.pi * 440 * t) + 0.05 * rng.standard_normal(len(t))).astype(
        np.float32
    )
    mel = librosa.feature.melspectrogram(
        y=wave, sr=16000, n_fft=512, hop_length=160, win_length=400, window="hann", center=True,
        pad_mode="constant", power=2.0, n_mels=80, htk=True, norm=None,
    )  # fmt: skip
    ref = np.log(mel + 1e-6).T
    ref = (ref - ref.mean(0)) / (ref.std(0) + 1e-5)
    ours = log_mel(torch.from_numpy(wave)).numpy()
    assert ours.shape == (201, 80)
    np.testing.assert_allclose(ours, ref, atol=2e-3)


def test_resample_is_anti_aliased() -> None:
    # 48 -> 16 kHz: a 12 kHz tone is above the new Nyquist (8 kHz) and must be removed, not
    # folded to 4 kHz as plain decimation would; a 3 kHz tone passes.
    t = np.arange(48000) / 48000
    out = resample(np.sin(2 * np.pi * 12000 * t).astype(np.float32), 48000, 16000)
    assert len(out) == 16000
    assert np.abs(out[1000:-1000]).max() < 0.01
    kept = resample(np.sin(2 * np.pi * 3000 * t).astype(np.float32), 48000, 16000)
    assert 0.9 < np.abs(kept[1000:-1000]).max() < 1.1


def test_spec_augment_masks_within_length_and_is_seeded() -> None:
    feats = torch.randn(3, 300, 80) + 5
    lens = torch.tensor([300, 120, 40])
    feats[1, 120:] = 0
    feats[2, 40:] = 0
    out = spec_augment(feats, lens, torch.Generator().manual_seed(1))
    again = spec_augment(feats, lens, torch.Generator().manual_seed(1))
    assert torch.equal(out, again) and not torch.equal(out, feats)
    masked = out == 0
    # Time masks: whole frames; per item at most time_masks * min(50, 0.1 * len) frames.
    full_frames = masked.all(dim=2)
    full_frames[1, 120:] = False
    full_frames[2, 40:] = False
    assert full_frames[0].sum() <= 10 * 30 and full_frames[2].sum() <= 10 * 4
    # Frequency masks: at most 2 bands of width <= 30.
    full_bands = masked[0].all(dim=0)
    assert full_bands.sum() <= 60
    assert torch.equal(out[~masked], feats[~masked])


def _utt(i: int, frames: int, tokens: int) -> Utterance:
    return Utterance(f"u{i}", f"s{i % 2}", torch.ones(frames, 80), torch.arange(1, tokens + 1),
                     "x", frames / 100)  # fmt: skip


def test_dynamic_batches_respect_seconds_and_cover_everything() -> None:
    seconds = [1.0, 5.0, 2.5, 30.0, 0.5, 4.0, 3.0, 2.0]
    for gen in (None, torch.Generator().manual_seed(0)):
        batches = dynamic_batches(seconds, max_seconds=6.0, generator=gen)
        assert sorted(i for b in batches for i in b) == list(range(len(seconds)))
        for b in batches:
            assert sum(seconds[i] for i in b) <= 6.0 or len(b) == 1
    assert [3] in dynamic_batches(seconds, 6.0)  # the 30 s item is alone
    g1 = dynamic_batches(seconds, 6.0, torch.Generator().manual_seed(3))
    g2 = dynamic_batches(seconds, 6.0, torch.Generator().manual_seed(3))
    assert g1 == g2


def test_collate_pads_with_zeros() -> None:
    batch = collate([_utt(0, 5, 2), _utt(1, 9, 4)])
    assert batch.feats.shape == (2, 9, 80) and batch.targets.shape == (2, 4)
    assert batch.feat_lens.tolist() == [5, 9] and batch.target_lens.tolist() == [2, 4]
    assert batch.feats[0, 5:].abs().sum() == 0 and batch.targets[0, 2:].abs().sum() == 0
    assert batch.to("cpu").utt_ids == ["u0", "u1"]
