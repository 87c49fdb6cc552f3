"""The federated round (paper Algorithm 1 with user-level DP), one central step at a time.

    cohort  = mechanism.cohort(t)                          # Poisson q = S/K, or fixed S, or
                                                           # the mechanism's own participation
    mine    = assign_users(cohort, world)[rank]            # balanced by expected local work
    for user in mine:                                      # data prefetched in the background
        Δ, extra = local_sgd(θ, data(user), t, user)       # θ − θ_local (fl.local_update), and
                                                           # the algorithm's payload (fl.algorithms)
                                                           # (or G users at once: fl.parallel)
        agg.add(Δ ⊕ extra)                                 # zero-if-NaN, clip, (noise), exact sum
    g ⊕ ḡ = agg.finish()                                   # all-reduce, /qK, + the mechanism's
                                                           # noise, e.g. N(0, (Cσ_DP)²)
    θ = server.step(θ, g, lr(t))                           # LAMB by default
    algorithm.server_step(ḡ)                               # e.g. SCAFFOLD's control variate

The privacy mechanism (privacy/mechanisms, built once per run) decides who takes part, clips and
noises. Every random choice is keyed by (seed, t, user), so the state to resume from is the model,
the server optimizer, the algorithm's state (the server's, and each user's: fl.user_state), the
mechanism's (C_t, a correlated noise's history) and t.
"""

from __future__ import annotations

import tempfile
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from pflbench.data.batching import chunks
from pflbench.data.store import FeatureStore
from pflbench.fl.aggregate import StepAggregator
from pflbench.fl.algorithms import CLIENT_ALGORITHMS, AlgorithmContext, ClientAlgorithm
from pflbench.fl.client import ClientTrainer, SequentialClientTrainer
from pflbench.fl.distributed import DistContext, assign_users, barrier
from pflbench.fl.parallel import ParallelClientTrainer
from pflbench.fl.server import ServerOptimizer, exponential_decay_lr
from pflbench.fl.user_state import UserStateStore
from pflbench.privacy.aggregate import ExactSum
from pflbench.privacy.audit import CanaryAudit
from pflbench.privacy.mechanisms import PRIVACY_MECHANISMS, MechanismContext
from pflbench.spec.models import Recipe

PREFETCH_DEPTH = 2  # users whose data loads while the current one trains


def prefetched(load: Callable[[str], Any], keys: list[str]) -> Iterator[tuple[str, Any]]:
    """Yield (key, load(key)) in order, loading the next keys on a background thread."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        pending = deque(pool.submit(load, k) for k in keys[:PREFETCH_DEPTH])
        for i, key in enumerate(keys):
            value = pending.popleft().result()
            if i + PREFETCH_DEPTH < len(keys):
                pending.append(pool.submit(load, keys[i + PREFETCH_DEPTH]))
            yield key, value


def expected_work(seconds: float, utterances: int, algorithm: ClientAlgorithm) -> float:
    """Seconds of audio a user's local training processes: what straggler balancing weighs."""
    recipe = algorithm.recipe
    used = algorithm.utterances_used(utterances)
    if used < utterances:
        seconds *= used / utterances
    if recipe.local_steps is not None:
        return recipe.local_steps * min(seconds, recipe.batch_seconds)
    return recipe.local_epochs * seconds


def update_bound(algorithm: ClientAlgorithm, max_user_utterances: int) -> float:
    """|Δ_i| ≤ ‖Δ‖ ≤ lr·C_loc·(local steps): the range of an unclipped update."""
    recipe = algorithm.recipe
    steps = recipe.local_steps
    if steps is None:
        steps = recipe.local_epochs * max(1, algorithm.utterances_used(max_user_utterances))
    return recipe.lr * recipe.grad_clip * steps


