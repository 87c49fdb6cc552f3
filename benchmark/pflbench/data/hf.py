"""Hugging Face datasets as users have them on disk -> manifest entries, audio `hf:<part>#<row>`.

Two on-disk forms are read (no network, no `datasets` cache):
  save_to_disk folders: `load_dataset(name, config).save_to_disk(DIR)` writes DIR/<split>/ holding
      dataset_info.json, state.json and data-*.arrow (one split saved alone is such a folder too);
  Parquet files in the Hub layouts: <config>/<split>/0000.parquet (the Hub's own files, e.g.
      openslr/librispeech_asr's clean/train.100/0000.parquet) or
      <config>/<split>-00000-of-00014.parquet (`push_to_hub`'s).

Where: a dataset folder D is the data root itself or a folder directly in it whose name contains
"librispeech" (LibriSpeech) or "common_voice"/"commonvoice" (Common Voice), e.g.
<root>/librispeech_asr, <root>/common_voice_13_0. In D:
  LibriSpeech subset -> (config, split) of openslr/librispeech_asr, e.g. dev-clean -> (all,
      validation.clean) or (clean, validation): D/<config>/<split>/ (save_to_disk or *.parquet),
      D/<config>/<split>-*.parquet; and D/<split>/ or D/<split>-*.parquet when the split name alone
      says the subset (train.100, test.other, ...), or a D/<split>/ save_to_disk folder of that
      config (`load_dataset("openslr/librispeech_asr", "clean").save_to_disk(D)`): its
      dataset_info.json's config_name, or else the split names saved beside it (train.100 is
      only in "clean", train.500 only in "other").
      The Hub repository holds every split twice, under "all" and under "clean"/"other": one
      corpus, so "all" is read (the first of LS_SPLITS) once the other holds as many rows; the data
      report and the record say which was read.
      openslr/librispeech_asr has no speaker attributes: LibriSpeech's SPEAKERS.TXT in D gives
      the speakers' genders (as beside a native LibriSpeech tree).
  Common Voice split for locale L (train, dev, test, ...; dev is HF's "validation"):
      D/L/<split>/ (save_to_disk or *.parquet), D/L/<split>-*.parquet; and a D/<split>/
      save_to_disk folder whose config_name is L or unset.
A split in more than one dataset folder -> UserError listing them. Not found -> the error lists
every layout tried and what the dataset folders hold instead. Fields: librispeech_asr `id,
speaker_id, text, audio` (file, chapter_id unused); Common Voice `client_id, path, sentence, audio`
and the speaker attributes `age, gender, accent`. `audio` is {bytes, path} (an encoded file,
decoded with soundfile) or {array, sampling_rate} (decoded mono samples). A column of another type
(a path string for `audio`, lists of sentences, ...) is an error naming the file, the column, its
type and the expected one; a decoded cell without a sampling rate is skipped and counted as
missing_sample_rate. User ids and skips are those of the native readers (corpora.py).
"""

from __future__ import annotations

import bisect
import glob
import json
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache, lru_cache
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pflbench.data.audio import AudioError, check_decoded, decode_audio_bytes, read_audio_file
from pflbench.data.corpora import (
    UNREPORTED,
    Entry,
    Manifest,
    Skips,
    librispeech_genders,
    make_entry,
    no_genders,
)
from pflbench.errors import UserError

