"""`pflbench run`: one run from a resolved RunConfig to a finished run directory (rundir.py).

    data, seed model  = prepared once per cache (rank 0 first)
    outcome           = TRAININGS[recipe.training](...)   # federated | central | seed-only
                                                          # | dpsgd-example
    final evaluation  → checkpoints/final, errors/, hypotheses/, record.json, DONE

The federated training is Algorithm 1 (fl.simulator) one central step at a time, with a
checkpoint every few steps. Because every random choice is keyed by (seed, step, user), resuming
from the latest checkpoint after a kill at any moment ends in exactly the same model. Only rank 0
writes; every rank runs the same server step. Example-level DP-SGD (dpsgd.py) runs the same way,
one DP-SGD step at a time, in one process.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from pflbench.central import set_cpu_threads
from pflbench.checkpoint import (
    ELAPSED,
    Elapsed,
    latest_checkpoint,
    load_checkpoint,
    prune_checkpoints,
    save_checkpoint,
    save_model,
    step_checkpoint,
)
from pflbench.digests import tensors_digest
from pflbench.errors import UserError
from pflbench.evaluate import evaluate_task, seed_model_summary
from pflbench.fl.distributed import DistContext, barrier, init_from_env, shutdown
from pflbench.fl.freeze import trained_tensors
from pflbench.fl.simulator import Simulator
from pflbench.methods import check_run
from pflbench.metrics_log import MetricsLog
from pflbench.numerics import NUMERICS_CHANGES, NUMERICS_VERSION
from pflbench.plugins import loaded_plugins
from pflbench.privacy.run import epsilon_so_far, privacy_claim, run_sigma_dp
from pflbench.privacy.sampling import sampling_rate
from pflbench.progress import make_progress
from pflbench.results.record import build_record, compute_info, data_info, write_record
from pflbench.results.schema import Outputs
from pflbench.rundir import (
    HYPOTHESES_DIR,
    config_to_continue,
    default_run_dir,
    is_done,
    mark_done,
    prepare_run_dir,
    write_hypotheses,
    write_utterance_errors,
)
from pflbench.seeds import keyed_seed
from pflbench.spec.models import RunConfig
from pflbench.spec.resolve import config_hash

CHECKPOINT_EVERY = 10  # central steps between resumable checkpoints (and always at eval steps)


@dataclass(frozen=True)
class RunOptions:
    """How to run, beside what (the RunConfig): none of these changes the config hash.
    `stop_after` ends the process after that many central steps in total without finishing the
    run (for tests and preemption). `parallel_clients` > 1 trains that many clients at once per
    process (fl.parallel), and `compile_backend` compiles the clients' local step with that
    torch.compile backend (`--compile`: inductor; fl.client): each the same run up to float
    rounding, faster or not depending on the device (`pflbench bench fl [--parallel-clients G]
    [--compile]`). The record states both."""

    device: str = "cpu"
    data_root: Path | None = None
    progress: bool = True
    checkpoint_every: int = CHECKPOINT_EVERY
    stop_after: int | None = None
    parallel_clients: int = 1
    compile_backend: str | None = None


@dataclass
class Prepared:
    """What every training starts from: the task's data and its seed model."""

    config: RunConfig
    run_dir: Path
    ctx: DistContext
    device: str
    options: RunOptions
    data: object  # data.prepare.TaskData
    model: torch.nn.Module
    seed_path: Path | None
    config_hash: str  # computed once: checkpoints and the record carry it
    elapsed: Elapsed  # the run's wall time, over its resumed processes too
    inputs: dict  # run_inputs: checkpoints carry it, a resumed run must start from the same


@dataclass
class Outcome:
    """What a training leaves for the run's end (the record's training side)."""

    model: torch.nn.Module
    final: dict  # evaluate_task results of the final model on the dev and test sets
    lines: list[dict]  # metrics lines: one per central step, one per evaluation
    seed_summary: dict  # the seed model's eval_summary
    meta: dict  # for checkpoints/final.json
    privacy: dict  # the record's privacy claim
    parallel_clients: int = 1
    compile_backend: str | None = None  # the clients' local step's torch.compile backend


