"""`pflbench submit`: a valid run is filed; every refusal is triggered by a tampered record.

The records here are made up around honest hypotheses: each eval set's references from the tiny
synthetic Common-Voice-like corpus with a few words dropped, and the figures that pflbench's own
re-scoring gives for them (as an honest privacy claim is a run's own: privacy_claim)."""

from __future__ import annotations

import copy
import json
import re
from hashlib import sha256
from pathlib import Path

import pytest

from pflbench.errors import UserError
from pflbench.numerics import NUMERICS_VERSION
from pflbench.privacy.run import privacy_claim, run_sigma_dp
from pflbench.results.bench import synthetic_record
from pflbench.results.leaderboard import load_results, render_leaderboard
from pflbench.results.rescore import DataOptions, rescored
from pflbench.results.schema import (
    MAX_RECORD_BYTES,
    compute_record_id,
    load_record,
    parse_record,
    record_numerics_version,
)
from pflbench.results.submit import (
    AlreadyFiled,
    current_config,
    record_path,
    submit,
    validate_record,
)
from pflbench.rundir import HYPOTHESES_DIR, hypotheses_content, write_hypotheses
from pflbench.spec.models import RunConfig
from pflbench.spec.names import safe_name
from pflbench.spec.registry import load_registry
from pflbench.spec.resolve import config_json_hash, resolve

SPECS = Path(__file__).parent / "fixtures" / "results" / "specs"
REPO_RESULTS = Path(__file__).parents[1] / "results"
HYPOTHESES: dict[int, dict] = {}  # seed -> {eval set: {"utterances": [...]}}, by make_record


@pytest.fixture(scope="module")
def registry():
    return load_registry([SPECS])


@pytest.fixture(scope="module")
def data(tiny_corpus_root, tiny_cache_dir) -> DataOptions:
    """fx-task's eval sets (Common Voice en dev and test) from the tiny synthetic corpus."""
    return DataOptions(data_root=tiny_corpus_root, cache_dir=tiny_cache_dir)


def accept(run_dir: Path, results: Path, registry, data: DataOptions, **kwargs):
    return submit(run_dir, results, registry, data=data, **kwargs)


def finalize(record: dict) -> dict:
    """Recompute the hashes a run would have written for this (possibly edited) record."""
    if record.get("config") is not None:
        record["config_hash"] = config_json_hash(record["config"])
    record["record_id"] = compute_record_id(record)
    return record


def make_record(
    registry, data: DataOptions, budget: str = "fx-dp", seed: int = 0, sigma_dp: float | None = None
):
    """A record of fx-task whose figures are those of its hypotheses (HYPOTHESES[seed]): the
    references, with the last word of every (3 + seed)-th utterance dropped."""
    config = resolve(registry, "fx-task", "perlayer-dim", budget, seed)
    if sigma_dp is None:  # what a run adds: its budget's (z ≈ 0.98 at fx-dp's cohort of 100)
        sigma_dp = run_sigma_dp(config)
    federated = data.federated_data(config.task)  # the population is its users
    privacy = privacy_claim(config, sigma_dp, len(federated.users()))
    eval_data = data.eval_data(config.task)
    results, final = {}, {}
    for eval_set in config.task.eval_sets:
        refs = sorted(eval_data.eval_sets[eval_set.name].references())
        hypotheses = {
            utt_id: " ".join(text.split()[:-1]) if i % (3 + seed) == 0 else text
            for i, (utt_id, _, text) in enumerate(refs)
        }
        utterances = [{"utt_id": u, "hypothesis": h} for u, h in hypotheses.items()]
        results[eval_set.name] = {"utterances": utterances}
        final[eval_set.name] = rescored(eval_set, eval_data, hypotheses, "test")
    HYPOTHESES[seed] = results
    created = f"2026-03-0{seed + 1}T00:00:00+00:00"
    wers = {name: result.wer for name, result in final.items()}
    record = synthetic_record(config.model_dump(mode="json"), wers, created, privacy)
    record["metrics"]["final"] = {n: r.model_dump(mode="json") for n, r in final.items()}
    record["data"]["digests"] = {n: s.digest for n, s in eval_data.eval_sets.items()}
    record["data"]["digests"]["federated_train"] = federated.digest
    stores = {**eval_data.eval_sets, "federated_train": federated}
    record["data"]["audio_digests"] = {n: s.audio_digest for n, s in stores.items()}
    digests = {
        n: sha256(hypotheses_content(r["utterances"])).hexdigest() for n, r in results.items()
    }
    record["outputs"] = {"final_model": "0" * 64, "hypotheses": digests}
    record["record_id"] = compute_record_id(record)
    return record


def write_run(run_dir: Path, record: dict, done: bool = True) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(record["config"], indent=2))
    (run_dir / "record.json").write_text(json.dumps(record, indent=2))
    if record.get("seed") in HYPOTHESES:
        write_hypotheses(run_dir / HYPOTHESES_DIR, HYPOTHESES[record["seed"]])
    if done:
        (run_dir / "DONE").write_text("done\n")
    return run_dir


@pytest.fixture(scope="module")
def dp_record(registry, data):
    return make_record(registry, data)


def dp_sigma(registry, budget: str = "fx-dp") -> float:
    return run_sigma_dp(resolve(registry, "fx-task", "perlayer-dim", budget, 0))


def refused(tmp_path: Path, registry, record: dict, match: str, **kwargs) -> None:
    run_dir = write_run(tmp_path / "run", record)
    with pytest.raises(UserError, match=match):
        submit(run_dir, tmp_path / "results", registry, **kwargs)
    assert not (tmp_path / "results").exists() or not any((tmp_path / "results").rglob("*"))