LS_SPLITS = {  # task subset -> (config, split) in openslr/librispeech_asr, the preferred first
    "train-clean-100": [("all", "train.clean.100"), ("clean", "train.100")],
    "train-clean-360": [("all", "train.clean.360"), ("clean", "train.360")],
    "train-other-500": [("all", "train.other.500"), ("other", "train.500")],
    "dev-clean": [("all", "validation.clean"), ("clean", "validation")],
    "dev-other": [("all", "validation.other"), ("other", "validation")],
    "test-clean": [("all", "test.clean"), ("clean", "test")],
    "test-other": [("all", "test.other"), ("other", "test")],
}
LS_CONFIG_SPLITS = {  # the splits of the configs whose split names are not unique
    "clean": {"train.100", "train.360", "validation", "test"},
    "other": {"train.500", "validation", "test"},
}
AMBIGUOUS_LS_SPLITS = {"validation", "test"}  # clean or other: only the config tells
CV_SPLITS = {"dev": "validation"}  # task split -> HF split; the others keep their name
LS_FIELDS = ("id", "speaker_id", "text")  # utterance id, user, transcript
CV_FIELDS = ("path", "client_id", "sentence")
CV_ATTRIBUTE_COLUMNS = {"age": ("age",), "gender": ("gender",), "accent": ("accent", "accents")}
LS_WORDS, CV_WORDS = ("librispeech",), ("common_voice", "commonvoice")
MAX_LISTED = 8


@dataclass(frozen=True)
class HfSplit:
    """A split found in a Hugging Face dataset folder: its save_to_disk folder or Parquet files."""

    dataset: Path  # D: the data root, or the folder in it named like the corpus
    config: str | None  # LibriSpeech: all, clean or other; Common Voice: the locale
    split: str  # as the dataset names it (validation.clean, train.100, validation, ...)
    parts: list[Path]
    chosen_over: str = ""  # why this config was read and another one holding the split was not

    def describe(self) -> str:
        """Where, relative to the data root, and in which form (the data report's `read_from`)."""
        first = self.parts[0]
        where = first if first.is_dir() else first.parent
        form = "save_to_disk" if first.is_dir() else f"Parquet, {len(self.parts)} file(s)"
        config = f", config {self.config!r}" if self.config else ""
        choice = f"; {self.chosen_over}" if self.chosen_over else ""
        return f"Hugging Face {where.relative_to(self.dataset.parent)} ({form}{config}{choice})"


# ----------------------------------------------------------------------------------------------
# Finding a split


def is_saved_dataset(folder: Path) -> bool:
    return (folder / "state.json").is_file() and (folder / "dataset_info.json").is_file()


def saved_config_name(folder: Path) -> str | None:
    try:
        return json.loads((folder / "dataset_info.json").read_text()).get("config_name")
    except (OSError, json.JSONDecodeError, AttributeError) as err:
        raise UserError(f"{folder}/dataset_info.json: not readable ({err})") from None


def saved_ls_config(folder: Path) -> str | None:
    """The config of a LibriSpeech split saved as D/<split>/: its config_name, or else the one
    config whose splits include every split saved beside it (DatasetDict.save_to_disk)."""
    if name := saved_config_name(folder):
        return name
    beside = {p.name for p in folder.parent.iterdir() if is_saved_dataset(p)}
    configs = [c for c, splits in LS_CONFIG_SPLITS.items() if beside <= splits]
    return configs[0] if len(configs) == 1 else None


def split_parts(folder: Path, split: str) -> list[Path]:
    """folder/<split>/ as a save_to_disk folder, or its Parquet files (Hub layouts)."""
    if is_saved_dataset(folder / split):
        return [folder / split]
    pattern = f"{glob.escape(split)}-*.parquet"
    return sorted(folder.glob(pattern)) or sorted((folder / split).glob("*.parquet"))


def dataset_dirs(root: Path, words: tuple[str, ...]) -> list[Path]:
    named = [p for p in root.iterdir() if p.is_dir() and any(w in p.name.lower() for w in words)]
    return [root, *sorted(named)]


def one_dataset(root: Path, found: list[list[HfSplit]], what: str) -> list[HfSplit]:
    """The candidates of the one dataset folder holding the split ([] if none holds it)."""
    if len(found) > 1:
        places = ", ".join(str(f[0].dataset) for f in found)
        raise UserError(f"{what} found in more than one Hugging Face dataset folder under {root}: "
                        f"{places}; keep one of them there and move the others out")  # fmt: skip
    return found[0] if found else []


READ_ERRORS = (pa.ArrowException, OSError, KeyError, json.JSONDecodeError)