def run(
    config: RunConfig,
    *,
    out_dir: Path | None = None,
    resume: bool = False,
    options: RunOptions = RunOptions(),
) -> Path:
    """Run (or resume) a run; returns its directory."""
    elapsed = Elapsed()
    check_run(config)  # before the run folder, the data or the seed model
    set_cpu_threads()
    ctx = init_from_env(options.device)
    device = f"cuda:{ctx.local_rank}" if options.device == "cuda" else options.device
    run_dir = Path(out_dir) if out_dir is not None else default_run_dir(config)
    try:
        if ctx.is_main:
            prepare_run_dir(config, run_dir, resume)
        if is_done(run_dir):
            return run_dir
        barrier(ctx)
        config = config_to_continue(config, run_dir)
        data, model, seed_path = _prepare(config, ctx, device, options)
        if not data.federated_train.users():
            raise UserError(f"task {config.task.name!r}: the federated training data has no users")
        prepared = Prepared(
            config, run_dir, ctx, device, options, data, model, seed_path, config_hash(config),
            elapsed, run_inputs(data, seed_path),
        )  # fmt: skip
        outcome = TRAININGS[config.recipe.training](prepared)
        if outcome is not None and ctx.is_main:
            _finish(prepared, outcome, elapsed.seconds())
        return run_dir
    finally:
        shutdown()


# ----------------------------------------------------------------------------------------------
# Preparation


def run_inputs(data, seed_path: Path | None) -> dict:
    """What a run's steps were computed from beyond its config: every data set and the starting
    weights (their digests, as the record states them) and the plug-ins' sources. A run resumed
    on other inputs would be one record of two runs."""
    plugins = {plugin.name: plugin.sha256 for plugin in loaded_plugins()}
    return {"data": data_info(data, seed_path).digests, "plugins": plugins}


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


def _prepare(config: RunConfig, ctx: DistContext, device: str, options: RunOptions):
    """Data and seed model; rank 0 builds the caches first, the other ranks then read them."""
    from pflbench.central import START_MODEL_SEED, seed_model, shipped_seed_dir
    from pflbench.data.prepare import cache_dir_default

    data = model = seed_path = None
    for turn in ("main", "others"):
        if (turn == "main") == ctx.is_main:
            progress = options.progress and ctx.is_main
            data = prepare_data(config, options.data_root, progress)
            model, seed_path = seed_model(
                config.task,
                config.recipe,
                data,
                seed=START_MODEL_SEED,
                device=device,
                cache_dir=cache_dir_default(),
                progress=progress,
                shipped_dir=shipped_seed_dir(),
            )
        barrier(ctx)
    set_cpu_threads()  # seed training restores its own count; this one is the run's
    return data, model, seed_path


# ----------------------------------------------------------------------------------------------
# The trainings (recipe.training): each returns its Outcome, or None where this process has no
# record to write (another rank's, or stopped by `stop_after`).


def train_federated(p: Prepared) -> Outcome | None:
    """Federated fine-tuning, with DP when the budget has noise: Algorithm 1, step by step."""
    config, ctx, options = p.config, p.ctx, p.options
    fed = config.recipe.federated
    state = _federated_state(p)
    sim = state.sim
    # The population the cohorts are drawn from (audit canaries included) is the one the
    # privacy statement and ε so far are computed for.
    population = len(sim.population)
    log = MetricsLog(p.run_dir, state.history, sim.step) if ctx.is_main else None
    show_progress = options.progress and ctx.is_main
    try:
        with steps_progress("federated", show_progress, fed.central_steps, sim.step) as advance:
            while sim.step < fed.central_steps:
                if options.stop_after is not None and sim.step >= options.stop_after:
                    return None
                started = time.perf_counter()
                stats = sim.run_step()
                epsilon = epsilon_so_far(config, state.sigma_dp, population, sim.step)
                line = step_line(stats, time.perf_counter() - started, epsilon)
                new = [line]
                is_eval = sim.step % fed.eval_every == 0 and sim.step < fed.central_steps
                if is_eval and ctx.is_main:
                    dev = evaluate_task(sim.model, p.data, config.task.eval_sets, {"dev"}, p.device)
                    new.append({"step": sim.step, "eval": wer_cer(dev)})
                if log is not None:
                    log.append(new)
                advance(line)
                if is_eval or sim.step % options.checkpoint_every == 0:
                    _save_federated_checkpoint(p, state)
        _save_federated_checkpoint(p, state)
        if log is None:
            return None
        final = evaluate_task(sim.model, p.data, config.task.eval_sets, {"dev", "test"}, p.device)
        log.append([{"step": sim.step, "eval": wer_cer(final)}])
    finally:
        if log is not None:
            log.close()

    privacy = privacy_claim(config, state.sigma_dp, population)
    if (note := sim.algorithm.privacy_note()) is not None:
        privacy["payload"] = note
    if sim.audit is not None:
        params = dict(sim.model.named_parameters())
        privacy["audit"] = sim.audit.finish(
            params, sim.mechanism.cohort, sim.step, privacy["simulated"]
        )
    return Outcome(
        model=sim.model,
        final=final,
        lines=state.history,
        seed_summary=state.seed_summary,
        meta={"kind": "federated", "step": sim.step},
        privacy=privacy,
        parallel_clients=sim.client.group_size,
        compile_backend=sim.client.compile_backend,
    )


