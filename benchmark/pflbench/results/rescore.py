"""Re-scoring: every WER/CER figure of a record computed again from the run's stored hypotheses
and the eval sets' own references, with pflbench's normalizer (the references in the feature
store) and scorer (evaluate.score) — a record's WER is recomputed, as its ε is, never trusted.

A run stores hypotheses/<eval set>.jsonl.gz (utterance id and hypothesis; rundir.py) and its
record names each file's sha256 (`outputs.hypotheses`). Re-scoring a record checks that
- it evaluates exactly the task's eval sets, and names a hypotheses file for each;
- each file's sha256 is the record's (so a changed file is caught);
- the eval sets' data here are those the run evaluated (`data.digests`: the store's digest covers
  the manifest, the normalizer and the tokenizer);
- the hypotheses cover exactly the eval set's utterances;
- every figure of `metrics.final[<eval set>]` (pooled WER and CER, the speaker summaries, the
  per-speaker counts, the groups) and the history's final evaluation equal the fresh ones,
  exactly: the same integer error counts give the same floats.

`pflbench submit` re-scores before filing and files the hypotheses next to the record
(results/<task>/<budget>/<record id>/hypotheses/, leaderboard.filed_dir); `pflbench results
rescore` re-scores filed records (CI; verify.recheck_filed).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pflbench.data.prepare import EvalData, prepare_eval_data, prepare_federated_data
from pflbench.data.store import FeatureStore
from pflbench.errors import UserError
from pflbench.evaluate import Transcript, eval_summary, score, with_groups
from pflbench.privacy.example import expected_batch
from pflbench.results.schema import EvalResult, ResultRecord
from pflbench.rundir import HYPOTHESES_DIR, hypotheses_file, read_hypotheses
from pflbench.spec.models import EvalSet, RunConfig, Task


@dataclass(frozen=True)
class DataOptions:
    """Where a task's eval data come from, as for `pflbench run`: --data-root (real corpora) or
    the cache (synthetic corpora, generated there on first use; feature stores)."""

    data_root: Path | None = None
    cache_dir: Path | None = None
    progress: bool = False

    def eval_data(self, task: Task) -> EvalData:
        return prepare_eval_data(task, self.data_root, self.cache_dir, self.progress)

    def federated_data(self, task: Task) -> FeatureStore:
        return prepare_federated_data(task, self.data_root, self.cache_dir, self.progress)


# ----------------------------------------------------------------------------------------------
# Comparing figures


def differences(
    claimed: Any, fresh: Any, field: str, float_rtol: float = 0.0
) -> Iterator[tuple[str, Any, Any]]:
    """(field, claimed, fresh) wherever two JSON values differ, in the claimed value's key order
    (a record's EvalResult: wer before cer); floats within `float_rtol` of each other are equal
    (0: exactly equal)."""
    if isinstance(claimed, dict) and isinstance(fresh, dict):
        for key in [*claimed, *(k for k in fresh if k not in claimed)]:
            yield from differences(claimed.get(key), fresh.get(key), f"{field}.{key}", float_rtol)
    elif isinstance(claimed, list) and isinstance(fresh, list) and len(claimed) == len(fresh):
        for i, (a, b) in enumerate(zip(claimed, fresh, strict=True)):
            yield from differences(a, b, f"{field}[{i}]", float_rtol)
    elif type(claimed) is float and type(fresh) is float:
        if not math.isclose(claimed, fresh, rel_tol=float_rtol, abs_tol=0.0):
            yield field, claimed, fresh
    elif claimed != fresh:
        yield field, claimed, fresh


def first_difference(
    claimed: Any, fresh: Any, field: str, float_rtol: float = 0.0
) -> tuple[str, Any, Any] | None:
    return next(differences(claimed, fresh, field, float_rtol), None)


# ----------------------------------------------------------------------------------------------
# Re-scoring


def check_data_digest(record: ResultRecord, name: str, store: FeatureStore, where: str) -> bool:
    """The store here holds the data the run used under `name`: its digest is the record's
    data.digests[name] (same manifest, normalizer, tokens and features), or, where this CPU
    computed other features, its audio digest is data.audio_digests[name] (the same utterances,
    users, normalized texts and decoded audio). Scoring and the population read no features, and
    feature arithmetic differs between CPUs (docs/RESULTS.md), so the audio is what must match.
    Returns whether the features matched too (False: matched by the audio digest only)."""
    data = record.data
    stated = data.digests.get(name) if data is not None else None
    if stated == store.digest:
        return True
    stated_audio = (data.audio_digests or {}).get(name) if data is not None else None
    if stated_audio is not None and stated_audio == store.audio_digest:
        return False
    raise UserError(
        f"{where}: {name!r} here (data digest {store.digest}, audio digest "
        f"{store.audio_digest}) is not the data the run used (data.digests[{name!r}] = "
        f"{stated!r}, data.audio_digests[{name!r}] = {stated_audio!r}): the corpus, its version "
        "or pflbench's normalizer differ"
    )


def check_eval_data(record: ResultRecord, data: EvalData, where: str) -> list[str]:
    """The eval sets here are the data the run evaluated; returns those that matched by their
    audio digest only (check_data_digest)."""
    return [
        name
        for name, store in data.eval_sets.items()
        if not check_data_digest(record, name, store, where)
    ]


def rescored(eval_set: EvalSet, data: EvalData, hypotheses: dict[str, str], where: str):
    """The EvalResult the run must have recorded for `eval_set` if these were its hypotheses."""
    refs = list(data.eval_sets[eval_set.name].references())
    ids = {utt_id for utt_id, _, _ in refs}
    missing = [utt_id for utt_id, _, _ in refs if utt_id not in hypotheses]
    extra = sorted(set(hypotheses) - ids)
    if missing:
        raise UserError(
            f"{where}: {len(missing)} of the eval set's {len(refs)} utterances have no hypothesis "
            f"(e.g. {missing[0]!r})"
        )
    if extra:
        raise UserError(
            f"{where}: {len(extra)} hypotheses are for utterances that are not in eval set "
            f"{eval_set.name!r} (e.g. {extra[0]!r})"
        )
    transcripts = [Transcript(u, speaker, text, hypotheses[u]) for u, speaker, text in refs]
    groups = data.eval_groups.get(eval_set.name, {})
    result = with_groups(eval_set.role, score(transcripts), groups)
    return EvalResult.model_validate(eval_summary({eval_set.name: result})[eval_set.name])


def rescore_record(
    record: ResultRecord, eval_sets: list[EvalSet], folder: Path, data: EvalData, where: str
) -> list[str]:
    """Re-score a run record (`eval_sets`: its config's) from the hypotheses files in `folder`;
    a UserError names the first figure that differs, with both values. Returns the eval sets
    that matched the record's data by their audio digest only."""
    outputs = record.outputs  # a run record has them (schema)
    names = sorted(e.name for e in eval_sets)
    for what, found in (
        ("metrics.final", record.metrics.final),
        ("outputs.hypotheses", outputs.hypotheses),
    ):
        if sorted(found) != names:
            raise UserError(
                f"{where}: {what} has eval sets {sorted(found)}, but the task evaluates {names}"
            )
    audio_only = check_eval_data(record, data, where)
    final_step = max((h.step for h in record.metrics.history), default=None)
    at_final = sorted(h.eval_set for h in record.metrics.history if h.step == final_step)
    if final_step is not None and at_final != names:
        # The last step's points are the final evaluation, checked below: one point there for
        # some eval sets only would leave the others' final points unchecked.
        raise UserError(
            f"{where}: metrics.history's last step ({final_step}) evaluates {at_final}, but the "
            f"final evaluation is of every eval set once: {names}"
        )
    for eval_set in eval_sets:
        name = eval_set.name
        path = hypotheses_file(folder, name)
        hypotheses, digest = read_hypotheses(path)
        if digest != outputs.hypotheses[name]:
            raise UserError(
                f"{path}: its content's sha256 is {digest}, but the record's "
                f"outputs.hypotheses[{name!r}] is {outputs.hypotheses[name]}: the file was "
                "changed after the run"
            )
        fresh = rescored(eval_set, data, hypotheses, str(path)).model_dump(mode="json")
        claimed = {f"metrics.final.{name}": record.metrics.final[name].model_dump(mode="json")}
        for i, point in enumerate(record.metrics.history):
            if point.step == final_step and point.eval_set == name:  # the final evaluation
                claimed[f"metrics.history[{i}]"] = {"wer": point.wer, "cer": point.cer}
        for field, figures in claimed.items():
            found = first_difference(figures, {k: fresh[k] for k in figures}, field)
            if found is not None:
                field, a, b = found
                raise UserError(
                    f"{where}: {field} is {a!r} in the record, but re-scoring the stored "
                    f"hypotheses against the eval set's references gives {b!r}"
                )
    return audio_only


def states_population(record: ResultRecord) -> bool:
    """Whether the record's privacy statement has a scale (federated and DP-SGD runs; not central
    or seed-only ones): what check_training_data checks."""
    return record.privacy is not None and record.privacy.simulated is not None


def check_training_data(
    record: ResultRecord, config: RunConfig, store: FeatureStore, where: str
) -> bool:
    """The privacy statement's scale is the training data's: the federated data here are those
    the run trained on (`data.digests`), and the simulated population is their users (audit
    canaries added) or, for example-level DP-SGD, their N utterances, with the expected batch
    B = fine_tune.batch_seconds of their audio. `results validate` recomputes every ε from the
    stated population; this ties that population to the data. Returns whether the features
    matched too (check_data_digest)."""
    features_match = check_data_digest(record, "federated_train", store, where)
    simulated = record.privacy.simulated
    recipe = config.recipe
    if recipe.training == "dpsgd-example":
        seconds = store.utterance_seconds()  # the runner's [u.seconds for u in store]
        schedule = recipe.fine_tune or recipe.central
        expected = {"population": len(seconds)}
        expected["cohort"] = expected_batch(seconds, schedule.batch_seconds)
        what = "training examples (N) and the expected batch (B)"
    else:
        expected = {"population": len(store.users()) + (recipe.privacy.audit_canaries or 0)}
        what = "users" + (" and audit canaries" if recipe.privacy.audit_canaries else "")
    for field, value in expected.items():
        if getattr(simulated, field) != value:
            raise UserError(
                f"{where}: privacy.simulated.{field} is {getattr(simulated, field)}, but the "
                f"training data's {what} give {value}"
            )
    return features_match


def recheck_record(
    record: ResultRecord,
    config: RunConfig,
    hypotheses_dir: Path,
    eval_data: EvalData,
    federated_data: Callable[[], FeatureStore],
    where: str,
) -> list[str]:
    """Re-score a run record from `hypotheses_dir` and, where it states a population, check it
    against the training data (`federated_data()`, called only then). Returns the data sets that
    matched the record's by their audio digest only."""
    audio_only = rescore_record(record, config.task.eval_sets, hypotheses_dir, eval_data, where)
    if states_population(record):
        if not check_training_data(record, config, federated_data(), where):
            audio_only.append("federated_train")
    return audio_only


def rescore_run_dir(
    record: ResultRecord, config: RunConfig, run_dir: Path, data: DataOptions
) -> list[str]:
    """Re-score the record of a run directory from its hypotheses/ and check its population
    against the training data (what `submit` does); recheck_record's return."""
    return recheck_record(
        record,
        config,
        Path(run_dir) / HYPOTHESES_DIR,
        data.eval_data(config.task),
        lambda: data.federated_data(config.task),
        str(Path(run_dir) / "record.json"),
    )
