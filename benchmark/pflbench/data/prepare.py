"""From a Task to its data: find the corpora, build manifests and user splits, fill the stores."""

from __future__ import annotations

import hashlib
import json
import os
from collections import Counter
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

from pflbench.data.adapters import CORPORA
from pflbench.data.corpora import Entry, Manifest, Skips, speaker_groups
from pflbench.data.features import FEATURE_CONFIG
from pflbench.data.splits import apply_user_split, iid_reassign, users_digest
from pflbench.data.store import FeatureStore, build_store
from pflbench.data.synth import SYNTH_VERSION, synthesize_cached
from pflbench.data.text import NORMALIZER_VERSION, Tokenizer, tokenizer_for
from pflbench.errors import UserError
from pflbench.files import exclusive
from pflbench.spec.models import DataSource, EvalSet, Task

MANIFEST_VERSION = 1


@dataclass
class TaskData:
    tokenizer: Tokenizer
    seed_train: FeatureStore | None
    federated_train: FeatureStore
    eval_sets: dict[str, FeatureStore]
    # per split: sizes, skipped counts by reason + example ids, where each subset was read from,
    # its speakers' groups (or why there are none): FeatureStore.stats() and split_notes()
    report: dict
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
) -> Manifest:
    """The corpus as downloaded (a LibriSpeech tree, a Common Voice release) if present, else its
    Hugging Face dataset; the error lists every place looked at and what is there instead. The
    corpus's adapter (pflbench.data.adapters) knows where each lies and how to read it."""
    adapter = CORPORA[corpus]
    locale = locale or language
    found = adapter.find(root, subset, locale)
    if found:
        return adapter.read(found, subset, language, skips)
    found_hf = adapter.find_hf(root, subset, locale)
    if found_hf:
        return adapter.read_hf(found_hf, subset, language, skips)
    looked_for = adapter.looked_for(root, subset, locale) + adapter.looked_for_hf(
        root, subset, locale
    )
    instead = adapter.found_instead(root, subset, locale)
    raise UserError(
        f"{adapter.describe(subset, locale)} not found; looked for " + "; ".join(looked_for)
        + ("; found instead: " + "; ".join(instead) if instead else "")
    )  # fmt: skip


def split_notes(manifests: dict[str, Manifest], entries: list[Entry]) -> dict:
    """What the data report says of a split besides its sizes: where each subset was read from
    and how many speakers each group of each attribute has, or why the speakers form no groups
    (so that per-group WER never disappears unexplained)."""
    groups = speaker_groups(entries)
    notes: dict = {
        "read_from": {subset: m.source for subset, m in manifests.items()},
        "speaker_groups": {
            attribute: dict(sorted(Counter(of_speaker.values()).items()))
            for attribute, of_speaker in groups.items()
        },
    }
    if not groups:
        why = [m.no_attributes for m in manifests.values() if m.no_attributes]
        attributes = sorted({name for e in entries for name, _ in e.attributes})
        if attributes:
            why.append(f"all speakers are in one group of each of {', '.join(attributes)}")
        notes["speaker_groups_unavailable"] = "; ".join(dict.fromkeys(why))
    return notes


def source_manifest(
    root: Path, source: DataSource, language: str, skips: Skips
) -> tuple[list[Entry], dict, dict]:
    """The source's entries, what its store's report keeps, and its split_notes (the speaker
    groups of its speakers: before an -iid task turns them into pseudo-users)."""
    manifests = {
        subset: subset_manifest(root, source.corpus, subset, source.locale, language, skips)
        for subset in source.subsets
    }
    entries = [e for m in manifests.values() for e in m.entries]
    info = {"users_before_split": len({e.user_id for e in entries})}
    if source.user_split is not None:
        us = source.user_split
        entries = apply_user_split(entries, us.percent, us.part, us.seed)
    info["users_digest"] = users_digest(e.user_id for e in entries)
    notes = split_notes(manifests, entries)
    if source.iid:
        entries = iid_reassign(entries, source.user_split.seed if source.user_split else 0)
    return entries, info, notes