@dataclass
class FederatedState:
    """What a federated run carries from step to step, and what its checkpoints restore."""

    sim: Simulator
    sigma_dp: float
    trained: list[str]  # the tensors clients train (layer freezing picks them once)
    seed_summary: dict | None  # the seed model's evaluation (rank 0)
    history: list[dict]  # the metrics lines so far; MetricsLog appends to this very list


def _federated_state(p: Prepared) -> FederatedState:
    """A fresh federated run, or the one its latest checkpoint left."""
    config = p.config
    tensors, meta = _latest_state(p)
    if "trained" in meta:
        trained = meta["trained"]
    else:
        sizes = {name: t.numel() for name, t in p.model.named_parameters()}
        fed = config.recipe.federated
        trained = trained_tensors(fed.layer_freeze, sizes, p.seed_path, config.task.name)
    sigma_dp = run_sigma_dp(config)
    sim = Simulator(
        p.model, p.data.federated_train, config.recipe, sigma_dp, config.seed, p.device, p.ctx,
        trained, p.options.parallel_clients, p.run_dir / "user-state",
        compile_backend=p.options.compile_backend,
    )  # fmt: skip
    seed_summary = meta.get("seed_results")
    if p.ctx.is_main and seed_summary is None:  # the seed model's: before a checkpoint is loaded
        seed_summary = seed_model_summary(sim.model, p.data, config, p.device, p.seed_path)
    if tensors is not None:
        sim.load_state_dict(tensors)
    return FederatedState(sim, sigma_dp, trained, seed_summary, meta.get("metrics", []))


def _save_federated_checkpoint(p: Prepared, state: FederatedState) -> None:
    """Rank 0 writes the step's checkpoint (model, server, algorithm, step, history)."""
    if not p.ctx.is_main:
        return
    sim = state.sim
    meta = {
        "trained": state.trained,
        "metrics": state.history,
        "seed_results": state.seed_summary,
        "parallel_clients": p.options.parallel_clients,
        "compile_backend": p.options.compile_backend,
    }
    _save_step_checkpoint(p, sim.step, sim.state_dict(), meta)
    sim.checkpointed()


STEP_CHECKPOINTS = "step"  # checkpoints/step-NNNNNNN: federated and DP-SGD trainings
CENTRAL_CHECKPOINTS = "central"  # checkpoints/central-NNNNNNN: central fine-tuning's


def _save_step_checkpoint(p: Prepared, step: int, tensors: dict, meta: dict) -> None:
    """A training's checkpoint after `step` steps, with what every one carries (the config hash,
    the run's inputs and setup, its elapsed time); older ones pruned."""
    path = step_checkpoint(p.run_dir / "checkpoints", STEP_CHECKPOINTS, step)
    meta = {"step": step, **meta, **_checkpoint_carry(p)}
    meta[ELAPSED] = p.elapsed.seconds()
    save_checkpoint(path, tensors, meta)
    prune_checkpoints(path.parent, STEP_CHECKPOINTS, path)


def _checkpoint_carry(p: Prepared) -> dict:
    """What every checkpoint of a run carries, for _check_resumable."""
    return {
        "config_hash": p.config_hash,
        "inputs": p.inputs,
        "setup": _setup(p),
        "numerics": NUMERICS_VERSION,
    }


