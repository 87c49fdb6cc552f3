"""The feature store: features computed once, kept on disk as Arrow IPC shards, grouped by user.

Layout of a store folder (its name ends in a key of manifest + normalizer + feature config, see
pflbench.data.prepare.store_key):
  shard-00000.arrow ...  rows sorted by (user, utterance); a user never straddles two shards, so
                         one user's rows are one contiguous slice of one memory-mapped file. Each
                         shard's schema metadata holds the items it skipped (unreadable audio, ...)
                         and a sha256 of each row and of the audio it was computed from.
  index.json             per-user (shard, offset, count, seconds), stats and skip report, and the
                         store's digests: `digest` (sha256 of what training reads: ids, users,
                         texts, durations, features, tokens) and `audio_digest` (sha256 of the
                         decoded audio with ids, users and texts). Both hash content only, so the
                         same corpus anywhere gives the same digests; when two machines' `digest`
                         differ, `audio_digest` tells a different corpus (synthesis, decoding)
                         from different feature arithmetic.
Shards and the index are written to a temp name and renamed into place, so an interrupted build
resumes from the finished shards and never leaves a partial shard that reads as complete.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from pflbench.data.audio import AudioError, read_audio_file
from pflbench.data.corpora import Entry, Skips
from pflbench.data.features import N_MELS, log_mel, resample
from pflbench.data.hf import read_hf_audio
from pflbench.data.text import tokenizer_for

INDEX = "index.json"
SHARD_UTTERANCES = 2000  # target rows per shard (a user is never split)
SCHEMA = pa.schema(
    [
        ("utt_id", pa.string()),
        ("user_id", pa.string()),
        ("text", pa.string()),
        ("seconds", pa.float32()),
        ("n_frames", pa.int32()),
        ("feats", pa.large_binary()),  # float16 [n_frames, 80], row-major
        ("tokens", pa.binary()),  # int16
    ]
)


@dataclass
class Utterance:
    utt_id: str
    user_id: str
    feats: torch.Tensor  # [T, 80] float32
    tokens: torch.Tensor  # [L] int64
    text: str
    seconds: float


# ----------------------------------------------------------------------------------------------
# Audio (file path or Hugging Face row)

AudioReader = Callable[[str], tuple[np.ndarray, int]]


def read_audio(ref: str) -> tuple[np.ndarray, int]:
    """Samples and rate of a manifest audio reference: a file path, or `hf:<part>#<row>`."""
    return read_hf_audio(ref) if ref.startswith("hf:") else read_audio_file(ref)


def features_of(wave: np.ndarray, rate: int) -> tuple[np.ndarray, float]:
    """float16 [T, 80] features and the duration in seconds."""
    if len(wave) == 0:
        raise AudioError("zero_length_audio")
    audio = torch.from_numpy(resample(wave, rate))
    return log_mel(audio).to(torch.float16).numpy(), len(wave) / rate


# ----------------------------------------------------------------------------------------------
# Building


def plan_shards(entries: Sequence[Entry]) -> list[list[Entry]]:
    """Entries sorted by (user, utterance) and cut into shards at user boundaries."""
    shards: list[list[Entry]] = []
    current: list[Entry] = []
    ordered = sorted(entries, key=lambda e: (e.user_id, e.utt_id))
    for i, entry in enumerate(ordered):
        new_user = i == 0 or entry.user_id != ordered[i - 1].user_id
        if new_user and len(current) >= SHARD_UTTERANCES:
            shards.append(current)
            current = []
        current.append(entry)
    if current:
        shards.append(current)
    return shards


def shard_path(folder: Path, index: int) -> Path:
    return folder / f"shard-{index:05d}.arrow"


def write_shard(
    path: Path, entries: Sequence[Entry], language: str, read_audio: AudioReader
) -> Skips:
    """Computes and writes one shard atomically; returns what it skipped."""
    tokenizer = tokenizer_for(language)
    skips, columns = Skips(), {name: [] for name in SCHEMA.names}
    row_digests, audio_digests = [], []  # a sha256 per row, for the store's (write_index)
    for e in entries:
        try:
            wave, rate = read_audio(e.audio)
            feats, seconds = features_of(wave, rate)
        except AudioError as err:
            skips.add(err.reason, e.utt_id)
            continue
        row = {
            "utt_id": e.utt_id, "user_id": e.user_id, "text": e.text, "seconds": seconds,
            "n_frames": len(feats), "feats": feats.tobytes(),
            "tokens": np.asarray(tokenizer.encode(e.text), np.int16).tobytes(),
        }  # fmt: skip
        for name, value in row.items():
            columns[name].append(value)
        wave = np.ascontiguousarray(wave)
        header = _digest_header(e, rate, wave.dtype.str, len(wave))
        audio_digests.append(hashlib.sha256(header + wave.tobytes()).digest())
        header = _digest_header(e, seconds, len(feats), len(row["tokens"]))
        row_digests.append(hashlib.sha256(header + row["feats"] + row["tokens"]).digest())
    metadata = {
        "skips": json.dumps(skips.to_dict()),
        "row_digests": b"".join(row_digests),
        "audio_digests": b"".join(audio_digests),
    }
    schema = SCHEMA.with_metadata(metadata)
    table = pa.table(columns, schema=schema)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, schema) as writer:
        writer.write_table(table)
    os.replace(tmp, path)
    return skips


def _digest_header(entry: Entry, *sizes: object) -> bytes:
    """An utterance's identity and the sizes of the bytes that follow it into a digest (so that
    no two different sequences of rows hash the same bytes)."""
    return json.dumps([entry.utt_id, entry.user_id, entry.text, *sizes]).encode() + b"\n"


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch's intra-op thread count set to `n` inside the block and restored after it."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _write_shard_job(args: tuple[Path, list[Entry], str, AudioReader]) -> int:
    # One thread per shard (workers build shards side by side; the features must not depend on
    # how many shards were left to build), restored after: it may run in the caller's process.
    path, entries, language, read_audio = args
    with torch_threads(1):
        write_shard(path, entries, language, read_audio)
    return len(entries)


def build_store(
    folder: Path,
    entries: Sequence[Entry],
    language: str,
    report: dict,
    read_audio: AudioReader = read_audio,
    workers: int | None = None,
    on_progress: Callable[[int, int], None] | None = None,
) -> FeatureStore:
    """Builds (or finishes building) the store in `folder`; `report` (manifest-level skips etc.)
    is kept in the index. `on_progress(done, total)` counts utterances."""
    if (folder / INDEX).exists():
        store = FeatureStore(folder)
        # The key covers the rows kept, not the ones the manifest dropped (a malformed row added,
        # an empty transcript): the report of this reading is the one to keep and show.
        if store.manifest_report != json.loads(json.dumps(report)):
            write_index(folder, store.n_shards, report)
            store = FeatureStore(folder)
        return store
    folder.mkdir(parents=True, exist_ok=True)
    shards = plan_shards(entries)
    todo = [(shard_path(folder, i), s, language, read_audio) for i, s in enumerate(shards)]
    done = sum(len(s) for i, s in enumerate(shards) if shard_path(folder, i).exists())
    todo = [job for job in todo if not job[0].exists()]  # resume: finished shards are kept
    total = len(entries)
    if on_progress:
        on_progress(done, total)
    workers = max(1, min(workers or os.cpu_count() or 1, len(todo)))
    if workers == 1:
        results = map(_write_shard_job, todo)
    else:
        import multiprocessing as mp

        pool = mp.get_context("fork").Pool(workers)
        results = pool.imap_unordered(_write_shard_job, todo)
    for n in results:
        done += n
        if on_progress:
            on_progress(done, total)
    if workers > 1:
        pool.close()
        pool.join()
    write_index(folder, len(shards), report)
    return FeatureStore(folder)


def write_index(folder: Path, n_shards: int, report: dict) -> None:
    users: dict[str, list] = {}
    skips = Skips.from_dict(report.get("skipped", {}))
    # The store's digests hash its rows' digests in order: whatever the sharding, the same rows
    # give the same digests.
    digests = {"digest": hashlib.sha256(), "audio_digest": hashlib.sha256()}
    for i in range(n_shards):
        with pa.memory_map(str(shard_path(folder, i))) as source:
            reader = pa.ipc.open_file(source)
            metadata = reader.schema.metadata
            skips.merge(Skips.from_dict(json.loads(metadata[b"skips"])))
            digests["digest"].update(metadata[b"row_digests"])
            digests["audio_digest"].update(metadata[b"audio_digests"])
            table = reader.read_all().select(["user_id", "seconds"])
        user_ids = table.column("user_id").to_pylist()
        if not user_ids:  # every utterance of the shard was skipped (counted above)
            continue
        seconds = table.column("seconds").to_numpy()
        # Rows are user-contiguous: find each user's (offset, count) from the boundaries.
        starts = [j for j in range(len(user_ids)) if j == 0 or user_ids[j] != user_ids[j - 1]]
        for a, b in zip(starts, [*starts[1:], len(user_ids)], strict=True):
            users[user_ids[a]] = [i, a, b - a, float(seconds[a:b].sum())]
    index = {
        **{name: digest.hexdigest() for name, digest in digests.items()},
        "n_shards": n_shards,
        "users": dict(sorted(users.items())),
        "report": {**report, "skipped": skips.to_dict()},
        "manifest_report": report,  # as given (build_store compares a later reading's with it)
    }
    tmp = folder / f"{INDEX}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(index))
    os.replace(tmp, folder / INDEX)


# ----------------------------------------------------------------------------------------------
# Reading


class FeatureStore:
    """A finished store: users, per-user sizes, and memory-mapped per-user reads."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        index_file = self.path / INDEX
        if not index_file.exists():
            raise FileNotFoundError(f"{self.path} is not a finished feature store (no {INDEX})")
        index = json.loads(index_file.read_text())
        self.digest: str = index["digest"]
        self.audio_digest: str = index["audio_digest"]
        self.report: dict = index["report"]
        self.manifest_report: dict | None = index.get("manifest_report")  # None: an older index
        self.n_shards: int = index["n_shards"]
        self._users: dict[str, list] = index["users"]
        self._tables: dict[int, pa.Table] = {}
        self.total_seconds = float(sum(u[3] for u in self._users.values()))
        self._len = sum(u[2] for u in self._users.values())

    def _table(self, shard: int) -> pa.Table:
        if shard not in self._tables:  # zero-copy: the table's buffers point into the mapping
            source = pa.memory_map(str(shard_path(self.path, shard)))
            self._tables[shard] = pa.ipc.open_file(source).read_all()
        return self._tables[shard]

    def users(self) -> list[str]:
        return list(self._users)

    def user_seconds(self, user: str) -> float:
        return self._users[user][3]

    def user_num_utterances(self, user: str) -> int:
        return self._users[user][2]

    def load_user(self, user: str) -> list[Utterance]:
        shard, offset, count, _ = self._users[user]
        return rows_to_utterances(self._table(shard).slice(offset, count))

    def __iter__(self) -> Iterator[Utterance]:
        for user in self._users:
            yield from self.load_user(user)

    def references(self) -> Iterator[tuple[str, str, str]]:
        """(utt_id, user_id, normalized text) of every utterance, without reading features."""
        for shard, offset, count, _ in self._users.values():
            rows = self._table(shard).slice(offset, count)
            columns = [rows.column(c).to_pylist() for c in ("utt_id", "user_id", "text")]
            yield from zip(*columns, strict=True)

    def utterance_seconds(self) -> list[float]:
        """Every utterance's duration, in iteration order, without reading features."""
        return [
            seconds
            for shard, offset, count, _ in self._users.values()
            for seconds in self._table(shard).slice(offset, count).column("seconds").to_pylist()
        ]

    def __len__(self) -> int:
        return self._len

    def stats(self) -> dict:
        minutes = (
            np.array([u[3] / 60 for u in self._users.values()]) if self._users else np.zeros(1)
        )
        return {
            "hours": self.total_seconds / 3600,
            "users": len(self._users),
            "utterances": len(self),
            "minutes_per_user": {
                "mean": float(minutes.mean()),
                "std": float(minutes.std()),
                "min": float(minutes.min()),
                "max": float(minutes.max()),
            },  # fmt: skip
            "skipped": self.report.get("skipped", {}),
        }


def rows_to_utterances(rows: pa.Table) -> list[Utterance]:
    cols = {name: rows.column(name) for name in ("utt_id", "user_id", "text", "seconds")}
    utt_ids, user_ids = cols["utt_id"].to_pylist(), cols["user_id"].to_pylist()
    texts, seconds = cols["text"].to_pylist(), cols["seconds"].to_pylist()
    feats, tokens = rows.column("feats"), rows.column("tokens")
    out = []
    for i in range(rows.num_rows):
        f = np.frombuffer(feats[i].as_buffer(), np.float16).reshape(-1, N_MELS)
        t = np.frombuffer(tokens[i].as_buffer(), np.int16)
        feats_i, tokens_i = (
            torch.from_numpy(f.astype(np.float32)),
            torch.from_numpy(t.astype(np.int64)),
        )
        out.append(Utterance(utt_ids[i], user_ids[i], feats_i, tokens_i, texts[i], seconds[i]))
    return out
