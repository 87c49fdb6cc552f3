"""Speaker-level bootstrap CIs of WER and paired comparisons (pflbench.results.stats)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
from conftest import STALE_NUMERICS
from typer.testing import CliRunner

from pflbench.cli import app
from pflbench.errors import UserError
from pflbench.numerics import NUMERICS_VERSION
from pflbench.results.schema import compute_record_id, load_record
from pflbench.results.stats import difference_interval, unchecked_seed_models, wer_interval

RESULTS = Path(__file__).resolve().parents[1] / "results"


def population(rng: np.random.Generator, speakers: int) -> tuple[np.ndarray, np.ndarray]:
    """Speakers with heterogeneous WERs and amounts of speech: (errors, words) per speaker."""
    words = rng.poisson(30, speakers) + 1
    rates = rng.beta(2.0, 6.0, speakers)
    return rng.binomial(words, rates), words


def as_counts(errors, words, ids=None) -> dict[str, tuple[int, int]]:
    ids = ids if ids is not None else range(len(words))
    return {f"spk{i}": (int(e), int(n)) for i, e, n in zip(ids, errors, words, strict=True)}


def test_speaker_bootstrap_covers_the_population_wer_about_95_percent():
    rng = np.random.default_rng(0)
    errors, words = population(rng, 20_000)
    true_wer = errors.sum() / words.sum()
    trials, covered = 200, 0
    for trial in range(trials):
        sample = rng.choice(len(words), size=80, replace=False)
        ci = wer_interval([as_counts(errors[sample], words[sample])], replicates=800, seed=trial)
        covered += ci.low <= true_wer <= ci.high
    # 200 trials: the binomial sd of the coverage is ~1.5 points around the nominal 95%.
    assert 0.89 <= covered / trials <= 0.99


def test_interval_shrinks_with_more_speakers_and_contains_the_estimate():
    rng = np.random.default_rng(1)
    errors, words = population(rng, 1_000)
    small = wer_interval([as_counts(errors[:50], words[:50])])
    large = wer_interval([as_counts(errors, words)])
    assert small.low <= small.estimate <= small.high and large.low <= large.estimate <= large.high
    # The width scales ~1/sqrt(speakers): 20x the speakers, ~4.5x narrower.
    assert (large.high - large.low) < (small.high - small.low) / 3
    assert large.num_speakers == 1_000 and large.num_seeds == 1


def test_interval_is_deterministic_given_the_seed():
    rng = np.random.default_rng(2)
    counts = as_counts(*population(rng, 100))
    assert wer_interval([counts], seed=7) == wer_interval([counts], seed=7)
    assert wer_interval([counts], seed=7) != wer_interval([counts], seed=8)


def test_seed_noise_widens_the_interval_and_the_estimate_is_the_mean_over_seeds():
    rng = np.random.default_rng(3)
    errors, words = population(rng, 200)
    same = [as_counts(errors, words)] * 3
    # Seeds that land 25% better / worse on every speaker: the same speakers, different training.
    spread = [as_counts(np.round(errors * f), words) for f in (0.75, 1.0, 1.25)]
    quiet, noisy = wer_interval(same), wer_interval(spread)
    assert (noisy.high - noisy.low) > 2 * (quiet.high - quiet.low)
    per_seed = [sum(e for e, _ in c.values()) / words.sum() for c in spread]
    assert noisy.estimate == pytest.approx(np.mean(per_seed))


def test_paired_difference_of_identical_rows_is_zero_and_within_noise():
    rng = np.random.default_rng(4)
    counts = as_counts(*population(rng, 60))
    diff = difference_interval([counts], [counts])
    assert diff.estimate == 0 and diff.low == diff.high == 0 and not diff.excludes(0)


def test_paired_difference_detects_a_real_improvement_and_not_pure_noise():
    rng = np.random.default_rng(5)
    errors, words = population(rng, 60)
    base = [as_counts(rng.binomial(words, errors / words), words) for _ in range(3)]
    better = [as_counts(rng.binomial(words, 0.7 * errors / words), words) for _ in range(3)]
    same = [as_counts(rng.binomial(words, errors / words), words) for _ in range(3)]
    gain = difference_interval(better, base)
    assert gain.estimate < 0 and gain.excludes(0)
    assert not difference_interval(same, base).excludes(0)


def test_pairing_makes_the_interval_narrower_than_the_unpaired_one():
    # The same speakers are hard for both systems: pairing cancels the speaker variance.
    rng = np.random.default_rng(6)
    errors, words = population(rng, 100)
    a = [as_counts(errors, words)]
    b = [as_counts(np.minimum(words, errors + rng.binomial(words, 0.05)), words)]
    paired = difference_interval(a, b)
    left, right = wer_interval(a), wer_interval(b)
    unpaired_width = np.hypot(left.high - left.low, right.high - right.low)
    assert (paired.high - paired.low) < unpaired_width / 2


def test_different_eval_sets_and_missing_words_are_refused():
    rng = np.random.default_rng(7)
    errors, words = population(rng, 20)
    with pytest.raises(UserError, match="not the same eval set"):
        difference_interval([as_counts(errors, words)], [as_counts(errors[:10], words[:10])])
    with pytest.raises(UserError, match="no reference words"):
        wer_interval([{"a": (3, 0), "b": (1, 0)}])
    with pytest.raises(UserError, match="no per-speaker counts"):
        wer_interval([])


def test_compare_refuses_rows_from_different_seed_models(tmp_path):
    """A leaderboard record and a copy of it naming another seed model (its id recomputed, so
    it is a valid record): `pflbench compare` refuses to pair them, naming both digests, on
    either side; the record against itself compares."""
    source = next(p for p in sorted(RESULTS.rglob("*.json")) if '"seed_model": "' in p.read_text())
    data = json.loads(source.read_text())
    other = copy.deepcopy(data)
    other["data"]["digests"]["seed_model"] = "0" * 64
    other["record_id"] = compute_record_id(other)
    folder = tmp_path / data["task"]["name"] / data["budget"]
    folder.mkdir(parents=True)
    for record in (data, other):
        (folder / f"{record['record_id']}.json").write_text(json.dumps(record))

    def compare(a: str, b: str):
        args = ["compare", a, b, "--results", str(tmp_path), "--replicates", "200", "--json"]
        return CliRunner().invoke(app, args)

    ours, theirs = data["record_id"], other["record_id"]
    assert compare(ours, ours).exit_code == 0
    refused = compare(ours, theirs)
    assert isinstance(refused.exception, UserError)
    message = str(refused.exception)
    assert "different seed models" in message
    assert data["data"]["digests"]["seed_model"] in message and "0" * 64 in message
    refused = compare(f"{ours},{theirs}", ours)  # one side's seeds from two seed models
    assert isinstance(refused.exception, UserError) and "side A" in str(refused.exception)


def test_records_without_a_seed_model_digest_are_listed_as_unchecked():
    records = [load_record(p)[0] for p in sorted(RESULTS.glob("synth-cv-en-ls-seed/*/*.json"))]
    named = [r for r in records if r.data.digests.get("seed_model")]
    assert named and unchecked_seed_models(named) == []
    # A record from before records named their seed model (its digest left out).
    digests = {k: v for k, v in named[0].data.digests.items() if k != "seed_model"}
    older = named[0].model_copy(
        update={"data": named[0].data.model_copy(update={"digests": digests}), "record_id": "old"}
    )
    assert unchecked_seed_models([*named, older]) == ["old"]


def _filed_copy(tmp_path: Path, record: dict, **changes) -> str:
    """A copy of a filed record with `changes` at dotted paths, its id recomputed (a valid
    record), filed under tmp_path as results/ files it; returns its id."""
    record = copy.deepcopy(record)
    for dotted, value in changes.items():
        *parents, last = dotted.split("__")
        node = record
        for key in parents:
            node = node[key]
        node[last] = value
    record["record_id"] = compute_record_id(record)
    folder = tmp_path / record["task"]["name"] / record["budget"]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{record['record_id']}.json").write_text(json.dumps(record))
    return record["record_id"]


def _compare(tmp_path: Path, a: str, b: str, *extra: str):
    args = ["compare", a, b, "--results", str(tmp_path), "--replicates", "200", *extra]
    return CliRunner().invoke(app, args)


def test_compare_names_each_row_as_the_leaderboard_does_and_says_what_it_measured(tmp_path):
    """Two rows of one baseline and budget that differ in a --set override and in the task's
    version: compare labels them apart, notes the version, and with one seed a side says seed
    noise is unmeasured; --json names each side's records."""
    fedavg = [
        json.loads(p.read_text()) for p in sorted(RESULTS.glob("synth-cv-en-ls-seed/none/*.json"))
    ]
    data = max(  # a current run: its row is not stale
        (r for r in fedavg if r["baseline"] == "fedavg" and not r["config"].get("overrides")),
        key=lambda r: (r["task"]["version"], r["software"]["numerics_version"]),
    )
    version = data["task"]["version"]
    ours = _filed_copy(tmp_path, data)
    older = _filed_copy(
        tmp_path, data, task__version=version - 1, config__task__version=version - 1
    )
    cohort = _filed_copy(
        tmp_path,
        data,
        config__overrides={"federated.cohort_size": "8"},
        config__recipe__federated__cohort_size=8,
    )
    shown = _compare(tmp_path, cohort, ours, "--eval-set", "cv-test")
    assert shown.exit_code == 0, shown.output
    lines = shown.stdout.splitlines()
    assert lines[0].startswith("A = fedavg [federated.cohort_size=8] / none, synth-cv-en-ls-seed")
    assert lines[1] == f"B = fedavg / none, synth-cv-en-ls-seed v{version} (1 seed)"
    assert "seed noise unmeasured: a side has 1 seed" in " ".join(shown.stdout.split())
    shown = _compare(tmp_path, older, ours, "--json")
    assert f"A ran synth-cv-en-ls-seed v{version - 1}, B synth-cv-en-ls-seed v{version}" in (
        " ".join(shown.stderr.split())
    )
    found = json.loads(shown.stdout)
    assert found[0]["a"] == {
        "row": f"fedavg / none, synth-cv-en-ls-seed v{version - 1} (1 seed)",
        "records": [older],
    }
    assert found[0]["b"]["records"] == [ours] and found[0]["noise"].startswith("speaker")
    older_code = _filed_copy(tmp_path, data, software__numerics_version=STALE_NUMERICS)
    shown = _compare(tmp_path, older_code, ours, "--json")
    assert f"A ran code of numerics v{STALE_NUMERICS}, B v{NUMERICS_VERSION}" in " ".join(
        shown.stderr.split()
    )
    assert json.loads(shown.stdout)[0]["a"]["row"].startswith(
        f"fedavg ⚠ stale (numerics v{STALE_NUMERICS}) / none"
    )
    # One side of two configurations: the error names what differs.
    refused = _compare(tmp_path, f"{ours},{cohort}", ours)
    assert isinstance(refused.exception, UserError)
    assert "differing in recipe.federated.cohort_size" in str(refused.exception)
    refused = _compare(tmp_path, ours, cohort, "--eval-set", "nothing")
    assert "(they share cv-dev, cv-test, ls-dev-clean)" in str(refused.exception)


def test_compare_takes_run_dirs_record_files_filed_folders_and_ids(tmp_path):
    source = next(p for p in sorted(RESULTS.glob("synth-cv-en-ls-seed/none/*.json")))
    data = json.loads(source.read_text())
    ours = _filed_copy(tmp_path, data)
    record_file = next(tmp_path.rglob(f"{ours}.json"))
    filed_folder = record_file.with_suffix("")
    filed_folder.mkdir()  # where a filed record keeps its hypotheses
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "record.json").write_text(record_file.read_text())
    for item in (ours, str(record_file), str(filed_folder), str(run_dir)):
        shown = _compare(tmp_path, item, ours, "--json")
        assert shown.exit_code == 0, (item, shown.output)
        assert json.loads(shown.stdout)[0]["a"]["records"] == [ours]
    paper = next((RESULTS / "paper").glob("*.json"))
    for item, why in (
        (tmp_path / "nothing", "no such file or folder"),
        (tmp_path, "a folder"),
        (Path("."), "a folder"),  # its sibling <name>.json has no name to take
        (paper, "a reference record (a paper's number"),
    ):
        refused = _compare(tmp_path, str(item), ours)
        assert isinstance(refused.exception, UserError) and why in str(refused.exception)