def _setup(p: Prepared) -> dict:
    """What a resumed run must run on to continue the same computation: the device type (a CUDA
    generator draws other numbers than a CPU one), on a CPU the thread count (kernels split their
    sums by it) and, with client groups, the processes (fl.parallel: the groups depend on them)."""
    device = torch.device(p.device).type
    return {
        "device": device,
        "cpu_threads": torch.get_num_threads() if device == "cpu" else None,
        "processes": p.ctx.world_size if p.options.parallel_clients > 1 else None,
    }


def _check_resumable(p: Prepared, meta: dict) -> None:
    """Refuse to resume from a checkpoint (its `meta`) made on other inputs or another setup: one
    record would mix two runs. Checkpoints from before a field was stored skip its check."""
    run_dir = p.run_dir
    began = meta.get("inputs")
    if began is not None and began != p.inputs:
        changed = [
            f"{part} {name}"
            for part in ("data", "plugins")
            for name in sorted(set(began.get(part, {})) | set(p.inputs[part]))
            if began.get(part, {}).get(name) != p.inputs[part].get(name)
        ]
        raise UserError(
            f"{run_dir} began on other inputs than it would resume on ({', '.join(changed)} "
            "changed since its last checkpoint): one record would mix two runs. Restore them, "
            "or start the run again in a new folder"
        )
    numerics = meta.get("numerics")
    if numerics is not None and numerics != NUMERICS_VERSION:
        raise UserError(
            f"{run_dir} began under code of numerics version {numerics}; this pflbench computes "
            f"as version {NUMERICS_VERSION} ({NUMERICS_CHANGES.get(NUMERICS_VERSION, '')}): one "
            "record would mix the two. Start the run again in a new folder"
        )
    how = {
        "device": "--device",
        "cpu_threads": "OMP_NUM_THREADS (torch.set_num_threads)",
        "processes": "torchrun --nproc-per-node",
    }
    setup = _setup(p)
    for key, was in (meta.get("setup") or {}).items():
        if was != setup.get(key):
            raise UserError(
                f"{run_dir} was run with {key.replace('_', ' ')} {was}, this process has "
                f"{setup.get(key)}: the resumed run would not continue the same computation. "
                f"Resume it with the same ({how[key]})"
            )


def _latest_state(p: Prepared) -> tuple[dict | None, dict]:
    """The latest step checkpoint's tensors and metadata, (None, {}) before the first; the run's
    clock continues from it."""
    run_dir, options = p.run_dir, p.options
    checkpoint = latest_checkpoint(run_dir / "checkpoints", STEP_CHECKPOINTS)
    if checkpoint is None:
        return None, {}
    tensors, meta = load_checkpoint(checkpoint)
    # Groups and compilation change the float rounding: the resumed run would not be the same.
    if meta.get("parallel_clients", 1) != options.parallel_clients:
        raise UserError(
            f"{run_dir} was run with --parallel-clients {meta.get('parallel_clients', 1)}; resume"
            f" it with the same value (got {options.parallel_clients})"
        )
    was, now = meta.get("compile_backend"), options.compile_backend
    if was != now:
        raise UserError(
            f"{run_dir} was run with the local step {was or 'eager'}; resume it the same way"
            f" (`--compile`: inductor), not {now or 'eager'}"
        )
    _check_resumable(p, meta)
    p.elapsed.resume(meta)
    return tensors, meta


def fine_tune_central(p: Prepared) -> Outcome | None:
    """The paper's central row: the seed model fine-tuned on the pooled federated training data
    (recipe.fine_tune, else the seed model's schedule; no FL, no clipping, no noise), resuming
    from run_dir/checkpoints after a kill."""
    from pflbench.central import CentralCheckpoints, train_central

    seed_summary = _check_one_process(p)
    stats = train_central(
        p.model,
        p.data.federated_train,
        p.config.recipe.fine_tune or p.config.recipe.central,
        p.config.recipe.spec_augment,
        device=p.device,
        seed=keyed_seed(p.config.seed, "fine-tune"),
        progress=p.options.progress,
        checkpoints=CentralCheckpoints(
            p.run_dir / "checkpoints",
            CENTRAL_CHECKPOINTS,
            every=p.options.checkpoint_every,
            stop_after=p.options.stop_after,
            carry=_checkpoint_carry(p),
            check_resume=lambda meta: _check_resumable(p, meta),
        ),
        elapsed=p.elapsed,
    )
    if stats is None:  # stopped by stop_after
        return None
    return _evaluated_as_is(p, seed_summary)


