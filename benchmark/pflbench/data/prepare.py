"""From a Task to its data: find the corpora, build manifests and user splits, fill the stores."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

from pflbench.checkpoint import exclusive
from pflbench.data.adapters import CORPORA
from pflbench.data.corpora import Entry, Skips, speaker_groups
from pflbench.data.features import FEATURE_CONFIG
from pflbench.data.splits import apply_user_split, iid_reassign, users_digest
from pflbench.data.store import FeatureStore, build_store
from pflbench.data.synth import SYNTH_VERSION, synthesize_cached
from pflbench.data.text import NORMALIZER_VERSION, Tokenizer, tokenizer_for
from pflbench.errors import UserError
from pflbench.spec.models import DataSource, EvalSet, Task

MANIFEST_VERSION = 1


@dataclass
class TaskData:
    tokenizer: Tokenizer
    seed_train: FeatureStore | None
    federated_train: FeatureStore
    eval_sets: dict[str, FeatureStore]
    report: dict  # per split: skipped counts by reason + example ids, user digest, sizes
    # per eval set: attribute -> speaker -> group (age, gender, accent), for per-group WER
    eval_groups: dict[str, dict[str, dict[str, str]]] = field(default_factory=dict)


def cache_dir_default() -> Path:
    return Path(os.environ.get("PFLBENCH_CACHE") or Path.home() / ".cache" / "pflbench")


def synth_root(task: Task, cache_dir: Path | None = None) -> Path:
    s = task.synthetic
    name = f"{s.language}-{s.size}-seed{s.seed}-v{SYNTH_VERSION}"  # a new version: new corpora
    return (cache_dir or cache_dir_default()) / "synth" / name


def data_root_for(
    task: Task,
    data_root: Path | None,
    cache_dir: Path | None = None,
    on_unit: Callable[[int, int], None] | None = None,
) -> Path:
    """Where the task's corpora are: for a synth-* task the cached synthetic corpora (generated on
    first use), else --data-root or PFLBENCH_DATA."""
    if task.synthetic is not None:
        s = task.synthetic
        root = synth_root(task, cache_dir)
        return synthesize_cached(root, s.language, s.size, s.seed, on_unit=on_unit)
    root = data_root or (
        Path(os.environ["PFLBENCH_DATA"]) if os.environ.get("PFLBENCH_DATA") else None
    )
    if root is None:
        raise UserError(
            f"task {task.name!r} reads real corpora: pass --data-root DIR or set PFLBENCH_DATA to "
            "a folder holding LibriSpeech/<subset>/... and/or cv-corpus-*/<locale>/<split>.tsv + "
            "clips/ (or Hugging Face datasets); the synth-* tasks need no download"
        )
    if not Path(root).is_dir():
        raise UserError(f"data root {root} does not exist or is not a folder")
    return Path(root)


# ----------------------------------------------------------------------------------------------
# Manifests


def subset_manifest(
    root: Path, corpus: str, subset: str, locale: str | None, language: str, skips: Skips
) -> list[Entry]:
    """The corpus as downloaded (a LibriSpeech tree, a Common Voice release) if present, else its
    Hugging Face dataset; the error lists every place looked at. The corpus's adapter
    (pflbench.data.adapters) knows where each lies and how to read it."""
    adapter = CORPORA[corpus]
    locale = locale or language
    found = adapter.find(root, subset, locale)
    if found:
        return adapter.read(found, subset, language, skips)
    parts = adapter.find_hf(root, subset, locale)
    if parts:
        return adapter.read_hf(parts, subset, language, skips)
    looked_for = adapter.looked_for(root, subset, locale) + adapter.looked_for_hf(
        root, subset, locale
    )
    raise UserError(
        f"{adapter.describe(subset, locale)} not found; looked for " + "; ".join(looked_for)
    )


def source_manifest(
    root: Path, source: DataSource, language: str, skips: Skips
) -> tuple[list[Entry], dict]:
    entries = []
    for subset in source.subsets:
        entries += subset_manifest(root, source.corpus, subset, source.locale, language, skips)
    info = {"users_before_split": len({e.user_id for e in entries})}
    if source.user_split is not None:
        us = source.user_split
        entries = apply_user_split(entries, us.percent, us.part, us.seed)
    info["users_digest"] = users_digest(e.user_id for e in entries)
    if source.iid:
        entries = iid_reassign(entries, source.user_split.seed if source.user_split else 0)
    return entries, info


def store_key(entries: list[Entry], language: str, root: Path) -> str:
    """The feature store's cache key: manifest + normalizer + tokenizer + feature config, each
    row's audio named by its path relative to the data root and its size, so that the same
    corpus in another folder finds the same store (the store's own digests hash its content)."""
    h = hashlib.sha256()
    config = {
        "manifest": MANIFEST_VERSION, "normalizer": NORMALIZER_VERSION, "features": FEATURE_CONFIG,
        "vocab": tokenizer_for(language).vocab,
    }  # fmt: skip
    h.update(json.dumps(config, sort_keys=True).encode())
    part_sizes: dict[str, int] = {}
    for e in sorted(entries, key=lambda e: e.utt_id):
        audio = _relative_audio(e.audio, root, part_sizes)
        h.update(f"{e.utt_id}\t{e.user_id}\t{audio}\t{e.text}\n".encode())
    return h.hexdigest()


def _relative_audio(ref: str, root: Path, part_sizes: dict[str, int]) -> str:
    """`path:size` of a manifest audio reference with the path relative to `root`; a Hugging Face
    row `hf:<part>#<row>` is named by its part (whose sizes `part_sizes` caches) and row."""
    if not ref.startswith("hf:"):
        return f"{os.path.relpath(ref, root)}:{_size(Path(ref))}"
    part, _, row = ref.removeprefix("hf:").rpartition("#")
    if part not in part_sizes:
        part_sizes[part] = _size(Path(part))
    return f"hf:{os.path.relpath(part, root)}#{row}:{part_sizes[part]}"


def _size(path: Path) -> int:
    """Bytes of a file or of the files in a folder (a saved dataset); -1 when missing (the store
    counts the row as a skip when it reads it)."""
    try:
        if path.is_dir():
            return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
        return path.stat().st_size
    except OSError:
        return -1


def split_label(corpus: str, subsets: list[str], locale: str | None) -> str:
    return "-".join([corpus, *([locale] if locale else []), "+".join(subsets)])


# ----------------------------------------------------------------------------------------------
# The task


def prepare_split(
    name: str,
    label: str,
    entries: list[Entry],
    info: dict,
    skips: Skips,
    language: str,
    root: Path,
    cache_dir: Path,
    progress,
) -> FeatureStore:
    key = store_key(entries, language, root)
    folder = cache_dir / "features" / f"{label}-{key[:16]}"
    report = {**info, "utterances_in_manifest": len(entries), "skipped": skips.to_dict()}
    if progress is None:
        return build_store(folder, entries, language, report)
    bar = progress.add_task(f"features {name}", total=max(len(entries), 1))
    store = build_store(
        folder, entries, language, report,
        on_progress=lambda done, total: progress.update(bar, completed=done, total=max(total, 1)),
    )  # fmt: skip
    progress.update(bar, completed=max(len(entries), 1))
    return store


def prepare_task(
    task: Task, data_root: Path | None = None, cache_dir: Path | None = None, progress: bool = True
) -> TaskData:
    """Builds (or reuses) the feature store of every split the task uses."""
    cache_dir = Path(cache_dir or cache_dir_default())
    bars = _progress() if progress else None
    with exclusive(cache_dir / "prepare.lock"), bars or nullcontext():
        on_unit = None
        if (
            bars is not None
            and task.synthetic is not None
            and not synth_root(task, cache_dir).exists()
        ):
            synth_bar = bars.add_task("synthesizing corpora", total=None)
            on_unit = lambda done, total: bars.update(synth_bar, completed=done, total=total)  # noqa: E731
        root = data_root_for(task, data_root, cache_dir, on_unit=on_unit)
        language = task.language
        sources = {"seed": task.seed_data, "federated": task.federated_data}
        stores: dict[str, FeatureStore] = {}
        for name, source in sources.items():
            if source is None:
                continue
            skips = Skips()
            entries, info = source_manifest(root, source, language, skips)
            if not entries:
                raise UserError(f"task {task.name!r}: the {name} data has no usable utterances")
            label = split_label(source.corpus, source.subsets, source.locale)
            if source.user_split:
                us = source.user_split
                label += f"-users{us.percent:g}{us.part}s{us.seed}" + ("-iid" if source.iid else "")
            stores[name] = prepare_split(
                name, label, entries, info, skips, language, root, cache_dir, bars
            )
        eval_groups = {}
        for ev in task.eval_sets:
            stores[f"eval:{ev.name}"], eval_groups[ev.name] = prepare_eval(
                ev, root, language, cache_dir, bars
            )
    report = {name: store.stats() for name, store in stores.items()}
    return TaskData(
        tokenizer=tokenizer_for(language),
        seed_train=stores.get("seed"),
        federated_train=stores["federated"],
        eval_sets={ev.name: stores[f"eval:{ev.name}"] for ev in task.eval_sets},
        report=report,
        eval_groups=eval_groups,
    )


def prepare_eval(
    ev: EvalSet, root: Path, language: str, cache_dir: Path, bars
) -> tuple[FeatureStore, dict[str, dict[str, str]]]:
    """The eval set's feature store and its speakers' groups (`speaker_groups`)."""
    skips = Skips()
    entries = subset_manifest(root, ev.corpus, ev.subset, ev.locale, language, skips)
    if not entries:
        raise UserError(f"eval set {ev.name!r} ({ev.corpus} {ev.subset}) has no usable utterances")
    info = {"users_digest": users_digest(e.user_id for e in entries)}
    label = split_label(ev.corpus, [ev.subset], ev.locale)
    store = prepare_split(ev.name, label, entries, info, skips, language, root, cache_dir, bars)
    return store, speaker_groups(entries)


def _progress():
    from rich.progress import BarColumn, MofNCompleteColumn, TimeElapsedColumn

    from pflbench.progress import make_progress

    return make_progress(
        "data", "[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
        TimeElapsedColumn(),
    )  # fmt: skip
