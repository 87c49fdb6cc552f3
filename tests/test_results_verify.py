"""Verified rows on a real run of the tiny task: a forged WER is refused by `pflbench submit`
(re-scoring), `pflbench verify` passes on the honest run and fails on a swapped checkpoint, and
the leaderboard shows which rows were re-scored and re-evaluated."""

from __future__ import annotations

import gzip
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import STALE_NUMERICS
from test_run import TASK, specs_dir  # noqa: F401  (fixture)

from pflbench.digests import tensors_digest
from pflbench.errors import UserError
from pflbench.privacy.run import privacy_claim
from pflbench.results.leaderboard import load_result_files, render_leaderboard
from pflbench.results.rescore import DataOptions, rescored
from pflbench.results.schema import compute_record_id, load_record
from pflbench.results.submit import submit
from pflbench.results.verify import (
    TOLERANCE,
    EvalFigures,
    check_figures,
    recheck_filed,
    reevaluated_ids,
    verify_run,
)
from pflbench.rundir import HYPOTHESES_DIR, hypotheses_file, read_hypotheses, write_hypotheses
from pflbench.runner import RunOptions, run
from pflbench.spec.models import RunConfig
from pflbench.spec.registry import load_registry
from pflbench.spec.resolve import resolve


@pytest.fixture(scope="module")
def data(tiny_cache_dir, tiny_task_data) -> DataOptions:
    return DataOptions(cache_dir=tiny_cache_dir)


@pytest.fixture(scope="module")
def specs(specs_dir) -> Path:  # noqa: F811
    return specs_dir


@pytest.fixture(scope="module")
def registry(specs) -> object:
    return load_registry([specs])


@pytest.fixture(scope="module")
def honest_run(tmp_path_factory, tiny_cache_dir, tiny_task_data, registry) -> Path:
    """A finished fedavg run of the tiny task (3 central steps), shared read-only: tests copy it."""
    config = resolve(registry, TASK, "fedavg", "none", 0, [])
    out = tmp_path_factory.mktemp("honest") / "run"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PFLBENCH_CACHE", str(tiny_cache_dir))
        return run(config, out_dir=out, options=RunOptions(progress=False))


def copy_run(honest_run: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(honest_run, tmp_path / "run"))


def rewrite_record(run_dir: Path, edit) -> dict:
    """Edit record.json and recompute its record_id, as a forger would."""
    raw = json.loads((run_dir / "record.json").read_text())
    edit(raw)
    raw["record_id"] = compute_record_id(raw)
    (run_dir / "record.json").write_text(json.dumps(raw, indent=2))
    return raw


def test_the_run_stores_its_hypotheses_and_names_them_and_its_checkpoint(honest_run):
    record, _ = load_record(honest_run / "record.json")
    assert record.outputs.final_model == tensors_digest(
        honest_run / "checkpoints" / "final.safetensors"
    )
    assert set(record.outputs.hypotheses) == set(record.metrics.final)
    for name, result in record.metrics.final.items():
        hypotheses, digest = read_hypotheses(hypotheses_file(honest_run / HYPOTHESES_DIR, name))
        assert digest == record.outputs.hypotheses[name]
        assert len(hypotheses) == result.num_utterances
        errors = [
            json.loads(x)
            for x in (honest_run / "errors" / f"{name}.jsonl").read_text().split("\n")
            if x
        ]
        assert {u["utt_id"] for u in errors} == set(hypotheses)
        assert "hypothesis" not in errors[0]  # the counts stay where they were
    # The tiny model transcribes something (else every check below would compare empty strings).
    assert any(h.strip() for h in hypotheses.values())


def test_an_honest_run_is_filed_and_re_scores_exactly(honest_run, tmp_path, registry, data):
    run_dir = copy_run(honest_run, tmp_path)
    accepted = submit(run_dir, tmp_path / "results", registry, data=data)
    assert not accepted.reevaluated
    folder = accepted.path.with_suffix("")
    for name in accepted.record.metrics.final:
        filed = hypotheses_file(folder / HYPOTHESES_DIR, name)
        assert filed.read_bytes() == hypotheses_file(run_dir / HYPOTHESES_DIR, name).read_bytes()
    files = load_result_files(tmp_path / "results")  # the filed folder holds no records
    assert [path for path, _, _ in files] == [accepted.path]
    report = recheck_filed(files, data)  # CI: `pflbench results rescore`
    assert report.rescored == [accepted.path]
    assert report.audio_only == []  # this machine computed the run's features
    text = render_leaderboard([r for _, r, _ in files], reevaluated=reevaluated_ids(files))
    row = next(line for line in text.splitlines() if accepted.record.record_id in line)
    assert row.endswith("| run | re-scored |")