def train_example_dpsgd(p: Prepared) -> Outcome | None:
    """Paper 003's example-level DP-SGD through opacus (pflbench.dpsgd): the seed model
    fine-tuned on the pooled federated training data at recipe.fine_tune's schedule, one
    Poisson batch per step (expected fine_tune.batch_seconds of audio), each example's gradient
    clipped, noise calibrated to the budget's example-level (ε, δ) at the run's own N, q and T
    by opacus' accountant. Resumes from the latest step checkpoint, ending in the same model."""
    from pflbench.dpsgd import ExampleDPSGD
    from pflbench.privacy.example import (
        NO_BUDGET_ACCOUNTANT,
        check_delta_below_one_over_n,
        clipping_words,
        example_epsilon,
        example_noise_multiplier,
        example_statement,
        expected_batch,
    )

    config, options = p.config, p.options
    recipe, budget = config.recipe, config.budget
    schedule = recipe.fine_tune or recipe.central
    steps = schedule.steps
    seed_summary = _check_one_process(p)  # before training (cached beside the seed model)
    utterances = list(p.data.federated_train)  # held in memory, as central fine-tuning does
    examples = len(utterances)
    if budget.dp:
        check_delta_below_one_over_n(budget.delta, examples, budget.name)
    batch = expected_batch([u.seconds for u in utterances], schedule.batch_seconds)
    q = sampling_rate(examples, batch)
    noise_multiplier = example_noise_multiplier(budget, q, steps)
    tensors, meta = _latest_state(p)
    if "trained" in meta:
        trained = meta["trained"]
    else:
        sizes = {name: t.numel() for name, t in p.model.named_parameters()}
        freeze = recipe.example_dp.layer_freeze
        trained = trained_tensors(freeze, sizes, p.seed_path, config.task.name)
    trainer = ExampleDPSGD(
        p.model, utterances, recipe, noise_multiplier, batch, config.seed, p.device, trained
    )
    if tensors is not None:
        trainer.load_state_dict(tensors, meta["step"])
    history = meta.get("metrics", [])

    def save() -> None:
        meta = {"trained": trained, "metrics": history}
        _save_step_checkpoint(p, trainer.step, trainer.state_dict(), meta)

    log = MetricsLog(p.run_dir, history, trainer.step)
    try:
        with steps_progress("dp-sgd", options.progress, steps, trainer.step) as advance:
            while trainer.step < steps:
                if options.stop_after is not None and trainer.step >= options.stop_after:
                    return None
                started = time.perf_counter()
                stats = trainer.run_step()
                epsilon = None  # opacus' RDP ε so far
                if noise_multiplier > 0:
                    epsilon = example_epsilon(
                        noise_multiplier, q, trainer.step, budget.delta, NO_BUDGET_ACCOUNTANT
                    ).epsilon
                line = {
                    "step": stats["step"],
                    "loss": stats["loss"],
                    "epsilon_rdp": epsilon,
                    "lr": stats["lr"],
                    "step_seconds": time.perf_counter() - started,
                    "examples": stats["examples"],
                    "nonfinite_examples": stats["nonfinite"],
                    # from the raw per-example gradients: not private
                    "diagnostics": {"private": False, "clipped_fraction": stats["clipped"]},
                }
                log.append([line])
                advance(line)
                if trainer.step % options.checkpoint_every == 0:
                    save()
        save()
        model = trainer.finish()
        final = evaluate_task(model, p.data, config.task.eval_sets, {"dev", "test"}, p.device)
        log.append([{"step": trainer.step, "eval": wer_cer(final)}])
    finally:
        log.close()
    privacy = example_statement(
        noise_multiplier, recipe.privacy.clip_bound, clipping_words(recipe.privacy), examples,
        batch, steps, budget,
    )  # fmt: skip
    return Outcome(
        model=model,
        final=final,
        lines=[{"step": trainer.step, "eval": wer_cer(final)}],
        seed_summary=seed_summary,
        meta={"kind": "dpsgd-example", "step": trainer.step},
        privacy=privacy,
    )


