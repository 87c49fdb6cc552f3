"""Synthetic corpora in the real on-disk formats, spoken by the bundled espeak-ng.

`synthesize(out, language, size, seed)` writes
  out/LibriSpeech/{train-clean-100,dev-clean,test-clean}/<spk>/<chap>/<spk>-<chap>-<utt>.flac
      + <spk>-<chap>.trans.txt (UPPERCASE) and out/LibriSpeech/SPEAKERS.TXT   (the LS-like corpus)
  out/cv-corpus-13.0-2023-03-09/<lang>/{train,dev,test,validated}.tsv + clips/*.mp3 (CV-like)
LS-like: clean audio at 16 kHz, long sentences with clear word gaps, balanced minutes per speaker,
two standard accents. CV-like: 48 kHz MP3, short mixed-case punctuated sentences with a flatter word
distribution, other accents and voice variants, wider pitch/rate, shorter word gaps, each user's
cheap microphone (band-pass), background noise and gain, heavy-tailed clips per user. Users are
disjoint across splits. Both use the same small vocabulary: a character CTC model without a
language model learns spellings slowly, and with a small vocabulary the minutes of CPU training
reach the regime where the acoustic domain shift, which federated fine-tuning learns, dominates
CV-like WER (with 600-1,500 words WER stayed above 85% whatever the fine-tuning).

Cost (size small, measured): ~75 CPU-seconds in all, half of it LAME's MP3 encoding (lameenc at its
fast quality 7; libsndfile's settings took ~4x longer), a third espeak-ng; units run in parallel.

Determinism: espeak-ng carries hidden state from one utterance to the next (its pitch flutter), so
each work unit (a speaker, or a group of users) runs in a fresh process forked from a clean fork
server and synthesizes its utterances in a fixed order; all other randomness is seeded per unit.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import resource
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import lameenc
import numpy as np
import soundfile as sf
import soxr

from pflbench.data.espeak import Espeak
from pflbench.data.text import letters

CV_RELEASE = "cv-corpus-13.0-2023-03-09"
MP3_KBPS = 64
# The most frequent words; the CV-like corpus draws them with a flatter distribution.
LS_VOCABULARY = 200
CV_VOCABULARY = 200
SYNTH_VERSION = 6  # bumped whenever the bytes written change
COMPLETE_MARKER = "pflbench-synth.json"
LS_SUBSETS = {"train": "train-clean-100", "dev": "dev-clean", "test": "test-clean"}
CV_COLUMNS = [
    "client_id", "path", "sentence", "up_votes", "down_votes", "age", "gender", "accents",
    "variant", "locale", "segment",
]  # fmt: skip

# Accents: the LS-like corpus uses the standard ones, the CV-like corpus adds regional ones.
LS_ACCENTS = {"en": ["en-us", "en"], "fr": ["fr"], "de": ["de"]}
CV_ACCENTS = {
    "en": ["en-us", "en", "en-gb-scotland", "en-029", "en-us-nyc", "en-gb-x-rp", "en-gb-x-gbclan"],
    "fr": ["fr", "fr-be", "fr-ch"],
    "de": ["de"],
}
LS_VARIANTS = ["m1", "m2", "m3", "m4", "m5", "m6", "m7", "f1", "f2", "f3", "f4"]
# Voices no LS-like speaker resembles. Not espeak's formant-synthesizer voices (klatt, klatt2,
# iven): a seed model scores 90-110% WER on them whatever its training (a shift of another kind
# than LibriSpeech -> Common Voice's; measured, docs/RESULTS.md).
CV_VARIANTS = LS_VARIANTS + ["m8", "f5", "croak", "Andy", "Annie", "max"]


@dataclass(frozen=True)
class Size:
    ls_speakers: dict[str, int]  # per split
    ls_seconds: dict[str, float]  # target audio per speaker
    cv_users: dict[str, int]
    cv_max_clips: dict[str, int]  # cap of the heavy-tailed clips per user
    users_per_unit: int  # CV users synthesized by one worker process


SIZES = {
    "tiny": Size({"train": 8, "dev": 3, "test": 3}, {"train": 12, "dev": 6, "test": 6},
                 {"train": 40, "dev": 8, "test": 8}, {"train": 10, "dev": 3, "test": 3}, 40),
    "small": Size({"train": 48, "dev": 10, "test": 10}, {"train": 150, "dev": 45, "test": 45},
                  {"train": 1200, "dev": 150, "test": 150}, {"train": 250, "dev": 6, "test": 6},
                  60),
    "base": Size({"train": 200, "dev": 20, "test": 20}, {"train": 300, "dev": 60, "test": 60},
                 {"train": 5000, "dev": 400, "test": 400}, {"train": 1000, "dev": 8, "test": 8},
                 100),
}  # fmt: skip


# ----------------------------------------------------------------------------------------------
# Vocabularies and sentences


def vocabulary(language: str, n: int) -> list[str]:
    """The n most frequent wordfreq words made only of the language's letters (and ')."""
    from wordfreq import (
        top_n_list,
    )  # imported here: slow to import, and runs on a cache need neither

    alphabet = set(letters(language) + "'")
    words = [
        w
        for w in top_n_list(language, 4 * n)
        if set(w) <= alphabet and (len(w) > 1 or w in ("a", "i", "y", "à")) and w[0] != "'"
    ]
    return words[:n]


def zipf_weights(n: int, offset: float, power: float) -> np.ndarray:
    w = 1.0 / (np.arange(n) + offset) ** power
    return w / w.sum()


def ls_sentence(rng: np.random.Generator, words: list[str], weights: np.ndarray) -> str:
    picks = rng.choice(len(words), size=int(rng.integers(8, 17)), p=weights)
    return " ".join(words[i] for i in picks)


def cv_sentence(rng: np.random.Generator, words: list[str], weights: np.ndarray) -> str:
    """Mixed case and punctuation, so that normalization matters."""
    picks = [words[i] for i in rng.choice(len(words), size=int(rng.integers(3, 10)), p=weights)]
    picks[0] = picks[0].capitalize()
    for i in range(1, len(picks)):
        r = rng.random()
        if r < 0.08:
            picks[i] = picks[i].capitalize()
        elif r < 0.12:
            picks[i - 1] += ","
    if rng.random() < 0.1:
        picks[-1] = f'"{picks[-1]}"'
    return " ".join(picks) + str(rng.choice([".", ".", ".", "?", "!"]))


# ----------------------------------------------------------------------------------------------
# Voices and audio


@dataclass(frozen=True)
class Voice:
    name: str  # espeak voice, e.g. "en-us+m3"
    rate: int
    pitch: int
    range_: int
    snr_db: float | None  # None: clean
    gain_db: float
    # espeak's pause between words (10 ms units): read LS-like speech separates words a little,
    # which a character CTC model without a language model needs to place word boundaries.
    word_gap: int
    # The user's microphone as a band-pass (Hz): CV-like clips come from cheap microphones.
    band: tuple[float, float] | None


def ls_voice(rng: np.random.Generator, language: str) -> Voice:
    name = f"{rng.choice(LS_ACCENTS[language])}+{rng.choice(LS_VARIANTS)}"
    return Voice(name, int(rng.integers(150, 186)), int(rng.integers(35, 66)),
                 int(rng.integers(40, 61)), None, 0.0, int(rng.integers(2, 5)), None)  # fmt: skip


def cv_voice(rng: np.random.Generator, language: str) -> Voice:
    name = f"{rng.choice(CV_ACCENTS[language])}+{rng.choice(CV_VARIANTS)}"
    rate, pitch, range_ = rng.integers(140, 201), rng.integers(15, 91), rng.integers(20, 91)
    # Milder than v5's 20-45 dB and 1-3 word gaps: each alone doubled the seed model's WER, and
    # with the accents and voices compounded to a seed model near 90% (docs/RESULTS.md).
    snr_db, gain_db = rng.uniform(30, 50), rng.uniform(-12, 3)
    word_gap = int(rng.integers(2, 4))
    band = (float(rng.uniform(200, 400)), float(rng.uniform(3000, 4000)))
    return Voice(name, int(rate), int(pitch), int(range_), float(snr_db), float(gain_db), word_gap,
                 band)  # fmt: skip


def speak(text: str, voice: Voice, rng: np.random.Generator, sr_out: int) -> np.ndarray:
    """float32 audio at sr_out: espeak at 22.05 kHz, then noise, the microphone's band-pass and
    gain, then soxr resampling."""
    tts = Espeak.instance()
    seed = int(rng.integers(2**31))
    from scipy.signal import butter, lfilter, sosfilt  # slow to import: synthesis only

    wave = tts.synth(
        text, voice.name, voice.rate, voice.pitch, voice.range_, wordgap=voice.word_gap, seed=seed
    )
    wave = wave.astype(np.float32)
    wave /= 32768.0
    if voice.snr_db is not None:
        # Mix of white and low-passed (rumble) noise at the voice's SNR, varying a little per clip.
        white = rng.standard_normal(len(wave)).astype(np.float32)
        brown = lfilter([1.0], [1.0, -0.98], white).astype(np.float32)
        noise = white / (white.std() + 1e-8) + brown / (brown.std() + 1e-8)
        snr = voice.snr_db + rng.uniform(-3, 3)
        signal_power = float(np.mean(wave**2)) + 1e-10
        wave += noise * np.sqrt(signal_power / 2 / 10 ** (snr / 10))
    if voice.band is not None:
        sos = butter(2, voice.band, btype="bandpass", fs=tts.sample_rate, output="sos")
        wave = sosfilt(sos, wave).astype(np.float32)
    wave *= 10 ** ((voice.gain_db + rng.uniform(-2, 2)) / 20)
    return np.clip(soxr.resample(wave, tts.sample_rate, sr_out, quality="HQ"), -1.0, 1.0)


def mp3_bytes(wave: np.ndarray, rate: int) -> bytes:
    """Mono CBR 64 kbit/s MP3 at `rate`, like Common Voice clips. LAME's fast algorithm (quality
    7): MP3 encoding dominates synthesis, and this is ~4x faster than libsndfile's LAME settings."""
    encoder = lameenc.Encoder()
    encoder.set_in_sample_rate(rate)
    encoder.set_out_sample_rate(rate)
    encoder.set_channels(1)
    encoder.set_bit_rate(MP3_KBPS)
    encoder.set_quality(7)
    pcm = np.round(wave * 32767).astype(np.int16).tobytes()
    return bytes(encoder.encode(pcm) + encoder.flush())


