"""Corpus readers: LibriSpeech trees and Common Voice release folders -> one manifest schema
(the registry of corpora, which ties each to its Hugging Face reader in hf.py, is adapters.py).

A data root may hold (exactly as downloaded, nothing renamed):
  LibriSpeech/<subset>/<speaker>/<chapter>/*.flac + <speaker>-<chapter>.trans.txt (+ SPEAKERS.TXT),
      or the root may be the LibriSpeech folder itself;
  cv-corpus-*/<locale>/{train,dev,test,validated}.tsv + clips/, or the root may be one release
      folder (<locale>/...) or one locale folder; with several cv-corpus-* releases holding the
      locale, the error lists them and asks to point --data-root at one;
  Hugging Face datasets (save_to_disk folders or Parquet files, see hf.py).
Text problems (empty or untokenizable transcripts, malformed rows), missing audio files, rows
without a speaker id and utterances listed twice (in one subset or in two subsets of one source:
the first is kept) are skipped here and counted by reason; audio that cannot be decoded is counted
when features are made. A text file that is not UTF-8 is an error naming its first such line.
Speaker attributes for per-group WER come from Common Voice's age/gender/accents columns and
LibriSpeech's SPEAKERS.TXT (gender); an attribute a speaker did not report is "unreported". A
reader that has no attributes to give says why (Manifest.no_attributes): the data report and the
record carry it, so per-group WER never disappears unexplained.
"""

from __future__ import annotations

import csv
import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from pflbench.data.text import normalize, tokenizer_for
from pflbench.errors import UserError

CV_REQUIRED_COLUMNS = ("client_id", "path", "sentence")
CV_ATTRIBUTE_COLUMNS = {"age": "age", "gender": "gender", "accent": "accents"}
LS_GENDERS = {"F": "female", "M": "male"}
UNREPORTED = "unreported"
MAX_EXAMPLES = 5


@dataclass(frozen=True)
class Entry:
    """One manifest row. `audio` is a file path, or `hf:<key>#<row>` for a Hugging Face row."""

    utt_id: str
    user_id: str
    split: str
    audio: str
    text: str  # normalized
    corpus: str
    attributes: tuple[tuple[str, str], ...] = ()  # (name, value) of the speaker: age, gender, ...


@dataclass
class Manifest:
    """One subset as a reader found it: its entries, where they were read (relative to the data
    root's corpus folder; a Hugging Face dataset's config included) and, when the entries carry no
    speaker attributes, why."""

    entries: list[Entry]
    source: str
    no_attributes: str | None = None


@dataclass
class Skips:
    """Skipped items: count per reason and a few example ids, so nothing is dropped silently."""

    counts: dict[str, int] = field(default_factory=dict)
    examples: dict[str, list[str]] = field(default_factory=dict)
    # Utterance ids read so far: one Skips spans every subset of a source (prepare.py), so
    # duplicates are found across them too. Not part of the report.
    utterances_read: set[str] = field(default_factory=set, repr=False, compare=False)

    def add(self, reason: str, item_id: str) -> None:
        self.counts[reason] = self.counts.get(reason, 0) + 1
        examples = self.examples.setdefault(reason, [])
        if len(examples) < MAX_EXAMPLES:
            examples.append(item_id)

    def seen_before(self, utt_id: str) -> bool:
        """Whether `utt_id` was already read under these skips; a repeat is counted as
        duplicate_utterance (the first listing is kept: Common Voice's validated.tsv repeats the
        clips of train.tsv and dev.tsv, so a source [dev, validated] reads each clip once)."""
        if utt_id in self.utterances_read:
            self.add("duplicate_utterance", utt_id)
            return True
        self.utterances_read.add(utt_id)
        return False

    def merge(self, other: Skips) -> None:
        for reason, n in other.counts.items():
            self.counts[reason] = self.counts.get(reason, 0) + n
            room = MAX_EXAMPLES - len(self.examples.setdefault(reason, []))
            self.examples[reason] += other.examples.get(reason, [])[: max(room, 0)]

    def to_dict(self) -> dict:
        return {"counts": dict(sorted(self.counts.items())), "examples": self.examples}

    @classmethod
    def from_dict(cls, d: dict) -> Skips:
        return cls(
            dict(d.get("counts", {})), {k: list(v) for k, v in d.get("examples", {}).items()}
        )

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def speaker_groups(entries: list[Entry]) -> dict[str, dict[str, str]]:
    """attribute -> speaker -> group, for the attributes that split the speakers into >= 2 groups.
    Common Voice stores attributes per clip; a speaker whose clips disagree gets the value most of
    them carry (ties broken alphabetically)."""
    votes: dict[str, dict[str, Counter]] = defaultdict(lambda: defaultdict(Counter))
    for e in entries:
        for name, value in e.attributes:
            votes[name][e.user_id][value] += 1
    groups = {}
    for name, by_speaker in sorted(votes.items()):
        chosen = {s: min(c, key=lambda v: (-c[v], v)) for s, c in sorted(by_speaker.items())}
        if len(set(chosen.values())) >= 2:
            groups[name] = chosen
    return groups


