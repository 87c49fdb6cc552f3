"""pflbench side by side with pfl-research 0.6.0 on the same federated work (issue 26, item 4).

The workload is the embedded task's (synth-cv-en-ls-seed) federated phase from its shipped seed
model, on its federated data as `prepare_task` builds it (cached in ~/.cache/pflbench): a fixed
cohort of 16 users per central step drawn by pflbench's sampler, 2 local SGD steps per user on
pflbench's local batches (the task's 8 s of audio per batch and client lr 0.2, local gradient
clipping at the recipe's 1.0 in both), and a plain FedAvg server (SGD at lr 1, no decay:
θ ← θ − mean Δ). Two configurations:

- `none`: no DP. pflbench's `fedavg` baseline (no clipping); pfl without postprocessors (its
  updates' default weight 1 already gives the unweighted mean).
- `dp`: the matched ε 7.2 budget. pflbench's `global` baseline (‖Δ‖ ≤ C = 0.01, N(0, (C·σ_DP)²)
  on the mean, σ_DP of the task's default budget, e.g. eps7.2-synth-m-cohort-matched); pfl's
  CentrallyAppliedPrivacyMechanism(GaussianMechanism(C, σ_DP·16)): pfl noises the sum, then
  averages, so its noise on the mean is the same C·σ_DP.

Each system runs in its own process with torch on `--threads` threads (2), and they step in
lock-step: pfl's step i, then pflbench's step i, never both at once, so neither competes with the
other for the cores. pfl is driven by its own `FederatedAveraging.run` with a `SimulatedBackend`;
a callback hands the turn over after each central iteration. It gets pflbench's users of each
step in pflbench's training order, and the same batches: its user dataset yields, per local step,
the utterances pflbench's client plan picks, with the same SpecAugment draws and the same seeding
of the model's own draws, so that without DP both compute the same model. A pfl step is timed
from its turn to its callback, a pflbench step is `Simulator.run_step`.

Printed per configuration: the median over the paired steps after warm-up of pfl's time /
pflbench's time per central step (wall time, and each process's CPU time), each side's median,
and the load average while measuring; whether each of step 0's client updates (before clipping)
is bitwise the same in both, and the max abs difference of the final weights (without DP only
float rounding should separate them). On a machine loaded beyond its cores, torch processes on 2
threads spend much of a step waiting at OpenMP barriers, the more so the more parallel passes a
step makes: compare with `--threads 1`, which has no barriers.

`--profile` also times sections of both systems' central steps (forward, backward, local step,
data, privacy steps, sum, server step, ...; each section's own time, nested sections subtracted)
and prints where each system's step goes; the hooks add a little time of their own, so take the
ratio from a run without it.

pfl is not a pflbench dependency: put an installation of it on PYTHONPATH, e.g.

    PYTHONPATH=/work/pfl-lib:$PWD/benchmark python scripts/peer_pfl.py --steps 80
    PYTHONPATH=/work/pfl-lib:$PWD/benchmark python scripts/peer_pfl.py --steps 20 --profile
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import threading
import time
from collections import defaultdict, deque
from pathlib import Path

import numpy as np
import torch

import pflbench.fl.aggregate
import pflbench.fl.client
import pflbench.fl.simulator
import pflbench.privacy.steps
from pflbench.central import START_MODEL_SEED, seed_model, shipped_seed_dir, shipped_seed_path
from pflbench.data.batching import collate
from pflbench.data.features import spec_augment
from pflbench.data.prepare import cache_dir_default
from pflbench.fl.algorithms import CLIENT_ALGORITHMS, AlgorithmContext
from pflbench.fl.client import augment_args, plan_client
from pflbench.fl.distributed import DistContext
from pflbench.fl.freeze import trained_tensors
from pflbench.fl.simulator import Simulator
from pflbench.fl.user_state import UserStateStore
from pflbench.model.transformer import ctc_loss
from pflbench.privacy.aggregate import ExactSum
from pflbench.privacy.noise import server_noise_std
from pflbench.privacy.run import run_sigma_dp
from pflbench.privacy.steps import AddServerNoise, ClipGlobal, MeasureNorms, ZeroNonfinite
from pflbench.runner import prepare_data
from pflbench.spec.registry import load_registry
from pflbench.spec.resolve import resolve

TASK = "synth-cv-en-ls-seed"
CONFIGS = {"none": "fedavg", "dp": "global"}  # baseline; `dp` runs at the task's default budget
RUN_SEED = 0
PFL_PREFIX = "net."  # pfl's names of the model's tensors: the wrapper's attribute, then ours


# ----------------------------------------------------------------------------------------------
# The workload, the same in both processes


def workload(dp: str, steps: int):
    """The RunConfig both systems run: the task's recipe with a fixed cohort and a plain FedAvg
    server, under `dp`'s baseline and budget."""
    registry = load_registry()
    budget = registry.task(TASK).spec.budgets[0] if dp == "dp" else "none"
    sets = [
        "federated.sampling=fixed",
        "federated.server.optimizer=sgd",
        "federated.server.lr=1.0",
        "federated.server.decay.rate=1.0",
        f"federated.central_steps={steps}",
    ]
    # Fixed cohorts give both systems the same users each step. `run` refuses them under a DP
    # budget (their ε is not Poisson's); this compares speed and claims no ε.
    return resolve(registry, TASK, CONFIGS[dp], budget, RUN_SEED, sets)