# ----------------------------------------------------------------------------------------------
# Work units: one LS speaker, or a group of CV users (each runs in its own fresh process)


@dataclass(frozen=True)
class LsSpeakerUnit:
    root: str
    language: str
    subset: str
    speaker: int
    target_seconds: float
    seed: int


@dataclass(frozen=True)
class CvUsersUnit:
    clips_dir: str
    language: str
    split: str
    users: list[tuple[str, int, int]]  # (client_id, number of clips, first clip number)
    seed: int


def run_ls_speaker(unit: LsSpeakerUnit) -> tuple[int, str, float]:
    """Writes one speaker's chapters; returns (speaker, sex, minutes)."""
    rng = np.random.default_rng([unit.seed, 1, unit.speaker])
    words = vocabulary(unit.language, LS_VOCABULARY)
    weights = zipf_weights(len(words), 10, 1.0)
    voice = ls_voice(rng, unit.language)
    chapters = [int(c) for c in sorted(rng.choice(np.arange(1000, 9999), 2, replace=False))]
    total, n = 0.0, 0
    lines: dict[int, list[str]] = {c: [] for c in chapters}
    while total < unit.target_seconds:
        chapter = chapters[n % len(chapters)]
        utt = f"{unit.speaker}-{chapter}-{len(lines[chapter]):04d}"
        text = ls_sentence(rng, words, weights)
        wave = speak(text, voice, rng, 16000)
        folder = Path(unit.root) / unit.subset / str(unit.speaker) / str(chapter)
        folder.mkdir(parents=True, exist_ok=True)
        sf.write(folder / f"{utt}.flac", wave, 16000, subtype="PCM_16", format="FLAC")
        lines[chapter].append(f"{utt} {text.upper()}")
        total += len(wave) / 16000
        n += 1
    for chapter, chapter_lines in lines.items():
        if chapter_lines:
            trans = Path(unit.root) / unit.subset / str(unit.speaker) / str(chapter)
            (trans / f"{unit.speaker}-{chapter}.trans.txt").write_text(
                "\n".join(chapter_lines) + "\n"
            )
    sex = "F" if "+f" in voice.name else "M"
    return unit.speaker, sex, total / 60