# ----------------------------------------------------------------------------------------------
# Accepted


def test_valid_dp_run_is_filed_and_shown(tmp_path, registry, data, dp_record):
    run_dir = write_run(tmp_path / "run", dp_record)
    (run_dir / "checkpoints").mkdir()
    (run_dir / "checkpoints" / "final.safetensors").write_bytes(b"weights")
    accepted = accept(run_dir, tmp_path / "results", registry, data)
    expected = tmp_path / "results" / "fx-task" / "fx-dp" / f"{dp_record['record_id']}.json"
    assert accepted.path == expected and not accepted.stale and not accepted.reevaluated
    stored, raw = load_record(expected)
    assert raw == dp_record
    # The record and what re-scoring needs (the hypotheses, gzipped); not the checkpoints.
    filed = sorted(str(p.relative_to(expected.parent)) for p in expected.parent.rglob("*.*"))
    hypotheses = [f"{expected.stem}/hypotheses/{name}.jsonl.gz" for name in ("cv-dev", "cv-test")]
    assert filed == [expected.name, *hypotheses]
    for name in hypotheses:
        assert (expected.parent / name).read_bytes() == (
            run_dir / name.split("/", 1)[1]
        ).read_bytes()
    dev, test = (100 * dp_record["metrics"]["final"][n]["wer"] for n in ("cv-dev", "cv-test"))
    assert 0 < dev < 100 and 0 < test < 100
    text = render_leaderboard(load_results(tmp_path / "results"), {"fx-task": 2})
    row = next(line for line in text.splitlines() if dp_record["record_id"] in line)
    assert row.startswith(f"| 1 | perlayer-dim (rule: clip) | {dev:.2f} [")  # [95% CI]
    assert f"| {test:.2f} [" in row and "| 1.5 rdp |" in row
    assert row.endswith("| run | re-scored |")


def test_no_dp_run_is_filed(tmp_path, registry, data):
    record = make_record(registry, data, budget="fx-nodp")
    accepted = accept(write_run(tmp_path / "run", record), tmp_path / "results", registry, data)
    assert accepted.path.parent == tmp_path / "results" / "fx-task" / "fx-nodp"


# ----------------------------------------------------------------------------------------------
# Refused


def test_unknown_schema_version(tmp_path, registry, dp_record):
    record = finalize({**copy.deepcopy(dp_record), "schema_version": 99})
    refused(tmp_path, registry, record, "unknown record schema_version 99")


def test_config_hash_mismatch(tmp_path, registry, dp_record):
    record = copy.deepcopy(dp_record)
    record["config"]["recipe"]["federated"]["client"]["lr"] = 0.9  # edited after the run
    refused(tmp_path, registry, finalize_id_only(record), "does not match the stored config")


def finalize_id_only(record: dict) -> dict:
    record["record_id"] = compute_record_id(record)
    return record


def test_run_dir_config_differs_from_record(tmp_path, registry, dp_record):
    run_dir = write_run(tmp_path / "run", dp_record)
    other = copy.deepcopy(dp_record["config"])
    other["seed"] = 7
    (run_dir / "config.json").write_text(json.dumps(other))
    with pytest.raises(UserError, match="config.json: the resolved config"):
        submit(run_dir, tmp_path / "results", registry)


def test_old_task_version_needs_stale_and_is_shown_stale(tmp_path, registry, data, dp_record):
    record = copy.deepcopy(dp_record)
    record["config"]["task"]["version"] = 1
    record["task"]["version"] = 1
    record = finalize(record)
    refused(tmp_path, registry, record, "version 2 in the registry but the run used version 1")
    accepted = accept(tmp_path / "run", tmp_path / "results", registry, data, stale_ok=True)
    assert accepted.stale
    text = render_leaderboard(load_results(tmp_path / "results"), {"fx-task": 2})
    assert "perlayer-dim (rule: clip) ⚠ stale (v1)" in text


def test_a_stale_record_is_unranked_and_cannot_redefine_its_eval_sets(
    tmp_path, registry, data, dp_record
):
    """A stale record's config is not resolved again, but its eval sets must be the task's: re-
    scoring reads the record's own definitions. A version newer than the registry's is refused."""
    newer = copy.deepcopy(dp_record)
    newer["config"]["task"]["version"] = newer["task"]["version"] = 3
    refused(tmp_path, registry, finalize(newer), "version 3 and numerics .* a newer one cannot")
    moved = copy.deepcopy(dp_record)
    moved["config"]["task"]["version"] = moved["task"]["version"] = 1
    test_set = next(e for e in moved["config"]["task"]["eval_sets"] if e["role"] == "test")
    test_set["subset"] = "dev"  # another subset scored as the test set
    refused(
        tmp_path, registry, finalize(moved), "config.task.eval_sets are not task", stale_ok=True
    )
    old = copy.deepcopy(dp_record)
    old["config"]["task"]["version"] = old["task"]["version"] = 1
    accept(write_run(tmp_path / "old", finalize(old)), tmp_path / "results", registry, data,
           stale_ok=True)  # fmt: skip
    accept(write_run(tmp_path / "now", dp_record), tmp_path / "results", registry, data)
    text = render_leaderboard(load_results(tmp_path / "results"), {"fx-task": 2})
    rows = [line.split(" | ") for line in text.splitlines() if line.startswith("| ")]
    ranked = {cells[1]: cells[0] for cells in rows if cells[1].startswith("perlayer-dim")}
    assert ranked == {
        "perlayer-dim (rule: clip)": "| 1",
        "perlayer-dim (rule: clip) ⚠ stale (v1)": "| –",
    }


