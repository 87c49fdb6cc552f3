"""Transcript normalization and character token sets (PAPER.md, Data).

English: lowercase, Latin letters spelled in ASCII (unidecode: é → e, æ → ae), punctuation
removed except hyphen and apostrophe inside words.
French/German: lowercase, keep their letters and single quotes; other Latin letters are spelled in
ASCII.
Only Latin letters are transliterated: a letter of another script (Москва, 東京, α) or a digit is
not a spelling of what the speaker said, so it survives normalization, the tokenizer rejects it
and the adapters count the utterance as dropped (characters_outside_token_set): nothing is silent.
"""

from __future__ import annotations

import re
import string
import unicodedata
from collections.abc import Sequence
from functools import cache

from unidecode import unidecode

NORMALIZER_VERSION = 2  # 2: only Latin letters are transliterated
EXTRA_LETTERS = {"en": "", "fr": "àâæçéèêëîïôœùûüÿ", "de": "äöüß"}
BLANK = "<blank>"
_APOSTROPHES = str.maketrans({"’": "'", "‘": "'", "ʼ": "'", "`": "'", "´": "'"})
_HYPHENS = str.maketrans({"‐": "-", "‑": "-", "‒": "-", "–": "-", "—": "-"})
_SPACES = re.compile(r"\s+")
_EDGE_MARKS = "'-"


def letters(language: str) -> str:
    if language not in EXTRA_LETTERS:
        raise ValueError(f"unsupported language {language!r} (en, fr, de)")
    return string.ascii_lowercase + EXTRA_LETTERS[language]


def _is_punctuation(ch: str) -> bool:
    return unicodedata.category(ch)[0] in "PS" and ch not in _EDGE_MARKS


def _spelled_in_ascii(ch: str) -> str:
    """A character outside the language's letters, as normalization keeps it."""
    category = unicodedata.category(ch)
    # A diacritic NFC found no precomposed letter for, or invisible formatting (soft hyphen,
    # zero-width space): dropped, as unidecode drops an accent.
    if category in ("Mn", "Cf"):
        return ""
    # A Latin letter (é, ø, ß, the ligature ﬁ, fullwidth Ａ): its ASCII spelling.
    if category[0] == "L" and "LATIN" in unicodedata.name(ch, "").split():
        return unidecode(ch).lower()
    # Punctuation and symbols become spaces (normalize); anything else is left for the tokenizer
    # to reject: unidecode would spell 東京 "dong jing" and € "EUR", words nobody said.
    return ch


def normalize(text: str, language: str) -> str:
    """The normalized transcript: lowercase words of the language's letters, ' and - inside words,
    single spaces."""
    keep = set(letters(language))
    text = unicodedata.normalize("NFC", text).translate(_APOSTROPHES).translate(_HYPHENS).lower()
    text = "".join(ch if ch in keep else _spelled_in_ascii(ch) for ch in text)
    text = "".join(" " if _is_punctuation(ch) else ch for ch in text)
    words = (w.strip(_EDGE_MARKS) for w in _SPACES.split(text))
    return " ".join(w for w in words if w)


class Tokenizer:
    """Characters -> ids for CTC: 0 blank, 1 word boundary, then ' and -, then the letters."""

    def __init__(self, language: str) -> None:
        self.language = language
        self.blank = 0
        self.vocab: list[str] = [BLANK, " ", "'", "-", *letters(language)]
        self.size = len(self.vocab)
        self._ids = {ch: i for i, ch in enumerate(self.vocab) if i != self.blank}

    def encode(self, text: str) -> list[int]:
        try:
            return [self._ids[ch] for ch in text]
        except KeyError as exc:
            raise ValueError(f"character {exc.args[0]!r} is not a {self.language} token") from None

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(self.vocab[i] for i in ids if i != self.blank)

    def unknown_characters(self, text: str) -> str:
        """The characters of `text` outside the token set, in order of first appearance."""
        return "".join(dict.fromkeys(ch for ch in text if ch not in self._ids))


@cache
def tokenizer_for(language: str) -> Tokenizer:
    return Tokenizer(language)