def store_key(entries: list[Entry], language: str, root: Path) -> str:
    """The feature store's cache key: manifest + normalizer + tokenizer + feature config, each
    row's audio named by its path relative to the data root, its size and its modification time
    (as make and rsync tell a changed file: a clip re-synthesized or corrected in place keeps its
    size, PCM of one duration always does), so that the same corpus moved to another folder finds
    the same store. The store's own digests hash its content."""
    h = hashlib.sha256()
    config = {
        "manifest": MANIFEST_VERSION, "normalizer": NORMALIZER_VERSION, "features": FEATURE_CONFIG,
        "vocab": tokenizer_for(language).vocab,
    }  # fmt: skip
    h.update(json.dumps(config, sort_keys=True).encode())
    part_stamps: dict[str, str] = {}
    for e in sorted(entries, key=lambda e: e.utt_id):
        audio = _relative_audio(e.audio, root, part_stamps)
        h.update(f"{e.utt_id}\t{e.user_id}\t{audio}\t{e.text}\n".encode())
    return h.hexdigest()


def _relative_audio(ref: str, root: Path, part_stamps: dict[str, str]) -> str:
    """`path:stamp` of a manifest audio reference with the path relative to `root`; a Hugging
    Face row `hf:<part>#<row>` is named by its part (whose stamps `part_stamps` caches) and row."""
    if not ref.startswith("hf:"):
        return f"{os.path.relpath(ref, root)}:{_stamp(Path(ref))}"
    part, _, row = ref.removeprefix("hf:").rpartition("#")
    if part not in part_stamps:
        part_stamps[part] = _stamp(Path(part))
    return f"hf:{os.path.relpath(part, root)}#{row}:{part_stamps[part]}"


def _stamp(path: Path) -> str:
    """`size:mtime_ns` of a file, or of the files in a folder (a saved dataset: their total size,
    the newest time); "missing" (the store counts the row as a skip when it reads it)."""
    try:
        if path.is_dir():
            stats = [p.stat() for p in path.rglob("*") if p.is_file()]
            size, mtime = (
                sum(s.st_size for s in stats),
                max((s.st_mtime_ns for s in stats), default=0),
            )
        else:
            stat = path.stat()
            size, mtime = stat.st_size, stat.st_mtime_ns
    except OSError:
        return "missing"
    return f"{size}:{mtime}"


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
        store = build_store(folder, entries, language, report)
    else:
        bar = progress.add_task(f"features {name}", total=max(len(entries), 1))

        def on_progress(done: int, total: int) -> None:
            progress.update(bar, completed=done, total=max(total, 1))

        store = build_store(folder, entries, language, report, on_progress=on_progress)
        progress.update(bar, completed=max(len(entries), 1))
    if not store.users():
        raise UserError(
            f"{name}: none of its {len(entries)} utterances under {root} could be used"
            f"{skipped_summary(Skips.from_dict(store.report.get('skipped', {})))}"
        )
    return store


def skipped_summary(skips: Skips) -> str:
    """`: skipped N (reason n, e.g. id; ...)`, or "" when nothing was skipped."""
    if not skips.total:
        return ""
    reasons = "; ".join(
        f"{reason} {n}"
        + (f", e.g. {skips.examples[reason][0]}" if skips.examples.get(reason) else "")
        for reason, n in sorted(skips.counts.items())
    )
    return f": skipped {skips.total} ({reasons})"


@contextmanager
def _preparing(task: Task, data_root: Path | None, cache_dir: Path | None, progress: bool):
    """(corpora root, cache dir, progress bars or None), under the cache's lock: the corpora of a
    synth-* task are synthesized on first use."""
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
        yield data_root_for(task, data_root, cache_dir, on_unit=on_unit), cache_dir, bars


def prepare_task(
    task: Task, data_root: Path | None = None, cache_dir: Path | None = None, progress: bool = True
) -> TaskData:
    """Builds (or reuses) the feature store of every split the task uses."""
    with _preparing(task, data_root, cache_dir, progress) as (root, cache_dir, bars):
        sources = {"seed": task.seed_data, "federated": task.federated_data}
        stores: dict[str, FeatureStore] = {}
        notes: dict[str, dict] = {}  # not in the stores' reports: not part of their digests
        for name, source in sources.items():
            if source is not None:
                stores[name], notes[name] = _prepare_source(
                    task, name, source, root, cache_dir, bars
                )
        evals = _prepare_evals(task, root, cache_dir, bars)
    stores.update({f"eval:{name}": store for name, store in evals.eval_sets.items()})
    notes.update({f"eval:{name}": note for name, note in evals.notes.items()})
    report = {name: {**store.stats(), **notes[name]} for name, store in stores.items()}
    return TaskData(
        tokenizer=evals.tokenizer,
        seed_train=stores.get("seed"),
        federated_train=stores["federated"],
        eval_sets=evals.eval_sets,
        report=report,
        eval_groups=evals.eval_groups,
    )


