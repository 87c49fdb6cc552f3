"""Hugging Face datasets as users have them on disk -> manifest entries, audio `hf:<part>#<row>`.

Two on-disk forms are read (no network, no `datasets` cache):
  save_to_disk folders: `load_dataset(name, config).save_to_disk(DIR)` writes DIR/<split>/ holding
      dataset_info.json, state.json and data-*.arrow (one split saved alone is such a folder too);
  Parquet files in the Hub layout: <config>/<split>-00000-of-00014.parquet
      (e.g. clean/train.100-00000-of-00014.parquet) or <config>/<split>/*.parquet.

Where: a dataset folder D is the data root itself or a folder directly in it whose name contains
"librispeech" (LibriSpeech) or "common_voice"/"commonvoice" (Common Voice), e.g.
<root>/librispeech_asr, <root>/common_voice_13_0. In D:
  LibriSpeech subset -> (config, split) of openslr/librispeech_asr, e.g. dev-clean -> (clean,
      validation) or (all, validation.clean):  D/<config>/<split>/ (save_to_disk),
      D/<config>/<split>-*.parquet, D/<config>/<split>/*.parquet; and D/<split>/ or
      D/<split>-*.parquet when the split name alone says the subset (train.100, test.other, ...),
      or a D/<split>/ save_to_disk folder whose dataset_info.json has that config_name
      (`load_dataset("openslr/librispeech_asr", "clean").save_to_disk(D)`).
  Common Voice split for locale L (train, dev, test, ...; dev is HF's "validation"):
      D/L/<split>/ (save_to_disk), D/L/<split>-*.parquet, D/L/<split>/*.parquet; and a D/<split>/
      save_to_disk folder whose config_name is L or unset.
Found in more than one place -> UserError listing them. Fields: librispeech_asr `id, speaker_id,
text, audio` (file, chapter_id unused); Common Voice `client_id, path, sentence, audio`. `audio` is
{bytes, path} (an encoded file, decoded with soundfile) or {array, sampling_rate}. User ids and
skips are those of the native readers (corpora.py).
"""

from __future__ import annotations

import bisect
import glob
import json
from functools import cache, lru_cache
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pflbench.data.audio import AudioError, decode_audio_bytes, read_audio_file
from pflbench.data.corpora import Entry, Skips, make_entry
from pflbench.errors import UserError

LS_SPLITS = {  # task subset -> (config, split) in openslr/librispeech_asr
    "train-clean-100": [("clean", "train.100"), ("all", "train.clean.100")],
    "train-clean-360": [("clean", "train.360"), ("all", "train.clean.360")],
    "train-other-500": [("other", "train.500"), ("all", "train.other.500")],
    "dev-clean": [("clean", "validation"), ("all", "validation.clean")],
    "dev-other": [("other", "validation"), ("all", "validation.other")],
    "test-clean": [("clean", "test"), ("all", "test.clean")],
    "test-other": [("other", "test"), ("all", "test.other")],
}
AMBIGUOUS_LS_SPLITS = {"validation", "test"}  # clean or other: only the config tells
CV_SPLITS = {"dev": "validation"}  # task split -> HF split; the others keep their name
LS_FIELDS = ("id", "speaker_id", "text")  # utterance id, user, transcript
CV_FIELDS = ("path", "client_id", "sentence")


# ----------------------------------------------------------------------------------------------
# Finding a split


def is_saved_dataset(folder: Path) -> bool:
    return (folder / "state.json").is_file() and (folder / "dataset_info.json").is_file()


def saved_config_name(folder: Path) -> str | None:
    return json.loads((folder / "dataset_info.json").read_text()).get("config_name")


def split_parts(folder: Path, split: str) -> list[Path]:
    """folder/<split>/ as a save_to_disk folder, or its Parquet files (Hub layouts)."""
    if is_saved_dataset(folder / split):
        return [folder / split]
    pattern = f"{glob.escape(split)}-*.parquet"
    return sorted(folder.glob(pattern)) or sorted((folder / split).glob("*.parquet"))


def dataset_dirs(root: Path, words: tuple[str, ...]) -> list[Path]:
    named = [p for p in root.iterdir() if p.is_dir() and any(w in p.name.lower() for w in words)]
    return [root, *sorted(named)]


def unique_parts(found: list[list[Path]], what: str) -> list[Path] | None:
    if len(found) > 1:
        places = ", ".join(
            str(parts[0].parent if parts[0].is_file() else parts[0]) for parts in found
        )
        raise UserError(f"{what} found in several Hugging Face datasets: {places}; "
                        "point --data-root (or PFLBENCH_DATA) at the one to use")  # fmt: skip
    return found[0] if found else None


def librispeech_hf_parts(root: Path, subset: str) -> list[Path] | None:
    found = []
    for d in dataset_dirs(root, ("librispeech",)):
        for config, split in LS_SPLITS.get(subset, []):
            parts = split_parts(d / config, split)
            if not parts and split not in AMBIGUOUS_LS_SPLITS:
                parts = split_parts(d, split)
            if not parts and is_saved_dataset(d / split) and saved_config_name(d / split) == config:
                parts = [d / split]
            if parts:
                found.append(parts)
    return unique_parts(found, f"LibriSpeech {subset}")


def commonvoice_hf_parts(root: Path, locale: str, split: str) -> list[Path] | None:
    hf_split = CV_SPLITS.get(split, split)
    found = []
    for d in dataset_dirs(root, ("common_voice", "commonvoice")):
        parts = split_parts(d / locale, hf_split)
        if not parts and is_saved_dataset(d / hf_split):
            parts = [d / hf_split] if saved_config_name(d / hf_split) in (locale, None) else []
        if parts:
            found.append(parts)
    return unique_parts(found, f"Common Voice {locale} {split}")


