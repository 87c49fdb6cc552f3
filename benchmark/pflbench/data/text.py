"""Transcript normalization and character token sets (PAPER.md, Data).

English: lowercase, unidecode, punctuation removed except hyphen and apostrophe inside words.
French/German: lowercase, keep their letters and single quotes; other letters are unidecoded.
Characters that survive normalization but are not tokens (digits, ...) are not removed here: the
tokenizer rejects them and the adapters count the utterance as dropped, so nothing is silent.
"""

from __future__ import annotations

import re
import string
import unicodedata
from collections.abc import Sequence
from functools import cache

from unidecode import unidecode

NORMALIZER_VERSION = 1
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


def normalize(text: str, language: str) -> str:
    """The normalized transcript: lowercase words of the language's letters, ' and - inside words,
    single spaces."""
    keep = set(letters(language))
    text = unicodedata.normalize("NFC", text).translate(_APOSTROPHES).translate(_HYPHENS).lower()
    # Unidecode only what is not already one of the language's letters (all of it for English).
    text = "".join(ch if ch in keep else unidecode(ch).lower() for ch in text)
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