def run_cv_users(unit: CvUsersUnit) -> list[list[str]]:
    """Writes the clips of a group of users; returns their TSV rows."""
    words = vocabulary(unit.language, CV_VOCABULARY)
    weights = zipf_weights(len(words), 50, 0.9)
    rows = []
    for client_id, n_clips, first in unit.users:
        rng = np.random.default_rng([unit.seed, 2, int(client_id[:12], 16)])
        voice = cv_voice(rng, unit.language)
        age = rng.choice(["", "twenties", "thirties", "fourties", "fifties", "teens"])
        gender = "female" if "+f" in voice.name else rng.choice(["male", ""])
        for k in range(n_clips):
            path = f"common_voice_{unit.language}_{first + k}.mp3"
            sentence = cv_sentence(rng, words, weights)
            wave = speak(sentence, voice, rng, 48000)
            (Path(unit.clips_dir) / path).write_bytes(mp3_bytes(wave, 48000))
            up, down = int(rng.integers(2, 5)), int(rng.integers(0, 2))
            accent = voice.name.split("+")[0]
            rows.append([client_id, path, sentence, str(up), str(down), str(age), str(gender),
                         accent, "", unit.language, ""])  # fmt: skip
    return rows


def _run_unit(unit: LsSpeakerUnit | CvUsersUnit):
    """The unit's result and the CPU seconds of its (fresh) process."""
    result = run_ls_speaker(unit) if isinstance(unit, LsSpeakerUnit) else run_cv_users(unit)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return result, usage.ru_utime + usage.ru_stime


