"""`pflbench run`: one federated run from a resolved RunConfig to a finished run directory.

    runs/<task>/<baseline>/<budget>/seed<N>-<hash8>/
        config.json     the resolved RunConfig
        metrics.jsonl   one line per central step (loss, ε so far, lr, diagnostics) and per eval
        tensorboard/    the same scalars as TensorBoard events (when tensorboard is installed)
        checkpoints/    step-XXXXXXX.safetensors (+ .json): model, server state, step, metrics
                        final.safetensors (+ .json): the final model (loadable by load_model)
        errors/         <eval set>.jsonl: per-utterance word/char errors of the final evaluation
        record.json     the result record (pflbench.results.schema.ResultRecord)
        DONE            written last

Every file is written atomically. Because every random choice is keyed by (seed, step, user),
resuming from the latest checkpoint after a kill at any moment ends in exactly the same model.
Only rank 0 writes; every rank runs the same server step.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import torch

from pflbench import __version__
from pflbench.checkpoint import atomic_write, load_checkpoint, save_checkpoint, save_model
from pflbench.errors import UserError
from pflbench.fl.distributed import DistContext, barrier, init_from_env, shutdown
from pflbench.fl.freeze import layer_scores, select_trained
from pflbench.fl.sampling import keyed_seed, sampling_rate
from pflbench.fl.simulator import Simulator
from pflbench.metrics_log import MetricsLog
from pflbench.privacy.audit import check_audit
from pflbench.progress import make_progress
from pflbench.results.schema import safe_name
from pflbench.spec.models import RunConfig
from pflbench.spec.resolve import canonical_json, config_hash

CHECKPOINT_EVERY = 10  # central steps between resumable checkpoints (and always at eval steps)
DEFAULT_DELTA = 1e-9  # δ for the simulated-scale statement of runs without a DP budget
# The starting model (seed model, or fresh init without seed data) belongs to the task: every run
# starts from the one trained with this seed, as every FL run of the paper starts from one seed
# model; run seeds vary the federated (or fine-tuning) randomness only.
START_MODEL_SEED = 0


def set_cpu_threads() -> None:
    """A fixed intra-op thread count (kernels may round differently with another count, and
    other code in the process may have changed it): OMP_NUM_THREADS if set (torchrun sets it
    to 1 per process), else this process's share of the CPUs it may run on."""
    if os.environ.get("OMP_NUM_THREADS"):
        threads = int(os.environ["OMP_NUM_THREADS"])
    else:
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        threads = max(1, len(os.sched_getaffinity(0)) // local_world)
    torch.set_num_threads(threads)


def default_run_dir(config: RunConfig, root: Path = Path("runs")) -> Path:
    name = f"seed{config.seed}-{config_hash(config)[:8]}"
    return root / config.task.name / config.baseline.name / config.budget.name / name


# ----------------------------------------------------------------------------------------------
# Files


def write_atomic(path: Path, text: str) -> None:
    atomic_write(path, lambda tmp: tmp.write_text(text))


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete step checkpoint (its JSON sidecar is written last)."""
    done = sorted((run_dir / "checkpoints").glob("step-*.json"))
    return done[-1].with_suffix(".safetensors") if done else None


def prune_checkpoints(run_dir: Path, keep: Path) -> None:
    for old in (run_dir / "checkpoints").glob("step-*"):
        if old.stem != keep.stem:
            old.unlink(missing_ok=True)


def prepare_run_dir(config: RunConfig, run_dir: Path, resume: bool) -> None:
    """Create the run directory, or check that an existing one holds this very config.

    An identical run that already finished is accepted without `--resume` (re-running the same
    command, e.g. `make demo`, reports it); an unfinished one needs `--resume`."""
    config_json = json.dumps(config.model_dump(mode="json"), indent=2, sort_keys=True)
    existing = run_dir / "config.json"
    finished = (run_dir / "DONE").is_file()
    if resume or finished:
        if not existing.is_file():
            raise UserError(f"--resume {run_dir}: no config.json there (not a run directory)")
        if canonical_json(json.loads(existing.read_text())) != canonical_json(
            config.model_dump(mode="json")
        ):
            raise UserError(
                f"{run_dir}: its config.json differs from this command's resolved config "
                "(resume with the same --task/--baseline/--budget/--seed/--set, "
                "or choose another --out)"
            )
        return
    if existing.is_file():
        raise UserError(
            f"{run_dir} already holds an unfinished run; continue it with --resume {run_dir} "
            "or choose another --out"
        )
    (run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
    write_atomic(existing, config_json + "\n")


# ----------------------------------------------------------------------------------------------
# Privacy


def check_privacy(config: RunConfig) -> None:
    """Refuse runs a DP budget cannot cover: DP noise is calibrated to a clipping bound (so the
    baseline must clip), and to the budget's T (so the run may not take more central steps);
    training that is not federated has no DP mechanism at all."""
    from pflbench.privacy.statement import check_steps_within_budget

    training = config.recipe.training
    if config.budget.dp and training != "federated":
        raise UserError(
            f"baseline {config.baseline.name!r} (training: {training}) is a non-private reference"
            f" row, so budget {config.budget.name!r} cannot be met; use --budget none"
        )
    check_audit(config.recipe)
    if config.budget.dp and config.recipe.privacy.clipping == "none":
        raise UserError(
            f"baseline {config.baseline.name!r} does not clip client updates "
            f"(privacy.clipping: none), so budget {config.budget.name!r} cannot be met; "
            "use --budget none or a clipping baseline"
        )
    steps = config.recipe.federated.central_steps
    check_steps_within_budget(steps, config.budget, "federated.central_steps")


def run_noise(config: RunConfig) -> float:
    """σ_DP of the run: the budget's (0 without DP)."""
    from pflbench.privacy.statement import budget_noise

    return float(budget_noise(config.budget)["sigma_dp"])


def epsilon_so_far(config: RunConfig, sigma_dp: float, population: int, steps: int) -> float | None:
    """ε by RDP at the simulated scale after `steps` central steps (None without noise)."""
    from pflbench.privacy.accountants import compute_epsilon

    if sigma_dp == 0 or steps == 0:
        return None
    cohort = config.recipe.federated.cohort_size
    q = sampling_rate(population, cohort)
    delta = config.budget.delta or DEFAULT_DELTA
    return compute_epsilon(sigma_dp * q * population, q, steps, delta, "rdp").epsilon


NO_FL_PRIVACY = {
    "seed-only": "No federated training: the seed model never sees the federated users' data,"
    " so this row spends no privacy budget on them (and claims no DP guarantee).",
    "central": "Central fine-tuning on the pooled federated data without clipping or noise:"
    " no DP guarantee (epsilon is infinite).",
}


def privacy_claim(config: RunConfig, sigma_dp: float, population: int) -> dict:
    from pflbench.privacy.statement import privacy_statement

    if config.recipe.training != "federated":
        return {"dp": False, "how": NO_FL_PRIVACY[config.recipe.training]}
    fed = config.recipe.federated
    statement = privacy_statement(
        sigma_dp=sigma_dp,
        clip_bound=config.recipe.privacy.clip_bound,
        cohort=min(fed.cohort_size, population),
        population=population,
        steps=fed.central_steps,
        delta=config.budget.delta or DEFAULT_DELTA,
        sampling=fed.sampling,
        budget=config.budget if config.budget.dp else None,
        pseudo_users=config.task.federated_data.iid,
    )
    adaptive = config.recipe.privacy.adaptive_clip
    if adaptive is not None:
        from pflbench.privacy.adaptive import adaptive_statement

        statement["adaptive_clipping"] = adaptive_statement(sigma_dp, adaptive)
    return statement


# ----------------------------------------------------------------------------------------------
# Evaluation


def evaluate(model: torch.nn.Module, data, config: RunConfig, roles: set[str], device: str) -> dict:
    from pflbench.evaluate import evaluate_sets, group_counts

    names = [e.name for e in config.task.eval_sets if e.role in roles]
    results = evaluate_sets(
        model, {n: data.eval_sets[n] for n in names}, data.tokenizer, device=device
    )
    roles_by_name = {e.name: e.role for e in config.task.eval_sets}
    return {
        name: {
            "role": roles_by_name[name],
            **results[name],
            "groups": group_counts(results[name]["speaker_counts"], data.eval_groups.get(name, {})),
        }
        for name in names
    }


def seed_model_results(model, data, config: RunConfig, device: str, seed_path) -> dict:
    """The starting model's dev/test summary. Every run of a task starts from the same seed
    model, so its evaluation is cached next to the checkpoint, keyed by the eval sets' data."""
    eval_sets = {e.name: [e.role, data.eval_sets[e.name].digest] for e in config.task.eval_sets}
    key = canonical_json({"pflbench": __version__, "eval_sets": eval_sets, "summary": "groups"})
    cache = None
    if seed_path is not None:
        cache = Path(seed_path).with_name(
            f"eval-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"
        )
        if cache.is_file():
            return json.loads(cache.read_text())
    results = eval_summary(evaluate(model, data, config, {"dev", "test"}, device))
    if cache is not None:
        write_atomic(cache, json.dumps(results, indent=2, sort_keys=True) + "\n")
    return results


def write_utterance_errors(run_dir: Path, results: dict) -> None:
    """errors/<eval set>.jsonl: one line per utterance of the final evaluation (utt_id, speaker,
    word_errors, words, char_errors, chars), for error analysis beyond the record's counts."""
    folder = run_dir / "errors"
    folder.mkdir(exist_ok=True)
    for name, r in results.items():
        lines = [json.dumps(u, sort_keys=True) + "\n" for u in r["utterances"]]
        write_atomic(folder / f"{safe_name(name, 'eval set')}.jsonl", "".join(lines))


def eval_summary(results: dict) -> dict:
    return {
        name: {
            "role": r["role"],
            "wer": r["wer"],
            "cer": r.get("cer"),
            "speaker_wer_mean": r.get("speaker_wer_mean"),
            "speaker_wer_p10": r.get("speaker_wer_p10"),
            "speaker_wer_p50": r.get("speaker_wer_median"),
            "speaker_wer_p90": r.get("speaker_wer_p90"),
            "num_utterances": r.get("num_utterances"),
            "speakers": r.get("speaker_counts"),
            "groups": r.get("groups") or None,
        }
        for name, r in results.items()
    }


# ----------------------------------------------------------------------------------------------
# Progress


@contextmanager
def progress_bar(enabled: bool, total: int, completed: int) -> Iterator:
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    columns = [
        TextColumn("[bold]federated"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
        TextColumn("{task.description}"),
    ]
    with make_progress("federated", *columns, enabled=enabled) as progress:
        task = progress.add_task("", total=total, completed=completed)

        def update(line: dict) -> None:
            eps = line.get("epsilon_rdp")
            eps_text = f"ε {eps:.3g}" if eps is not None else "ε ∞"
            speed = f"{line['step_seconds']:.2f} s/step"
            text = f"loss {line['loss']:.3f}  {eps_text}  {speed}"
            progress.update(task, advance=1, description=text)

        yield update


# ----------------------------------------------------------------------------------------------
# The run


def run(
    config: RunConfig,
    *,
    out_dir: Path | None = None,
    resume: bool = False,
    device: str = "cpu",
    data_root: Path | None = None,
    progress: bool = True,
    checkpoint_every: int = CHECKPOINT_EVERY,
    stop_after: int | None = None,
    parallel_clients: int = 1,
) -> Path:
    """Run (or resume) a federated run; returns its directory. `stop_after` ends the process
    after that many central steps in total without finishing the run (for tests and preemption).
    `parallel_clients` > 1 trains that many clients at once per process (fl.parallel): the same
    run up to float rounding, faster or not depending on the device (`pflbench bench fl`)."""
    started = time.perf_counter()
    check_privacy(config)
    set_cpu_threads()
    ctx = init_from_env(device)
    device = f"cuda:{ctx.local_rank}" if device == "cuda" else device  # cuda:N: one process
    run_dir = Path(out_dir) if out_dir is not None else default_run_dir(config)
    try:
        if ctx.is_main:
            prepare_run_dir(config, run_dir, resume)
        if (run_dir / "DONE").is_file():
            return run_dir
        barrier(ctx)
        options = RunOptions(data_root, progress, checkpoint_every, stop_after, parallel_clients)
        return _run(config, run_dir, ctx, device, options, started)
    finally:
        shutdown()


def prepare_data(config: RunConfig, data_root: Path | None, progress: bool):
    from pflbench.data.prepare import prepare_task

    try:
        return prepare_task(config.task, data_root=data_root, progress=progress)
    except UserError as exc:
        if config.task.synthetic is not None:
            raise
        raise UserError(
            f"{exc}\nTask {config.task.name!r} reads real corpora (--data-root or PFLBENCH_DATA). "
            "Without them, try a synthetic task that runs anywhere, e.g. "
            "`pflbench run --task synth-cv-en-ls-seed --baseline perlayer-dim`."
        ) from None


def _prepare(config: RunConfig, ctx: DistContext, device: str, data_root, progress: bool):
    """Data and seed model; rank 0 builds the caches first, the other ranks then read them."""
    from pflbench.central import seed_model
    from pflbench.data.prepare import cache_dir_default

    cache = cache_dir_default()
    data = model = seed_path = None
    for turn in ("main", "others"):
        if (turn == "main") == ctx.is_main:
            data = prepare_data(config, data_root, progress and ctx.is_main)
            model, seed_path = seed_model(
                config.task,
                config.recipe,
                data,
                seed=START_MODEL_SEED,
                device=device,
                cache_dir=cache,
                progress=progress and ctx.is_main,
            )
        barrier(ctx)
    return data, model, seed_path


def trained_tensors(config: RunConfig, model: torch.nn.Module, seed_path: Path | None) -> list[str]:
    """All parameter names, or those layer freezing leaves trainable (scored by the squared
    gradients the seed training accumulated, stored beside the cached seed model)."""
    from pflbench.checkpoint import meta_path

    names = [n for n, _ in model.named_parameters()]
    freeze = config.recipe.federated.layer_freeze
    if freeze is None:
        return names
    if seed_path is None:
        raise UserError(
            f"task {config.task.name!r} has no seed data, whose training layer freezing ranks"
            " layers by"
        )
    sums = json.loads(meta_path(seed_path).read_text())["training"]["layer_grad_sq_sums"]
    if not any(sums.values()):
        raise UserError(
            f"layer freezing: the seed model {seed_path} saw no gradients (central.steps ="
            f" {config.recipe.central.steps}), so there are no scores to rank layers by"
        )
    sizes = {n: p.numel() for n, p in model.named_parameters()}
    return select_trained(layer_scores(sums, sizes), sizes, freeze.train_percent, freeze.train)


@dataclass(frozen=True)
class RunOptions:
    """How to run, beside what (the RunConfig): none of these changes the config hash."""

    data_root: Path | None
    progress: bool
    checkpoint_every: int
    stop_after: int | None
    parallel_clients: int


def _run(config, run_dir, ctx, device, options: RunOptions, started: float):
    fed = config.recipe.federated
    data, model, seed_path = _prepare(config, ctx, device, options.data_root, options.progress)
    set_cpu_threads()  # seed training may have changed it
    population = len(data.federated_train.users())
    if population == 0:
        raise UserError(f"task {config.task.name!r}: the federated training data has no users")
    if config.recipe.training != "federated":
        return _run_without_fl(
            config, run_dir, ctx, device, data, model, seed_path, options, started
        )
    sigma_dp = run_noise(config)
    population += config.recipe.privacy.audit_canaries  # canaries are users: accounted for

    checkpoint = latest_checkpoint(run_dir)
    meta: dict = {}
    tensors = None
    if checkpoint is not None:
        tensors, meta = load_checkpoint(checkpoint)
        trained = meta["trained"]
        before = meta.get("parallel_clients", 1)
        if before != options.parallel_clients:
            # Groups change the float rounding: the resumed run would not be the same run.
            raise UserError(
                f"{run_dir} was run with --parallel-clients {before}; resume it with the same "
                f"value (got {options.parallel_clients})"
            )
    else:
        trained = trained_tensors(config, model, seed_path)
    sim = Simulator(
        model, data.federated_train, config.recipe, sigma_dp, config.seed, device, ctx, trained,
        options.parallel_clients,
    )  # fmt: skip
    if tensors is not None:
        sim.load_state_dict(tensors)
    lines: list[dict] = meta.get("metrics", [])
    seed_results = meta.get("seed_results")
    if ctx.is_main and seed_results is None:
        seed_results = seed_model_results(sim.model, data, config, device, seed_path)

    def save(step_lines: list[dict]) -> None:
        if not ctx.is_main:
            return
        path = run_dir / "checkpoints" / f"step-{sim.step:07d}.safetensors"
        meta = {
            "step": sim.step,
            "trained": trained,
            "metrics": step_lines,
            "seed_results": seed_results,
            "config_hash": config_hash(config),
            "parallel_clients": options.parallel_clients,
        }
        save_checkpoint(path, sim.state_dict(), meta)
        prune_checkpoints(run_dir, path)

    log = MetricsLog(run_dir, lines, sim.step) if ctx.is_main else None
    try:
        with progress_bar(options.progress and ctx.is_main, fed.central_steps, sim.step) as advance:
            while sim.step < fed.central_steps:
                if options.stop_after is not None and sim.step >= options.stop_after:
                    return run_dir
                t0 = time.perf_counter()
                stats = sim.run_step()
                line = {
                    "step": stats["step"],
                    "loss": stats["loss"],
                    "epsilon_rdp": epsilon_so_far(config, sigma_dp, population, sim.step),
                    "lr": stats["lr"],
                    "step_seconds": time.perf_counter() - t0,
                    "clients": stats["clients"],
                    "nonfinite_updates": stats["nonfinite_updates"],
                    "local_steps": stats["local_steps"],
                    "diagnostics": stats["diagnostics"],
                    **{k: stats[k] for k in ("clip_bound", "unclipped_fraction") if k in stats},
                }
                new = [line]
                is_eval = sim.step % fed.eval_every == 0 and sim.step < fed.central_steps
                if is_eval and ctx.is_main:
                    dev = evaluate(sim.model, data, config, {"dev"}, device)
                    new.append({"step": sim.step, "eval": _wer_cer(dev)})
                lines += new
                if log is not None:
                    log.append(new)
                advance(line)
                if is_eval or sim.step % options.checkpoint_every == 0:
                    save(lines)
        save(lines)
        if ctx.is_main:
            final = evaluate(sim.model, data, config, {"dev", "test"}, device)
            lines.append({"step": sim.step, "eval": _wer_cer(final)})
            log.append(lines[-1:])
    finally:
        if log is not None:
            log.close()

    if ctx.is_main:
        final_meta = {
            "kind": "federated",
            "config_hash": config_hash(config),
            "step": sim.step,
            "seed_checkpoint": str(seed_path) if seed_path else None,
        }
        save_model(run_dir / "checkpoints" / "final.safetensors", sim.model, final_meta)
        wall = time.perf_counter() - started
        write_utterance_errors(run_dir, final)
        record = build_record(
            config, data, lines, final, seed_results, sigma_dp, population, ctx, device,
            sim.model, sim.client.group_size, wall, sim.audit, seed_path,
        )  # fmt: skip
        write_atomic(run_dir / "record.json", json.dumps(record, indent=2, sort_keys=True) + "\n")
        write_atomic(run_dir / "DONE", datetime.now(UTC).isoformat() + "\n")
    return run_dir


def _run_without_fl(config, run_dir, ctx, device, data, model, seed_path, options, started):
    """The paper's reference rows: `seed-only` evaluates the seed model as it is; `central`
    fine-tunes it on the pooled federated training data (recipe.fine_tune, else the seed model's
    schedule; no FL, no clipping, no noise), resuming from run_dir/checkpoints after a kill."""
    from pflbench.central import train_central

    if ctx.world_size > 1:
        raise UserError(f"training: {config.recipe.training} runs in one process (no torchrun)")
    seed_results = seed_model_results(model, data, config, device, seed_path)
    if config.recipe.training == "central":
        train_central(
            model,
            data.federated_train,
            config.recipe.fine_tune or config.recipe.central,
            config.recipe.spec_augment,
            device=device,
            seed=keyed_seed(config.seed, "fine-tune"),
            progress=options.progress,
            resume_dir=run_dir / "checkpoints",
        )
    final = evaluate(model.eval(), data, config, {"dev", "test"}, device)
    lines = [{"step": 0, "eval": _wer_cer(final)}]
    meta = {
        "kind": config.recipe.training,
        "config_hash": config_hash(config),
        "seed_checkpoint": str(seed_path) if seed_path else None,
    }
    save_model(run_dir / "checkpoints" / "final.safetensors", model, meta)
    write_utterance_errors(run_dir, final)
    wall = time.perf_counter() - started
    record = build_record(
        config, data, lines, final, seed_results, 0.0, 0, ctx, device, model, 1, wall,
        seed_path=seed_path,
    )  # fmt: skip
    write_atomic(run_dir / "record.json", json.dumps(record, indent=2, sort_keys=True) + "\n")
    write_atomic(run_dir / "DONE", datetime.now(UTC).isoformat() + "\n")
    return run_dir


def _wer_cer(results: dict) -> dict:
    return {name: {"wer": r["wer"], "cer": r.get("cer")} for name, r in results.items()}


# ----------------------------------------------------------------------------------------------
# The record


def build_record(
    config: RunConfig,
    data,
    lines: list[dict],
    final: dict,
    seed_results: dict | None,
    sigma_dp: float,
    population: int,
    ctx: DistContext,
    device: str,
    model: torch.nn.Module,
    parallel_clients: int,
    wall_seconds: float,
    audit=None,
    seed_path: Path | None = None,
) -> dict:
    from pflbench.results.schema import RECORD_SCHEMA_VERSION, ResultRecord, compute_record_id

    steps = [x for x in lines if "loss" in x]
    history = [
        {"step": x["step"], "eval_set": name, "wer": r["wer"], "cer": r.get("cer")}
        for x in lines
        if "eval" in x
        for name, r in x["eval"].items()
    ]
    fractions = [x["diagnostics"]["clipped_fraction"] for x in steps]
    fractions = [f for f in fractions if f is not None]
    record = {
        "schema_version": RECORD_SCHEMA_VERSION,
        "created": datetime.now(UTC).isoformat(),
        "kind": "run",
        "provenance": None,
        "task": {"name": config.task.name, "version": config.task.version},
        "baseline": config.baseline.name,
        "budget": config.budget.name,
        "seed": config.seed,
        "config_hash": config_hash(config),
        "config": config.model_dump(mode="json"),
        "metrics": {
            "final": eval_summary(final),
            "seed_model": eval_summary(seed_results) if seed_results else None,
            "history": history,
        },
        "privacy": privacy_claim(config, sigma_dp, population),
        "compute": compute_info(config, steps, ctx, device, model, parallel_clients, wall_seconds),
        "software": software_info(),
        "data": data_info(data, seed_path),
        "diagnostics": {
            "private": False,  # computed from raw client updates, like metrics.jsonl's
            "nonfinite_updates": sum(x["nonfinite_updates"] for x in steps),
            "clipped_fraction_mean": sum(fractions) / len(fractions) if fractions else None,
        },
    }
    if audit is not None:
        params, simulated = dict(model.named_parameters()), record["privacy"]["simulated"]
        record["privacy"]["audit"] = audit.finish(params, len(steps), simulated)
    record["record_id"] = compute_record_id(record)
    ResultRecord.model_validate(record)
    return record


def compute_info(
    config, steps: list[dict], ctx, device: str, model, parallel_clients: int, wall: float
) -> dict:
    cuda = device.startswith("cuda")
    clients = sum(x["clients"] for x in steps)
    rounds = len(steps)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    payload = 2.0 * model_bytes  # download the model, upload a delta (paper 004's P ≈ 2×size)
    mean_local_steps = sum(x["local_steps"] for x in steps) / clients if clients else 0.0
    peak = float(torch.cuda.max_memory_allocated(device)) if cuda else None
    alpha = 1.0
    value = None
    if peak is not None:
        value = rounds * (clients / max(rounds, 1)) * (payload + alpha * mean_local_steps * peak)
    return {
        "wall_seconds": wall,
        "device": "cuda" if cuda else "cpu",
        "device_name": torch.cuda.get_device_name(device)
        if cuda
        else platform.processor() or platform.machine(),
        "num_processes": ctx.world_size,
        "intra_op_threads": None if cuda else torch.get_num_threads(),
        "parallel_clients": parallel_clients,
        "gpu_hours": wall * ctx.world_size / 3600 if cuda else 0.0,
        "central_steps": len(steps),
        "cohort_per_step": [x["clients"] for x in steps],
        "cfmq": {
            "rounds": rounds,
            "clients_per_round": clients / max(rounds, 1),
            "payload_bytes": payload,
            "mean_local_steps": mean_local_steps,
            "peak_client_memory_bytes": peak,
            "alpha": alpha,
            "value": value,
        },
    }


def software_info() -> dict:
    try:
        commit = (
            subprocess.run(
                ["git", "rev-parse", "HEAD"],
                cwd=Path(__file__).resolve().parent,
                capture_output=True,
                text=True,
                timeout=10,
            ).stdout.strip()
            or None
        )
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {
        "pflbench_version": __version__,
        "git_commit": commit,
        "torch_version": torch.__version__,
        "python_version": sys.version.split()[0],
        "platform": platform.platform(),
    }


def data_info(data, seed_path: Path | None) -> dict:
    from pflbench.checkpoint import tensors_digest

    digests = {"federated_train": data.federated_train.digest}
    if data.seed_train is not None:
        digests["seed_train"] = data.seed_train.digest
    if seed_path is not None:  # the starting weights: runs are comparable only from the same ones
        digests["seed_model"] = tensors_digest(seed_path)
    digests.update({name: store.digest for name, store in data.eval_sets.items()})
    skipped = {split: stats.get("skipped", {}) for split, stats in data.report.items()}
    return {"digests": digests, "skipped": skipped}
