"""Central (seed-model) training: the paper's recipe (App. F) on a feature store.

LARS (or adam/adamw/sgd where a task's recipe says so), lr constant after an optional linear
warmup, multiplied by `step_decay_factor` every `step_decay_every` steps; gradient-norm clipping;
SpecAugment from step 0; dynamic batches of up to `batch_seconds` of audio.

Every random choice of step t (batch order of its epoch, SpecAugment masks, dropout, CAPE, layer
drop) is seeded from (seed, t), so a run resumed from its last checkpoint continues exactly as the
uninterrupted run would have.

Under torchrun each process trains on its share of every batch (dealt by length, so the shares pad
alike), with the SpecAugment masks and CAPE positions the whole batch would have; the summed
gradients are all-reduced, so a step equals the one-process step up to float summation order
(differences that grow over a training: Adam's normalization amplifies them). Dropout and layer
drop would draw per process, so multi-process training refuses them.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
from torch import Tensor, nn

from pflbench.checkpoint import (
    ELAPSED,
    Elapsed,
    latest_checkpoint,
    load_checkpoint,
    load_model,
    meta_path,
    prune_checkpoints,
    save_checkpoint,
    save_model,
    step_checkpoint,
)
from pflbench.data.batching import collate, dynamic_batches
from pflbench.data.features import spec_augment as apply_spec_augment
from pflbench.data.store import Utterance, torch_threads
from pflbench.data.text import tokenizer_for
from pflbench.digests import state_digest, tensors_digest
from pflbench.errors import UserError
from pflbench.files import atomic_write, atomic_write_text, exclusive
from pflbench.fl.distributed import (
    DistContext,
    all_reduce_sum,
    barrier,
    broadcast_from_main,
)
from pflbench.model.optim import make_central_optimizer
from pflbench.model.transformer import CTCTransformer, build_model, cape_positions, ctc_losses
from pflbench.numerics import cpu_kernels, package_versions
from pflbench.progress import make_progress
from pflbench.seeds import keyed_seed, seed_global_draws
from pflbench.spec.models import CentralRecipe, Recipe, SpecAugmentRecipe, Task
from pflbench.spec.registry import builtin_spec_root
from pflbench.spec.resolve import canonical_json

# ----------------------------------------------------------------------------------------------
# The schedule


def step_decay_lr(recipe: CentralRecipe, step: int) -> float:
    """The seed (and central fine-tuning) schedule of step `step` (from 0): a linear warmup over
    `warmup_steps`, then lr multiplied by `step_decay_factor` every `step_decay_every` steps (a
    staircase; the paper's central recipe, App. F). The server has its own schedule, continuous
    exponential decay after a constant phase as optax has it (pflbench.fl.server
    .exponential_decay_lr): the recipes configure them with different keys, so they stay two."""
    warm = min(1.0, (step + 1) / recipe.warmup_steps) if recipe.warmup_steps else 1.0
    return recipe.lr * warm * recipe.step_decay_factor ** (step // recipe.step_decay_every)


# ----------------------------------------------------------------------------------------------
# Determinism and resumption


def set_cpu_threads() -> None:
    """A fixed intra-op thread count (kernels may round differently with another count, and
    other code in the process may have changed it): OMP_NUM_THREADS if set (torchrun sets it
    to 1 per process), else this process's share of the CPUs it may run on (torch's default
    counts physical cores, which undercounts in VMs and containers with CPU quotas)."""
    if os.environ.get("OMP_NUM_THREADS"):
        threads = int(os.environ["OMP_NUM_THREADS"])
    else:
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        threads = max(1, len(os.sched_getaffinity(0)) // local_world)
    torch.set_num_threads(threads)


def optimizer_tensors(opt: torch.optim.Optimizer) -> dict[str, Tensor]:
    return {
        f"optim.{idx}.{key}": torch.as_tensor(value)
        for idx, state in opt.state_dict()["state"].items()
        for key, value in state.items()
    }


def load_optimizer_tensors(opt: torch.optim.Optimizer, tensors: dict[str, Tensor]) -> None:
    state: dict[int, dict[str, Tensor]] = {}
    for name, value in tensors.items():
        if name.startswith("optim."):
            _, idx, key = name.split(".", 2)
            state.setdefault(int(idx), {})[key] = value
    opt.load_state_dict({"state": state, "param_groups": opt.state_dict()["param_groups"]})


GRAD_SQ = "layer_grad_sq"  # the resume checkpoint's running Σ‖g_h‖² (float64 [H])
SEED_CHECKPOINTS = "central"  # a seed training's checkpoints: central-NNNNNNN in its cache folder
RECENT_LOSSES = 10  # the steps `final_loss` averages


@dataclass(frozen=True)
class CentralCheckpoints:
    """Where train_central keeps its resumable state, and how: `folder/prefix-NNNNNNN` every
    `every` steps (None: ~10% of the steps) and at the end, each carrying `carry` (a run's config
    hash, inputs and setup); the latest is continued after `check_resume(its metadata)`, which
    raises where it may not be. `stop_after`: end the process after that many steps in total,
    without finishing (for tests and preemption; steps after the last checkpoint are redone)."""

    folder: Path
    prefix: str = SEED_CHECKPOINTS
    every: int | None = None
    stop_after: int | None = None
    carry: dict = field(default_factory=dict)
    check_resume: Callable[[dict], None] | None = None


def epoch_batches(seconds: list[float], recipe: CentralRecipe, seed: int) -> Iterator[list[int]]:
    """All batches of all epochs, in order; each epoch shuffled from (seed, epoch)."""
    epoch = 0
    while True:
        gen = torch.Generator().manual_seed(keyed_seed(seed, "epoch", epoch))
        yield from dynamic_batches(seconds, recipe.batch_seconds, gen)
        epoch += 1


def batch_shares(frames: list[int], world_size: int) -> list[list[int]]:
    """Positions into a batch, per rank: longest first (ties by position) dealt round-robin, so
    the ranks pad similar lengths and get about the same audio."""
    order = sorted(range(len(frames)), key=lambda i: (-frames[i], i))
    return [sorted(order[rank::world_size]) for rank in range(world_size)]


# ----------------------------------------------------------------------------------------------
# Training


def train_step(
    model: CTCTransformer,
    opt: torch.optim.Optimizer,
    items: list[Utterance],
    recipe: CentralRecipe,
    augment: SpecAugmentRecipe,
    generator: torch.Generator,
    grad_sq: Tensor,
    *,
    device,
    ctx: DistContext,
) -> float:
    """One step on the batch `items`, of which this process trains on its share; adds each
    parameter's squared gradient norm ‖∂L/∂θ_h‖² (before clipping) to `grad_sq` (float64 [H],
    named_parameters order): layer freezing's scores (paper 003). The loss is the mean over the
    whole batch of each utterance's CTC loss."""
    rows = batch_shares([len(u.feats) for u in items], ctx.world_size)[ctx.rank]
    feat_lens = torch.tensor([len(u.feats) for u in items], dtype=torch.int64)
    out_lens = model.output_lengths(feat_lens.to(device))
    # The whole batch's CAPE draws (global RNG) on every rank: each takes its rows.
    positions = cape_positions(out_lens, int(out_lens.max()), model.cfg, model.training)
    opt.zero_grad(set_to_none=True)
    loss = torch.zeros((), device=device)
    if rows:  # a batch of fewer utterances than processes leaves some ranks without any
        batch = collate([items[i] for i in rows]).to(device)
        feats = batch.feats
        if augment.enabled:
            args = augment.model_dump(exclude={"enabled"})
            feats = apply_spec_augment(feats, feat_lens, generator, rows=rows, **args)
        frames = int(model.output_lengths(batch.feat_lens).max())
        log_probs, share_lens = model(feats, batch.feat_lens, positions[rows, :frames])
        losses = ctc_losses(log_probs, share_lens, batch.targets, batch.target_lens)
        loss = losses.sum() / len(items)
        loss.backward()
    params = list(model.parameters())
    if ctx.world_size > 1:
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        loss = loss.detach()
        all_reduce_sum([p.grad for p in params] + [loss])
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    grad_sq += torch.stack(torch._foreach_norm(grads)).double() ** 2
    nn.utils.clip_grad_norm_(params, recipe.grad_clip)
    opt.step()
    return loss.item()