def test_privacy_claim_mismatch(tmp_path, registry, dp_record):
    record = copy.deepcopy(dp_record)
    record["privacy"]["extrapolated"]["epsilon"]["rdp"]["epsilon"] = 1.2  # a rosier claim
    refused(tmp_path, registry, finalize(record), "claimed ε = 1.2 but the rdp accountant")


def test_the_claimed_epsilon_is_re_accounted_to_what_two_machines_agree_to(
    tmp_path, registry, data, dp_record
):
    """RDP is closed form: a claim 1e-5 off (a nudge the leaderboard could show) is refused.
    PLD's FFTs round per CPU (1.2e-5 apart between two): such a claim is accepted, 1e-3 is not."""
    nudged = copy.deepcopy(dp_record)
    nudged["privacy"]["extrapolated"]["epsilon"]["rdp"]["epsilon"] *= 1 - 1e-5
    refused(tmp_path, registry, finalize(nudged), "but the rdp accountant gives")
    for factor, fine in ((1 + 2e-5, True), (1 + 1e-3, False)):
        record = copy.deepcopy(dp_record)
        record["privacy"]["extrapolated"]["epsilon"]["pld"]["epsilon"] *= factor
        if fine:
            run_dir = write_run(tmp_path / "pld-run", finalize(record))
            accept(run_dir, tmp_path / "pld-results", registry, data)
        else:
            refused(tmp_path, registry, finalize(record), "but the pld accountant gives")


def test_a_tampered_prv_cross_check_is_refused(tmp_path, registry, dp_record):
    record = copy.deepcopy(dp_record)
    claim = record["privacy"]["extrapolated"]["epsilon"]["prv"]
    claim["epsilon"] = round(claim["epsilon"] * 0.9, 3)  # a rosier cross-check
    refused(tmp_path, registry, finalize(record), "but the prv accountant gives")


def test_a_record_from_before_prv_with_rdp_and_pld_claims_only_is_filed(
    tmp_path, registry, data, dp_record
):
    record = copy.deepcopy(dp_record)
    config = RunConfig.model_validate(record["config"])
    sigma_dp = record["privacy"]["sigma_dp"]
    population = record["privacy"]["simulated"]["population"]
    record["privacy"] = privacy_claim(config, sigma_dp, population, accountants=("rdp", "pld"))
    run_dir = write_run(tmp_path / "run", finalize(record))
    accepted = accept(run_dir, tmp_path / "results", registry, data)
    assert set(accepted.record.privacy.extrapolated.epsilon) == {"rdp", "pld"}


def test_a_claim_of_more_noise_than_the_budget_prescribes_is_refused(tmp_path, registry, dp_record):
    """Three times the budget's σ_DP, the whole claim regenerated by pflbench's own statement for
    it: every ε is right for that σ, and lower than the run's; the run added its budget's σ."""
    record = copy.deepcopy(dp_record)
    config = RunConfig.model_validate(record["config"])
    sigma_dp, population = (
        record["privacy"]["sigma_dp"],
        record["privacy"]["simulated"]["population"],
    )
    record["privacy"] = privacy_claim(config, 3 * sigma_dp, population)
    refused(
        tmp_path, registry, finalize(record), "privacy.sigma_dp is .* but budget 'fx-dp' prescribes"
    )


def test_a_dp_record_of_fixed_size_cohorts_is_refused(tmp_path, registry, dp_record):
    """The accountants analyse Poisson sampling; a fixed cohort is not covered (a user added to
    it displaces another: the sum moves by up to 2C). The whole claim is pflbench's own statement
    for the config, so only the sampling rule refuses it."""
    record = copy.deepcopy(dp_record)
    record["config"]["recipe"]["federated"]["sampling"] = "fixed"  # as --set gives it
    record["config"]["overrides"] = {"federated.sampling": "fixed"}
    config = RunConfig.model_validate(record["config"])
    sigma_dp, population = (
        record["privacy"]["sigma_dp"],
        record["privacy"]["simulated"]["population"],
    )
    record["privacy"] = privacy_claim(config, sigma_dp, population)
    refused(tmp_path, registry, finalize(record), "fixed-size cohorts under DP budget 'fx-dp'")


def test_privacy_claim_with_wrong_noise_multiplier(tmp_path, registry, dp_record):
    record = copy.deepcopy(dp_record)
    record["privacy"]["sigma_dp"] *= 2  # claims more noise than its ε numbers used
    refused(tmp_path, registry, finalize(record), "noise_multiplier")


def test_epsilon_above_budget(tmp_path, registry, data):
    # An honest claim (the accountants agree) for too little noise for the budget it is filed under.
    record = make_record(registry, data, sigma_dp=dp_sigma(registry) * 0.8)
    refused(tmp_path, registry, record, "above the budget 'fx-dp'")


def test_a_pld_budget_is_claimed_and_checked_by_pld(tmp_path, registry, data):
    """One accountant choice: the budget's. fx-dp-pld's σ_DP is calibrated by PLD to its ε = 1.0
    (RDP would give more), and the run meets its budget by the budget's own accountant."""
    record = make_record(registry, data, budget="fx-dp-pld")
    assert record["privacy"]["claimed_by"] == "pld"
    accepted = accept(write_run(tmp_path / "run", record), tmp_path / "results", registry, data)
    assert accepted.record.privacy.extrapolated.epsilon["pld"].epsilon <= 1.0
    text = render_leaderboard(load_results(tmp_path / "results"), {"fx-task": 2})
    assert "| 1 pld |" in text
    assert accepted.record.privacy.extrapolated.epsilon["rdp"].epsilon > 1.0