def task_start(config):
    """The task's data and its shipped seed model (refusing to train one: minutes of CPU)."""
    data = prepare_data(config, None, progress=False)
    vocab = data.tokenizer.vocab
    shipped = shipped_seed_path(
        config.task, config.recipe, START_MODEL_SEED, vocab, shipped_seed_dir()
    )
    if not shipped.is_file():
        sys.exit(f"no shipped seed model for {TASK} at {shipped}")
    model, _ = seed_model(
        config.task,
        config.recipe,
        data,
        seed=START_MODEL_SEED,
        device="cpu",
        cache_dir=cache_dir_default(),
        progress=False,
        shipped_dir=shipped_seed_dir(),
    )
    return data, model


def clock() -> tuple[float, float]:
    """(wall time, this process's CPU time summed over its threads) in seconds."""
    return time.perf_counter(), time.process_time()


def since(start: tuple[float, float]) -> tuple[float, float]:
    return tuple(now - then for now, then in zip(clock(), start, strict=True))


def update_digest(tensors) -> str:
    """sha256 of an update's bytes, zeros' signs made positive (−0.0 from a negation)."""
    digest = hashlib.sha256()
    for t in tensors:
        digest.update((t.detach() + 0.0).contiguous().numpy().tobytes())
    return digest.hexdigest()


# ----------------------------------------------------------------------------------------------
# Section timing (--profile)