def librispeech_hf_looked_for(root: Path, subset: str) -> list[str]:
    pairs = LS_SPLITS.get(subset, [])
    return [
        f"{root}[/*librispeech*]/{c}/{s}/ (save_to_disk) or {c}/{s}-*.parquet" for c, s in pairs
    ]


def commonvoice_hf_looked_for(root: Path, locale: str, split: str) -> list[str]:
    hf_split = CV_SPLITS.get(split, split)
    return [f"{root}[/*common_voice*]/{locale}/{hf_split}/ (save_to_disk or *.parquet) or "
            f"{locale}/{hf_split}-*.parquet"]  # fmt: skip


# ----------------------------------------------------------------------------------------------
# Manifests


def saved_table(folder: Path) -> pa.Table:
    """A save_to_disk folder's rows, memory-mapped (its data-*.arrow files are Arrow streams)."""
    files = [f["filename"] for f in json.loads((folder / "state.json").read_text())["_data_files"]]
    return pa.concat_tables(
        pa.ipc.open_stream(pa.memory_map(str(folder / name))).read_all() for name in files
    )


def read_columns(part: Path, columns: tuple[str, ...]) -> pa.Table:
    """The text columns of a part (a Parquet file's audio bytes are not read here)."""
    try:
        saved = saved_table(part) if part.is_dir() else None
        schema = pq.read_schema(part) if saved is None else saved.schema
    except (pa.ArrowException, OSError, KeyError, json.JSONDecodeError) as err:
        raise UserError(f"{part}: not a readable Hugging Face dataset ({err})") from None
    missing = [c for c in (*columns, "audio") if c not in schema.names]
    if missing:
        raise UserError(f"{part}: no column(s) {', '.join(missing)} (has {schema.names})")
    return pq.read_table(part, columns=list(columns)) if saved is None else saved.select(columns)


def hf_manifest(
    parts: list[Path], fields: tuple[str, str, str], corpus: str, split: str, language: str,
    skips: Skips,
) -> list[Entry]:  # fmt: skip
    """Entries of the rows of `parts`; `fields` name the utterance id, user and transcript."""
    entries, seen = [], set()
    for part in parts:
        table = read_columns(part, fields)
        ids, users, texts = (table.column(name).to_pylist() for name in fields)
        for row, (utt, user, raw) in enumerate(zip(ids, users, texts, strict=True)):
            utt_id = Path(utt).stem if utt else f"{part.name}#{row}"  # CV `path` -> clip name
            if not utt:
                skips.add("missing_utterance_id", utt_id)
                continue
            if user is None or str(user) == "":
                skips.add("missing_user_id", utt_id)
                continue
            if utt_id in seen:
                skips.add("duplicate_utterance", utt_id)
                continue
            seen.add(utt_id)
            entry = make_entry(utt_id, str(user), split, f"hf:{part}#{row}", raw or "", corpus,
                               language, skips)  # fmt: skip
            if entry:
                entries.append(entry)
    return entries


def librispeech_hf_manifest(parts: list[Path], subset: str, language: str, skips: Skips):
    """User = speaker_id, as for the native tree."""
    return hf_manifest(parts, LS_FIELDS, "librispeech", subset, language, skips)


def commonvoice_hf_manifest(parts: list[Path], split: str, language: str, skips: Skips):
    """User = client_id; utterance id = the clip name, as for the native release."""
    return hf_manifest(parts, CV_FIELDS, "commonvoice", split, language, skips)


# ----------------------------------------------------------------------------------------------
# Audio of one row (in feature-store workers; tables are cached per process)


@cache
def _saved_audio(folder: str) -> pa.ChunkedArray:
    return saved_table(Path(folder)).column("audio")


@cache
def _parquet_row_starts(path: str) -> list[int]:
    meta = pq.ParquetFile(path).metadata
    return list(np.cumsum([0] + [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]))


@lru_cache(maxsize=4)  # a few row groups of audio bytes: memory stays bounded for real corpora
def _parquet_audio(path: str, group: int) -> pa.ChunkedArray:
    return pq.ParquetFile(path).read_row_group(group, columns=["audio"]).column("audio")


def hf_audio_value(part: str, row: int) -> pa.StructScalar:
    if Path(part).is_dir():
        return _saved_audio(part)[row]
    starts = _parquet_row_starts(part)
    group = bisect.bisect_right(starts, row) - 1
    return _parquet_audio(part, group)[row - starts[group]]


def read_hf_audio(ref: str) -> tuple[np.ndarray, int]:
    """Samples and rate of `hf:<part>#<row>`: encoded bytes, a file path, or a decoded array."""
    part, _, row = ref.removeprefix("hf:").rpartition("#")
    value = hf_audio_value(part, int(row))
    if not value.is_valid:
        raise AudioError("missing_audio_file")
    fields = {f.name for f in value.type}
    if "array" in fields:
        samples = value["array"].values
        if samples is None or len(samples) == 0:
            raise AudioError("zero_length_audio")
        return samples.to_numpy(zero_copy_only=False).astype(np.float32), int(
            value["sampling_rate"].as_py()
        )
    data = value["bytes"].as_py() if "bytes" in fields else None
    if data is not None:
        return decode_audio_bytes(data)
    path = value["path"].as_py() if "path" in fields else None
    if path:  # audio kept as a file next to (or named absolutely from) the dataset
        return read_audio_file(str(Path(part).parent / path))
    raise AudioError("missing_audio_file")