def test_a_claim_by_another_accountant_than_the_budgets_is_refused(tmp_path, registry, data):
    record = copy.deepcopy(make_record(registry, data, budget="fx-dp-pld"))
    record["privacy"]["claimed_by"] = "rdp"
    refused(tmp_path, registry, finalize(record), "privacy.claimed_by is 'rdp' but the config")


def test_a_run_with_more_steps_than_its_budget_is_refused(tmp_path, registry, dp_record):
    record = copy.deepcopy(dp_record)
    record["config"]["recipe"]["federated"]["central_steps"] = 60  # fx-dp: T = 50
    record["config"]["overrides"] = {"federated.central_steps": "60"}  # run with --set
    record["privacy"]["simulated"]["steps"] = 60
    record["compute"]["central_steps"] = 60
    refused(tmp_path, registry, finalize(record), "60 central steps .* T = 50")


def test_leaderboard_says_a_pseudo_user_epsilon_is_per_pseudo_user(tmp_path, registry, dp_record):
    record = copy.deepcopy(dp_record)
    record["privacy"]["unit"] = "pseudo-user"  # as a run on an -iid task writes it
    record = finalize(record)
    (tmp_path / "record.json").write_text(json.dumps(record))
    path = record_path(tmp_path / "results", load_record(tmp_path / "record.json")[0])
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(record))
    text = render_leaderboard(load_results(tmp_path / "results"), {"fx-task": 2})
    assert "| 1.5 rdp, per pseudo-user |" in text


def test_a_forged_wer_is_refused_naming_the_field_and_both_values(
    tmp_path, registry, data, dp_record
):
    record = copy.deepcopy(dp_record)
    honest = record["metrics"]["final"]["cv-test"]["wer"]
    record["metrics"]["final"]["cv-test"]["wer"] = honest / 2  # record_id recomputed below
    message = (
        f"metrics.final.cv-test.wer is {honest / 2!r} in the record, but re-scoring the stored "
        f"hypotheses against the eval set's references gives {honest!r}"
    )
    with pytest.raises(UserError, match=re.escape(message)):
        accept(write_run(tmp_path / "run", finalize(record)), tmp_path / "results", registry, data)
    assert not (tmp_path / "results").exists()


@pytest.mark.parametrize(
    "field", ["cer", "speaker_wer_p90", "num_utterances", "speakers", "groups"]
)
def test_every_recorded_figure_is_re_scored(tmp_path, registry, data, dp_record, field):
    record = copy.deepcopy(dp_record)
    result = record["metrics"]["final"]["cv-dev"]
    if field == "speakers":  # one error moved between two speakers: the totals still add up
        a, b = sorted(speaker for speaker, (errors, _) in result["speakers"].items() if errors)[:2]
        result["speakers"][a][0] -= 1
        result["speakers"][b][0] += 1
        field = rf"speakers.{a}\[0\]"  # [word errors, words]: the errors named
    elif field == "groups":  # the same in the gender groups
        groups = result["groups"]["gender"]
        a, b = sorted(groups)[:2]
        groups[a]["errors"] += 1
        groups[a]["wer"] = groups[a]["errors"] / groups[a]["words"]
        groups[b]["errors"] -= 1
        groups[b]["wer"] = groups[b]["errors"] / groups[b]["words"]
        field = f"groups.gender.{a}.errors"
    else:
        result[field] = result[field] / 2 if field != "num_utterances" else result[field] - 1
    with pytest.raises(UserError, match=f"metrics.final.cv-dev.{field} is"):
        accept(write_run(tmp_path / "run", finalize(record)), tmp_path / "results", registry, data)


def test_a_changed_hypotheses_file_is_refused(tmp_path, registry, data, dp_record):
    import gzip

    run_dir = write_run(tmp_path / "run", dp_record)
    path = run_dir / HYPOTHESES_DIR / "cv-test.jsonl.gz"
    lines = gzip.decompress(path.read_bytes()).decode().splitlines()
    lines[0] = json.dumps({"hypothesis": "", "utt_id": json.loads(lines[0])["utt_id"]})
    path.write_bytes(gzip.compress(("\n".join(lines) + "\n").encode()))
    with pytest.raises(UserError, match="cv-test.jsonl.gz: its content's sha256 .* changed"):
        accept(run_dir, tmp_path / "results", registry, data)
    path.unlink()
    with pytest.raises(UserError, match="cv-test.jsonl.gz: no such file"):
        accept(run_dir, tmp_path / "results", registry, data)
    assert not (tmp_path / "results").exists()


def test_hypotheses_must_cover_exactly_the_eval_sets_utterances(
    tmp_path, registry, data, dp_record
):
    """A file that leaves an utterance out (its digest in the record, consistently) is refused:
    re-scoring would otherwise pass over the utterances a run got wrong."""
    record = copy.deepcopy(dp_record)
    utterances = HYPOTHESES[0]["cv-dev"]["utterances"][1:]
    record["outputs"]["hypotheses"]["cv-dev"] = sha256(hypotheses_content(utterances)).hexdigest()
    run_dir = write_run(tmp_path / "run", finalize(record))
    write_hypotheses(run_dir / HYPOTHESES_DIR, {"cv-dev": {"utterances": utterances}})
    missing = HYPOTHESES[0]["cv-dev"]["utterances"][0]["utt_id"]
    with pytest.raises(UserError, match=f"1 of the eval set's .* no hypothesis .*{missing}"):
        accept(run_dir, tmp_path / "results", registry, data)


