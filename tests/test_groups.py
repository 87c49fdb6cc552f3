"""Per-group WER: speaker attributes from the corpora, group counts, the record's consistency
check, and the leaderboard's worst-group and DP-gap tables (hand-computed)."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from pflbench.data.corpora import (
    Skips,
    commonvoice_manifest,
    librispeech_manifest,
    speaker_groups,
)
from pflbench.data.prepare import split_notes
from pflbench.evaluate import group_counts
from pflbench.numerics import NUMERICS_VERSION
from pflbench.results.groups import MIN_SPEAKERS, render_groups, row_group_wers, worst_group
from pflbench.results.leaderboard import Row, cell, load_results, render_leaderboard
from pflbench.results.schema import EvalResult
from pflbench.spec.models import Budget

GOLDEN = Path(__file__).parent / "fixtures" / "results" / "golden"
NO_DP = "fx-nodp"
BUDGETS = {
    NO_DP: Budget(name=NO_DP, dp=False),
    "fx-dp": Budget(name="fx-dp", epsilon=1.5, delta=1e-6, population=10000, cohort=100, steps=50),
}
CV_HEADER = "client_id\tpath\tsentence\tup_votes\tdown_votes\tage\tgender\taccents"


def _cv_release(tmp_path: Path, rows: list[tuple[str, str, str, str]]) -> Path:
    """A Common Voice dev.tsv with (client, age, gender, accent) rows and empty clip files."""
    clips = tmp_path / "clips"
    clips.mkdir()
    lines = [CV_HEADER]
    for k, (client, age, gender, accent) in enumerate(rows):
        (clips / f"c{k}.mp3").write_bytes(b"")
        lines.append(f"{client}\tc{k}.mp3\thello world\t2\t0\t{age}\t{gender}\t{accent}")
    tsv = tmp_path / "dev.tsv"
    tsv.write_text("\n".join(lines) + "\n")
    return tsv


def test_common_voice_attributes_become_speaker_groups(tmp_path):
    tsv = _cv_release(
        tmp_path,
        [
            ("a", "twenties", "female", "en-us"),
            ("a", "twenties", "female", "en-us"),
            ("a", "thirties", "female", "en-gb"),  # minority clip: a keeps en-us, twenties
            ("b", "", "male", "en-gb"),  # age not given: unreported
            ("c", "fifties", "male", "en-gb"),
        ],
    )
    entries = commonvoice_manifest(tsv, "dev", "en", Skips()).entries
    groups = speaker_groups(entries)
    assert groups == {
        "accent": {"a": "en-us", "b": "en-gb", "c": "en-gb"},
        "age": {"a": "twenties", "b": "unreported", "c": "fifties"},
        "gender": {"a": "female", "b": "male", "c": "male"},
    }


def test_an_attribute_with_one_group_is_left_out(tmp_path):
    tsv = _cv_release(tmp_path, [("a", "teens", "male", "en"), ("b", "teens", "female", "en")])
    assert set(speaker_groups(commonvoice_manifest(tsv, "dev", "en", Skips()).entries)) == {
        "gender"
    }


def test_the_data_report_says_why_speakers_form_no_groups(tmp_path):
    tsv = _cv_release(tmp_path, [("a", "teens", "male", "en"), ("b", "teens", "male", "en")])
    manifest = commonvoice_manifest(tsv, "dev", "en", Skips())
    notes = split_notes({"dev": manifest}, manifest.entries)
    assert notes["speaker_groups"] == {}
    assert notes["speaker_groups_unavailable"] == (
        "all speakers are in one group of each of accent, age, gender"
    )
    tsv.write_text("\n".join(line.rsplit("\t", 3)[0] for line in tsv.read_text().splitlines()))
    manifest = commonvoice_manifest(tsv, "dev", "en", Skips())  # no age, gender, accents columns
    assert split_notes({"dev": manifest}, manifest.entries)["speaker_groups_unavailable"] == (
        "dev.tsv has none of the columns age, gender, accents"
    )


def test_librispeech_gender_comes_from_speakers_txt(tiny_corpus_root: Path):
    subset = tiny_corpus_root / "LibriSpeech" / "dev-clean"
    entries = librispeech_manifest(subset, "dev-clean", "en", Skips()).entries
    sexes = {}
    for line in (tiny_corpus_root / "LibriSpeech" / "SPEAKERS.TXT").read_text().splitlines():
        if not line.startswith(";"):
            fields = [f.strip() for f in line.split("|")]
            sexes[fields[0]] = {"F": "female", "M": "male"}[fields[1]]
    genders = speaker_groups(entries).get("gender", {})
    speakers = {e.user_id for e in entries}
    assert genders == {s: sexes[s] for s in speakers} or len(set(sexes[s] for s in speakers)) < 2


def test_group_counts_pool_each_groups_speakers():
    counts = {"a": (1, 10), "b": (3, 10), "c": (6, 20), "d": (0, 0)}
    groups = {"accent": {"a": "x", "b": "x", "c": "y"}}  # d has no label
    assert group_counts(counts, groups) == {
        "accent": {
            "unreported": {"errors": 0, "words": 0, "speakers": 1, "wer": None},
            "x": {"errors": 4, "words": 20, "speakers": 2, "wer": 0.2},
            "y": {"errors": 6, "words": 20, "speakers": 1, "wer": 0.3},
        }
    }


def _result(speakers: dict, groups: dict) -> EvalResult:
    return EvalResult(role="test", wer=0.25, speakers=speakers, groups=groups)


def test_a_record_whose_groups_do_not_add_up_is_refused():
    speakers = {"a": (1, 10), "b": (3, 10)}
    good = group_counts(speakers, {"gender": {"a": "female", "b": "male"}})
    assert _result(speakers, good).groups["gender"]["male"].wer == 0.3
    tampered = {"gender": {**good["gender"], "male": {**good["gender"]["male"], "errors": 0}}}
    with pytest.raises(ValidationError, match="add up to"):
        _result(speakers, tampered)
    wrong_wer = {"gender": {**good["gender"], "male": {**good["gender"]["male"], "wer": 0.9}}}
    with pytest.raises(ValidationError, match="not errors / words"):
        _result(speakers, wrong_wer)


def _with_groups(record, group_wers: dict[str, float], speakers_per_group: int):
    """The record with a test-set result split into groups of the given WERs (50 words each
    speaker)."""
    speakers, groups = {}, {}
    for name, wer in group_wers.items():
        for k in range(speakers_per_group):
            speakers[f"{name}{k}"] = (round(wer * 50), 50)
            groups[f"{name}{k}"] = name
    final = {
        name: result.model_dump()
        | (
            {"speakers": speakers, "groups": group_counts(speakers, {"accent": groups})}
            if result.role == "test"
            else {}
        )
        for name, result in record.metrics.final.items()
    }
    return record.model_validate(
        record.model_dump() | {"metrics": record.metrics.model_dump() | {"final": final}}
    )


def test_worst_group_ignores_small_and_unreported_groups():
    from pflbench.results.groups import GroupWer

    groups = {
        "accent": {
            "x": GroupWer(0.30, MIN_SPEAKERS),
            "y": GroupWer(0.90, MIN_SPEAKERS - 1),  # too few speakers to rank
            "unreported": GroupWer(0.95, 50),
        },
        "gender": {"female": GroupWer(0.20, 10), "male": GroupWer(0.40, 10)},
    }
    attribute, name, g = worst_group(groups)
    assert (attribute, name, g.wer) == ("gender", "male", 0.40)


def _fx_records():
    return [r for r in load_results(GOLDEN / "results") if r.task.name == "fx-task"]


def _grouped_dp_pair():
    """A DP row of the golden records and its no-DP partner, given groups x and y whose WERs
    are 40/60% under DP and 30/56% without: ((baseline, budget) of the DP row, DP, no-DP)."""
    by_budget = {}
    for r in _fx_records():
        by_budget.setdefault((r.baseline, r.budget), []).append(r)
    (dp_key, dp_rows), (_, base_rows) = _dp_pair(by_budget)
    dp = [_with_groups(r, {"x": 0.40, "y": 0.60}, MIN_SPEAKERS) for r in dp_rows]
    base = [_with_groups(r, {"x": 0.30, "y": 0.56}, MIN_SPEAKERS) for r in base_rows]
    return dp_key, dp, base


def test_leaderboard_shows_worst_group_and_dp_gap_per_group():
    dp_key, dp, base = _grouped_dp_pair()
    assert row_group_wers(dp, next(iter(_test_sets(dp[0]))))["accent"]["y"].wer == pytest.approx(
        0.6
    )
    text = render_groups(
        [Row(tuple(dp)), Row(tuple(base))],
        lambda b: b != NO_DP,
        cell,
        lambda row: cell(row.first.baseline),
    )
    worst = next(
        line for line in text.splitlines() if line.startswith(f"| {dp_key[0]} | {dp_key[1]}")
    )
    assert "accent=y" in worst and "60.00" in worst and "| 40.00 |" in worst
    gap = [line for line in text.splitlines() if line.startswith(f"| {dp_key[0]} | {dp_key[1]}")][
        -1
    ]
    assert gap.endswith("| +10.00 | +4.00 |")
    full = render_leaderboard(dp + base, budgets=BUDGETS)
    assert "### per-group WER" in full and "DP's cost per group" in full


def _current(records, group_wers: dict[str, float]):
    """The records as if run by today's code (numerics), with other group WERs."""
    out = []
    for r in records:
        r = _with_groups(r, group_wers, MIN_SPEAKERS)
        r.software.numerics_version = NUMERICS_VERSION
        out.append(r)
    return out