def not_readable(part: Path, err: Exception) -> UserError:
    return UserError(f"{part}: not a readable Hugging Face dataset ({err})")


def part_rows(part: Path) -> int:
    try:
        return (
            saved_table(part).num_rows if part.is_dir() else pq.ParquetFile(part).metadata.num_rows
        )
    except READ_ERRORS as err:
        raise not_readable(part, err) from None


def one_config(candidates: list[HfSplit], what: str) -> HfSplit:
    """The first of a dataset's configs holding the split, once the others hold as many rows (the
    Hub repository of openslr/librispeech_asr holds every split under two configs)."""
    first, *others = candidates
    if not others:
        return first
    rows = {c.config: sum(part_rows(p) for p in c.parts) for c in candidates}
    if len(set(rows.values())) > 1:
        counts = ", ".join(f"{n} in config {c!r}" for c, n in rows.items())
        raise UserError(f"{what}: the configs of {first.dataset} hold different numbers of rows "
                        f"({counts}): one is an incomplete download; remove it")  # fmt: skip
    names = " and ".join(repr(c.config) for c in others)
    note = f"config {names} holds the same split ({rows[first.config]} rows), not read"
    return HfSplit(first.dataset, first.config, first.split, first.parts, note)


def librispeech_hf_parts(root: Path, subset: str) -> HfSplit | None:
    found = []
    for d in dataset_dirs(root, LS_WORDS):
        here = []
        for config, split in LS_SPLITS.get(subset, []):
            parts = split_parts(d / config, split)
            if not parts and split not in AMBIGUOUS_LS_SPLITS:
                parts = split_parts(d, split)
            if not parts and is_saved_dataset(d / split) and saved_ls_config(d / split) == config:
                parts = [d / split]
            if parts:
                here.append(HfSplit(d, config, split, parts))
        if here:
            found.append(here)
    candidates = one_dataset(root, found, f"LibriSpeech {subset}")
    return one_config(candidates, f"LibriSpeech {subset}") if candidates else None


def commonvoice_hf_parts(root: Path, locale: str, split: str) -> HfSplit | None:
    hf_split = CV_SPLITS.get(split, split)
    found = []
    for d in dataset_dirs(root, CV_WORDS):
        parts, config = split_parts(d / locale, hf_split), locale
        if not parts and is_saved_dataset(d / hf_split):
            config = saved_config_name(d / hf_split)
            parts = [d / hf_split] if config in (locale, None) else []
        if parts:
            found.append([HfSplit(d, config, hf_split, parts)])
    candidates = one_dataset(root, found, f"Common Voice {locale} {split}")
    return candidates[0] if candidates else None


def librispeech_hf_looked_for(root: Path, subset: str) -> list[str]:
    looked = []
    for config, split in LS_SPLITS.get(subset, []):
        alone = (f"{split}/ (save_to_disk of config {config})" if split in AMBIGUOUS_LS_SPLITS
                 else f"{split}/ (save_to_disk or *.parquet) or {split}-*.parquet")  # fmt: skip
        looked.append(f"{root}[/*librispeech*]/{config}/{split}/ (save_to_disk or *.parquet) or "
                      f"{config}/{split}-*.parquet or {alone}")  # fmt: skip
    return looked


def commonvoice_hf_looked_for(root: Path, locale: str, split: str) -> list[str]:
    hf_split = CV_SPLITS.get(split, split)
    return [f"{root}[/*common_voice*]/{locale}/{hf_split}/ (save_to_disk or *.parquet) or "
            f"{locale}/{hf_split}-*.parquet or {hf_split}/ (save_to_disk of config {locale} or "
            "of none)"]  # fmt: skip


def saved_form(folder: Path) -> str:
    config = saved_config_name(folder)
    return "save_to_disk, " + (f"config {config!r}" if config else "no config_name")


def listed(items: list[str], most: int) -> str:
    return ", ".join(items[:most]) + (
        f", ... ({len(items) - most} more)" if len(items) > most else ""
    )