def test_eval_data_other_than_the_runs_are_refused(tmp_path, registry, data, dp_record):
    record = copy.deepcopy(dp_record)
    record["data"]["digests"]["cv-dev"] = "f" * 64  # the run evaluated other data
    record["data"]["audio_digests"]["cv-dev"] = "f" * 64
    with pytest.raises(UserError, match="'cv-dev' here .* is not the data the run used"):
        accept(write_run(tmp_path / "run", finalize(record)), tmp_path / "results", registry, data)


def test_features_another_cpu_computed_from_the_runs_audio_are_the_runs_data(
    tmp_path, registry, data, dp_record
):
    """A run filed on another CPU states other feature digests (other feature arithmetic) and
    the same audio digests: re-scoring and the population check read no features, so the
    record is accepted; its audio digest changed too, it is refused."""
    record = copy.deepcopy(dp_record)
    same = accept(write_run(tmp_path / "same", dp_record), tmp_path / "same-cpu", registry, data)
    assert same.audio_only == []  # every feature digest matched
    for name in ("cv-dev", "federated_train"):
        record["data"]["digests"][name] = "f" * 64
    run_dir = write_run(tmp_path / "run", finalize(record))
    accepted = accept(run_dir, tmp_path / "results", registry, data)
    assert sorted(accepted.audio_only) == ["cv-dev", "federated_train"]  # reported, not silent
    record["data"]["audio_digests"]["federated_train"] = "e" * 64
    with pytest.raises(UserError, match="'federated_train' here .* is not the data the run used"):
        accept(write_run(tmp_path / "run2", finalize(record)), tmp_path / "other", registry, data)


def test_a_population_other_than_the_datas_is_refused(tmp_path, registry, data, dp_record):
    """Ten times the users, the claim regenerated by pflbench's own statement for them (every ε
    right for that population, and lower than the run's): the record alone passes `validate`,
    the training data refuse it; so does a record of other training data."""
    record = copy.deepcopy(dp_record)
    config = RunConfig.model_validate(record["config"])
    users = record["privacy"]["simulated"]["population"]
    record["privacy"] = privacy_claim(config, record["privacy"]["sigma_dp"], 10 * users)
    validate_record(parse_record(finalize(record), "forged"), record, registry, "forged")
    with pytest.raises(UserError, match=f"simulated.population is {10 * users}, .* give {users}"):
        accept(write_run(tmp_path / "run", record), tmp_path / "results", registry, data)
    record = copy.deepcopy(dp_record)
    record["data"]["digests"]["federated_train"] = "f" * 64
    record["data"]["audio_digests"]["federated_train"] = "f" * 64
    with pytest.raises(UserError, match="'federated_train' here .* is not the data the run used"):
        accept(write_run(tmp_path / "run2", finalize(record)), tmp_path / "results", registry, data)


def test_dp_budget_without_claim(tmp_path, registry, dp_record):
    record = finalize({**copy.deepcopy(dp_record), "privacy": None})
    refused(tmp_path, registry, record, "needs a DP privacy claim")


def test_duplicates(tmp_path, registry, data, dp_record):
    accept(write_run(tmp_path / "run", dp_record), tmp_path / "results", registry, data)
    with pytest.raises(AlreadyFiled, match="run: already filed as .*json"):
        submit(tmp_path / "run", tmp_path / "results", registry)
    # The same id with other content in the run folder (its record edited): refused.
    (tmp_path / "run" / "record.json").write_text(
        json.dumps({**dp_record, "created": "2026-04-02T00:00:00+00:00"})
    )
    with pytest.raises(UserError, match="does not match its content"):
        submit(tmp_path / "run", tmp_path / "results", registry)
    rerun = finalize({**copy.deepcopy(dp_record), "created": "2026-04-01T00:00:00+00:00"})
    with pytest.raises(UserError, match="duplicate"):  # same config and seed, run again
        submit(write_run(tmp_path / "rerun", rerun), tmp_path / "results", registry)
    # ...also after the baseline's description was reworded (the same run: one row's seed).
    reworded = copy.deepcopy(rerun)
    reworded["config"]["baseline"]["description"] = "reworded"
    with pytest.raises(UserError, match="duplicate"):
        submit(write_run(tmp_path / "reworded", finalize(reworded)), tmp_path / "results", registry)