def keep_seed_model(p: Prepared) -> Outcome | None:
    """The paper's seed-only row: the seed model evaluated as it is."""
    return _evaluated_as_is(p, _check_one_process(p))


def _check_one_process(p: Prepared) -> dict:
    """Reference rows run in one process; returns the seed model's summary (before training)."""
    if p.ctx.world_size > 1:
        raise UserError(f"training: {p.config.recipe.training} runs in one process (no torchrun)")
    return seed_model_summary(p.model, p.data, p.config, p.device, p.seed_path)


def _evaluated_as_is(p: Prepared, seed_summary: dict) -> Outcome:
    final = evaluate_task(
        p.model.eval(), p.data, p.config.task.eval_sets, {"dev", "test"}, p.device
    )
    return Outcome(
        model=p.model,
        final=final,
        lines=[{"step": 0, "eval": wer_cer(final)}],
        seed_summary=seed_summary,
        meta={"kind": p.config.recipe.training},
        privacy=privacy_claim(p.config, 0.0, 0),
    )


# The registry of trainings; spec.models.Recipe.training names exactly these (a test checks).
TRAININGS: dict[str, Callable[[Prepared], Outcome | None]] = {
    "federated": train_federated,
    "central": fine_tune_central,
    "seed-only": keep_seed_model,
    "dpsgd-example": train_example_dpsgd,
}


# ----------------------------------------------------------------------------------------------
# The end of a run


def _finish(p: Prepared, outcome: Outcome, wall_seconds: float) -> None:
    """The final model, per-utterance errors and hypotheses, the record, and DONE last."""
    meta = {
        **outcome.meta,
        "config_hash": p.config_hash,
        "seed_checkpoint": str(p.seed_path) if p.seed_path else None,
    }
    final_path = p.run_dir / "checkpoints" / "final.safetensors"
    save_model(final_path, outcome.model, meta)
    write_utterance_errors(p.run_dir, outcome.final)
    outputs = Outputs(
        final_model=tensors_digest(final_path),
        hypotheses=write_hypotheses(p.run_dir / HYPOTHESES_DIR, outcome.final),
    )
    steps = [x for x in outcome.lines if "loss" in x]
    compute = compute_info(
        steps, p.ctx.world_size, p.device, outcome.model, outcome.parallel_clients,
        outcome.compile_backend, wall_seconds,
    )  # fmt: skip
    record = build_record(
        p.config,
        lines=outcome.lines,
        final=outcome.final,
        seed_summary=outcome.seed_summary,
        privacy=outcome.privacy,
        compute=compute,
        data=data_info(p.data, p.seed_path),
        outputs=outputs,
    )
    write_record(p.run_dir / "record.json", record)
    mark_done(p.run_dir)


def step_line(stats: dict, seconds: float, epsilon: float | None) -> dict:
    """A central step's metrics line (metrics_log.py) from its Simulator.run_step stats."""
    optional = {k: stats[k] for k in ("clip_bound", "unclipped_fraction") if k in stats}
    return {
        "step": stats["step"],
        "loss": stats["loss"],
        "epsilon_rdp": epsilon,
        "lr": stats["lr"],
        "step_seconds": seconds,
        "clients": stats["clients"],
        "nonfinite_updates": stats["nonfinite_updates"],
        "local_steps": stats["local_steps"],
        "diagnostics": stats["diagnostics"],
        **optional,
    }


def wer_cer(results: dict) -> dict:
    return {name: {"wer": r["wer"], "cer": r["cer"]} for name, r in results.items()}


@contextmanager
def steps_progress(label: str, enabled: bool, total: int, completed: int) -> Iterator:
    """A bar over the steps; `advance(line)` shows the step's loss, ε so far and speed."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    columns = [
        TextColumn(f"[bold]{label}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
        TextColumn("{task.description}"),
    ]
    with make_progress(label, *columns, enabled=enabled) as progress:
        task = progress.add_task("", total=total, completed=completed)

        def advance(line: dict) -> None:
            eps = line.get("epsilon_rdp")
            eps_text = f"ε {eps:.3g}" if eps is not None else "ε ∞"
            loss = f"{line['loss']:.3f}" if line["loss"] is not None else "–"
            text = f"loss {loss}  {eps_text}  {line['step_seconds']:.2f} s/step"
            progress.update(task, advance=1, description=text)

        yield advance