def _prepare_source(
    task: Task, name: str, source: DataSource, root: Path, cache_dir: Path, bars
) -> tuple[FeatureStore, dict]:
    """A training source's store and its split_notes."""
    skips = Skips()
    entries, info, notes = source_manifest(root, source, task.language, skips)
    if not entries:
        raise UserError(
            f"task {task.name!r}: the {name} data ({source.corpus} {'+'.join(source.subsets)} "
            f"under {root}) has no usable utterances{skipped_summary(skips)}"
        )
    label = split_label(source.corpus, source.subsets, source.locale)
    if source.user_split:
        us = source.user_split
        label += f"-users{us.percent:g}{us.part}s{us.seed}" + ("-iid" if source.iid else "")
    store = prepare_split(name, label, entries, info, skips, task.language, root, cache_dir, bars)
    return store, notes


def prepare_federated_data(
    task: Task, data_root: Path | None = None, cache_dir: Path | None = None, progress: bool = True
) -> FeatureStore:
    """Builds (or reuses) the feature store of the task's federated training data alone: what
    re-checking a record's population (users, or examples) needs."""
    with _preparing(task, data_root, cache_dir, progress) as (root, cache_dir, bars):
        return _prepare_source(task, "federated", task.federated_data, root, cache_dir, bars)[0]


@dataclass
class EvalData:
    """A task's eval sets alone: what re-scoring or re-evaluating a finished run needs."""

    tokenizer: Tokenizer
    eval_sets: dict[str, FeatureStore]
    eval_groups: dict[str, dict[str, dict[str, str]]]
    notes: dict[str, dict]  # per eval set: where it was read from, why it has no groups


def prepare_eval_data(
    task: Task, data_root: Path | None = None, cache_dir: Path | None = None, progress: bool = True
) -> EvalData:
    """Builds (or reuses) the feature stores of the task's eval sets only."""
    with _preparing(task, data_root, cache_dir, progress) as (root, cache_dir, bars):
        return _prepare_evals(task, root, cache_dir, bars)


def _prepare_evals(task: Task, root: Path, cache_dir: Path, bars) -> EvalData:
    stores, groups, notes = {}, {}, {}
    for ev in task.eval_sets:
        stores[ev.name], groups[ev.name], notes[ev.name] = prepare_eval(
            ev, root, task.language, cache_dir, bars
        )
    return EvalData(tokenizer_for(task.language), stores, groups, notes)


def prepare_eval(
    ev: EvalSet, root: Path, language: str, cache_dir: Path, bars
) -> tuple[FeatureStore, dict[str, dict[str, str]], dict]:
    """The eval set's feature store, its speakers' groups (`speaker_groups`) and split_notes."""
    skips = Skips()
    manifest = subset_manifest(root, ev.corpus, ev.subset, ev.locale, language, skips)
    entries = manifest.entries
    if not entries:
        raise UserError(
            f"eval set {ev.name!r} ({ev.corpus} {ev.subset} under {root}) has no usable "
            f"utterances{skipped_summary(skips)}"
        )
    info = {"users_digest": users_digest(e.user_id for e in entries)}
    label = split_label(ev.corpus, [ev.subset], ev.locale)
    store = prepare_split(ev.name, label, entries, info, skips, language, root, cache_dir, bars)
    return store, speaker_groups(entries), split_notes({ev.subset: manifest}, entries)


def _progress():
    from rich.progress import BarColumn, MofNCompleteColumn, TimeElapsedColumn

    from pflbench.progress import make_progress

    return make_progress(
        "data", "[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
        TimeElapsedColumn(),
    )  # fmt: skip
