"""Uncertainty of WER: speaker-level bootstrap CIs and paired comparisons of two rows.

The unit of sampling is the speaker (utterances of one speaker are correlated), and WER is the
corpus-level ratio: sum of word errors / sum of reference words over the (resampled) speakers.

Seeds: a row is several runs (seeds) of one configuration evaluated on the same eval set, so the
same speakers. Its WER is the mean over seeds of each seed's corpus WER, and its CI comes from a
two-stage (hierarchical) bootstrap: each replicate resamples the speakers (one draw, shared by
every seed, since they are the same people) and, independently, the seeds with replacement, and
takes the mean over the drawn seeds of their WER on the drawn speakers. The interval therefore
covers both sources of noise: which speakers were sampled into the eval set and which training
seed was run. With one seed it is the plain speaker bootstrap (seed noise unmeasured); with few
seeds the seed part is an underestimate (the bootstrap of n values has variance (n-1)/n of theirs).

A comparison of rows A and B is paired by speaker: each replicate draws one speaker resample used
for both sides, and seeds within each side, and takes mean_A - mean_B. The difference is beyond
seed and speaker-sampling noise when its 95% percentile interval excludes 0 (speaker sampling
alone where a side has one seed).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pflbench.errors import UserError

DEFAULT_REPLICATES = 2000
DEFAULT_LEVEL = 0.95

SpeakerCounts = dict[str, tuple[int, int]]  # speaker -> (word errors, reference words)


@dataclass(frozen=True)
class Interval:
    estimate: float
    low: float
    high: float
    num_speakers: int
    num_seeds: int

    def excludes(self, value: float) -> bool:
        return not self.low <= value <= self.high


def count_matrix(seeds: Sequence[SpeakerCounts], speakers: list[str]) -> np.ndarray:
    """[seed, speaker, (errors, words)] for the speakers given, in that order."""
    out = np.zeros((len(seeds), len(speakers), 2), dtype=np.float64)
    for i, counts in enumerate(seeds):
        missing = [s for s in speakers if s not in counts]
        if missing or len(counts) != len(speakers):
            raise UserError(
                "the runs were not evaluated on the same speakers "
                f"({len(counts)} vs {len(speakers)} speakers, e.g. {(missing or ['?'])[0]!r} "
                "missing): they are not the same eval set"
            )
        out[i] = [counts[s] for s in speakers]
    return out


def shared_speakers(*sides: Sequence[SpeakerCounts]) -> list[str]:
    counts = [c for side in sides for c in side]
    if not counts or any(not side for side in sides):
        raise UserError("no per-speaker counts to resample (records before per-speaker counts?)")
    return sorted(counts[0])


BLOCK = 256  # replicates per block: bounds memory at BLOCK x speakers weights


def speaker_weights(rng: np.random.Generator, replicates: int, num_speakers: int):
    """Bootstrap multiplicities [block, speakers] (how often each speaker is drawn), in blocks."""
    uniform = np.full(num_speakers, 1.0 / num_speakers)
    for start in range(0, replicates, BLOCK):
        yield rng.multinomial(num_speakers, uniform, size=min(BLOCK, replicates - start))


def _replicate_wers(counts: np.ndarray, weights: np.ndarray, rng: np.random.Generator):
    """Per replicate (row of weights): the mean over resampled seeds of each seed's corpus WER on
    the resampled speakers."""
    num_seeds, replicates = counts.shape[0], weights.shape[0]
    errors = weights @ counts[:, :, 0].T  # [replicate, seed]
    words = weights @ counts[:, :, 1].T
    with np.errstate(invalid="ignore", divide="ignore"):
        wer = errors / words  # a replicate that drew only wordless speakers is NaN, then dropped
    seed_draws = rng.integers(0, num_seeds, size=(replicates, num_seeds))
    return np.take_along_axis(wer, seed_draws, axis=1).mean(axis=1)


def corpus_wer(counts: np.ndarray) -> float:
    """Mean over seeds of sum errors / sum words."""
    return float(np.mean(counts[:, :, 0].sum(axis=1) / counts[:, :, 1].sum(axis=1)))


def _percentiles(values: np.ndarray, level: float) -> tuple[float, float]:
    values = values[np.isfinite(values)]
    tail = 100 * (1 - level) / 2
    low, high = np.percentile(values, [tail, 100 - tail])
    return float(low), float(high)


def _check(counts: np.ndarray, what: str) -> None:
    if counts[:, :, 1].sum(axis=1).min() <= 0:
        raise UserError(f"{what}: the eval set has no reference words; WER is undefined")


def wer_interval(
    seeds: Sequence[SpeakerCounts],
    *,
    replicates: int = DEFAULT_REPLICATES,
    level: float = DEFAULT_LEVEL,
    seed: int = 0,
) -> Interval:
    """Mean-over-seeds WER with its two-stage bootstrap CI (see the module docstring)."""
    speakers = shared_speakers(seeds)
    counts = count_matrix(seeds, speakers)
    _check(counts, "wer_interval")
    rng = np.random.default_rng(seed)
    weights = speaker_weights(rng, replicates, len(speakers))
    wers = [_replicate_wers(counts, w, rng) for w in weights]
    low, high = _percentiles(np.concatenate(wers), level)
    return Interval(corpus_wer(counts), low, high, len(speakers), len(seeds))


def difference_interval(
    side_a: Sequence[SpeakerCounts],
    side_b: Sequence[SpeakerCounts],
    *,
    replicates: int = DEFAULT_REPLICATES,
    level: float = DEFAULT_LEVEL,
    seed: int = 0,
) -> Interval:
    """WER(A) - WER(B), each a mean over its seeds, with a speaker-paired two-stage bootstrap."""
    speakers = shared_speakers(side_a, side_b)
    a, b = count_matrix(side_a, speakers), count_matrix(side_b, speakers)
    _check(a, "side A")
    _check(b, "side B")
    rng = np.random.default_rng(seed)
    diff = [
        _replicate_wers(a, w, rng) - _replicate_wers(b, w, rng)
        for w in speaker_weights(rng, replicates, len(speakers))
    ]
    low, high = _percentiles(np.concatenate(diff), level)
    return Interval(
        corpus_wer(a) - corpus_wer(b), low, high, len(speakers), min(len(side_a), len(side_b))
    )


# ----------------------------------------------------------------------------------------------
# Records


def record_counts(record, eval_set: str) -> SpeakerCounts | None:
    """A record's per-speaker counts on an eval set (None: not evaluated there, or no counts)."""
    result = record.metrics.final.get(eval_set)
    return None if result is None or result.speakers is None else dict(result.speakers)