def test_malformed_json(tmp_path, registry):
    run_dir = write_run(tmp_path / "run", {"config": {}})
    (run_dir / "record.json").write_text('{"schema_version": 1, "record_id": ')
    with pytest.raises(UserError, match="record.json: not valid JSON"):
        submit(run_dir, tmp_path / "results", registry)
    (run_dir / "record.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(UserError, match="record.json: JSON nested too deeply"):
        submit(run_dir, tmp_path / "results", registry)
    (run_dir / "record.json").unlink()
    (run_dir / "record.json").mkdir()
    with pytest.raises(UserError, match="record.json: a folder, not a file"):
        submit(run_dir, tmp_path / "results", registry)


def test_nan_is_refused(tmp_path, registry, dp_record):
    run_dir = write_run(tmp_path / "run", dp_record)
    wer = json.dumps(dp_record["metrics"]["final"]["cv-test"]["wer"])
    text = (run_dir / "record.json").read_text().replace(f'"wer": {wer}', '"wer": NaN')
    (run_dir / "record.json").write_text(text)
    with pytest.raises(UserError, match="NaN"):
        submit(run_dir, tmp_path / "results", registry)


def test_oversized_file(tmp_path, registry, dp_record):
    run_dir = write_run(tmp_path / "run", dp_record)
    padded = json.dumps(dp_record) + " " * MAX_RECORD_BYTES
    (run_dir / "record.json").write_text(padded)
    with pytest.raises(UserError, match="over the 2097152-byte limit"):
        submit(run_dir, tmp_path / "results", registry)


def test_edited_record_id(tmp_path, registry, dp_record):
    record = copy.deepcopy(dp_record)
    record["metrics"]["final"]["cv-test"]["wer"] = 0.01  # a better number, id left as it was
    refused(tmp_path, registry, record, "record_id .* does not match its content")


@pytest.mark.parametrize("name", ["../../evil", "a/b", "..", "/etc", "Task", ".hidden", ""])
def test_path_traversal_names(tmp_path, registry, dp_record, name):
    record = copy.deepcopy(dp_record)
    record["task"]["name"] = name
    record["config"]["task"]["name"] = name
    refused(tmp_path, registry, finalize(record), "task.name")
    with pytest.raises(UserError, match="not a safe name"):
        safe_name(name, "task name")
    assert not (tmp_path / "evil").exists()


def test_record_path_stays_inside_results(tmp_path, registry, dp_record):
    from pflbench.results.schema import ResultRecord

    record = ResultRecord.model_validate(dp_record)
    path = record_path(tmp_path / "results", record)
    assert path.resolve().parent.parent.parent == (tmp_path / "results").resolve()


def test_unfinished_run(tmp_path, registry, dp_record):
    run_dir = write_run(tmp_path / "run", dp_record, done=False)
    with pytest.raises(UserError, match="no DONE marker"):
        submit(run_dir, tmp_path / "results", registry)
    with pytest.raises(UserError, match="missing: no such folder"):
        submit(tmp_path / "missing", tmp_path / "results", registry)
    with pytest.raises(UserError, match="config.json: a file, not a run directory"):
        submit(run_dir / "config.json", tmp_path / "results", registry)


def test_reference_rows_cannot_be_submitted(tmp_path, registry):
    paper = Path(__file__).parents[1] / "results" / "paper" / "002-t1-global-eps7.2-high-pop.json"
    record = json.loads(paper.read_text())
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "record.json").write_text(json.dumps(record))
    (run_dir / "config.json").write_text("{}")
    (run_dir / "DONE").write_text("")
    with pytest.raises(UserError):
        submit(run_dir, tmp_path / "results", registry)


def test_cli_submit_then_validate(tmp_path, dp_record, data, monkeypatch):
    from typer.testing import CliRunner

    from pflbench.cli import app

    monkeypatch.setenv("PFLBENCH_CACHE", str(data.cache_dir))
    run_dir = write_run(tmp_path / "run", dp_record)
    results = tmp_path / "results"
    common = ["--results", str(results), "--specs", str(SPECS)]
    submit_args = ["submit", str(run_dir), *common, "--data-root", str(data.data_root), "--json"]
    result = CliRunner().invoke(app, submit_args)
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["record_id"] == dp_record["record_id"]
    # Submitted again (a sweep's folder, over sessions): reported as filed, not refused.
    result = CliRunner().invoke(app, submit_args)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["already_filed"].endswith(f"{dp_record['record_id']}.json")
    result = CliRunner().invoke(app, ["results", "validate", *common])
    assert result.exit_code == 0 and "1 records valid (0 stale)" in result.output
    # a record edited inside results/ is caught by validate
    stored = next(results.rglob("*.json"))
    wer = json.dumps(dp_record["metrics"]["final"]["cv-test"]["wer"])
    stored.write_text(stored.read_text().replace(f'"wer": {wer}', '"wer": 0.05'))
    result = CliRunner().invoke(app, ["results", "validate", *common])
    assert result.exit_code != 0 and "does not match its content" in str(result.exception)


def test_a_run_from_before_hypotheses_were_stored_is_refused_naming_why(tmp_path):
    """A run folder written by `pflbench run` before runs kept their hypotheses (synth task, 2
    central steps, no checkpoints): its WER cannot be re-scored, so no pflbench command accepts
    its record (a hypothesis-less record in results/ would be a WER pflbench never computed)."""
    run_dir = Path(__file__).parent / "fixtures" / "results" / "run-synth"
    raw = json.loads((run_dir / "record.json").read_text())
    assert raw["kind"] == "run" and "outputs" not in raw
    with pytest.raises(UserError, match="(?s)record.json: invalid record.*needs outputs"):
        load_record(run_dir / "record.json")
    with pytest.raises(UserError, match="needs outputs .* must be run again"):
        submit(run_dir, tmp_path / "results", load_registry(), stale_ok=True)
    assert not (tmp_path / "results").exists()