def holds_split(folder: Path) -> bool:
    return is_saved_dataset(folder) or any(folder.glob("*.parquet"))


def listing(folder: Path, usable_only: bool = False) -> str:
    """What a folder holds that could be a split or a config: save_to_disk folders, and folders
    with what they hold of split folders and Parquet files (`usable_only`: none of the others)."""
    items = []
    for p in sorted(folder.iterdir()):
        if is_saved_dataset(p):
            items.append(f"{p.name}/ ({saved_form(p)})")
        elif p.is_dir():
            inner = [f"{c.name}/" for c in sorted(p.iterdir()) if holds_split(c)]
            inner += [f.name for f in sorted(p.glob("*.parquet"))]
            if inner or not usable_only:
                items.append(
                    f"{p.name}/ ({listed(inner, 3) or 'neither save_to_disk nor Parquet'})"
                )
        elif p.suffix == ".parquet":
            items.append(p.name)
    return listed(items, MAX_LISTED)


def hf_found_instead(
    root: Path, words: tuple[str, ...], configs: list[str], splits: list[str]
) -> list[str]:
    """Near misses: what each dataset folder's config folders hold, or, where the folder named
    like the corpus has none of them, what it holds that is a Hugging Face dataset; and the
    `splits` saved directly in a dataset folder that were not taken (another config, or none that
    says which)."""
    found = []
    for d in dataset_dirs(root, words):
        config_dirs = [d / c for c in dict.fromkeys(configs) if (d / c).is_dir()]
        found += [f"{c} holds {listing(c) or 'nothing'}" for c in config_dirs]
        if d != root and not config_dirs:
            if held := listing(d, usable_only=True):
                found.append(f"{d} holds {held}")
        else:
            saved = [d / s for s in dict.fromkeys(splits) if is_saved_dataset(d / s)]
            found += [f"{p} ({saved_form(p)})" for p in saved]
    return found


def librispeech_hf_found_instead(root: Path, subset: str) -> list[str]:
    pairs = LS_SPLITS.get(subset, [])
    return hf_found_instead(root, LS_WORDS, [c for c, _ in pairs], [s for _, s in pairs])


def commonvoice_hf_found_instead(root: Path, locale: str, split: str) -> list[str]:
    return hf_found_instead(root, CV_WORDS, [locale], [CV_SPLITS.get(split, split)])


# ----------------------------------------------------------------------------------------------
# Manifests


def saved_table(folder: Path) -> pa.Table:
    """A save_to_disk folder's rows, memory-mapped (its data-*.arrow files are Arrow streams)."""
    files = [f["filename"] for f in json.loads((folder / "state.json").read_text())["_data_files"]]
    return pa.concat_tables(
        pa.ipc.open_stream(pa.memory_map(str(folder / name))).read_all() for name in files
    )


def is_text(t: pa.DataType) -> bool:
    """Strings (plain, large or dictionary-encoded), or nulls only (each row then skipped as
    missing its value)."""
    if pa.types.is_dictionary(t):
        t = t.value_type
    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_null(t)


def is_text_or_integer(t: pa.DataType) -> bool:
    return is_text(t) or pa.types.is_integer(t)


def is_bytes(t: pa.DataType) -> bool:
    return pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_null(t)


def is_float_list(t: pa.DataType) -> bool:
    lists = pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)
    return lists and pa.types.is_floating(t.value_type)


def is_audio(t: pa.DataType) -> bool:
    """datasets' Audio feature: {bytes, path} (either may be absent), or {array, sampling_rate}
    with `array` a list of floats. A list of lists is refused, not mixed down: Audio(mono=False)
    gives [channels, samples], soundfile [samples, channels], and the cells do not say which."""
    if not pa.types.is_struct(t):
        return False
    fields = {f.name: f.type for f in t}
    if "array" in fields:
        rate = fields.get("sampling_rate")
        return is_float_list(fields["array"]) and rate is not None and pa.types.is_integer(rate)
    encoded = {"bytes": is_bytes, "path": is_text}
    present = fields.keys() & encoded.keys()
    return bool(present) and all(encoded[name](fields[name]) for name in present)


