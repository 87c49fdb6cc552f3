"""`pflbench run` end to end on the tiny synthetic corpora: every baseline writes a valid record,
kill-and-resume ends in the same model, a NaN client is zeroed and counted, bad input fails fast."""

import dataclasses
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from opacus.accountants import RDPAccountant
from safetensors.torch import load_file
from typer.testing import CliRunner

from pflbench.checkpoint import ELAPSED, latest_checkpoint, load_checkpoint, save_checkpoint
from pflbench.cli import app
from pflbench.errors import UserError
from pflbench.fl.distributed import DistContext
from pflbench.fl.simulator import Simulator
from pflbench.model.transformer import build_model
from pflbench.numerics import NUMERIC_PACKAGES, NUMERICS_VERSION
from pflbench.privacy.run import check_run_privacy, epsilon_so_far, privacy_claim
from pflbench.results.schema import compute_record_id, load_record
from pflbench.runner import RunOptions, run
from pflbench.spec.models import Recipe
from pflbench.spec.registry import load_registry
from pflbench.spec.resolve import resolve

TASK = "synth-tiny-test"
REFERENCE_ROWS = ("seed-only", "central")  # no federated training
BASELINE_FILES = sorted((Path(__file__).parents[1] / "baselines").glob("*.yaml"))
# Example-level DP-SGD (no federated training; example-level budgets): tests/test_dpsgd.py.
EXAMPLE_LEVEL = tuple(
    p.stem
    for p in BASELINE_FILES
    if yaml.safe_load(p.read_text())["overrides"].get("training") == "dpsgd-example"
)
BASELINES = [p.stem for p in BASELINE_FILES if p.stem not in REFERENCE_ROWS + EXAMPLE_LEVEL]
RECIPE = {
    "model": {"preset": "tiny"},
    "central": {"optimizer": "adam", "lr": 0.002, "steps": 5, "batch_seconds": 20.0},
    "fine_tune": {"optimizer": "adam", "lr": 0.002, "steps": 3, "batch_seconds": 20.0},
    "federated": {
        "central_steps": 3,
        "cohort_size": 4,
        "client": {"local_steps": 1, "batch_seconds": 10.0},
        "eval_every": 2,
    },
}


@pytest.fixture(scope="session")
def specs_dir(tmp_path_factory, tiny_task) -> Path:
    root = tmp_path_factory.mktemp("specs")
    (root / "tasks").mkdir()
    task = tiny_task.model_dump(mode="json", exclude_none=True) | {"recipe": RECIPE}
    (root / "tasks" / f"{TASK}.yaml").write_text(yaml.safe_dump(task))
    return root


@pytest.fixture
def env(monkeypatch, tiny_cache_dir, tiny_task_data, specs_dir) -> Path:
    monkeypatch.setenv("PFLBENCH_CACHE", str(tiny_cache_dir))
    return specs_dir


def _config(specs: Path, baseline: str, budget: str = "none", sets=None):
    return resolve(load_registry([specs]), TASK, baseline, budget, 0, sets or [])


@pytest.mark.parametrize("baseline", BASELINES)
def test_each_baseline_writes_a_valid_record(env, tmp_path, baseline):
    budget = "none" if baseline == "fedavg" else "eps7.2-high-pop"
    # BandMF draws each step from one of b groups: 8 need 8·S users, the tiny corpus has 12. (At
    # q_b = 2·4/12 the PLD ε of the simulated scale, ~6e9, takes minutes; at 2·2/12 it is above
    # what PLD computes and is skipped at once.)
    sets = ["privacy.mechanism_options.bands=2", "federated.cohort_size=2"]
    sets = sets if baseline.startswith("bandmf") else []
    run_dir = run(
        _config(env, baseline, budget, sets),
        out_dir=tmp_path / "run",
        options=RunOptions(progress=False),
    )
    record, _ = load_record(run_dir / "record.json")
    assert (run_dir / "DONE").is_file() and record.kind == "run" and record.baseline == baseline
    assert set(record.metrics.final) == {"cv-dev", "cv-test", "ls-dev-clean"}
    assert record.metrics.seed_model is not None
    assert {h.step for h in record.metrics.history} == {2, 3}
    assert record.privacy.dp == (budget != "none")
    # What an algorithm sends beside Δ is named in the privacy statement.
    assert (record.privacy.payload is not None) == (baseline == "scaffold")
    # Users' state (SCAFFOLD's control variates) is for resuming: none is left once the run ends.
    assert not (run_dir / "user-state").exists()
    assert record.compute.central_steps == 3 and record.diagnostics.nonfinite_updates == 0
    assert re.fullmatch(r"[0-9a-f]{64}", record.data.digests["seed_model"])  # starting weights
    assert set(record.data.audio_digests) == set(record.data.digests) - {"seed_model"}
    assert record.compute.intra_op_threads >= 1 and record.compute.compile_backend is None
    # what else decides the numbers: package versions, the CPU and the kernels torch picked
    assert set(NUMERIC_PACKAGES) | {"libsndfile", "libespeak-ng"} <= set(record.software.packages)
    assert record.software.packages["numpy"] == np.__version__
    assert record.compute.cpu.aten_capability == torch.backends.cpu.get_cpu_capability()
    expected_groups = {"cv-test": {"age", "gender", "accent"}, "ls-dev-clean": {"gender"}}
    for name, attributes in expected_groups.items():
        result = record.metrics.final[name]
        assert set(result.groups) == attributes  # the corpus's speaker attributes, each >= 2 groups
        assert all(len(groups) >= 2 for groups in result.groups.values())
    assert record.diagnostics.private is False
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines if "loss" in x] == [0, 1, 2]
    # the realized cohort of every step (Poisson: it varies around the expected cohort)
    assert record.compute.cohort_per_step == [x["clients"] for x in lines if "loss" in x]
    assert all(x["diagnostics"]["private"] is False for x in lines if "loss" in x)
    epsilons = [x["epsilon_rdp"] for x in lines if "loss" in x]
    if budget != "none":
        assert 0 < epsilons[0] < epsilons[1] < epsilons[2]
        # the running ε is the claim's RDP ε at the simulated scale, reached at the last step
        assert epsilons[-1] == pytest.approx(record.privacy.simulated.epsilon["rdp"].epsilon)
    else:
        assert epsilons == [None, None, None]