def test_a_forged_wer_is_refused_with_the_field_and_both_values(
    honest_run, tmp_path, specs, tiny_cache_dir
):
    """Issue 21's case: every final WER lowered by 30 points and the record_id recomputed with
    compute_record_id. `pflbench submit` exits 2, names the field and both values, files nothing."""
    run_dir = copy_run(honest_run, tmp_path)
    honest = json.loads((run_dir / "record.json").read_text())["metrics"]["final"]

    def lower(raw: dict) -> None:
        for result in raw["metrics"]["final"].values():
            result["wer"] = max(0.0, result["wer"] - 0.30)

    forged = rewrite_record(run_dir, lower)["metrics"]["final"]
    load_record(run_dir / "record.json")  # a valid record: its id matches its content
    args = [
        "submit",
        str(run_dir),
        "--specs",
        str(specs),
        "--results",
        str(tmp_path / "results"),
    ]
    out = subprocess.run(
        [sys.executable, "-m", "pflbench", *args],
        capture_output=True,
        text=True,
        env={**os.environ, "PFLBENCH_CACHE": str(tiny_cache_dir)},
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    message = (  # cv-dev: the task's first eval set
        f"metrics.final.cv-dev.wer is {forged['cv-dev']['wer']!r} in the record, but re-scoring "
        f"the stored hypotheses against the eval set's references gives {honest['cv-dev']['wer']!r}"
    )
    assert message in " ".join(out.stderr.split()), out.stderr
    assert not (tmp_path / "results").exists()


def test_a_forged_final_point_of_the_history_is_refused(honest_run, tmp_path, registry, data):
    """The history's last evaluation is the final one: its WER is re-scored as well."""
    run_dir = copy_run(honest_run, tmp_path)

    def lower(raw: dict) -> None:
        history = raw["metrics"]["history"]
        i = max(range(len(history)), key=lambda k: (history[k]["step"], history[k]["eval_set"]))
        history[i]["wer"] /= 2

    history = rewrite_record(run_dir, lower)["metrics"]["history"]
    with pytest.raises(UserError, match=r"metrics.history\[\d+\].wer is .* in the record"):
        submit(run_dir, tmp_path / "results", registry, data=data)
    assert len({point["step"] for point in history}) == 2  # an intermediate evaluation, kept


def test_a_history_point_after_the_final_evaluation_is_refused(
    honest_run, tmp_path, registry, data
):
    """One eval set's true final figures at a step after the last one would make that step the
    "final" evaluation, and the other eval sets' real final points (edited) go unchecked."""
    run_dir = copy_run(honest_run, tmp_path)

    def sidestep(raw: dict) -> None:
        history = raw["metrics"]["history"]
        last = max(point["step"] for point in history)
        final = [point for point in history if point["step"] == last]
        history.append({**final[0], "step": last + 1})  # true figures, one eval set only
        final[1]["wer"] /= 2  # another eval set's final point, forged

    rewrite_record(run_dir, sidestep)
    with pytest.raises(UserError, match=r"metrics.history's last step \(\d+\) evaluates"):
        submit(run_dir, tmp_path / "results", registry, data=data)
    assert not (tmp_path / "results").exists()


def test_a_tampered_hypotheses_file_is_refused(honest_run, tmp_path, registry, data):
    run_dir = copy_run(honest_run, tmp_path)
    path = hypotheses_file(run_dir / HYPOTHESES_DIR, "cv-test")
    hypotheses, _ = read_hypotheses(path)
    first = sorted(hypotheses)[0]
    hypotheses[first] += " extra"
    lines = [json.dumps({"hypothesis": h, "utt_id": u}) for u, h in sorted(hypotheses.items())]
    path.write_bytes(gzip.compress("".join(x + "\n" for x in lines).encode()))
    with pytest.raises(UserError, match=r"cv-test.jsonl.gz: its content's sha256 .* changed"):
        submit(run_dir, tmp_path / "results", registry, data=data)
    assert not (tmp_path / "results").exists()


def perfect_transcripts(run_dir: Path, data: DataOptions, registry) -> None:
    """Replace the run's hypotheses by the references and rewrite every figure, digest and the
    record_id to match: a forgery that re-scoring cannot catch (its numbers follow from its
    hypotheses), and that only re-evaluating the checkpoint can."""
    record, raw = load_record(run_dir / "record.json")
    task = resolve(registry, TASK, "fedavg", "none", 0, []).task
    eval_data = data.eval_data(task)
    results, final = {}, {}
    for eval_set in task.eval_sets:
        refs = {u: text for u, _, text in eval_data.eval_sets[eval_set.name].references()}
        results[eval_set.name] = {
            "utterances": [{"utt_id": u, "hypothesis": t} for u, t in refs.items()]
        }
        final[eval_set.name] = rescored(eval_set, eval_data, refs, "forgery")
    digests = write_hypotheses(run_dir / HYPOTHESES_DIR, results)
    last = max(point["step"] for point in raw["metrics"]["history"])

    def forge(raw: dict) -> None:
        raw["metrics"]["final"] = {n: r.model_dump(mode="json") for n, r in final.items()}
        for point in raw["metrics"]["history"]:
            if point["step"] == last:
                point["wer"], point["cer"] = (
                    final[point["eval_set"]].wer,
                    final[point["eval_set"]].cer,
                )
        raw["outputs"]["hypotheses"] = digests

    rewrite_record(run_dir, forge)
    assert all(r.wer == 0.0 for r in final.values())


def test_verify_passes_on_the_honest_run_and_its_stamp_is_filed(
    honest_run, tmp_path, registry, data
):
    run_dir = copy_run(honest_run, tmp_path)
    stamp = verify_run(run_dir, "cpu", data)
    record, _ = load_record(run_dir / "record.json")
    assert stamp.exact and stamp.record_id == record.record_id  # the same machine: exact
    assert {n: f.wer for n, f in stamp.eval.items()} == {
        n: r.wer for n, r in record.metrics.final.items()
    }
    assert json.loads((run_dir / "verification.json").read_text())["final_model"] == (
        record.outputs.final_model
    )
    accepted = submit(run_dir, tmp_path / "results", registry, data=data)
    assert accepted.reevaluated
    stamp_file = accepted.path.with_suffix("") / "verification.json"
    assert stamp_file.read_bytes() == (run_dir / "verification.json").read_bytes()
    files = load_result_files(tmp_path / "results")
    assert recheck_filed(files, data).rescored == [accepted.path]
    text = render_leaderboard([r for _, r, _ in files], reevaluated=reevaluated_ids(files))
    assert "| run | re-evaluated |" in text
    # A filed stamp edited afterwards is caught by CI.
    edited = json.loads(stamp_file.read_text())
    edited["eval"]["cv-dev"]["wer"] /= 2
    stamp_file.write_text(json.dumps(edited))
    with pytest.raises(UserError, match=r"verification.json .*metrics.final.cv-dev.wer"):
        recheck_filed(load_result_files(tmp_path / "results"), data)
    # So is one claiming an exact comparison on another setup than the run's.
    edited["eval"]["cv-dev"]["wer"] *= 2
    edited["setup"]["torch_version"] = "made-up"
    stamp_file.write_text(json.dumps(edited))
    with pytest.raises(UserError, match="claims an exact comparison, but its setup is not"):
        recheck_filed(load_result_files(tmp_path / "results"), data)


def test_ci_refuses_a_filed_record_whose_population_is_not_its_datas(
    honest_run, tmp_path, registry, data
):
    """A filed record re-stated for 10x its users by pflbench's own statement (every ε right for
    that population; id recomputed, filed under it): `results rescore` checks the population
    against the training data."""
    accepted = submit(copy_run(honest_run, tmp_path), tmp_path / "results", registry, data=data)
    raw = json.loads(accepted.path.read_text())
    config = RunConfig.model_validate(raw["config"])
    users = raw["privacy"]["simulated"]["population"]
    raw["privacy"] = privacy_claim(config, raw["privacy"]["sigma_dp"], 10 * users)
    raw["record_id"] = compute_record_id(raw)
    forged = accepted.path.with_name(f"{raw['record_id']}.json")
    accepted.path.with_suffix("").rename(forged.with_suffix(""))
    accepted.path.unlink()
    forged.write_text(json.dumps(raw))
    with pytest.raises(UserError, match=f"simulated.population is {10 * users}, .* give {users}"):
        recheck_filed(load_result_files(tmp_path / "results"), data)


def test_ci_reports_records_it_matched_by_audio_only(honest_run, tmp_path, registry, data):
    """A record filed from another CPU (other feature digests, the same audio digests, id
    recomputed): re-scored, and counted as matched by its audio rather than passed silently."""
    accepted = submit(copy_run(honest_run, tmp_path), tmp_path / "results", registry, data=data)
    raw = json.loads(accepted.path.read_text())
    raw["data"]["digests"]["cv-test"] = "f" * 64
    raw["record_id"] = compute_record_id(raw)
    other_cpu = accepted.path.with_name(f"{raw['record_id']}.json")
    accepted.path.with_suffix("").rename(other_cpu.with_suffix(""))
    accepted.path.unlink()
    other_cpu.write_text(json.dumps(raw))
    report = recheck_filed(load_result_files(tmp_path / "results"), data)
    assert report.rescored == report.audio_only == [other_cpu]


def test_verify_fails_on_a_swapped_checkpoint(honest_run, tmp_path, registry, data):
    run_dir = copy_run(honest_run, tmp_path)
    final = run_dir / "checkpoints" / "final.safetensors"
    meta = json.loads(final.with_suffix(".json").read_text())
    seed_model = Path(meta["seed_checkpoint"])  # another checkpoint of the same architecture
    shutil.copyfile(seed_model, final)
    with pytest.raises(UserError, match="not the checkpoint the record was written from"):
        verify_run(run_dir, "cpu", data)
    # With the record's digest rewritten too, re-evaluation shows the difference.
    rewrite_record(run_dir, lambda raw: raw["outputs"].update(final_model=tensors_digest(final)))
    with pytest.raises(UserError, match="the final checkpoint re-evaluated (gives|transcribes)"):
        verify_run(run_dir, "cpu", data)
    assert not (run_dir / "verification.json").exists()


def test_verify_refuses_a_run_of_older_numerics_by_name(honest_run, tmp_path, data):
    """A run whose code decoded otherwise (numerics) cannot re-evaluate to its own transcripts:
    verify says why instead of reporting a transcript mismatch."""
    run_dir = copy_run(honest_run, tmp_path)
    older = STALE_NUMERICS
    rewrite_record(run_dir, lambda raw: raw["software"].update(numerics_version=older))
    with pytest.raises(UserError, match=f"numerics version {older}, this pflbench as"):
        verify_run(run_dir, "cpu", data)
    assert not (run_dir / "verification.json").exists()


def test_hypotheses_made_up_with_consistent_figures_pass_re_scoring_but_fail_verify(
    honest_run, tmp_path, registry, data
):
    run_dir = copy_run(honest_run, tmp_path)
    perfect_transcripts(run_dir, data, registry)
    differs = (
        r"metrics.final.cv-dev.wer is 0.0 in the record, but the final checkpoint re-evaluated"
    )
    with pytest.raises(UserError, match=differs):
        verify_run(run_dir, "cpu", data)
    submit(run_dir, tmp_path / "results", registry, data=data)  # what re-scoring alone accepts


def test_on_another_setup_verify_compares_within_the_stated_tolerance(
    honest_run, tmp_path, registry, data
):
    run_dir = copy_run(honest_run, tmp_path)
    rewrite_record(run_dir, lambda raw: raw["compute"].update(device_name="another CPU"))
    stamp = verify_run(run_dir, "cpu", data)
    assert not stamp.exact
    # A CPU's device name is its architecture only (x86_64 for Intel and AMD alike): another
    # vendor or kernel choice under the same name is another setup too.
    other_vendor = copy_run(honest_run, tmp_path / "vendor")
    rewrite_record(other_vendor, lambda raw: raw["compute"]["cpu"].update(vendor="another"))
    assert not verify_run(other_vendor, "cpu", data).exact
    record, _ = load_record(run_dir / "record.json")
    near = {
        n: EvalFigures(wer=f.wer + TOLERANCE / 2, cer=f.cer, num_utterances=f.num_utterances)
        for n, f in stamp.eval.items()
    }
    check_figures(record, near, exact=False, where="stamp")
    with pytest.raises(UserError, match="compared exactly"):
        check_figures(record, near, exact=True, where="stamp")
    far = {n: f.model_copy(update={"wer": f.wer + 2 * TOLERANCE}) for n, f in near.items()}
    with pytest.raises(UserError, match=re.escape(f"within {TOLERANCE} (another setup)")):
        check_figures(record, far, exact=False, where="stamp")