class Simulator:
    """Owns the global model's trained tensors, the privacy mechanism, the client algorithm and
    trainer, and the server optimizer. `user_state_dir` keeps the users' algorithm state (a
    temporary folder if None); `compile_backend` compiles the clients' local step (fl.client;
    None: eager)."""

    def __init__(
        self,
        model: torch.nn.Module,
        store: FeatureStore,
        recipe: Recipe,
        sigma_dp: float,
        seed: int,
        device: str,
        ctx: DistContext,
        trained: list[str] | None = None,
        parallel_clients: int = 1,
        user_state_dir: Path | None = None,
        compile_backend: str | None = None,
    ):
        self.model = model.to(device)
        self.store, self.recipe = store, recipe
        self.device, self.ctx = device, ctx
        named = dict(model.named_parameters())
        self.names = list(trained) if trained is not None else list(named)
        self.params = [named[n].data for n in self.names]
        fed = recipe.federated
        if parallel_clients < 1:
            raise ValueError(f"parallel_clients must be at least 1, got {parallel_clients}")
        self.users = sorted(store.users())
        # Audit canaries are extra users: sampled like the others, trained by nobody.
        self.audit = None
        self.population = self.users
        if recipe.privacy.audit_canaries:
            trained = dict(zip(self.names, self.params, strict=True))
            self.audit = CanaryAudit(recipe, seed, trained, self.users)
            self.population = self.users + self.audit.ids
        self.mechanism = PRIVACY_MECHANISMS[recipe.privacy.mechanism](
            recipe, MechanismContext(self.population, sigma_dp, seed, device)
        )
        if user_state_dir is None:
            self._user_state_tmp = tempfile.TemporaryDirectory(prefix="pflbench-user-state-")
            user_state_dir = Path(self._user_state_tmp.name)
        context = AlgorithmContext(
            names=self.names,
            params=self.params,
            seed=seed,
            device=device,
            user_states=UserStateStore(user_state_dir),
            sampling_rate=self.mechanism.denominator / len(self.population),
        )
        self.algorithm = CLIENT_ALGORITHMS[fed.client.algorithm](fed.client, context)
        client_args = (model, self.names, self.algorithm, recipe.spec_augment, seed, device)
        self.client: ClientTrainer = (
            SequentialClientTrainer(*client_args, compile_backend=compile_backend)
            if parallel_clients == 1
            else ParallelClientTrainer(
                *client_args, group_size=parallel_clients, compile_backend=compile_backend
            )
        )
        self.server = ServerOptimizer(fed.server, self.names, self.params)
        counts = [store.user_num_utterances(u) for u in self.users]
        self.work = [
            expected_work(store.user_seconds(u), n, self.algorithm)
            for u, n in zip(self.users, counts, strict=True)
        ] + [0.0] * (len(self.population) - len(self.users))
        self.update_bound = self.algorithm.payload_bound(
            update_bound(self.algorithm, max(counts, default=1))
        )
        # What each client sends: Δ per trained tensor, then the algorithm's entries.
        self.payload_like = dict(zip(self.names, self.params, strict=True))
        self.payload_like |= self.algorithm.payload_like()
        self.payload_names = list(self.payload_like)[len(self.names) :]  # beside Δ
        self._sum_workspace: ExactSum | None = None  # the last step's sum (StepAggregator)
        self.step = 0
        self.aggregation_seconds = 0.0  # per-user privacy steps and exact sum (`bench fl`)

    def my_users(self, step: int) -> list[str]:
        """This process's share of step `step`'s cohort."""
        population = self.population
        cohort_list = self.mechanism.cohort(step).tolist()
        shares = assign_users([self.work[i] for i in cohort_list], self.ctx.world_size)
        return [population[cohort_list[i]] for i in shares[self.ctx.rank]]

    def run_step(self) -> dict:
        """One central step; returns its stats (identical on every rank)."""
        step = self.step
        aggregator = StepAggregator(
            self.payload_like, self.mechanism, step, self.update_bound, self._sum_workspace
        )
        self._sum_workspace = aggregator.sum  # the next step sums in its buffers
        mine = self.my_users(step)
        if self.audit is not None:
            mine = self.audit.fold_in(aggregator, mine)
        users = prefetched(self.store.load_user, mine)
        for group in chunks(users, self.client.group_size):
            for user, result in self.client.train_group(self.params, group, step):
                aggregator.add(
                    result.update,
                    user,
                    result.loss,
                    result.local_steps,
                    result.frames,
                    held=self.client.updates_outlive,
                )
        averaged, stats = aggregator.finish()
        self.aggregation_seconds += aggregator.seconds
        fed = self.recipe.federated
        lr = exponential_decay_lr(step, fed.server.lr, fed.server.decay)
        self.server.step(averaged[: len(self.names)], lr)
        beside = averaged[len(self.names) :]
        with self.algorithm.context.user_states.sealed():
            self.algorithm.server_step(dict(zip(self.payload_names, beside, strict=True)))
        self.step += 1
        return {"step": step, "lr": lr, **stats}

    def checkpointed(self) -> None:
        """After a checkpoint at this step: drop the users' states no resume can read, all of
        them after the last step (SCAFFOLD's are a model's size per user: ~15 GB in a run of
        the embedded task)."""
        states = self.algorithm.context.user_states
        if self.step >= self.recipe.federated.central_steps:
            states.clear()
        else:
            states.prune(self.step)

    def state_dict(self) -> dict[str, torch.Tensor]:
        tensors = {f"model.{k}": v for k, v in self.model.state_dict().items()}
        tensors.update({f"server.{k}": v for k, v in self.server.state_dict().items()})
        tensors.update({f"algorithm.{k}": v for k, v in self.algorithm.state_dict().items()})
        tensors.update({f"mechanism.{k}": v for k, v in self.mechanism.state_dict().items()})
        tensors["step"] = torch.tensor(self.step, dtype=torch.int64)
        return tensors

    def load_state_dict(self, tensors: dict[str, torch.Tensor]) -> None:
        self.model.load_state_dict(_under("model.", tensors))
        self.server.load_state_dict(_under("server.", tensors))
        self.algorithm.load_state_dict(_under("algorithm.", tensors))
        self.step = int(tensors["step"])
        # What users' state the killed process wrote after this checkpoint is not the run's.
        if self.ctx.is_main:
            self.algorithm.context.user_states.rewind(self.step)
        barrier(self.ctx)
        # Checkpoints from before the mechanism kept its own state hold C_t at the top level.
        legacy = {"clip_bound": tensors["clip_bound"]} if "clip_bound" in tensors else {}
        self.mechanism.load_state_dict(_under("mechanism.", tensors) or legacy)
        # Frozen tensors live in the client's copy too; keep it in sync with the global model.
        self.client.load_frozen(self.model)


def _under(prefix: str, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k.removeprefix(prefix): v for k, v in tensors.items() if k.startswith(prefix)}