@pytest.mark.parametrize("stated", [1, None])
def test_a_record_stating_older_numerics_is_refused_unless_stale(
    tmp_path, registry, dp_record, stated
):
    """A run of code whose numbers have changed since (pflbench.numerics) is stale work; one
    stating none is version 1's, as the leaderboard, the sweep manifest and reproduce read it."""
    record = copy.deepcopy(dp_record)
    record["software"]["numerics_version"] = stated
    record = finalize(record)
    refused(tmp_path, registry, record, f"numerics version 1, this pflbench as {NUMERICS_VERSION}")


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("task", "gone-task", "unknown task 'gone-task'"),
        ("budget", "gone-budget", "unknown budget 'gone-budget'"),
        ("baseline", "gone-baseline", "unknown baseline 'gone-baseline'"),
    ],
)
def test_an_error_from_the_registry_names_the_record(
    tmp_path, registry, dp_record, field, value, message
):
    """A record naming a task, budget or baseline the registry does not know: the error names
    the record's file, as every other check's does."""
    record = copy.deepcopy(dp_record)
    record["config"][field]["name"] = value
    if field == "task":
        record["task"]["name"] = value
    else:
        record[field] = value
    record = finalize(record)
    run_dir = write_run(tmp_path / "run", record)
    with pytest.raises(UserError, match=message) as error:
        submit(run_dir, tmp_path / "results", registry)
    assert str(run_dir / "record.json") in str(error.value)


# ----------------------------------------------------------------------------------------------
# Re-stamped edits: a record edited with its config hash and record id recomputed (the public
# formulas, `finalize`) still names a run pflbench did not make; each is refused by what it says.


def test_a_config_edited_and_rehashed_is_not_its_baselines_run(tmp_path, registry, data, dp_record):
    record = copy.deepcopy(dp_record)
    record["config"]["recipe"]["federated"]["client"]["lr"] = 0.9  # not perlayer-dim's 0.2 … lr
    refused(tmp_path, registry, finalize(record), "client.lr is 0.9, but task 'fx-task' with")
    # The same recipe, stated as the --set it took, is that run: filed (and labelled with it).
    record["config"]["overrides"] = {"federated.client.lr": "0.9"}
    accepted = accept(
        write_run(tmp_path / "honest", finalize(record)), tmp_path / "res", registry, data
    )
    assert accepted.record.config["overrides"] == {"federated.client.lr": "0.9"}


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        (("how",), "epsilon computed by hand.", "privacy.how is 'epsilon computed by hand.'"),
        (("extrapolated", "target_epsilon"), 1.0, "privacy.extrapolated.target_epsilon is 1.0"),
        (("extrapolated", "budget"), "eps1", "privacy.extrapolated.budget is 'eps1'"),
    ],
)
def test_every_field_of_the_privacy_statement_is_pflbenchs(
    tmp_path, registry, dp_record, path, value, message
):
    record = copy.deepcopy(dp_record)
    node = record["privacy"]
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    refused(tmp_path, registry, finalize(record), re.escape(message) + ".* statement .* says")


def test_a_run_record_without_a_privacy_statement_is_refused(tmp_path, registry, data):
    record = finalize({**make_record(registry, data, budget="fx-nodp"), "privacy": None})
    refused(tmp_path, registry, record, "privacy is missing")


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("central_steps", 4000, "compute.central_steps is 4000, but the config"),
        ("cohort_per_step", [8] * 3, "cohort_per_step has 3 entries, one per central step is 20"),
        ("gpu_hours", 2.5, "compute.gpu_hours is 2.5, but its device 'cpu'"),
    ],
)
def test_the_compute_a_record_shows_follows_from_the_record(
    tmp_path, registry, dp_record, field, value, message
):
    record = copy.deepcopy(dp_record)
    record["compute"][field] = value
    refused(tmp_path, registry, finalize(record), message)


def test_a_run_filed_twice_is_refused_wherever_records_are_read(
    tmp_path, registry, data, dp_record
):
    """A copy of a filed record with a new id (here: another `created`) would count as one more
    seed of its row; `submit` refuses it, and so does every reader of results/ (the leaderboard,
    `results validate`, CI's `results rescore`) when it was copied in by hand."""
    results = tmp_path / "results"
    filed = accept(write_run(tmp_path / "run", dp_record), results, registry, data).path
    copy_ = finalize({**copy.deepcopy(dp_record), "created": "2026-04-01T00:00:00+00:00"})
    (filed.parent / f"{copy_['record_id']}.json").write_text(json.dumps(copy_))
    with pytest.raises(UserError, match=r"the same config \(seed included\) as") as refusal:
        load_results(results)
    assert str(filed) in str(refusal.value) and copy_["record_id"] in str(refusal.value)


def test_a_record_with_a_key_given_twice_is_refused(tmp_path, dp_record):
    text = json.dumps(dp_record)
    path = tmp_path / "record.json"
    path.write_text(text.replace("{", '{"seed": 7, ', 1))  # json would keep the later seed
    with pytest.raises(UserError, match="record.json: not valid JSON: duplicate key 'seed'"):
        load_record(path)


@pytest.mark.parametrize(
    ("section", "field", "value"),
    [
        ("diagnostics", "clipped_fraction_mean", 7.0),
        ("compute", "wall_seconds", -5.0),
        ("compute", "gpu_hours", -1.0),
        ("compute", "cohort_per_step", [-1]),
    ],
)
def test_impossible_measurements_are_invalid(tmp_path, dp_record, section, field, value):
    record = copy.deepcopy(dp_record)
    record[section][field] = value
    path = tmp_path / "record.json"
    path.write_text(json.dumps(finalize(record)))
    with pytest.raises(UserError, match=f"invalid record\n  {section}.{field}"):
        load_record(path)