@pytest.mark.parametrize("population, sigma_dp", [(100, 0.1), (1000, 0.05)])
def test_the_running_epsilon_is_rdp_at_the_simulated_scale_after_each_step(population, sigma_dp):
    """metrics.jsonl's ε after t steps: opacus' RDP accountant at z = σ_DP·S, q = S/K, t steps
    (ε of moderate size, where a wrong K, S or t shows), and at the last step the record's."""
    config = resolve(
        load_registry(), "synth-cv-en-ls-seed", "perlayer-dim", "eps7.2-synth-m-cohort-matched"
    )
    cohort, steps = config.recipe.federated.cohort_size, config.recipe.federated.central_steps
    for t in (1, 30, steps):
        theirs = RDPAccountant()
        theirs.history = [(sigma_dp * cohort, cohort / population, t)]
        expected = theirs.get_epsilon(delta=config.budget.delta)
        assert epsilon_so_far(config, sigma_dp, population, t) == pytest.approx(expected, rel=1e-9)
    claim = privacy_claim(config, sigma_dp, population, ["rdp"])
    assert claim["simulated"]["epsilon"]["rdp"]["epsilon"] == pytest.approx(expected, rel=1e-9)
    assert epsilon_so_far(config, 0.0, population, steps) is None


def test_a_dp_budget_refuses_fixed_size_cohorts_before_training(env, tmp_path):
    """Fixed cohorts (and so client-side noise, which needs them) are not what the accountants
    analyse: `run` refuses them under a DP budget before any step, and runs them without one."""
    for sets in (["federated.sampling=fixed"],
                 ["federated.sampling=fixed", "privacy.noise_placement=client"]):  # fmt: skip
        config = _config(env, "perlayer-dim", "eps7.2-high-pop", sets)
        with pytest.raises(UserError, match="fixed-size cohorts under DP budget"):
            run(config, out_dir=tmp_path / "dp", options=RunOptions(progress=False))
        assert not (tmp_path / "dp").exists()
    check_run_privacy(_config(env, "perlayer-dim", "none", ["federated.sampling=fixed"]))


def test_bad_mechanism_options_name_the_task_and_baseline(env):
    config = _config(env, "perlayer-dim", "eps7.2-high-pop", ["privacy.mechanism_options.bands=2"])
    with pytest.raises(UserError, match=f"task '{TASK}', baseline 'perlayer-dim': "
                       "privacy.mechanism_options of 'gaussian'(.|\n)*bands"):  # fmt: skip
        check_run_privacy(config)


@pytest.mark.parametrize("baseline", REFERENCE_ROWS)
def test_reference_rows_run_without_fl_and_refuse_dp_budgets(env, tmp_path, baseline):
    with pytest.raises(UserError, match="non-private reference row"):
        run(
            _config(env, baseline, "eps7.2-high-pop"),
            out_dir=tmp_path / "dp",
            options=RunOptions(progress=False),
        )
    run_dir = run(
        _config(env, baseline), out_dir=tmp_path / "run", options=RunOptions(progress=False)
    )
    record, _ = load_record(run_dir / "record.json")
    final, seed = record.metrics.final, record.metrics.seed_model
    assert set(final) == {"cv-dev", "cv-test", "ls-dev-clean"}
    assert record.privacy.dp is False and record.compute.central_steps == 0
    model = load_file(run_dir / "checkpoints" / "final.safetensors")
    # The seed model's evaluation is cached next to it and shared by every run of the task.
    meta = json.loads((run_dir / "checkpoints" / "final.json").read_text())
    cached = list(Path(meta["seed_checkpoint"]).parent.glob("eval-*.json"))
    assert len(cached) == 1
    assert json.loads(cached[0].read_text())["cv-dev"]["wer"] == seed["cv-dev"].wer
    if baseline == "seed-only":  # the seed model itself, summarized alike
        assert all(final[n] == seed[n] for n in final)
        assert all(seed[n].speaker_wer_p50 is not None for n in seed)
    else:  # three Adam steps on the federated data move the model and its errors
        seed_model = load_file(meta["seed_checkpoint"])
        assert any(not torch.equal(model[k], seed_model[k]) for k in model)