class Sections:
    """Wall time per labelled section, each section's own (nested sections subtracted), per
    thread; labels starting with "bg:" run on a background thread, beside the step."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)
        self.enabled = False
        self._local = threading.local()

    def _timed(self, label: str, call):
        stack = self._local.__dict__.setdefault("stack", [])
        frame = [time.perf_counter(), 0.0]  # start, time in nested sections
        stack.append(frame)
        try:
            return call()
        finally:
            stack.pop()
            elapsed = time.perf_counter() - frame[0]
            if self.enabled:
                self.seconds[label] += elapsed - frame[1]
            if stack:
                stack[-1][1] += elapsed

    def wrap(self, owner, name: str, label: str) -> None:
        """Time every call of `owner.name` (a function, a method on a class or instance), or of
        `owner[name]` where `owner` is a namespace (a module's globals)."""
        original = owner[name] if isinstance(owner, dict) else getattr(owner, name)

        @functools.wraps(original)
        def timed(*args, **kwargs):
            return self._timed(label, lambda: original(*args, **kwargs))

        if isinstance(owner, dict):
            owner[name] = timed
        else:
            setattr(owner, name, timed)

    def wrap_iterator(self, owner, name: str, label: str) -> None:
        """Time each item of the iterator that `owner.name(...)` returns."""
        original = getattr(owner, name)
        end = object()

        @functools.wraps(original)
        def timed(*args, **kwargs):
            items = iter(original(*args, **kwargs))
            while (item := self._timed(label, lambda: next(items, end))) is not end:
                yield item

        setattr(owner, name, timed)


def profile_pflbench(sections: Sections, sim: Simulator) -> None:
    wrap, client = sections.wrap, sim.client
    wrap(sim, "my_users", "cohort: sampling")
    sections.wrap_iterator(pflbench.fl.simulator, "prefetched", "data: load users (waited)")
    wrap(sim.store, "load_user", "bg: data: load users (prefetch thread)")
    wrap(pflbench.fl.client, "plan_client", "data: batch plan")
    wrap(pflbench.fl.client, "collate", "data: collate")
    wrap(pflbench.fl.client, "spec_augment", "data: SpecAugment")
    sections.wrap_iterator(client, "train_group", "client: trainer loop")
    wrap(client, "_key_model_draws", "client: trainer loop")
    wrap(client.update, "start", "client: copy global weights")
    wrap(client.update, "take_grads", "client: zero grads")  # nothing to zero: the hand-over
    wrap(client.model, "forward", "client: forward")
    wrap(pflbench.fl.client, "ctc_losses", "client: forward")
    wrap(client, "_forward_backward", "client: backward")
    wrap(client.update, "step", "client: local step (clip + SGD)")
    wrap(client.update, "finish", "client: delta")
    for hook in ("start_group", "perturb", "unperturb", "correct", "payload"):
        wrap(sim.algorithm, hook, "client: trainer loop")
    wrap(pflbench.fl.aggregate.StepAggregator, "__init__", "aggregation: setup per step")
    wrap(pflbench.fl.aggregate.StepAggregator, "add", "aggregation: stats")
    wrap(pflbench.privacy.steps, "layer_norms", "aggregation: fp64 layer norms")
    wrap(pflbench.privacy.steps, "zero_if_nonfinite", "aggregation: non-finite check")
    wrap(pflbench.privacy.steps, "clip_update", "aggregation: clip")
    for step in (ZeroNonfinite, ClipGlobal, MeasureNorms):
        wrap(step, "apply", "aggregation: privacy steps (rest)")
    wrap(ExactSum, "add", "aggregation: exact sum")
    wrap(pflbench.fl.aggregate.StepAggregator, "finish", "finish: average + stats")
    wrap(ExactSum, "result", "finish: average + stats")
    wrap(AddServerNoise, "apply", "finish: server noise")
    wrap(sim.server, "step", "server: step")


# ----------------------------------------------------------------------------------------------
# The pflbench process


def pflbench_worker(conn, dp: str, steps: int, warmup: int, threads: int, profile: bool) -> None:
    torch.set_num_threads(threads)
    config = workload(dp, steps)
    data, model = task_start(config)
    sizes = {name: t.numel() for name, t in model.named_parameters()}
    trained = trained_tensors(config.recipe.federated.layer_freeze, sizes, None, TASK)
    sim = Simulator(
        model,
        data.federated_train,
        config.recipe,
        run_sigma_dp(config),
        config.seed,
        "cpu",
        DistContext(),
        trained,
    )
    start = [p.clone() for p in sim.params]
    sections = Sections()
    if profile:
        profile_pflbench(sections, sim)
    conn.send([sim.my_users(t) for t in range(steps)])

    # Step 0's client updates, before the privacy steps touch them.
    digests: dict[str, str] = {}
    train_group = sim.client.train_group

    def digesting(global_params, clients, step):
        for user, result in train_group(global_params, clients, step):
            digests[user] = update_digest(result.update[n] for n in sim.names)
            yield user, result

    for step in range(steps):
        _, turn = conn.recv()
        assert turn == step
        sim.client.train_group = digesting if step == 0 else train_group
        sections.enabled = profile and step >= warmup
        started = clock()
        sim.run_step()
        conn.send(since(started))
    conn.recv()
    conn.send(
        {
            "weights": {n: p.numpy().copy() for n, p in zip(sim.names, sim.params, strict=True)},
            "moved": max(
                float((p - s).abs().max()) for p, s in zip(sim.params, start, strict=True)
            ),
            "digests": digests,
            "sections": dict(sections.seconds),
            "noise_std_on_mean": server_noise_std(
                config.recipe.privacy.clip_bound, run_sigma_dp(config)
            ),
        }
    )


# ----------------------------------------------------------------------------------------------
# The pfl process


class AsrForPfl(torch.nn.Module):
    """pflbench's CTC transformer with the `loss` and `metrics` that pfl's PyTorchModel calls,
    on the batches PflbenchUser yields."""

    def __init__(self, net: torch.nn.Module):
        super().__init__()
        self.net = net

    def loss(self, feats, feat_lens, targets, target_lens):
        self.net.train()
        log_probs, out_lens = self.net(feats, feat_lens)
        return ctc_loss(log_probs, out_lens, targets, target_lens)

    @torch.no_grad()
    def metrics(self, feats, feat_lens, targets, target_lens):
        from pfl.metrics import Weighted

        self.net.eval()
        log_probs, out_lens = self.net(feats, feat_lens)
        loss = float(ctc_loss(log_probs, out_lens, targets, target_lens))
        return {"loss": Weighted(loss * len(feats), len(feats))}


def pfl_worker(conn, dp: str, steps: int, warmup: int, threads: int, profile: bool) -> None:
    os.environ["PFL_PYTORCH_DEVICE"] = "cpu"
    # pfl sets up its (here single-process) distributed context only in a process named
    # MainProcess, its guard against DataLoader workers: this process is the pfl run's main one.
    multiprocessing.current_process().name = "MainProcess"
    torch.set_num_threads(threads)
    from pfl.aggregate.simulate import SimulatedBackend
    from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
    from pfl.callback.base import TrainingProcessCallback
    from pfl.data.dataset import Dataset
    from pfl.data.federated_dataset import FederatedDataset
    from pfl.hyperparam import NNTrainHyperParams
    from pfl.metrics import Metrics
    from pfl.model.pytorch import PyTorchModel
    from pfl.postprocessor.base import Postprocessor
    from pfl.privacy import CentrallyAppliedPrivacyMechanism, GaussianMechanism
    from pfl.privacy.gaussian_mechanism import get_noise_stddev

    np.random.seed(RUN_SEED)  # pfl's central seeds (its noise) come from numpy's global RNG
    config = workload(dp, steps)
    data, model = task_start(config)
    recipe, fed = config.recipe, config.recipe.federated
    cohorts = conn.recv()
    names = [n for n, _ in model.named_parameters()]
    # The algorithm object only for plan_client (FedAvg's utterance selection: all of them).
    states = tempfile.TemporaryDirectory(prefix="peer-pfl-")  # FedAvg keeps no user state
    algorithm = CLIENT_ALGORITHMS[fed.client.algorithm](
        fed.client,
        AlgorithmContext(
            names,
            [p.data for p in model.parameters()],
            config.seed,
            "cpu",
            UserStateStore(Path(states.name)),
            1.0,
        ),
    )

    class PflbenchUser(Dataset):
        """A user's data at a central step as pfl iterates it: per local step, the batch of
        pflbench's client plan, SpecAugment drawn from the plan's stream, the model's own draws
        seeded as pflbench seeds them (each iteration starts afresh, so pfl's evaluation pass
        at iteration 0 changes nothing)."""

        def __init__(self, step: int, user: str):
            super().__init__(raw_data=(), user_id=user)
            self.step, self.utterances = step, data.federated_train.load_user(user)

        def __len__(self):
            return len(self.utterances)

        def iter(self, batch_size):
            plan = plan_client(algorithm, config.seed, self.step, self.user_id, self.utterances)
            torch.manual_seed(plan.model_seed)
            for indices in plan.schedule:
                batch = collate([plan.utterances[i] for i in indices])
                feats = batch.feats
                if recipe.spec_augment.enabled:
                    args = augment_args(recipe.spec_augment)
                    feats = spec_augment(feats, batch.feat_lens, plan.generator, **args)
                yield feats, batch.feat_lens, batch.targets, batch.target_lens

    pending: deque = deque()  # (step, user) of the step pfl is at, in pflbench's order
    digests: dict[str, str] = {}

    class StepZeroDigests(Postprocessor):
        """Records each user's update at step 0 in pflbench's sign (Δ = θ_global − θ_local)."""

        step = 0

        def postprocess_one_user(self, *, stats, user_context):
            if self.step == 0:
                digests[user_context.user_id] = update_digest(-stats[PFL_PREFIX + n] for n in names)
            return stats, Metrics()

    digest_step = StepZeroDigests()
    sections = Sections()

    class LockStep(TrainingProcessCallback):
        """After each central iteration: report its time, wait for the next turn."""

        def __init__(self):
            self.started = clock()

        def wait_turn(self, step: int) -> None:
            _, turn = conn.recv()
            assert turn == step
            digest_step.step = step
            sections.enabled = profile and step >= warmup
            pending.extend((step, user) for user in cohorts[step])
            self.started = clock()

        def after_central_iteration(self, aggregate_metrics, model, *, central_iteration):
            conn.send(since(self.started))
            if central_iteration + 1 < steps:
                self.wait_turn(central_iteration + 1)
            return False, Metrics()

    wrapper = AsrForPfl(model)

    def local_optimizer(params, lr):
        optimizer = torch.optim.SGD(params, lr=lr)
        if profile:
            sections.wrap(optimizer, "step", "client: local step (clip + SGD)")
            sections.wrap(optimizer, "zero_grad", "client: zero grads")
        return optimizer

    central = torch.optim.SGD(wrapper.parameters(), lr=fed.server.lr)
    pfl_model = PyTorchModel(wrapper, local_optimizer, central)
    postprocessors: list = [digest_step]
    sigma_dp = run_sigma_dp(config)
    cohort = fed.cohort_size
    noise_on_sum = 0.0
    if sigma_dp > 0:
        bound = recipe.privacy.clip_bound
        mechanism = GaussianMechanism(bound, sigma_dp * cohort)  # std C·σ·S on the sum
        postprocessors.append(CentrallyAppliedPrivacyMechanism(mechanism))
        noise_on_sum = get_noise_stddev(bound, mechanism.relative_noise_stddev)
    users = FederatedDataset(lambda key: PflbenchUser(*key), lambda: pending.popleft())
    backend = SimulatedBackend(training_data=users, val_data=None, postprocessors=postprocessors)
    if profile:
        profile_pfl(sections, globals(), data.federated_train, wrapper, pfl_model)
    lock_step = LockStep()
    lock_step.wait_turn(0)
    FederatedAveraging().run(
        algorithm_params=NNAlgorithmParams(
            central_num_iterations=steps,
            evaluation_frequency=steps,  # pfl evaluates at iteration 0 regardless: warm-up
            train_cohort_size=cohort,
            val_cohort_size=None,
        ),
        backend=backend,
        model=pfl_model,
        model_train_params=NNTrainHyperParams(
            local_num_epochs=None,
            local_learning_rate=fed.client.lr,
            local_batch_size=None,  # PflbenchUser batches by seconds of audio
            local_max_grad_norm=fed.client.grad_clip,
            local_num_steps=fed.client.local_steps,
        ),
        callbacks=[lock_step],
        send_metrics_to_platform=False,  # pfl's console print of every iteration's metrics
    )
    conn.recv()
    weights = {
        n.removeprefix(PFL_PREFIX): p.detach().numpy().copy() for n, p in wrapper.named_parameters()
    }
    conn.send(
        {
            "weights": weights,
            "digests": digests,
            "sections": dict(sections.seconds),
            # pfl's std on the sum, over the cohort it averages
            "noise_std_on_mean": noise_on_sum / cohort,
        }
    )


def profile_pfl(sections: Sections, script: dict, store, wrapper, pfl_model) -> None:
    """`script`: this script's globals, which the pfl worker's user data calls through."""
    import pfl.internal.bridge.pytorch.sgd as pfl_sgd
    from pfl.aggregate.base import SumAggregator
    from pfl.algorithm import FederatedAveraging
    from pfl.privacy.gaussian_mechanism import GaussianMechanism

    wrap = sections.wrap
    wrap(store, "load_user", "data: load users (waited)")
    wrap(script, "plan_client", "data: batch plan")
    wrap(script, "collate", "data: collate")
    wrap(script, "spec_augment", "data: SpecAugment")
    wrap(type(pfl_model), "get_parameters", "client: copy global weights")
    wrap(type(pfl_model), "set_parameters", "client: copy global weights")
    wrap(wrapper.net, "forward", "client: forward")
    wrap(script, "ctc_loss", "client: forward")
    wrap(pfl_sgd, "_sgd_train_step", "client: backward")
    wrap(torch.nn.utils, "clip_grad_norm_", "client: local step (clip + SGD)")
    wrap(type(pfl_model), "get_model_difference", "client: delta")
    wrap(GaussianMechanism, "constrain_sensitivity", "aggregation: clip")
    wrap(SumAggregator, "accumulate", "aggregation: sum")
    wrap(GaussianMechanism, "add_noise", "finish: server noise")
    wrap(FederatedAveraging, "process_aggregated_statistics", "finish: average + stats")
    wrap(type(pfl_model), "apply_model_update", "server: step")


# ----------------------------------------------------------------------------------------------
# The pairing


def paired_run(dp: str, steps: int, warmup: int, threads: int, profile: bool) -> dict:
    """Both systems `steps` central steps in lock-step; the figures of the steps after
    `warmup`."""
    context = multiprocessing.get_context("spawn")  # pfl sets its own start method on import
    workers, conns = {}, {}
    for name, target in (("pflbench", pflbench_worker), ("pfl", pfl_worker)):
        conns[name], child = context.Pipe()
        workers[name] = context.Process(
            target=target, args=(child, dp, steps, warmup, threads, profile), name=f"peer-{name}"
        )
        workers[name].start()
        child.close()  # the worker's end: a worker's death is then EOF here

    def receive(name: str):
        try:
            return conns[name].recv()
        except EOFError:
            sys.exit(f"the {name} worker died ({dp}); its traceback is above")

    try:
        conns["pfl"].send(receive("pflbench"))  # the cohorts, in pflbench's order
        seconds: dict[str, list[float]] = {"pfl": [], "pflbench": []}  # wall time per step
        cpu: dict[str, list[float]] = {"pfl": [], "pflbench": []}  # CPU time per step
        loads = []
        for step in range(steps):
            for name in ("pfl", "pflbench"):
                conns[name].send(("go", step))
                wall, cpu_seconds = receive(name)
                seconds[name].append(wall)
                cpu[name].append(cpu_seconds)
            loads.append(os.getloadavg()[0])
            pfl, ours = seconds["pfl"][-1], seconds["pflbench"][-1]
            print(
                f"  [{dp}] step {step + 1}/{steps}: pfl {pfl:.2f} s, pflbench {ours:.2f} s,"
                f" ratio {pfl / ours:.3f} (CPU time {cpu['pfl'][-1] / cpu['pflbench'][-1]:.3f}),"
                f" load {loads[-1]:.2f}",
                file=sys.stderr,
                flush=True,
            )
        ends = {}
        for name in ("pfl", "pflbench"):
            conns[name].send("finish")
            ends[name] = receive(name)
    finally:
        for conn in conns.values():
            conn.close()  # a worker still waiting for its turn then ends
        for worker in workers.values():
            worker.join(timeout=60)
            if worker.is_alive():
                worker.terminate()
    return summarize(dp, seconds, cpu, loads, warmup, ends)


def summarize(dp: str, seconds: dict, cpu: dict, loads: list, warmup: int, ends: dict) -> dict:
    pfl, ours = seconds["pfl"][warmup:], seconds["pflbench"][warmup:]
    ratios = [a / b for a, b in zip(pfl, ours, strict=True)]
    pfl_cpu, ours_cpu = cpu["pfl"][warmup:], cpu["pflbench"][warmup:]
    cpu_ratios = [a / b for a, b in zip(pfl_cpu, ours_cpu, strict=True)]
    result = {
        "config": dp,
        "paired_steps": len(ratios),
        "warmup_steps": warmup,
        "ratio_pfl_over_pflbench_median": statistics.median(ratios),
        "ratio_quartiles": statistics.quantiles(ratios, n=4),
        "pfl_step_seconds_median": statistics.median(pfl),
        "pflbench_step_seconds_median": statistics.median(ours),
        # CPU time of each process per step (all its threads, spinning included)
        "cpu_ratio_pfl_over_pflbench_median": statistics.median(cpu_ratios),
        "pfl_step_cpu_seconds_median": statistics.median(pfl_cpu),
        "pflbench_step_cpu_seconds_median": statistics.median(ours_cpu),
        "load_average_1min": {
            "min": min(loads),
            "median": statistics.median(loads),
            "max": max(loads),
        },
        "noise_std_on_mean": {k: ends[k]["noise_std_on_mean"] for k in ends},
        "seconds": seconds,
        "cpu_seconds": cpu,
    }
    a, b = ends["pfl"], ends["pflbench"]
    same = [u for u in b["digests"] if a["digests"].get(u) == b["digests"][u]]
    result["step0_client_updates_identical"] = f"{len(same)}/{len(b['digests'])}"
    diffs = {n: float(np.abs(a["weights"][n] - w).max()) for n, w in b["weights"].items()}
    result["final_weights_bitwise_equal"] = all(
        np.array_equal(a["weights"][n], w) for n, w in b["weights"].items()
    )
    result["final_weights_max_abs_diff"] = max(diffs.values())
    result["final_weights_max_abs_diff_tensor"] = max(diffs, key=diffs.get)
    result["pflbench_max_abs_weight_change_from_seed"] = b["moved"]
    if any(ends[k]["sections"] for k in ends):
        result["sections_ms_per_step"] = {
            k: sections_per_step(ends[k]["sections"], seconds[k][warmup:]) for k in ends
        }
    return result


def sections_per_step(sections: dict[str, float], steps: list[float]) -> dict[str, float]:
    """Milliseconds per step of each section, "other" for the step's time outside them, and the
    step's total."""
    per_step = {label: sec / len(steps) * 1e3 for label, sec in sections.items()}
    total = sum(steps) / len(steps) * 1e3
    inside = sum(ms for label, ms in per_step.items() if not label.startswith("bg:"))
    return dict(sorted(per_step.items())) | {
        "other: loop and bookkeeping": total - inside,
        "total": total,
    }


def report(result: dict) -> None:
    r = result
    q1, _, q3 = r["ratio_quartiles"]
    load = r["load_average_1min"]
    print(f"\n== {r['config']}: {r['paired_steps']} paired steps after {r['warmup_steps']} warm-up")
    print(
        f"pfl / pflbench time per central step: median {r['ratio_pfl_over_pflbench_median']:.3f}"
        f" (quartiles {q1:.3f}, {q3:.3f})"
    )
    print(
        f"CPU time per central step: ratio median {r['cpu_ratio_pfl_over_pflbench_median']:.3f};"
        f" pfl {r['pfl_step_cpu_seconds_median']:.2f} s, pflbench"
        f" {r['pflbench_step_cpu_seconds_median']:.2f} s"
    )
    print(
        f"median step: pfl {r['pfl_step_seconds_median'] * 1e3:.0f} ms, pflbench"
        f" {r['pflbench_step_seconds_median'] * 1e3:.0f} ms"
    )
    print(
        f"load average (1 min) while measuring: {load['min']:.2f} .. {load['max']:.2f},"
        f" median {load['median']:.2f}"
    )
    noise = r["noise_std_on_mean"]
    print(f"noise std on the mean: pfl {noise['pfl']:.4g}, pflbench {noise['pflbench']:.4g}")
    print(f"step 0 client updates bitwise identical: {r['step0_client_updates_identical']}")
    print(
        f"final weights bitwise equal: {r['final_weights_bitwise_equal']}; max abs diff"
        f" {r['final_weights_max_abs_diff']:.3g} ({r['final_weights_max_abs_diff_tensor']});"
        " largest change from the seed model"
        f" {r['pflbench_max_abs_weight_change_from_seed']:.3g}"
    )
    if "sections_ms_per_step" in r:
        sections = r["sections_ms_per_step"]
        ours, theirs = sections["pflbench"], sections["pfl"]
        print("\nwhere a central step goes (ms per step, share of the step; bg: beside it):")
        print(f"{'section':44} {'pflbench':>16} {'pfl':>16}")
        for label in sorted(set(ours) | set(theirs), key=lambda x: (x == "total", x)):
            cells = [
                f"{s[label]:8.1f} {s[label] / s['total']:7.1%}" if label in s else " " * 16
                for s in (ours, theirs)
            ]
            print(f"{label:44} {cells[0]} {cells[1]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=80, help="paired steps after warm-up")
    parser.add_argument("--warmup", type=int, default=2, help="steps left out (≥ 1)")
    parser.add_argument("--dp", default="none,dp", help="configurations: none, dp or none,dp")
    parser.add_argument("--threads", type=int, default=2, help="torch threads per process")
    parser.add_argument("--profile", action="store_true", help="time sections of the steps")
    parser.add_argument("--json", type=Path, help="write the figures (and step times) here")
    args = parser.parse_args()
    if args.warmup < 1:
        parser.error("--warmup must be at least 1 (pfl evaluates every user at iteration 0)")
    configs = args.dp.split(",")
    if unknown := set(configs) - set(CONFIGS):
        parser.error(f"--dp: unknown {sorted(unknown)}; known: {', '.join(CONFIGS)}")
    print(f"uptime before: {os.getloadavg()}", flush=True)
    results = []
    for dp in configs:
        results.append(
            paired_run(dp, args.warmup + args.steps, args.warmup, args.threads, args.profile)
        )
        report(results[-1])
    print(f"\nuptime after: {os.getloadavg()}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