# ----------------------------------------------------------------------------------------------
# Planning and writing


def clips_per_user(rng: np.random.Generator, n_users: int, cap: int) -> np.ndarray:
    """Heavy-tailed (discrete Pareto, alpha 1.2): most users a handful of clips, a few hundreds."""
    return np.minimum(cap, np.floor(rng.random(n_users) ** (-1 / 1.2))).astype(int)


def plan_units(root: Path, language: str, size: Size, seed: int):
    """All work units (LS speakers first, then CV user groups) in a fixed order."""
    ls_root, cv_dir = root / "LibriSpeech", root / CV_RELEASE / language
    units: list[LsSpeakerUnit | CvUsersUnit] = []
    speaker = 100
    for split, subset in LS_SUBSETS.items():
        for _ in range(size.ls_speakers[split]):
            speaker += 1 + (speaker * 7919 + seed) % 37  # LibriSpeech-like sparse speaker ids
            units.append(LsSpeakerUnit(str(ls_root), language, subset, speaker,
                                       size.ls_seconds[split], seed))  # fmt: skip
    rng = np.random.default_rng([seed, 3])
    clip = 10_000_000
    for s, split in enumerate(("train", "dev", "test")):
        counts = clips_per_user(rng, size.cv_users[split], size.cv_max_clips[split])
        users = []
        for i, n in enumerate(counts):
            client_id = hashlib.sha512(f"pflbench-{seed}-{s}-{i}".encode()).hexdigest()
            users.append((client_id, int(n), clip))
            clip += int(n)
        for start in range(0, len(users), size.users_per_unit):
            group = users[start : start + size.users_per_unit]
            units.append(CvUsersUnit(str(cv_dir / "clips"), language, split, group, seed))
    return units