def test_layerfreeze_leaves_the_frozen_tensors_bitwise_equal(env, tmp_path):
    config = _config(env, "layerfreeze", "eps7.2-high-pop")
    run_dir = run(
        config, out_dir=tmp_path / "run", options=RunOptions(progress=False, checkpoint_every=1)
    )
    trained = set(load_checkpoint(latest_checkpoint(run_dir / "checkpoints", "step"))[1]["trained"])
    final, meta = load_checkpoint(run_dir / "checkpoints" / "final.safetensors")
    seed, _ = load_checkpoint(Path(meta["seed_checkpoint"]))
    params = {n for n, _ in build_model("tiny", 30).named_parameters()}
    frozen = params - trained
    assert trained < params and frozen  # train: bottom 1% leaves most tensors frozen
    assert all(torch.equal(final[n], seed[n]) for n in frozen)
    assert all(not torch.equal(final[n], seed[n]) for n in trained)


def test_server_adam_and_sgd_apply_their_rules_to_the_same_update(env, tmp_path):
    """One central step from the same seed model and cohort: server-sgd moves θ by −1.6·g,
    server-adam (first step, bias-corrected) by −0.006·g/(|g| + 1e-8), as the baselines say."""
    final = {}
    for baseline in ("server-sgd", "server-adam"):
        config = _config(env, baseline, sets=["federated.central_steps=1"])
        run_dir = run(config, out_dir=tmp_path / baseline, options=RunOptions(progress=False))
        final[baseline], meta = load_checkpoint(run_dir / "checkpoints" / "final.safetensors")
    seed, _ = load_checkpoint(Path(meta["seed_checkpoint"]))
    checked = 0
    for name, theta0 in seed.items():
        if name not in final["server-sgd"] or not theta0.is_floating_point():
            continue
        g = (theta0 - final["server-sgd"][name]) / 1.6
        expected = theta0 - 0.006 * g / (g.abs() + 1e-8)
        # g recovered from float32 θ is off by up to ~1e-7; where |g| ≥ 100·eps, Adam's first
        # step is ≈ ±0.006 and moves by < 1e-5 with that rounding.
        mask = g.abs() > 1e-6
        torch.testing.assert_close(
            final["server-adam"][name][mask], expected[mask], rtol=0, atol=1e-5
        )
        checked += int(mask.sum())
    assert checked > 0.5 * sum(t.numel() for t in seed.values() if t.is_floating_point())


