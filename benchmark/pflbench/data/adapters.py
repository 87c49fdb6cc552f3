"""The registry of corpora: one adapter per corpus, saying where a subset (LibriSpeech) or split
(Common Voice) lies under a data root and how its manifest is read, both for the corpus as
downloaded (readers in corpora.py) and for its Hugging Face counterpart (readers in hf.py).

- "librispeech": LibriSpeech/<subset>/ trees; openslr/librispeech_asr datasets.
- "commonvoice": cv-corpus-*/<locale>/<split>.tsv + clips/; Common Voice datasets.

Specs name corpora (DataSource.corpus, EvalSet.corpus); pflbench.methods checks the names against
CORPORA, and pflbench.data.prepare reads through it. Adding a corpus is its readers, an adapter
registered in CORPORA (here, or from a plug-in: pflbench.plugins) and a test of its lookup.

hf.py (pyarrow, soundfile) is imported when a Hugging Face dataset is looked for, not with this
module.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from pflbench.data.corpora import (
    Manifest,
    Skips,
    commonvoice_found_instead,
    commonvoice_looked_for,
    commonvoice_manifest,
    commonvoice_tsv,
    librispeech_found_instead,
    librispeech_looked_for,
    librispeech_manifest,
    librispeech_subset_dir,
)
from pflbench.extension import ExtensionPoint

if TYPE_CHECKING:
    from pflbench.data.hf import HfSplit


class CorpusAdapter(ABC):
    """How one corpus is found under a data root and read into manifest entries.

    `subset` is what a task names (a LibriSpeech subset, a Common Voice split); `locale` is the
    source's locale or else the task's language (a corpus with one language ignores it). Each
    `find*` returns what the matching `read*` takes, or None where the data root does not hold it,
    and raises UserError where it holds it more than once. Not found, the error lists `looked_for`
    and `looked_for_hf` and, where there are near misses, what `found_instead` lists."""

    name: ClassVar[str]  # the value of `corpus` in task specs
    # Whether a training source (DataSource) must name its locale.
    needs_locale: ClassVar[bool] = False

    @abstractmethod
    def describe(self, subset: str, locale: str) -> str:
        """What was looked for, as the not-found error names it."""

    @abstractmethod
    def source_name(self, subsets: list[str], locale: str | None) -> str:
        """The paper's name of a source reading `subsets` (LS-100, CV-en-train)."""

    # The corpus as downloaded

    @abstractmethod
    def find(self, root: Path, subset: str, locale: str) -> Any | None: ...

    @abstractmethod
    def looked_for(self, root: Path, subset: str, locale: str) -> list[str]: ...

    @abstractmethod
    def read(self, found: Any, subset: str, language: str, skips: Skips) -> Manifest: ...

    # Its Hugging Face counterpart

    @abstractmethod
    def find_hf(self, root: Path, subset: str, locale: str) -> HfSplit | None: ...

    @abstractmethod
    def looked_for_hf(self, root: Path, subset: str, locale: str) -> list[str]: ...

    @abstractmethod
    def read_hf(self, found: HfSplit, subset: str, language: str, skips: Skips) -> Manifest: ...

    # Near misses, in both forms

    @abstractmethod
    def found_instead(self, root: Path, subset: str, locale: str) -> list[str]:
        """What lies where the subset was looked for, as the not-found error lists it."""


class LibriSpeech(CorpusAdapter):
    """User = speaker id; gender from SPEAKERS.TXT (beside the subset folders, or in the Hugging
    Face dataset's folder)."""

    name = "librispeech"
    PAPER_NAMES: ClassVar[dict[tuple[str, ...], str]] = {
        ("train-clean-100",): "LS-100",
        ("train-clean-360", "train-other-500"): "LS-860",
        ("train-clean-100", "train-clean-360", "train-other-500"): "LS-960",
    }

    def describe(self, subset: str, locale: str) -> str:
        return f"LibriSpeech subset {subset!r}"

    def source_name(self, subsets: list[str], locale: str | None) -> str:
        return self.PAPER_NAMES.get(tuple(sorted(subsets)), "LS:" + "+".join(subsets))

    def find(self, root: Path, subset: str, locale: str) -> Path | None:
        return librispeech_subset_dir(root, subset)

    def looked_for(self, root: Path, subset: str, locale: str) -> list[str]:
        return librispeech_looked_for(root, subset)

    def read(self, found: Path, subset: str, language: str, skips: Skips) -> Manifest:
        return librispeech_manifest(found, subset, language, skips)

    def find_hf(self, root: Path, subset: str, locale: str) -> HfSplit | None:
        from pflbench.data.hf import librispeech_hf_parts

        return librispeech_hf_parts(root, subset)

    def looked_for_hf(self, root: Path, subset: str, locale: str) -> list[str]:
        from pflbench.data.hf import librispeech_hf_looked_for

        return librispeech_hf_looked_for(root, subset)

    def read_hf(self, found: HfSplit, subset: str, language: str, skips: Skips) -> Manifest:
        from pflbench.data.hf import librispeech_hf_manifest

        return librispeech_hf_manifest(found, subset, language, skips)

    def found_instead(self, root: Path, subset: str, locale: str) -> list[str]:
        from pflbench.data.hf import librispeech_hf_found_instead

        return librispeech_found_instead(root, subset) + librispeech_hf_found_instead(root, subset)


class CommonVoice(CorpusAdapter):
    """User = client_id; age, gender and accent from the TSV columns."""

    name = "commonvoice"
    needs_locale = True  # a release holds many languages

    def describe(self, subset: str, locale: str) -> str:
        return f"Common Voice {locale} split {subset!r}"

    def source_name(self, subsets: list[str], locale: str | None) -> str:
        return f"CV-{locale}-" + "+".join(subsets)

    def find(self, root: Path, subset: str, locale: str) -> Path | None:
        return commonvoice_tsv(root, locale, subset)

    def looked_for(self, root: Path, subset: str, locale: str) -> list[str]:
        return commonvoice_looked_for(root, locale, subset)

    def read(self, found: Path, subset: str, language: str, skips: Skips) -> Manifest:
        return commonvoice_manifest(found, subset, language, skips)

    def find_hf(self, root: Path, subset: str, locale: str) -> HfSplit | None:
        from pflbench.data.hf import commonvoice_hf_parts

        return commonvoice_hf_parts(root, locale, subset)

    def looked_for_hf(self, root: Path, subset: str, locale: str) -> list[str]:
        from pflbench.data.hf import commonvoice_hf_looked_for

        return commonvoice_hf_looked_for(root, locale, subset)

    def read_hf(self, found: HfSplit, subset: str, language: str, skips: Skips) -> Manifest:
        from pflbench.data.hf import commonvoice_hf_manifest

        return commonvoice_hf_manifest(found, subset, language, skips)

    def found_instead(self, root: Path, subset: str, locale: str) -> list[str]:
        from pflbench.data.hf import commonvoice_hf_found_instead

        return commonvoice_found_instead(root, locale, subset) + commonvoice_hf_found_instead(
            root, locale, subset
        )


# The registry (plug-ins add corpora: pflbench.plugins).
CORPORA = ExtensionPoint(
    "corpus", ((a.name, a) for a in (LibriSpeech(), CommonVoice())), entry_type=CorpusAdapter
)