_ROW_INTERVALS: dict[tuple, Interval] = {}  # the leaderboard and the figures ask for the same rows


def row_interval(records: Sequence, eval_set: str, **kw) -> Interval | None:
    """The CI of a row (seeds of one configuration), or None unless every seed has counts.
    Memoized on the counts themselves (the bootstrap is deterministic for given counts)."""
    seeds = [record_counts(r, eval_set) for r in records]
    if not seeds or any(c is None for c in seeds):
        return None
    key = (tuple(tuple(sorted(c.items())) for c in seeds), tuple(sorted(kw.items())))
    if key not in _ROW_INTERVALS:
        _ROW_INTERVALS[key] = wer_interval(seeds, **kw)
    return _ROW_INTERVALS[key]


@dataclass(frozen=True)
class Comparison:
    eval_set: str
    wer_a: float
    wer_b: float
    difference: Interval

    @property
    def beyond_noise(self) -> bool:
        return self.difference.excludes(0.0)


def seed_model_digest(record) -> str | None:
    """The sha256 of the weights a run started from (None: not recorded, or no seed model)."""
    return record.data.digests.get("seed_model") if record.data else None


def check_same_seed_model(side_a: Sequence, side_b: Sequence) -> None:
    """Rows are compared only from the same starting weights: runs from different seed models
    differ by as much as the methods compared (another CPU trains another seed model)."""
    digests = {}
    for side, records in (("A", side_a), ("B", side_b)):
        found = sorted({d for d in map(seed_model_digest, records) if d is not None})
        if len(found) > 1:
            raise UserError(
                f"the runs of side {side} start from different seed models ({', '.join(found)}): "
                "rerun them from one"
            )
        digests[side] = found[0] if found else None
    if None not in digests.values() and digests["A"] != digests["B"]:
        raise UserError(
            f"A and B start from different seed models (A: {digests['A']}, B: {digests['B']}): "
            "their WER difference would mix the seed models' with the methods'; rerun both from "
            "one (`pflbench seed --task TASK` says which one runs start from)"
        )