@dataclass(frozen=True)
class ColumnType:
    expected: str  # as the error names it
    holds: Callable[[pa.DataType], bool]


TEXT = ColumnType("string", is_text)
TEXT_OR_INTEGER = ColumnType("string or integer", is_text_or_integer)
AUDIO = ColumnType(
    "struct<bytes: binary, path: string> (encoded audio) or struct<array: list<float>, "
    "sampling_rate: integer> (decoded mono samples)",
    is_audio,
)
COLUMN_TYPES = {  # every column read: LS_FIELDS, CV_FIELDS, CV_ATTRIBUTE_COLUMNS, audio
    "id": TEXT, "speaker_id": TEXT_OR_INTEGER, "text": TEXT,
    "path": TEXT, "client_id": TEXT_OR_INTEGER, "sentence": TEXT,
    "age": TEXT_OR_INTEGER, "gender": TEXT_OR_INTEGER, "accent": TEXT_OR_INTEGER,
    "accents": TEXT_OR_INTEGER, "audio": AUDIO,
}  # fmt: skip


def read_columns(part: Path, columns: tuple[str, ...], optional: tuple[str, ...] = ()) -> pa.Table:
    """The text columns of a part, and those of `optional` it has (a Parquet file's audio bytes
    are not read here), once every column read, `audio` included, has the type it should: a
    dataset exported with other types is an error here rather than a traceback at its first row."""
    try:
        saved = saved_table(part) if part.is_dir() else None
        schema = pq.read_schema(part) if saved is None else saved.schema
    except READ_ERRORS as err:
        raise not_readable(part, err) from None
    missing = [c for c in (*columns, "audio") if c not in schema.names]
    if missing:
        raise UserError(f"{part}: no column(s) {', '.join(missing)} (has {schema.names})")
    wanted = [*columns, *(c for c in optional if c in schema.names)]
    types = {c: schema.field(c).type for c in (*wanted, "audio")}
    wrong = [f"column {c!r} is {t}, expected {COLUMN_TYPES[c].expected}"
             for c, t in types.items() if not COLUMN_TYPES[c].holds(t)]  # fmt: skip
    if wrong:
        raise UserError(f"{part}: {'; '.join(wrong)}")
    try:  # the footer was readable; a page may still be corrupt
        return pq.read_table(part, columns=wanted) if saved is None else saved.select(wanted)
    except READ_ERRORS as err:
        raise not_readable(part, err) from None


Attributes = tuple[tuple[str, str], ...]


def hf_manifest(
    found: HfSplit, fields: tuple[str, str, str], optional: tuple[str, ...], corpus: str,
    split: str, language: str, skips: Skips, attributes: Callable[[pa.Table], list[Attributes]],
) -> list[Entry]:  # fmt: skip
    """Entries of the rows of the split; `fields` name the utterance id, user and transcript;
    `attributes` gives each row's speaker attributes from a part's table (`fields` and those of
    the `optional` columns it has)."""
    entries = []
    for part in found.parts:
        table = read_columns(part, fields, optional)
        ids, users, texts = (table.column(name).to_pylist() for name in fields)
        rows = zip(ids, users, texts, attributes(table), strict=True)
        for row, (utt, user, raw, attrs) in enumerate(rows):
            utt_id = Path(utt).stem if utt else f"{part.name}#{row}"  # CV `path` -> clip name
            if not utt:
                skips.add("missing_utterance_id", utt_id)
                continue
            if user is None or not str(user).strip():
                skips.add("missing_user_id", utt_id)
                continue
            if skips.seen_before(utt_id):
                continue
            entry = make_entry(utt_id, str(user), split, f"hf:{part}#{row}", raw or "", corpus,
                               language, skips, attrs)  # fmt: skip
            if entry:
                entries.append(entry)
    return entries