def test_stale_rows_are_marked_and_pair_only_with_stale_partners():
    """The golden records are numerics v1: beside today's runs of the same configurations, the
    per-group table marks them as the main tables do, and each DP row's cost is taken against
    the no-DP row of its own numerics (today 36/60 against 20/56: +16/+4; stale 40/60 against
    30/56: +10/+4)."""
    dp_key, dp, base = _grouped_dp_pair()
    now_dp = _current(dp, {"x": 0.36, "y": 0.60})
    now_base = _current(base, {"x": 0.20, "y": 0.56})
    text = render_leaderboard(dp + base + now_dp + now_base, budgets=BUDGETS)
    rows = [
        line
        for line in text[text.index("### per-group WER") :].splitlines()
        if line.startswith(f"| {dp_key[0]}") and f" | {dp_key[1]} |" in line
    ]
    stale = [line for line in rows if "⚠ stale (numerics v1) |" in line]
    current = [line for line in rows if "⚠" not in line]
    # One worst-group line and one DP-cost line each.
    assert len(stale) == len(current) == 2
    assert stale[-1].endswith("| +10.00 | +4.00 |")
    assert current[-1].endswith("| +16.00 | +4.00 |")
    # A figure cannot mark a series stale: of the two rows behind one label it draws today's.
    from pflbench.results.figures import group_figures
    from pflbench.results.leaderboard import group_rows

    wer, gap = group_figures(group_rows(dp + base + now_dp + now_base), "fx-task", BUDGETS, {})
    labels = [series["label"] for series in wer.data["series"]]
    assert len(labels) == len(set(labels))
    assert [series["values"]["accent"] for series in gap.data["series"]] == [[16.0, 4.0]]


def test_plot_draws_group_wer_and_dp_gap(tmp_path):
    from pflbench.results.plots import plot_results

    _, dp, base = _grouped_dp_pair()
    report = plot_results(dp + base, tmp_path, budgets=BUDGETS)
    names = {p.name for p in report.written}
    assert {"fx-task-group-wer.png", "fx-task-group-dp-gap.png"} <= names
    plain = plot_results(_fx_records(), tmp_path / "plain", budgets=BUDGETS)
    assert "fx-task-group-wer: no records with per-group WER" in plain.skipped


def _test_sets(record):
    return [n for n, r in record.metrics.final.items() if r.role == "test"]


def _dp_pair(by_budget):
    """A (baseline, DP budget) row of the golden records and its (baseline, none) partner."""
    for (baseline, budget), rows in sorted(by_budget.items()):
        if budget != NO_DP and (baseline, NO_DP) in by_budget:
            return ((baseline, budget), rows), ((baseline, NO_DP), by_budget[(baseline, NO_DP)])
    pytest.skip("golden records have no DP row with a no-DP partner")