def write_speakers_txt(ls_root: Path, speakers: list[tuple[int, str, str, float]]) -> None:
    lines = [";ID  |SEX| SUBSET           |MINUTES| NAME"]
    for spk, sex, subset, minutes in sorted(speakers):
        lines.append(f"{spk:<5}| {sex} | {subset:<17}| {minutes:5.2f} | Synthetic Reader {spk}")
    (ls_root / "SPEAKERS.TXT").write_text("\n".join(lines) + "\n")


def write_tsv(path: Path, rows: list[list[str]]) -> None:
    path.write_text("\t".join(CV_COLUMNS) + "\n" + "".join("\t".join(r) + "\n" for r in rows))


def synthesize(
    out: Path,
    language: str = "en",
    size: str = "small",
    seed: int = 0,
    workers: int | None = None,
    on_unit: Callable[[int, int], None] | None = None,
    report: dict | None = None,
) -> Path:
    """Writes both corpora under `out` (must be empty or absent); returns `out`.
    `on_unit(done, total)` reports progress; `report` gets the workers' CPU seconds."""
    if size not in SIZES:
        raise ValueError(f"unknown synthetic size {size!r} ({', '.join(SIZES)})")
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} is not empty")
    cv_dir = out / CV_RELEASE / language
    (cv_dir / "clips").mkdir(parents=True, exist_ok=True)
    (out / "LibriSpeech").mkdir(parents=True, exist_ok=True)
    units = plan_units(out, language, SIZES[size], seed)
    workers = workers or min(len(units), os.cpu_count() or 1)
    ctx = mp.get_context("forkserver")  # clean parent: every unit starts from fresh espeak state
    # The imports the units need, done once in the fork server rather than in each unit's fresh
    # process (scipy.signal alone takes ~1 s, more than a tiny corpus's unit of work).
    ctx.set_forkserver_preload([__name__, "scipy.signal", "wordfreq"])
    speakers, cv_rows = [], {"train": [], "dev": [], "test": []}
    worker_cpu = 0.0
    with ctx.Pool(workers, maxtasksperchild=1) as pool:
        for i, (unit, (result, cpu)) in enumerate(
            zip(units, pool.imap(_run_unit, units), strict=True)
        ):
            worker_cpu += cpu
            if isinstance(unit, LsSpeakerUnit):
                spk, sex, minutes = result
                speakers.append((spk, sex, unit.subset, minutes))
            else:
                cv_rows[unit.split] += result
            if on_unit:
                on_unit(i + 1, len(units))
    if report is not None:
        report["worker_cpu_seconds"] = worker_cpu
    write_speakers_txt(out / "LibriSpeech", speakers)
    for split, rows in cv_rows.items():
        write_tsv(cv_dir / f"{split}.tsv", rows)
    write_tsv(cv_dir / "validated.tsv", [r for rows in cv_rows.values() for r in rows])
    marker = {"version": SYNTH_VERSION, "language": language, "size": size, "seed": seed}
    (out / COMPLETE_MARKER).write_text(repr(marker) + "\n")
    return out


def synthesize_cached(root: Path, language: str, size: str, seed: int, **kwargs) -> Path:
    """`root` when it holds a complete synthesis, else synthesized into a temp folder and renamed
    into place (an interrupted run never looks complete)."""
    if (root / COMPLETE_MARKER).exists():
        return root
    tmp = root.with_name(root.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    synthesize(tmp, language, size, seed, **kwargs)
    if root.exists():  # a stale incomplete folder
        shutil.rmtree(root)
    os.replace(tmp, root)
    return root