def librispeech_hf_manifest(found: HfSplit, subset: str, language: str, skips: Skips) -> Manifest:
    """User = speaker_id, as for the native tree; gender from SPEAKERS.TXT in the dataset folder
    (the dataset has no speaker attributes)."""
    genders = librispeech_genders(found.dataset)

    def gender(table: pa.Table) -> list[Attributes]:
        speakers = table.column("speaker_id").to_pylist()
        return [(("gender", genders.get(str(s), UNREPORTED)),) if genders else () for s in speakers]

    entries = hf_manifest(found, LS_FIELDS, (), "librispeech", subset, language, skips, gender)
    why = (f"openslr/librispeech_asr has no speaker attributes, and {no_genders(found.dataset)} "
           f"(copy LibriSpeech's SPEAKERS.TXT into {found.dataset.name}/)")  # fmt: skip
    return Manifest(entries, found.describe(), None if genders else why)


def reported(value) -> str:
    """An attribute cell: empty or null is unreported, as in the native TSVs."""
    return (str(value).strip() if value is not None else "") or UNREPORTED


def commonvoice_hf_manifest(found: HfSplit, split: str, language: str, skips: Skips) -> Manifest:
    """User = client_id; utterance id = the clip name, as for the native release; age, gender and
    accent from their columns."""
    present: set[str] = set()  # the attributes some part has a column for

    def columns(table: pa.Table) -> list[Attributes]:
        cols = {a: next((c for c in names if c in table.column_names), None)
                for a, names in CV_ATTRIBUTE_COLUMNS.items()}  # fmt: skip
        values = {a: table.column(c).to_pylist() for a, c in cols.items() if c}
        present.update(values)
        return [tuple((a, reported(v[i])) for a, v in values.items()) for i in range(len(table))]

    optional = tuple(c for names in CV_ATTRIBUTE_COLUMNS.values() for c in names)
    entries = hf_manifest(found, CV_FIELDS, optional, "commonvoice", split, language, skips,
                          columns)  # fmt: skip
    why = (f"{found.dataset.name} split {found.split!r} has none of the columns "
           f"{', '.join(CV_ATTRIBUTE_COLUMNS)}")  # fmt: skip
    return Manifest(entries, found.describe(), None if present else why)


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
    try:
        audio = _parquet_audio(part, group)
    except READ_ERRORS as err:
        # A corrupt page spoils its row group: an error naming the file, not a skip of each of
        # its rows (each would read the group again).
        raise UserError(
            f"{part}: the audio of rows {starts[group]}-{starts[group + 1] - 1} (row group "
            f"{group}) is not readable ({err}); restore the file from the download"
        ) from None
    return audio[row - starts[group]]


def read_hf_audio(ref: str) -> tuple[np.ndarray, int]:
    """Samples and rate of `hf:<part>#<row>`: encoded bytes, a file path, or a decoded array."""
    part, _, row = ref.removeprefix("hf:").rpartition("#")
    value = hf_audio_value(part, int(row))
    if not value.is_valid:
        raise AudioError("missing_audio_file")
    fields = {f.name for f in value.type}
    if "array" in fields:  # read_columns checked the types: mono floats, an integer rate
        samples, rate = value["array"].values, value["sampling_rate"].as_py()
        if samples is None or len(samples) == 0:
            raise AudioError("zero_length_audio")
        if rate is None:  # this row's fault, not the dataset's: skipped, the others read
            raise AudioError("missing_sample_rate")
        decoded = samples.to_numpy(zero_copy_only=False).astype(np.float32)
        check_decoded(decoded, rate)  # as a file's samples are checked (audio.py)
        return decoded, rate
    data = value["bytes"].as_py() if "bytes" in fields else None
    if data is not None:
        return decode_audio_bytes(data)
    path = value["path"].as_py() if "path" in fields else None
    if path:  # audio kept as a file next to (or named absolutely from) the dataset
        return read_audio_file(str(Path(part).parent / path))
    raise AudioError("missing_audio_file")