def unchecked_seed_models(records: Sequence) -> list[str]:
    """Ids of records whose task has a seed model but which do not name it (written before
    records held its digest): check_same_seed_model cannot check them."""
    return [
        r.record_id
        for r in records
        if seed_model_digest(r) is None and ((r.config or {}).get("task") or {}).get("seed_data")
    ]


def compare_records(side_a: Sequence, side_b: Sequence, eval_sets: list[str] | None = None, **kw):
    """Paired comparison of two rows (each one or more seeds) on every eval set both have, from
    the same seed model (check_same_seed_model)."""
    check_same_seed_model(side_a, side_b)
    common = set.intersection(*(set(r.metrics.final) for r in [*side_a, *side_b]))
    names = sorted(common) if eval_sets is None else eval_sets
    out = []
    for name in names:
        if name not in common:
            raise UserError(
                f"--eval-set {name}: not an eval set of every compared record (they share "
                f"{', '.join(sorted(common)) or 'none'})"
            )
        a = [record_counts(r, name) for r in side_a]
        b = [record_counts(r, name) for r in side_b]
        missing = [r.record_id for r, c in zip([*side_a, *side_b], a + b, strict=True) if c is None]
        if missing:
            raise UserError(
                f"record {missing[0]} has no per-speaker counts for {name} (run before they were "
                "recorded); rerun it to compare"
            )
        diff = difference_interval(a, b, **kw)
        wa = corpus_wer(count_matrix(a, sorted(a[0])))
        out.append(Comparison(name, wa, wa - diff.estimate, diff))
    if not out:
        raise UserError("the compared records share no eval set")
    return out


def load_side(items: list[str], results_root: Path) -> list:
    """The records of one side of a comparison: run directories (their record.json), record
    files, filed records' folders (results/<task>/<budget>/<id>/, beside <id>.json) or record ids
    filed under results/; all seeds of one configuration."""
    from pflbench.results.leaderboard import group_key
    from pflbench.results.schema import RECORD_ID_PATTERN, load_record

    records = []
    for item in items:
        path = Path(item)
        if (path / "record.json").is_file():
            path = path / "record.json"
        elif (
            path.is_dir()
            and (beside := path.resolve().parent / f"{path.resolve().name}.json").is_file()
        ):
            path = beside
        elif re.fullmatch(RECORD_ID_PATTERN, item) and not path.exists():
            found = sorted(Path(results_root).glob(f"*/*/{item}.json"))
            if not found:
                raise UserError(f"{item}: no record with this id under {results_root}/")
            path = found[0]
        elif not (path.is_file() and path.suffix == ".json"):
            what = "a folder without a record" if path.is_dir() else "no such file or folder"
            raise UserError(
                f"{item}: {what}; give a finished run directory, a record file or a record id"
            )
        record = load_record(path)[0]
        if record.kind != "run":
            raise UserError(
                f"{item}: a {record.kind} record (a paper's number, no per-speaker counts): only "
                "runs are compared"
            )
        records.append(record)
    configurations = {group_key(r) for r in records}
    if len(configurations) > 1:
        raise UserError(
            f"{', '.join(items)}: one side must be seeds of one configuration; these are "
            f"{len(configurations)}, differing in {_listed(differing_keys(records))}"
        )
    return records


def _listed(names: list[str], most: int = 6) -> str:
    more = f" and {len(names) - most} more" if len(names) > most else ""
    return ", ".join(names[:most]) + more


def differing_keys(records: Sequence) -> list[str]:
    """The dotted config keys (and `numerics`) on which the records differ, the seed and the
    specs' words aside (spec.resolve.what_config_ran)."""
    from pflbench.results.rescore import differences
    from pflbench.results.schema import record_numerics_version
    from pflbench.spec.resolve import what_config_ran

    first, *others = [what_config_ran(r.config or {}) for r in records]
    found = sorted(
        {
            field.removeprefix("config.")
            for other in others
            for field, _, _ in differences(first, other, "config")
        }
    )
    if len({record_numerics_version(r) for r in records}) > 1:
        found.append("numerics")
    return found
