# ruff: noqa: F811  (pytest fixtures imported from other test modules, used as arguments)
"""`pflbench results reproduce` on real runs of the tiny task: an honest filed run is re-run and
reproduces bit for bit; a no-DP model filed as a DP run passes re-scoring and verify but not a
re-run; on another setup the comparison is within the stated tolerance and still exact where
floats cannot matter; the sample is fixed by its key."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import STALE_NUMERICS
from test_results_verify import copy_run, data, registry, rewrite_record, specs  # noqa: F401
from test_run import TASK, specs_dir  # noqa: F401  (fixture)
from typer.testing import CliRunner

from pflbench.cli import app
from pflbench.errors import UserError
from pflbench.results.reproduce import (
    RERUN_TOLERANCE,
    compare_rerun,
    sample_records,
    why_not_rerunnable,
)
from pflbench.results.schema import load_record
from pflbench.results.submit import submit
from pflbench.results.verify import verify_run
from pflbench.runner import RunOptions, run
from pflbench.spec.resolve import resolve

DP_BUDGET = "eps7.2-high-pop"


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_cache_dir, tiny_task_data, registry) -> dict[str, Path]:
    """Finished perlayer-dim runs of the tiny task without and with DP, shared read-only."""
    out = tmp_path_factory.mktemp("runs")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PFLBENCH_CACHE", str(tiny_cache_dir))
        return {
            budget: run(
                resolve(registry, TASK, "perlayer-dim", budget, 0, []),
                out_dir=out / budget,
                options=RunOptions(progress=False),
            )
            for budget in ("none", DP_BUDGET)
        }


def reproduce(tmp_path: Path, specs_dir: Path, *args: str):
    """The CLI on tmp_path/results, re-running into tmp_path/re."""
    common = ["--results", str(tmp_path / "results"), "--out", str(tmp_path / "re")]
    return CliRunner().invoke(
        app, ["results", "reproduce", *args, *common, "--specs", str(specs_dir)]
    )


@pytest.fixture
def file_run(tmp_path, registry, data, monkeypatch, tiny_cache_dir):
    """Files a copy of a run folder (after `edit` of the copy) under tmp_path/results."""
    monkeypatch.setenv("PFLBENCH_CACHE", str(tiny_cache_dir))

    def file(run_dir: Path, edit=lambda copy: None):
        copy = copy_run(run_dir, tmp_path)
        edit(copy)
        return submit(copy, tmp_path / "results", registry, data=data)

    return file


def test_an_honest_filed_run_reproduces_bit_for_bit(runs, tmp_path, specs, file_run):
    accepted = file_run(runs[DP_BUDGET])
    result = reproduce(tmp_path, specs, accepted.path.stem)
    assert result.exit_code == 0, result.output
    assert "bit for bit" in result.output and "1 records reproduced" in result.output
    # The re-run itself ran with the record's thread count and is a finished run of its own.
    rerun, _ = load_record(tmp_path / "re" / accepted.path.stem / "record.json")
    assert rerun.compute.intra_op_threads == accepted.record.compute.intra_op_threads
    assert rerun.outputs == accepted.record.outputs
    # A second re-run into the same folder is refused rather than resumed or skipped.
    again = reproduce(tmp_path, specs, accepted.path.stem)
    assert again.exit_code != 0 and "exists" in str(again.exception)


def test_a_no_dp_model_filed_as_a_dp_run_passes_the_file_checks_but_not_a_re_run(
    runs, tmp_path, specs, data, file_run
):
    honest_none, _ = load_record(runs["none"] / "record.json")

    def relabel(forged: Path) -> None:
        for folder in ("checkpoints", "hypotheses"):
            shutil.rmtree(forged / folder)
            shutil.copytree(runs["none"] / folder, forged / folder)
        rewrite_record(
            forged,
            lambda raw: raw.update(
                json.loads(honest_none.model_dump_json(include={"outputs", "metrics"}))
            ),
        )
        verify_run(forged, "cpu", data)  # the checkpoint does give these hypotheses

    accepted = file_run(runs[DP_BUDGET], relabel)  # and re-scoring passes
    result = reproduce(tmp_path, specs, accepted.path.stem)
    assert "did not reproduce" in str(result.exception)
    said = " ".join(result.output.split())  # as printed, wrapped to the terminal
    assert "does not reproduce: record.outputs.final_model" in said
    assert "bit for bit (the run's own setup)" in said


def test_on_another_setup_wer_within_tolerance_and_cohorts_exactly(runs):
    filed, _ = load_record(runs[DP_BUDGET] / "record.json")
    assert compare_rerun(filed, filed, "r").exact
    elsewhere = filed.model_copy(deep=True)
    elsewhere.compute.intra_op_threads = filed.compute.intra_op_threads + 1
    elsewhere.outputs.final_model = "0" * 64  # other rounding, another model
    for result in elsewhere.metrics.final.values():
        result.wer += RERUN_TOLERANCE / 2
    comparison = compare_rerun(filed, elsewhere, "r")
    assert not comparison.exact and comparison.setup_differences[0].startswith("intra_op_threads")
    with pytest.raises(UserError, match="record.outputs.final_model"):
        compare_rerun(filed, elsewhere.model_copy(update={"compute": filed.compute}), "r")
    far = elsewhere.model_copy(deep=True)
    next(iter(far.metrics.final.values())).wer += RERUN_TOLERANCE
    with pytest.raises(UserError, match=rf"\.wer is .* WER within {RERUN_TOLERANCE}"):
        compare_rerun(filed, far, "r")
    # Cohorts are integer randomness: no setup moves them.
    resampled = elsewhere.model_copy(deep=True)
    resampled.compute.cohort_per_step = [c + 1 for c in filed.compute.cohort_per_step]
    with pytest.raises(UserError, match="compute.cohort_per_step"):
        compare_rerun(filed, resampled, "r")
    # Another CPU computes other features from the same audio: its feature digests may differ,
    # its audio digests may not.
    other_cpu = elsewhere.model_copy(deep=True)
    other_cpu.data.digests = {n: "f" * 64 for n in filed.data.digests if n != "seed_model"}
    other_cpu.data.digests["seed_model"] = filed.data.digests["seed_model"]
    assert not compare_rerun(filed, other_cpu, "r").exact
    same_setup = filed.model_copy(update={"data": other_cpu.data})  # there, features are equal
    with pytest.raises(UserError, match=r"record.data.digests.cv-dev"):
        compare_rerun(filed, same_setup, "r")
    other_audio = other_cpu.model_copy(deep=True)
    other_audio.data.audio_digests["cv-test"] = "e" * 64
    with pytest.raises(UserError, match=r"record.data.(audio_)?digests.cv-test"):
        compare_rerun(filed, other_audio, "r")
    # Another CPU's FFTs move PLD's ε in its last digits (1.2e-5 measured), not further; RDP's
    # closed form moves only by float rounding.
    for name, last, further in (("pld", 2e-5, 1e-3), ("rdp", 1e-12, 1e-5)):
        moved = {}
        for factor in (last, further):
            moved[factor] = other_cpu.model_copy(deep=True)
            moved[factor].privacy.extrapolated.epsilon[name].epsilon *= 1 + factor
        compare_rerun(filed, moved[last], "r")
        with pytest.raises(UserError, match=rf"record.privacy.extrapolated.epsilon.{name}"):
            compare_rerun(filed, moved[further], "r")
        with pytest.raises(UserError, match=rf"record.privacy.extrapolated.epsilon.{name}"):
            compare_rerun(filed, filed.model_copy(update={"privacy": moved[last].privacy}), "r")
    other_model = other_cpu.model_copy(deep=True)
    other_model.data.digests["seed_model"] = "e" * 64
    with pytest.raises(UserError, match=r"record.data.digests.seed_model"):
        compare_rerun(filed, other_model, "r")
    other_config = filed.model_copy(deep=True)
    other_config.config["recipe"]["federated"]["client"]["lr"] *= 2
    with pytest.raises(UserError, match="another config .config.recipe.federated.client.lr"):
        compare_rerun(filed, other_config, "r")


def test_the_sample_is_fixed_by_its_key_and_respects_the_wall_time_limit(runs):
    base, _ = load_record(runs["none"] / "record.json")
    records = []
    for i in range(20):
        record = base.model_copy(deep=True)
        record.record_id = f"{i:016x}"
        record.compute.wall_seconds = 10.0 * i
        records.append((Path(f"{record.record_id}.json"), record))
    first = sample_records(records, 3, "abc", None)
    assert len(first) == 3 and first == sample_records(records, 3, "abc", None)
    assert first != sample_records(records, 3, "abd", None)
    quick = sample_records(records, 20, "abc", 50.0)
    assert sorted(r.compute.wall_seconds for _, r in quick) == [0, 10, 20, 30, 40, 50]


def test_a_stale_row_is_not_re_run(runs):
    """A row of an older task version or older numerics ran another recipe or other code: neither
    a sample nor a named re-run takes it (CI's sample would fail on the resolved config)."""
    record, _ = load_record(runs["none"] / "record.json")
    version = record.task.version
    assert why_not_rerunnable(record, False, version) is None
    older_task = record.model_copy(deep=True)
    older_task.task.version = version - 1
    why = why_not_rerunnable(older_task, False, version)
    assert why == f"run on task version {version - 1}; the task is version {version} now"
    older_code = record.model_copy(deep=True)
    older_code.software.numerics_version = STALE_NUMERICS
    assert "numerics version" in why_not_rerunnable(older_code, False, version)
    assert why_not_rerunnable(older_code, False, None) is not None


def test_bad_arguments_are_refused_with_the_reason(tmp_path, specs):
    (tmp_path / "results").mkdir()
    neither = reproduce(tmp_path, specs)
    assert "give record ids or --sample N" in str(neither.exception)
    unknown = reproduce(tmp_path, specs, "0123456789abcdef")
    assert "no record with this id" in str(unknown.exception)


@pytest.mark.parametrize("started", [False, True])
def test_the_run_commands_that_sweeps_and_re_runs_build_parse_as_pflbench_run(tmp_path, started):
    """sweep and reproduce (results layer) start `python -m pflbench run ...` with option names of
    the CLI above them: each option they can emit must be one `pflbench run` accepts, with a value
    where it takes one (parsed by the real command, not run)."""
    import click
    import typer

    from pflbench.results.sweep import PlannedRun

    run_dir = tmp_path / "run"
    if started:
        run_dir.mkdir()
        (run_dir / "config.json").write_text("{}")  # begun, not DONE: --resume
    options = ("--no-progress", "--device", "cpu", "--nproc", "2", "--parallel-clients", "4")
    options += ("--compile", "--specs", str(tmp_path), "--plugin", "x.py", "--data-root", "d")
    planned = PlannedRun(
        task="t", baseline="b", budget="none", seed=3, sets=("federated.cohort_size=8",),
        run_dir=run_dir, run_args=options,
    )  # fmt: skip
    command = planned.command()
    assert command[1:4] == ["-m", "pflbench", "run"]
    group = typer.main.get_command(app)
    run_command = group.get_command(click.Context(group), "run")
    params = run_command.make_context("run", command[4:]).params
    assert (params["task"], params["baseline"], params["seed"]) == ("t", "b", 3)
    assert params["resume" if started else "out"] == run_dir
    assert params["parallel_clients"] == 4 and params["compile_step"] and params["nproc"] == 2


def test_a_run_no_numerics_change_since_touches_is_re_run_bit_for_bit(runs):
    """A v3 run without DP has today's numbers (numerics v4 touches DP runs only): its re-run by
    today's code is held to the same setup, so compared bit for bit, not within tolerance."""
    from pflbench.results.reproduce import run_setup

    record, _ = load_record(runs["none"] / "record.json")
    assert not record.privacy.dp
    older = record.model_copy(deep=True)
    older.software.numerics_version = 3
    assert run_setup(older) == run_setup(record)
    older_dp = older.model_copy(deep=True)
    older_dp.privacy.dp = True
    assert run_setup(older_dp)["numerics_version"] == 3 != run_setup(record)["numerics_version"]