@pytest.mark.parametrize(
    ("client", "algorithm"),
    [
        ({"fedprox_mu": 0.001}, "fedprox"),
        ({"max_utterances": 32}, "data-limit"),
        ({"variational_noise": {"std": 0.01, "ramp_steps": 0}}, "fvn"),
        ({}, None),  # fedavg: the default, left out of the config
        ({"fedprox_mu": 0.001, "max_utterances": 32}, None),  # no single algorithm today
        ({"algorithm": "scaffold", "fedprox_mu": 0.0}, "scaffold"),  # named: kept
    ],
)
def test_a_config_from_before_client_algorithms_were_named_is_read_as_it_ran(client, algorithm):
    stored = {"recipe": {"federated": {"client": {"lr": 0.2, **client}}}}
    current = current_config(stored)["recipe"]["federated"]["client"]
    assert current.get("algorithm") == algorithm
    assert "algorithm" not in stored["recipe"]["federated"]["client"] or client.get("algorithm")


def test_a_run_of_a_task_with_a_shipped_seed_model_names_that_model():
    """A filed run of the embedded task (results/), its seed-model digest replaced and its id
    recomputed: every run of the task starts from the shipped seed model, so it is refused."""
    builtin = load_registry()
    task = builtin.task("synth-cv-en-ls-seed").spec
    filed = [
        path
        for path in sorted((REPO_RESULTS / "synth-cv-en-ls-seed").glob("*/*.json"))
        if load_record(path)[0].task.version == task.version
        and record_numerics_version(load_record(path)[0]) == NUMERICS_VERSION
    ]
    if not filed:  # between a task version's bump and its first filed runs (docs/RESULTS.md)
        pytest.skip(f"no run of task version {task.version} filed yet")
    raw = json.loads(filed[0].read_text())
    validate_record(*load_record(filed[0]), builtin, "filed")
    raw["data"]["digests"]["seed_model"] = "0" * 64
    record = finalize_id_only(raw)
    with pytest.raises(UserError, match="seed_model is '0{64}', but every run of this task"):
        validate_record(parse_record(record, "edited"), record, builtin, "edited")


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        (
            "created",
            "2099-01-01T00:00:00+00:00",
            "created '2099-01-01T00:00:00\\+00:00' is in the future",
        ),
        (
            "provenance",
            {"paper": "002", "table": "1", "row": "x"},
            "a run record has no provenance",
        ),
    ],
)
def test_a_run_record_cannot_claim_a_future_date_or_a_papers_citation(
    tmp_path, dp_record, field, value, message
):
    path = tmp_path / "record.json"
    path.write_text(json.dumps(finalize({**copy.deepcopy(dp_record), field: value})))
    with pytest.raises(UserError, match=message):
        load_record(path)


def test_a_seed_copied_from_another_seed_of_its_row_is_refused(tmp_path, registry, data, dp_record):
    """Another seed number on a copy of a filed run (its config re-hashed, its files copied):
    the configs differ, the trained model is the same; one row's seeds train different models."""
    results = tmp_path / "results"
    filed = accept(write_run(tmp_path / "run", dp_record), results, registry, data).path
    copy_ = copy.deepcopy(dp_record)
    copy_["seed"] = copy_["config"]["seed"] = 7
    copy_ = finalize(copy_)
    (filed.parent / f"{copy_['record_id']}.json").write_text(json.dumps(copy_))
    with pytest.raises(UserError, match="the same final model as .*another seed of the same row"):
        load_results(results)
    # Its final model's digest changed too (a claim nothing checks without the checkpoint): the
    # transcripts, which re-scoring reads and checks against their digests, are still the copy's.
    copy_["outputs"]["final_model"] = sha256(b"another model").hexdigest()
    assert copy_["outputs"]["final_model"] != dp_record["outputs"]["final_model"]
    (filed.parent / f"{copy_['record_id']}.json").unlink()
    copy_ = finalize(copy_)
    (filed.parent / f"{copy_['record_id']}.json").write_text(json.dumps(copy_))
    with pytest.raises(UserError, match="the same transcripts of every eval set as .*another seed"):
        load_results(results)


def test_a_filed_config_edited_where_nothing_reads_it_neither_passes_nor_splits_its_row():
    """A filed run of the embedded task, its config edited and every hash recomputed: a baseline's
    `overrides` changed (no recipe changes) is refused as not what the baseline resolves to; a
    retired recipe key added (the code drops it on reading) is the same configuration, so its
    leaderboard row and the filed-once check are the unedited run's."""
    from pflbench.results.groups import partner_key
    from pflbench.results.leaderboard import group_key
    from pflbench.results.schema import filed_once_key

    builtin = load_registry()
    path = next(
        p
        for p in sorted((REPO_RESULTS / "synth-cv-en-ls-seed").glob("*/*.json"))
        if record_numerics_version(load_record(p)[0]) == NUMERICS_VERSION
        and load_record(p)[0].task.version == builtin.task("synth-cv-en-ls-seed").spec.version
    )
    original = json.loads(path.read_text())

    def edited(change) -> dict:
        raw = copy.deepcopy(original)
        change(raw["config"])
        raw["config_hash"] = config_json_hash(raw["config"])
        return finalize_id_only(raw)

    overrides = edited(lambda c: c["baseline"].update(overrides={"federated": {"note": 1}}))
    with pytest.raises(UserError, match=r"config.baseline.overrides.* is not the one its baseline"):
        validate_record(parse_record(overrides, "edited"), overrides, builtin, "edited")
    retired = edited(lambda c: c["recipe"]["privacy"].update(accountant="rdp"))
    record, again = parse_record(retired, "edited"), parse_record(original, "filed")
    assert record.record_id != again.record_id
    for key in (group_key, partner_key, filed_once_key):
        assert key(record) == key(again), key