def tensorboard_scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """(step, value) per tag, as TensorBoard itself reads the event files (purges included)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_mirrors_the_metrics_log(env, tmp_path):
    run_dir = run(_config(env, "perlayer-dim", "eps7.2-high-pop"), out_dir=tmp_path / "run",
                  options=RunOptions(progress=False))  # fmt: skip
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    scalars = tensorboard_scalars(run_dir)
    training = [x for x in lines if "loss" in x]
    # TensorBoard's x axis counts steps done: training line k is drawn at k + 1.
    assert scalars["train/loss"] == [(x["step"] + 1, pytest.approx(x["loss"])) for x in training]
    assert [v for _, v in scalars["privacy/epsilon_rdp"]] == pytest.approx(
        [x["epsilon_rdp"] for x in training]
    )
    evals = [(x["step"], x["eval"]["cv-dev"]["wer"]) for x in lines if "eval" in x]
    assert scalars["eval/cv-dev/wer"] == [(s, pytest.approx(w)) for s, w in evals]
    assert "eval/cv-test/cer" in scalars and "diagnostics/clipped_fraction" in scalars
    layer_tags = [t for t in scalars if t.startswith("layer_norm_mean/")]
    assert len(layer_tags) == len(training[0]["diagnostics"]["layer_norm_mean"])


def test_without_tensorboard_the_run_still_logs_jsonl(env, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as if not installed
    run_dir = run(
        _config(env, "perlayer-dim"), out_dir=tmp_path / "run", options=RunOptions(progress=False)
    )
    assert not (run_dir / "tensorboard").exists()
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 3 + 2


def test_parallel_clients_give_the_same_run_to_float_tolerance(env, tmp_path):
    config = _config(env, "perlayer-dim", "eps7.2-high-pop")
    one = run(config, out_dir=tmp_path / "one", options=RunOptions(progress=False))
    grouped = run(
        config, out_dir=tmp_path / "grouped", options=RunOptions(progress=False, parallel_clients=3)
    )
    record, _ = load_record(grouped / "record.json")
    assert record.compute.parallel_clients == 3
    a = load_file(one / "checkpoints" / "final.safetensors")
    b = load_file(grouped / "checkpoints" / "final.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-3, atol=1e-5)


def test_resuming_on_another_thread_count_or_device_is_refused(env, tmp_path, monkeypatch):
    """CPU kernels split their sums by the thread count, and a CUDA generator draws other
    numbers: a run resumed on either would not continue the computation its record claims."""
    threads = torch.get_num_threads()
    config = _config(env, "perlayer-dim")
    stopped = RunOptions(progress=False, checkpoint_every=1, stop_after=1)
    try:
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        run_dir = run(config, out_dir=tmp_path / "r", options=stopped)
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        with pytest.raises(UserError, match="cpu threads 1, this process has 2"):
            run(config, out_dir=run_dir, resume=True, options=RunOptions(progress=False))
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        path = latest_checkpoint(run_dir / "checkpoints", "step")
        tensors, meta = load_checkpoint(path)
        save_checkpoint(path, tensors, meta | {"setup": meta["setup"] | {"device": "cuda"}})
        with pytest.raises(UserError, match="device cuda, this process has cpu"):
            run(config, out_dir=run_dir, resume=True, options=RunOptions(progress=False))
        # Code whose numbers have changed since (numerics) would finish another computation.
        save_checkpoint(path, tensors, meta | {"numerics": meta["numerics"] - 1})
        with pytest.raises(UserError, match="began under code of numerics version"):
            run(config, out_dir=run_dir, resume=True, options=RunOptions(progress=False))
        save_checkpoint(path, tensors, meta)
        run(config, out_dir=run_dir, resume=True, options=RunOptions(progress=False))
        assert (run_dir / "DONE").exists()
    finally:
        torch.set_num_threads(threads)


def test_the_seed_models_cached_summary_is_kept_per_numerics_version(
    env, tmp_path, tiny_task_data, monkeypatch
):
    """Runs share the seed model's evaluation (cached beside it). Another numerics version scores
    hypotheses otherwise, so its runs must not take this one's summary: the cache used to be keyed
    by the eval data alone, and numerics v3's records filed v2's seed-model CER."""
    import pflbench.evaluate as evaluate

    config = _config(env, "perlayer-dim")
    seed_path = tmp_path / "seed.safetensors"
    model = build_model("tiny", tiny_task_data.tokenizer.size)
    first = evaluate.seed_model_summary(model, tiny_task_data, config, "cpu", seed_path)
    (cache,) = tmp_path.glob("eval-*.json")
    marked = json.loads(json.dumps({**first, "marker": True}))  # returned as it is stored
    cache.write_text(json.dumps(marked))
    again = evaluate.seed_model_summary(model, tiny_task_data, config, "cpu", seed_path)
    assert again == marked
    # raising=False: without the key the patched name changes nothing and the assert below fails
    monkeypatch.setattr(evaluate, "NUMERICS_VERSION", NUMERICS_VERSION + 1, raising=False)
    other = evaluate.seed_model_summary(model, tiny_task_data, config, "cpu", seed_path)
    assert other == first and len(list(tmp_path.glob("eval-*.json"))) == 2


def stop_and_resume(config, run_dir: Path) -> Path:
    """Run `config` to 2 steps (a killed process), resume it to the end; checks that the
    record's wall time is the first process's time up to its last checkpoint plus the whole
    second process."""
    stopped = RunOptions(progress=False, checkpoint_every=1, stop_after=2)
    run(config, out_dir=run_dir, options=stopped)
    assert not (run_dir / "DONE").exists()
    _, meta = load_checkpoint(latest_checkpoint(run_dir / "checkpoints", "step"))
    first = meta[ELAPSED]
    started = time.perf_counter()
    run(config, out_dir=run_dir, resume=True, options=RunOptions(progress=False))
    second = time.perf_counter() - started
    record, _ = load_record(run_dir / "record.json")
    assert 0 < first < record.compute.wall_seconds <= first + second
    return run_dir


def test_a_resumed_run_s_wall_time_counts_every_process(env, tmp_path):
    stop_and_resume(_config(env, "perlayer-dim"), tmp_path / "r")


def test_resuming_with_other_parallel_clients_is_refused(env, tmp_path):
    config = _config(env, "perlayer-dim")
    run_dir = run(
        config,
        out_dir=tmp_path / "r",
        options=RunOptions(progress=False, checkpoint_every=1, stop_after=2),
    )
    with pytest.raises(UserError, match="--parallel-clients 1"):
        run(
            config,
            out_dir=run_dir,
            resume=True,
            options=RunOptions(progress=False, parallel_clients=2),
        )


@pytest.mark.parametrize("baseline", ["perlayer-dim", "central"])
def test_resuming_on_other_inputs_is_refused(env, tmp_path, baseline):
    """A checkpoint carries the digests of the data and starting weights (the record's) and of
    the plug-ins; a plug-in loaded only for the resume is another input: refused, naming it.
    Central fine-tuning's checkpoints too (they carried none of it: a resumed central row
    could mix two runs), and it stops where told as federated training does."""
    from pflbench import plugins

    config = _config(env, baseline)
    stopped = RunOptions(progress=False, checkpoint_every=1, stop_after=2)
    run_dir = run(config, out_dir=tmp_path / "r", options=stopped)
    assert not (run_dir / "DONE").exists()
    prefix = "central" if baseline == "central" else "step"
    _, meta = load_checkpoint(latest_checkpoint(run_dir / "checkpoints", prefix))
    assert meta["step"] == 2
    helper = tmp_path / "extra_sgd.py"
    helper.write_text(
        "from pflbench.fl.server_optimizers import SERVER_OPTIMIZERS as S\n"
        "S.register('extra-sgd', S['sgd'])\n"
    )
    saved = dict(plugins._loaded)
    plugins.load_plugin(str(helper))
    try:
        with pytest.raises(UserError, match="began on other inputs .*plugins extra_sgd changed"):
            run(config, out_dir=run_dir, resume=True, options=RunOptions(progress=False))
    finally:
        plugins._loaded.clear()
        plugins._loaded.update(saved)
        dict.pop(plugins.SERVER_OPTIMIZERS, "extra-sgd")
        plugins.SERVER_OPTIMIZERS.origins.pop("extra-sgd")  # (a later test lists the plug-ins')
    run(config, out_dir=run_dir, resume=True, options=RunOptions(progress=False))
    record, raw = load_record(run_dir / "record.json")
    assert meta["inputs"] == {"data": record.data.digests, "plugins": {}}
    # What preparation skipped is on the terminal too, not only in the record.
    from pflbench.cli.run import run_summary

    assert not [line for line in run_summary(run_dir) if "skipped" in line]
    raw["data"]["skipped"]["cv-test"] = {
        "counts": {"truncated_audio": 2, "malformed_tsv_row": 1},
        "examples": {"truncated_audio": ["clip_7"], "malformed_tsv_row": ["line 9"]},
    }
    raw["record_id"] = compute_record_id(raw)
    (run_dir / "record.json").write_text(json.dumps(raw))
    expected = (
        "data cv-test: skipped 3 (malformed_tsv_row 1, e.g. line 9; truncated_audio 2, e.g. "
        "clip_7) (all in the record's data.skipped)"
    )
    assert expected in run_summary(run_dir)


def test_a_recipe_naming_an_unknown_method_is_refused_before_anything_is_written(env, tmp_path):
    config = _config(env, "perlayer-dim", sets=["federated.server.optimizer=yogi-typo"])
    with pytest.raises(UserError, match="baseline 'perlayer-dim' \\+ --set: unknown server "
                       "optimizer 'yogi-typo'; known: lamb"):  # fmt: skip
        run(config, out_dir=tmp_path / "r", options=RunOptions(progress=False))
    config = _config(env, "perlayer-dim", sets=["federated.client.fedprox_mu=0.1"])
    with pytest.raises(UserError, match="baseline 'perlayer-dim' \\+ --set: client algorithm "
                       "'fedavg' does not use fedprox_mu"):  # fmt: skip
        run(config, out_dir=tmp_path / "r", options=RunOptions(progress=False))
    assert not (tmp_path / "r").exists()


def test_a_compiled_run_says_so_and_resumes_only_compiled(env, tmp_path):
    config = _config(env, "perlayer-dim")
    compiled = RunOptions(progress=False, checkpoint_every=1, compile_backend="aot_eager")
    run_dir = run(config, out_dir=tmp_path / "r",
                  options=dataclasses.replace(compiled, stop_after=1))  # fmt: skip
    with pytest.raises(UserError, match="local step aot_eager; .* not eager"):
        run(config, out_dir=run_dir, resume=True, options=RunOptions(progress=False))
    args = ["run", "--task", TASK, "--baseline", "perlayer-dim", "--specs", str(env),
            "--resume", str(run_dir), "--compile"]  # fmt: skip
    result = CliRunner().invoke(app, args)
    # `pflbench` prints a UserError without a traceback and exits 2
    assert isinstance(result.exception, UserError) and "not inductor" in str(result.exception)
    run(config, out_dir=run_dir, resume=True, options=compiled)
    record, _ = load_record(run_dir / "record.json")
    assert record.compute.compile_backend == "aot_eager" and record.compute.central_steps == 3


def test_fedavg_under_a_dp_budget_is_refused(env, tmp_path):
    with pytest.raises(UserError, match="does not clip"):
        run(
            _config(env, "fedavg", "eps7.2-high-pop"),
            out_dir=tmp_path / "r",
            options=RunOptions(progress=False),
        )


def _cli(*args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "pflbench", "run", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kw,
    )


def test_cli_run_in_a_pipe_prints_progress_lines_and_a_summary(env, tmp_path):
    args = ["run", "--task", TASK, "--baseline", "perlayer-dim", "--budget", "eps7.2-high-pop",
            "--specs", str(env), "--out", str(tmp_path / "run")]  # fmt: skip
    result = CliRunner().invoke(app, args)  # stdout is not a terminal here
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert any(line.startswith("federated  3/3 (100%)  elapsed") for line in lines)
    assert not any("…" in line for line in lines)  # no bar cut to the width
    record, _ = load_record(tmp_path / "run" / "record.json")
    wer = 100 * record.metrics.final["cv-dev"].wer
    seed_wer = 100 * record.metrics.seed_model["cv-dev"].wer
    assert any(line.startswith("cv-dev") and f"{wer:.1f} /" in line and f"({seed_wer:.1f} /" in line
               for line in lines)  # fmt: skip
    rdp = record.privacy.extrapolated.epsilon["rdp"].epsilon
    assert any("extrapolated scale" in line and f"rdp {rdp:.3g}" in line for line in lines)
    assert any("simulated scale" in line for line in lines)
    assert any(line.startswith("wall time: ") for line in lines)
    assert lines[-2:] == [f"run directory: {tmp_path / 'run'}",
                          f"result record: {tmp_path / 'run' / 'record.json'}"]  # fmt: skip


def test_real_task_without_corpora_fails_fast(tmp_path):
    args = ["run", "--task", "cv-en-ls100-seed", "--baseline", "perlayer-dim",
            "--data-root", str(tmp_path), "--out", str(tmp_path / "run")]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert isinstance(result.exception, UserError), result.output
    assert "synth" in str(result.exception)


@pytest.mark.slow
def test_a_run_with_more_steps_than_its_budget_is_refused_before_it_starts(tmp_path):
    """eps7.2-high-pop is calibrated for T = 2,034 steps: at 3,000 its ε would be 7.70."""
    args = ["run", "--task", "synth-cv-en-ls-seed", "--baseline", "perlayer-dim",
            "--budget", "eps7.2-high-pop", "--set", "federated.central_steps=3000",
            "--data-root", str(tmp_path), "--out", str(tmp_path / "run")]  # fmt: skip
    result = CliRunner().invoke(app, args)  # a UserError: the installed command exits 2
    assert isinstance(result.exception, UserError), result.output
    err = str(result.exception)
    assert "3000 central steps" in err and "T = 2034" in err and "7.70" in err
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_kill_and_resume_ends_in_the_same_model(env, tmp_path):
    sets = ["federated.central_steps=4", "federated.eval_every=100"]
    args = ["--task", TASK, "--baseline", "perlayer-dim", "--budget", "eps7.2-high-pop",
            "--specs", str(env), "--no-progress", "--checkpoint-every", "2"]  # fmt: skip
    for s in sets:
        args += ["--set", s]
    killed = tmp_path / "killed"
    proc = _cli(*args, "--out", str(killed), env={**os.environ})
    deadline = time.monotonic() + 120
    while not (killed / "checkpoints" / "step-0000002.json").exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (killed / "DONE").exists()
    resumed = _cli(*args, "--resume", str(killed), env={**os.environ})
    assert resumed.wait(timeout=300) == 0, resumed.communicate()

    straight = run(_config(env, "perlayer-dim", "eps7.2-high-pop", sets),
                   out_dir=tmp_path / "straight", options=RunOptions(progress=False))  # fmt: skip
    a = load_file(killed / "checkpoints" / "final.safetensors")
    b = load_file(straight / "checkpoints" / "final.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    lines = [json.loads(x) for x in (killed / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines if "loss" in x] == list(range(4))
    # TensorBoard purged the killed run's events after the checkpoint: each step once.
    assert [step for step, _ in tensorboard_scalars(killed)["train/loss"]] == list(range(1, 5))


class CorruptUser:
    """The real federated store, with one utterance of one user turned into NaN features."""

    def __init__(self, store, user: str):
        self.store, self.user = store, user
        self.users, self.user_seconds = store.users, store.user_seconds
        self.user_num_utterances = store.user_num_utterances

    def load_user(self, user: str):
        utterances = self.store.load_user(user)
        if user == self.user:
            utterances[0].feats[:] = float("nan")
        return utterances


def test_nan_client_is_zeroed_counted_and_does_not_poison_the_model(tiny_task_data):
    store = tiny_task_data.federated_train
    users = sorted(store.users())
    recipe = Recipe.model_validate(
        {
            "federated": {
                "cohort_size": len(users),
                "sampling": "fixed",
                "client": {"local_steps": 1, "batch_seconds": 20.0},
            }
        }  # fmt: skip
    )
    torch.manual_seed(0)
    model = build_model("tiny", tiny_task_data.tokenizer.size)
    sim = Simulator(model, CorruptUser(store, users[0]), recipe, 1e-3, 0, "cpu", DistContext())
    stats = sim.run_step()
    assert stats["nonfinite_updates"] == 1 and stats["clients"] == len(users)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert stats["loss"] == stats["loss"]  # the NaN client's loss is left out of the mean


def test_a_bandmf_simulator_resumed_mid_band_ends_in_the_same_model(tiny_task_data, tmp_path):
    """The correlated noise's history is part of the simulator's state (as the checkpoints hold
    it): resumed after one step, one of the band's two past noise vectors, the run continues bit
    for bit (Fault caught: a history left out of the simulator's state)."""
    store = tiny_task_data.federated_train
    recipe = Recipe.model_validate(
        {
            "federated": {"cohort_size": 3, "client": {"local_steps": 1, "batch_seconds": 10.0}},
            "privacy": {"mechanism": "bandmf", "mechanism_options": {"bands": 3}},
        }
    )

    def simulator(folder: str) -> Simulator:
        torch.manual_seed(0)
        model = build_model("tiny", tiny_task_data.tokenizer.size)
        return Simulator(model, store, recipe, 1e-2, 0, "cpu", DistContext(),
                         user_state_dir=tmp_path / folder)  # fmt: skip

    straight, first = simulator("straight"), simulator("first")
    for _ in range(3):
        straight.run_step()
    first.run_step()
    state = first.state_dict()
    assert int(state["mechanism.next_step"]) == 1
    assert any(k.startswith("mechanism.history.0.") for k in state)
    assert not any(k.startswith("mechanism.history.1.") for k in state)
    resumed = simulator("resumed")
    resumed.load_state_dict({k: v.clone() for k, v in state.items()})
    resumed.run_step()
    resumed.run_step()
    a, b = resumed.model.state_dict(), straight.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_rerunning_a_finished_run_reports_it_and_an_unfinished_one_needs_resume(tmp_path):
    from pflbench.errors import UserError
    from pflbench.rundir import config_to_continue, prepare_run_dir
    from pflbench.spec.registry import load_registry
    from pflbench.spec.resolve import resolve

    reg = load_registry()
    config = resolve(reg, "synth-cv-en-ls-seed", "perlayer-dim", "none", 0)
    other = resolve(reg, "synth-cv-en-ls-seed", "perlayer-dim", "none", 1)
    run_dir = tmp_path / "run"
    prepare_run_dir(config, run_dir, resume=False)
    with pytest.raises(UserError, match="unfinished run"):
        prepare_run_dir(config, run_dir, resume=False)
    (run_dir / "DONE").write_text("done\n")
    prepare_run_dir(config, run_dir, resume=False)  # the same finished run: accepted
    with pytest.raises(UserError, match="differs"):
        prepare_run_dir(other, run_dir, resume=False)
    a_file = tmp_path / "notes.txt"
    a_file.write_text("")
    with pytest.raises(UserError, match="notes.txt: a file, not a run directory"):
        prepare_run_dir(config, a_file, resume=False)
    # The baseline reworded since the run began: the same run, which keeps its own config.
    reworded = config.model_copy(
        update={"baseline": config.baseline.model_copy(update={"description": "reworded"})}
    )
    for done in (True, False):  # a rerun of a finished run; a resume of an unfinished one
        (run_dir / "DONE").unlink(missing_ok=True)
        if done:
            (run_dir / "DONE").write_text("done\n")
        prepare_run_dir(reworded, run_dir, resume=not done)
        assert config_to_continue(reworded, run_dir) == config
    assert config_to_continue(config, run_dir) is config


def test_per_utterance_errors_and_speaker_counts_feed_pflbench_compare(env, tmp_path):
    from typer.testing import CliRunner

    from pflbench.cli import app

    seed_only = run(
        _config(env, "seed-only"),
        out_dir=tmp_path / "seed-only",
        options=RunOptions(progress=False),
    )
    central = run(
        _config(env, "central"), out_dir=tmp_path / "central", options=RunOptions(progress=False)
    )
    record, _ = load_record(central / "record.json")
    for name, result in record.metrics.final.items():
        lines = (central / "errors" / f"{name}.jsonl").read_text().splitlines()
        utterances = [json.loads(x) for x in lines]
        assert len(utterances) == result.num_utterances
        by_speaker: dict[str, list[int]] = {}
        for u in utterances:
            counts = by_speaker.setdefault(u["speaker"], [0, 0])
            counts[0] += u["word_errors"]
            counts[1] += u["words"]
            assert 0 <= u["char_errors"] and u["chars"] >= u["words"]
        assert {s: tuple(c) for s, c in by_speaker.items()} == result.speakers
        speaker_wers = sorted(e / n for e, n in by_speaker.values() if n)
        assert result.speaker_wer_p10 == speaker_wers[round(0.1 * (len(speaker_wers) - 1))]
        assert result.speaker_wer_p90 == speaker_wers[round(0.9 * (len(speaker_wers) - 1))]
        assert result.speaker_wer_p10 <= result.speaker_wer_p50 <= result.speaker_wer_p90
        errors = sum(u["word_errors"] for u in utterances)
        assert errors / sum(u["words"] for u in utterances) == pytest.approx(result.wer)

    def compare(a: Path, b: Path) -> list[dict]:
        out = CliRunner().invoke(app, ["compare", str(a), str(b), "--replicates", "200", "--json"])
        assert out.exit_code == 0, out.output
        return json.loads(out.stdout)  # notes go to stderr

    seed_record, _ = load_record(seed_only / "record.json")
    for c in compare(central, seed_only):
        wer_a, wer_b = (
            record.metrics.final[c["eval_set"]].wer,
            seed_record.metrics.final[c["eval_set"]].wer,
        )
        assert c["difference"] == pytest.approx(wer_a - wer_b)
        assert c["ci95"][0] <= c["difference"] <= c["ci95"][1]
    assert not any(c["beyond_noise"] for c in compare(seed_only, seed_only))
    refused = CliRunner().invoke(app, ["compare", str(central), str(tmp_path / "nothing")])
    assert isinstance(refused.exception, UserError)
    assert "no such file or folder" in str(refused.exception)


def test_pflbench_seed_ships_its_model_and_runs_start_from_it(env, tmp_path, monkeypatch):
    import pflbench.central as central

    monkeypatch.setattr(central, "shipped_seed_dir", lambda: tmp_path / "seed-models")

    def seed(*extra: str) -> str:
        out = CliRunner().invoke(app, ["seed", "--task", TASK, "--specs", str(env), *extra])
        assert out.exit_code == 0, out.output
        return out.output

    first = json.loads(seed("--json"))["shipped"]
    assert first["matches"] is None and not Path(first["shipped"]).exists()
    assert "no seed model is shipped" in seed()
    assert "shipped as" in seed("--ship")
    assert Path(first["shipped"]).is_file() and Path(first["shipped"]).parent.name == "seed-models"
    again = json.loads(seed("--json"))["shipped"]
    assert again["matches"] is True and again["shipped_digest"] == first["digest"]
    assert "matches the seed model shipped" in seed()
    run_dir = run(
        _config(env, "seed-only"), out_dir=tmp_path / "run", options=RunOptions(progress=False)
    )
    record, _ = load_record(run_dir / "record.json")
    assert record.data.digests["seed_model"] == first["digest"]
    _, meta = load_checkpoint(run_dir / "checkpoints" / "final.safetensors")
    assert Path(meta["seed_checkpoint"]).parent.name == f"shipped-{first['digest'][:16]}"

    # A shipped sidecar naming other weights, trained on another CPU: `seed` says where they
    # differ, and a run refuses to start from a file whose tensors are not the ones named.
    sidecar = Path(first["shipped"]).with_suffix(".json")
    shipped_meta = json.loads(sidecar.read_text())
    shipped_meta["tensors_digest"] = "0" * 64
    shipped_meta["numerics"]["cpu"]["model"] = "Another CPU"
    sidecar.write_text(json.dumps(shipped_meta))
    output = seed()
    assert "DIFFERS from the seed model shipped" in output and "0" * 64 in output
    assert "seed data: same digest, same audio digest" in output
    assert "cpu.model: Another CPU / " in output
    with pytest.raises(UserError, match="its tensors hash to"):
        run(
            _config(env, "seed-only"),
            out_dir=tmp_path / "refused",
            options=RunOptions(progress=False),
        )


def test_adaptive_clipping_moves_the_bound_by_the_released_fraction(env, tmp_path):
    config = _config(env, "adaptive-global", "eps7.2-high-pop")
    run_dir = run(config, out_dir=tmp_path / "run", options=RunOptions(progress=False))
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [x for x in lines if "loss" in x]
    adaptive = config.recipe.privacy.adaptive_clip
    bound = config.recipe.privacy.clip_bound
    for line in steps:  # C_{t+1} = C_t·exp(−η(b̄_t − γ)), from C_0 = the recipe's bound
        assert line["clip_bound"] == pytest.approx(bound, rel=1e-12)
        bound *= math.exp(-adaptive.lr * (line["unclipped_fraction"] - adaptive.target_quantile))
    assert len({x["clip_bound"] for x in steps}) == len(steps)  # it moved every step
    record, _ = load_record(run_dir / "record.json")
    claim = record.privacy.model_dump()["adaptive_clipping"]
    assert claim["update_sigma"] > record.privacy.sigma_dp and claim["bit_noise_applied"] == 0.05


def test_every_training_the_recipe_names_has_a_runner_and_no_other():
    from typing import get_args

    from pflbench.runner import TRAININGS
    from pflbench.spec.models import Recipe

    assert tuple(TRAININGS) == get_args(Recipe.model_fields["training"].annotation)


def test_a_client_algorithm_reading_user_state_in_its_server_step_is_refused(
    tiny_task_data, tmp_path
):
    """A user's state is the client's, not privatized: the server step, which gets the
    privatized average only, may not read it (a raw channel around the DP bound)."""
    from pflbench.fl.algorithms import CLIENT_ALGORITHMS, ClientAlgorithm

    class Peeking(ClientAlgorithm):
        def server_step(self, averaged):
            self.context.user_states.load("anyone", 1)

    CLIENT_ALGORITHMS.register("peeking-here", Peeking)
    try:
        recipe = Recipe.model_validate(
            {
                "federated": {
                    "cohort_size": 2,
                    "client": {"algorithm": "peeking-here", "local_steps": 1},
                }
            }
        )
        torch.manual_seed(0)
        model = build_model("tiny", tiny_task_data.tokenizer.size)
        sim = Simulator(model, tiny_task_data.federated_train, recipe, 0.0, 0, "cpu", DistContext(),
                        user_state_dir=tmp_path / "states")  # fmt: skip
        with pytest.raises(UserError, match="read or wrote a user's state in its server_step"):
            sim.run_step()
        sim.algorithm.context.user_states.load("anyone", 1)  # in the client phase: allowed
    finally:
        dict.pop(CLIENT_ALGORITHMS, "peeking-here")
        CLIENT_ALGORITHMS.origins.pop("peeking-here")


def test_the_run_summary_says_how_many_updates_were_zeroed_for_nan_or_inf(tmp_path):
    from pflbench.cli.run import run_summary

    root = Path(__file__).resolve().parents[1] / "results" / "synth-cv-en-ls-seed" / "none"
    filed = json.loads(next(root.glob("*.json")).read_text())
    for zeroed in (0, 3):
        filed["diagnostics"]["nonfinite_updates"] = zeroed
        filed["record_id"] = compute_record_id(filed)
        (tmp_path / "record.json").write_text(json.dumps(filed))
        lines = [line for line in run_summary(tmp_path) if line.startswith("non-finite updates")]
        clients = sum(filed["compute"]["cohort_per_step"])
        said = f"non-finite updates: 3 of {clients} were zeroed (NaN or Inf; the record's"
        assert lines == ([f"{said} diagnostics.nonfinite_updates)"] if zeroed else [])