def progress_bar(enabled: bool):
    return make_progress(
        "seed",
        TextColumn("[bold]seed[/]"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
        TextColumn("{task.fields[info]}"),
        enabled=enabled,
    )


def train_central(
    model: CTCTransformer,
    store,
    recipe: CentralRecipe,
    spec_augment: SpecAugmentRecipe,
    *,
    device,
    seed: int,
    progress: bool = True,
    checkpoints: CentralCheckpoints | None = None,
    ctx: DistContext = DistContext(),
    elapsed: Elapsed | None = None,
) -> dict | None:
    """Train `model` in place for recipe.steps steps; returns stats, with the per-parameter sums
    of squared gradient norms over all steps (`layer_grad_sq_sums`), or None where
    `checkpoints.stop_after` ended it first. With `checkpoints`, rank 0 checkpoints the state
    (CentralCheckpoints) and a previous partial training with the same number of processes is
    continued; `elapsed` (a run's clock) is checkpointed with it. The stats' steps_this_run,
    wall_seconds and audio_seconds_per_second are this process's; seconds_of_audio, final_loss
    and layer_grad_sq_sums the whole training's."""
    if ctx.world_size > 1 and (model.cfg.dropout > 0 or model.cfg.layer_drop > 0):
        raise UserError(
            f"seed training on {ctx.world_size} processes needs model dropout and layer_drop 0 "
            f"(they are {model.cfg.dropout} and {model.cfg.layer_drop}: each process would draw "
            "its own); train this seed model with one process"
        )
    model.to(device).train()
    opt = make_central_optimizer(model.named_parameters(), recipe)
    names = [name for name, _ in model.named_parameters()]
    grad_sq = torch.zeros(len(names), dtype=torch.float64, device=device)
    start, audio_before, losses = 0, 0.0, []
    latest = latest_checkpoint(checkpoints.folder, checkpoints.prefix) if checkpoints else None
    if latest is not None:
        tensors, meta = load_checkpoint(latest)
        if meta.get("processes", 1) != ctx.world_size:
            raise UserError(
                f"{latest}: written by a {meta.get('processes', 1)}-process training; resume "
                f"it with {meta.get('processes', 1)} processes, not {ctx.world_size}"
            )
        if checkpoints.check_resume is not None:
            checkpoints.check_resume(meta)
        model.load_state_dict(
            {k: v for k, v in tensors.items() if not k.startswith(("optim.", GRAD_SQ))}
        )
        load_optimizer_tensors(opt, tensors)
        grad_sq.copy_(tensors[GRAD_SQ])
        start = int(meta["step"])
        audio_before, losses = meta.get("seconds_of_audio", 0.0), meta.get("recent_losses", [])
        if elapsed is not None:
            elapsed.resume(meta)
    utterances = list(store)  # the seed corpus is held in memory for the run
    batches = epoch_batches([u.seconds for u in utterances], recipe, seed)
    every = (checkpoints.every if checkpoints else None) or max(1, recipe.steps // 10)
    stop_after = checkpoints.stop_after if checkpoints else None
    audio, steps_this_run, t0 = 0.0, 0, time.perf_counter()

    def save(steps_done: int) -> None:
        path = step_checkpoint(checkpoints.folder, checkpoints.prefix, steps_done)
        meta = {
            "step": steps_done, "seed": seed, "processes": ctx.world_size,
            "seconds_of_audio": audio_before + audio, "recent_losses": losses[-RECENT_LOSSES:],
            **checkpoints.carry,
        } | ({ELAPSED: elapsed.seconds()} if elapsed is not None else {})  # fmt: skip
        save_checkpoint(
            path, {**model.state_dict(), **optimizer_tensors(opt), GRAD_SQ: grad_sq}, meta
        )
        prune_checkpoints(checkpoints.folder, checkpoints.prefix, path)

    with progress_bar(progress) as bar:
        task = bar.add_task("train", total=recipe.steps, completed=start, info="")
        for step, idx in enumerate(batches):
            if step >= recipe.steps:
                break
            if step < start:
                continue
            if stop_after is not None and step >= stop_after:
                return None
            seed_global_draws(keyed_seed(seed, "step", step), device)  # dropout, CAPE, layer drop
            for group in opt.param_groups:
                group["lr"] = step_decay_lr(recipe, step)
            items = [utterances[i] for i in idx]
            gen = torch.Generator().manual_seed(keyed_seed(seed, "specaug", step))
            losses.append(
                train_step(
                    model, opt, items, recipe, spec_augment, gen, grad_sq, device=device, ctx=ctx
                )
            )
            steps_this_run += 1
            audio += sum(utterances[i].seconds for i in idx)
            rate = audio / (time.perf_counter() - t0)
            bar.update(task, advance=1, info=f"loss {losses[-1]:7.2f}  {rate:6.1f} s-audio/s")
            saving = checkpoints and ((step + 1) % every == 0 or step + 1 == recipe.steps)
            if saving and ctx.is_main:
                save(step + 1)
    wall = time.perf_counter() - t0
    tail = losses[-RECENT_LOSSES:]
    return {
        "steps": recipe.steps,
        "steps_this_run": steps_this_run,
        "seconds_of_audio": audio_before + audio,
        "wall_seconds": wall,
        "audio_seconds_per_second": audio / wall if wall > 0 else None,
        "final_loss": sum(tail) / len(tail) if tail else None,
        "layer_grad_sq_sums": dict(zip(names, grad_sq.tolist(), strict=True)),
    }


# ----------------------------------------------------------------------------------------------
# The task's seed model: shipped, or trained and cached


# Bumped when a cached seed model's files change meaning or content, so no older cache is read:
# 2 = the sidecar holds layer_grad_sq_sums (layer freezing's scores).
SEED_FORMAT = 2

# The seed model is trained with this many CPU threads whatever the run's own count (a sweep's
# --jobs 2 gives each run one): float sums depend on it, and every run of a task must start from
# the same weights. One thread: the count every machine has.
SEED_TRAINING_THREADS = 1

# Seed models shipped with the tasks (tasks/seed-models/, digest-checked): the leaderboard's
# starting weights. Another CPU trains other weights from the same data (its kernels round
# differently: pflbench.numerics), so runs start from the shipped model where there is one, and
# `pflbench seed` trains this machine's own and says whether it matches.
SHIPPED_SEEDS = "seed-models"
# The starting model (seed model, or fresh init without seed data) belongs to the task: every run
# starts from the one trained with this seed, as every FL run of the paper starts from one seed
# model; run seeds vary the federated (or fine-tuning) randomness only.
START_MODEL_SEED = 0


def seed_spec(task: Task, recipe: Recipe, seed: int, vocab: list[str]) -> dict:
    """What defines a task's seed model, its training data aside: a shipped seed model is the
    one for this spec, whatever this machine's copy of the data."""
    return {
        "format": SEED_FORMAT,
        "seed_data": task.seed_data.model_dump(mode="json") if task.seed_data else None,
        "synthetic": task.synthetic.model_dump(mode="json") if task.synthetic else None,
        "model": recipe.model.model_dump(mode="json"),
        "central": recipe.central.model_dump(mode="json"),
        "spec_augment": recipe.spec_augment.model_dump(mode="json"),
        "seed": seed,
        "vocab": vocab,
    }


def seed_key(
    task: Task, recipe: Recipe, seed: int, vocab: list[str], digest: str, processes: int = 1
) -> str:
    """The key of a seed model trained here: its spec, the seed data's digest, the threads, and
    the processes count above one (float sums differ; one-process keys stay those of caches made
    before multi-process training)."""
    parts = {
        **seed_spec(task, recipe, seed, vocab),
        "data_digest": digest,
        "cpu_threads": SEED_TRAINING_THREADS,
    } | ({"processes": processes} if processes > 1 else {})
    return hashlib.sha256(canonical_json(parts).encode()).hexdigest()


def shipped_seed_dir() -> Path:
    """Where the built-in tasks' seed models are shipped: tasks/seed-models/."""
    return builtin_spec_root()[0] / SHIPPED_SEEDS


def shipped_seed_path(
    task: Task, recipe: Recipe, seed: int, vocab: list[str], shipped_dir: Path
) -> Path:
    """Where the seed model of this spec is (or would be) shipped in `shipped_dir`: the file
    named by the spec's hash, whichever task shipped it (a task of another name with the same
    seed spec, such as a copy in an outside specs folder, starts from the same model), else one
    named for this task."""
    spec = hashlib.sha256(canonical_json(seed_spec(task, recipe, seed, vocab)).encode())
    key = spec.hexdigest()[:16]
    shipped = sorted(shipped_dir.glob(f"*-{key}.safetensors"))
    return shipped[0] if shipped else shipped_dir / f"{task.name}-v{task.version}-{key}.safetensors"


def shipped_seed_digest(task: Task, recipe: Recipe) -> str | None:
    """The tensors digest (its sidecar's) of the seed model shipped for this task and recipe, which
    every run of them starts from; None when none is shipped."""
    if task.seed_data is None:
        return None
    vocab = tokenizer_for(task.language).vocab
    shipped = shipped_seed_path(task, recipe, START_MODEL_SEED, vocab, shipped_seed_dir())
    sidecar = meta_path(shipped)
    if not sidecar.is_file():
        return None
    return json.loads(sidecar.read_text()).get("tensors_digest")


def fresh_model(recipe: Recipe, vocab_size: int, seed: int) -> CTCTransformer:
    torch.manual_seed(keyed_seed(seed, "init"))
    m = recipe.model
    return build_model(m.preset, vocab_size, dropout=m.dropout, layer_drop=m.layer_drop)


def seed_model(
    task: Task,
    recipe: Recipe,
    data,
    *,
    seed: int,
    device,
    cache_dir: Path,
    progress: bool = True,
    shipped_dir: Path | None = None,
    ctx: DistContext = DistContext(),
) -> tuple[CTCTransformer, Path | None]:
    """The task's seed model and its checkpoint path (in the cache). With `shipped_dir` and a
    seed model shipped there for this spec (shipped_seed_path), that one, its digest checked;
    else the one trained for the same spec and seed data and number of processes, trained (by all
    ranks of `ctx` together) and cached by rank 0 when there is none. Tasks without seed data get
    a freshly initialized (seeded) model and path None."""
    model = fresh_model(recipe, data.tokenizer.size, seed)
    if task.seed_data is None or data.seed_train is None:
        return model.to(device), None
    vocab = data.tokenizer.vocab
    shipped = shipped_seed_path(task, recipe, seed, vocab, shipped_dir) if shipped_dir else None
    if shipped is not None and shipped.is_file():
        path = _cached_shipped_copy(shipped, Path(cache_dir))
        loaded, _ = load_model(path, device)
        return loaded, path
    digest = data.seed_train.digest
    key = seed_key(task, recipe, seed, vocab, digest, ctx.world_size)
    folder = Path(cache_dir) / "seeds" / f"{task.name}-{key[:16]}"
    path = folder / "seed.safetensors"
    # Rank 0 holds the lock and decides for all (the others would wait on it forever).
    lock = exclusive(folder.with_name(folder.name + ".lock")) if ctx.is_main else nullcontext()
    with lock:
        cached = path.is_file() and path.with_suffix(".json").is_file()
        if not broadcast_from_main(cached, ctx):
            with torch_threads(SEED_TRAINING_THREADS):
                stats = train_central(
                    model,
                    data.seed_train,
                    recipe.central,
                    recipe.spec_augment,
                    device=device,
                    seed=seed,
                    progress=progress,
                    checkpoints=CentralCheckpoints(folder),
                    ctx=ctx,
                )
            meta = {
                "kind": "seed",
                "task": task.name,
                "task_version": task.version,
                "seed": seed,
                "recipe": recipe.model_dump(mode="json"),
                "vocab": vocab,
                "seed_data_digest": digest,
                "seed_data_audio_digest": data.seed_train.audio_digest,
                "key": key,
                "training": stats,
                "tensors_digest": state_digest(model.state_dict()),
                "numerics": {"packages": package_versions(), "cpu": cpu_kernels()},
            }
            if ctx.is_main:
                save_model(path, model, meta)
                prune_checkpoints(folder, SEED_CHECKPOINTS, path)
            barrier(ctx)
            return model.eval(), path
    loaded, _ = load_model(path, device)
    return loaded, path


def _cached_shipped_copy(shipped: Path, cache_dir: Path) -> Path:
    """A copy of a shipped seed model in the cache (its evaluations are cached beside it, and the
    checkout is never written), made once, after checking the tensors' digest its sidecar names."""
    sidecar = meta_path(shipped)
    try:
        expected = json.loads(sidecar.read_text()).get("tensors_digest")
    except (OSError, ValueError, AttributeError) as exc:
        raise UserError(
            f"shipped seed model {shipped}: unreadable sidecar {sidecar} ({exc})"
        ) from None
    if not isinstance(expected, str):
        raise UserError(f"shipped seed model {shipped}: {sidecar.name} names no tensors_digest")
    folder = cache_dir / "seeds" / f"shipped-{expected[:16]}"
    path = folder / "seed.safetensors"
    with exclusive(folder.with_name(folder.name + ".lock")):
        if path.is_file() and meta_path(path).is_file():
            return path
        actual = tensors_digest(shipped)
        if actual != expected:
            raise UserError(
                f"shipped seed model {shipped}: its tensors hash to {actual}, not the "
                f"{expected} its sidecar names (a damaged or replaced file; `git status` it)"
            )
        folder.mkdir(parents=True, exist_ok=True)
        atomic_write(path, lambda tmp: shutil.copyfile(shipped, tmp))
        atomic_write(meta_path(path), lambda tmp: shutil.copyfile(meta_path(shipped), tmp))
    return path


def ship_seed_model(path: Path, shipped: Path) -> None:
    """Copies a seed model trained here to `shipped` (shipped_seed_path), its sidecar naming the
    digest that runs check it against."""
    meta = json.loads(meta_path(path).read_text())
    meta["tensors_digest"] = tensors_digest(path)
    shipped.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(shipped, lambda tmp: shutil.copyfile(path, tmp))
    atomic_write_text(meta_path(shipped), json.dumps(meta, indent=2, sort_keys=True) + "\n")


def compare_with_shipped(path: Path, shipped: Path) -> dict:
    """A seed model trained here against the one shipped for its spec: their tensors' digests,
    and where they differ, whether the seed data and its audio did, and which package versions
    and CPU kernel settings (pflbench.numerics) differ between the two trainings."""
    mine = json.loads(meta_path(path).read_text())
    check = {"digest": tensors_digest(path), "shipped": str(shipped), "matches": None}
    if not shipped.is_file():
        return check
    theirs = json.loads(meta_path(shipped).read_text())
    check["shipped_digest"] = theirs.get("tensors_digest")
    check["matches"] = check["digest"] == check["shipped_digest"]
    for name in ("seed_data_digest", "seed_data_audio_digest"):
        check[f"same_{name}"] = mine.get(name) == theirs.get(name) if theirs.get(name) else None
    numerics_here = mine.get("numerics") or {"packages": package_versions(), "cpu": cpu_kernels()}
    numerics_there = theirs.get("numerics") or {}
    check["numerics_differ"] = {
        f"{group}.{key}": [value, numerics_here[group].get(key)]
        for group in ("packages", "cpu")
        for key, value in numerics_there.get(group, {}).items()
        if value != numerics_here[group].get(key)
    }
    return check