def not_utf8(path: Path) -> UserError:
    """The error for a text file that does not decode as UTF-8, naming its first such line (found
    by reading it again: a streaming decoder's offset counts from the chunk it was decoding)."""
    with path.open("rb") as f:
        for n, line in enumerate(f, 1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as err:
                return UserError(
                    f"{path}: line {n} is not UTF-8 (byte 0x{line[err.start]:02x} at byte "
                    f"{err.start + 1} of the line); the corpora's text files are read as UTF-8, as "
                    "they are distributed: restore the file from the download or re-encode it"
                )
    return UserError(f"{path}: not UTF-8 when read, UTF-8 when read again (changed meanwhile?)")


def make_entry(
    utt_id: str, user_id: str, split: str, audio: str, raw: str, corpus: str, language: str,
    skips: Skips, attributes: tuple[tuple[str, str], ...] = (),
) -> Entry | None:  # fmt: skip
    """The entry, or None (counted in `skips`) when the transcript has nothing to learn from."""
    if not raw.strip():
        skips.add("empty_transcript", utt_id)
        return None
    text = normalize(raw, language)
    if not text:
        skips.add("nothing_left_after_normalization", utt_id)
        return None
    if tokenizer_for(language).unknown_characters(text):
        skips.add("characters_outside_token_set", utt_id)
        return None
    return Entry(utt_id, user_id, split, audio, text, corpus, attributes)


# ----------------------------------------------------------------------------------------------
# LibriSpeech


def librispeech_subset_dir(root: Path, subset: str) -> Path | None:
    for candidate in (root / "LibriSpeech" / subset, root / subset):
        if candidate.is_dir():
            return candidate
    return None


def librispeech_looked_for(root: Path, subset: str) -> list[str]:
    return [str(root / "LibriSpeech" / subset), str(root / subset)]


_LS_SUBSET = re.compile(r"^(train|dev|test)-(clean|other)(-\d+)?$")


def librispeech_found_instead(root: Path, subset: str) -> list[str]:
    """The LibriSpeech subset folders that are where `subset` was looked for."""
    found = []
    for folder in (root / "LibriSpeech", root):
        names = sorted(p.name for p in folder.glob("*") if p.is_dir() and _LS_SUBSET.match(p.name))
        if names:
            found.append(f"{folder} holds {', '.join(names)}")
        elif folder != root and folder.is_dir():
            found.append(f"{folder} holds no subset folder")
    return found


_LS_LINE = re.compile(r"^(\d+-\d+-\d+)(?:\s+(.*))?$")


def librispeech_manifest(subset_dir: Path, subset: str, language: str, skips: Skips) -> Manifest:
    """User = speaker id (not speaker-chapter)."""
    entries, described = [], set()
    genders = librispeech_genders(subset_dir.parent)
    for trans in sorted(subset_dir.glob("*/*/*.trans.txt")):
        # A byte that is not UTF-8 stops the read instead of skipping its line: the encoding is
        # the file's, and a file saved as Latin-1 would lose exactly its lines with accents.
        try:
            text = trans.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise not_utf8(trans) from None
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            match = _LS_LINE.match(line.strip())
            if not match:
                skips.add("malformed_transcript_line", f"{trans.name}:{n}")
                continue
            utt_id, raw = match.group(1), match.group(2) or ""
            audio = trans.parent / f"{utt_id}.flac"
            described.add(audio.name)
            # The id names its speaker (the DP user) and chapter: one filed in another speaker's
            # folder says two things about who spoke it.
            if not utt_id.startswith(f"{trans.parent.parent.name}-{trans.parent.name}-"):
                skips.add("misplaced_utterance", utt_id)
                continue
            if skips.seen_before(utt_id):
                continue
            if not audio.is_file():
                skips.add("missing_audio_file", utt_id)
                continue
            speaker = utt_id.split("-")[0]
            gender = (("gender", genders.get(speaker, UNREPORTED)),) if genders else ()
            entry = make_entry(utt_id, speaker, subset, str(audio), raw, "librispeech", language,
                               skips, gender)  # fmt: skip
            if entry:
                entries.append(entry)
    for flac in sorted(subset_dir.glob("*/*/*.flac")):
        if flac.name not in described:
            skips.add("audio_without_transcript", flac.stem)
    where = f"{subset_dir.parent.name}/{subset_dir.name}"
    return Manifest(entries, where, None if genders else no_genders(subset_dir.parent))


# ----------------------------------------------------------------------------------------------
# Common Voice


def commonvoice_locale_dirs(root: Path, locale: str) -> list[Path]:
    """Folders holding <split>.tsv files for `locale`, most specific interpretation first."""
    if (root / "clips").is_dir() and root.name == locale:
        return [root]
    if (root / locale).is_dir():
        return [root / locale]
    return sorted(p / locale for p in root.glob("cv-corpus-*") if (p / locale).is_dir())


def commonvoice_tsv(root: Path, locale: str, split: str) -> Path | None:
    dirs = commonvoice_locale_dirs(root, locale)
    if len(dirs) > 1:
        names = ", ".join(str(d.parent) for d in dirs)
        raise UserError(
            f"several Common Voice releases for locale {locale!r} under {root}: {names}; "
            "point --data-root (or PFLBENCH_DATA) at the one to use"
        )
    if dirs and (dirs[0] / f"{split}.tsv").is_file():
        return dirs[0] / f"{split}.tsv"
    return None


def commonvoice_looked_for(root: Path, locale: str, split: str) -> list[str]:
    return [
        str(root / "cv-corpus-*" / locale / f"{split}.tsv"),
        str(root / locale / f"{split}.tsv"),
    ]


def commonvoice_found_instead(root: Path, locale: str, split: str) -> list[str]:
    """The splits of the locale's folders, or the locales of the releases, that are there."""
    dirs = commonvoice_locale_dirs(root, locale)
    if dirs:
        return [f"{d} holds {', '.join(sorted(p.name for p in d.glob('*.tsv'))) or 'no *.tsv'}"
                for d in dirs]  # fmt: skip
    return [
        f"{release} holds {', '.join(sorted(p.name for p in release.iterdir() if p.is_dir()))}"
        for release in sorted(root.glob("cv-corpus-*"))
        if release.is_dir()
    ]


def librispeech_genders(folder: Path) -> dict[str, str]:
    """Speaker id -> female/male from folder/SPEAKERS.TXT ({} without one); a line that is not
    `ID | SEX | ...` is ignored (the file is documentation, not data)."""
    path = folder / "SPEAKERS.TXT"
    if not path.is_file():
        return {}
    genders = {}
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        fields = [f.strip() for f in line.split("|")]
        if line.startswith(";") or len(fields) < 2 or fields[1] not in LS_GENDERS:
            continue
        genders[fields[0]] = LS_GENDERS[fields[1]]
    return genders


def no_genders(folder: Path) -> str:
    return f"no speaker genders: {folder.name}/SPEAKERS.TXT is missing or lists none"


def commonvoice_manifest(tsv: Path, split: str, language: str, skips: Skips) -> Manifest:
    """User = client_id. Columns by header name; quoting off (real CV has unbalanced quotes)."""
    try:
        entries, attribute_col = commonvoice_rows(tsv, split, language, skips)
    except UnicodeDecodeError:  # an error, not a skip: see librispeech_manifest
        raise not_utf8(tsv) from None
    where = "/".join(tsv.parts[-3:])  # release/locale/split.tsv
    no_columns = f"{tsv.name} has none of the columns {', '.join(CV_ATTRIBUTE_COLUMNS.values())}"
    return Manifest(entries, where, None if attribute_col else no_columns)


def commonvoice_rows(
    tsv: Path, split: str, language: str, skips: Skips
) -> tuple[list[Entry], dict[str, int]]:
    """The TSV's entries, and the index of its column of each speaker attribute it has."""
    clips = tsv.parent / "clips"
    with tsv.open(encoding="utf-8-sig", newline="") as f:  # a BOM some editors add is not a name
        rows = csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
        header = next(rows, None) or []
        missing = [c for c in CV_REQUIRED_COLUMNS if c not in header]
        if missing:
            raise UserError(f"{tsv}: header lacks column(s) {', '.join(missing)} (got {header})")
        col = {name: header.index(name) for name in CV_REQUIRED_COLUMNS}
        attribute_col = {a: header.index(c) for a, c in CV_ATTRIBUTE_COLUMNS.items() if c in header}
        entries = []
        for n, row in enumerate(rows, 2):
            if len(row) != len(header):
                skips.add("malformed_tsv_row", f"{tsv.name}:{n}")
                continue
            path, client_id = row[col["path"]], row[col["client_id"]]
            utt_id = Path(path).stem
            # Without a client_id the row's speaker is unknown: as one user '' such rows would
            # merge different people into one DP user (the Hugging Face reader skips them too).
            if not client_id.strip():
                skips.add("missing_user_id", utt_id)
                continue
            if skips.seen_before(utt_id):
                continue
            if not (clips / path).is_file():
                skips.add("missing_audio_file", utt_id)
                continue
            attributes = tuple((a, row[i].strip() or UNREPORTED) for a, i in attribute_col.items())
            entry = make_entry(utt_id, client_id, split, str(clips / path), row[col["sentence"]],
                               "commonvoice", language, skips, attributes)  # fmt: skip
            if entry:
                entries.append(entry)
    return entries, attribute_col
