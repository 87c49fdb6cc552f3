"""The federated round (paper Algorithm 1 with user-level DP), one central step at a time.

    cohort  = sample_cohort(K, S, seed, t)                 # Poisson q = S/K, or fixed S
    mine    = assign_users(cohort, world)[rank]            # balanced by expected local work
    for user in mine:                                      # data prefetched in the background
        Δ = local_sgd(θ, data(user), t, user)              # θ − θ_local (fl.local_update)
                                                           # (or G users at once: fl.parallel)
        agg.add(Δ)                                         # zero-if-NaN, clip, (noise), exact sum
    g = agg.finish()                                       # all-reduce, /qK, + N(0, (Cσ_DP)²)
    θ = server.step(θ, g, lr(t))                           # LAMB by default

Every random choice is keyed by (seed, t, user), so the state to resume from is just the model,
the server optimizer and t.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from pflbench.data.batching import chunks
from pflbench.data.store import FeatureStore
from pflbench.fl.aggregate import StepAggregator
from pflbench.fl.client import ClientTrainer, SequentialClientTrainer
from pflbench.fl.distributed import DistContext, assign_users
from pflbench.fl.parallel import ParallelClientTrainer
from pflbench.fl.server import ServerOptimizer, exponential_decay_lr
from pflbench.privacy.adaptive import next_clip_bound
from pflbench.privacy.audit import CanaryAudit
from pflbench.privacy.sampling import expected_cohort, sample_cohort
from pflbench.spec.models import ClientRecipe, Recipe

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


def expected_work(seconds: float, utterances: int, recipe: ClientRecipe) -> float:
    """Seconds of audio a user's local training processes: what straggler balancing weighs."""
    if recipe.max_utterances is not None and utterances > recipe.max_utterances:
        seconds *= recipe.max_utterances / utterances
    if recipe.local_steps is not None:
        return recipe.local_steps * min(seconds, recipe.batch_seconds)
    return recipe.local_epochs * seconds


def update_bound(recipe: ClientRecipe, max_user_utterances: int) -> float:
    """|Δ_i| ≤ ‖Δ‖ ≤ lr·C_loc·(local steps): the range of an unclipped update."""
    steps = recipe.local_steps
    if steps is None:
        utterances = min(max_user_utterances, recipe.max_utterances or max_user_utterances)
        steps = recipe.local_epochs * max(1, utterances)
    return recipe.lr * recipe.grad_clip * steps


class Simulator:
    """Owns the global model's trained tensors, the client trainer and the server optimizer."""

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
    ):
        self.model = model.to(device)
        self.store, self.recipe, self.sigma_dp = store, recipe, sigma_dp
        self.seed, self.device, self.ctx = seed, device, ctx
        named = dict(model.named_parameters())
        self.names = list(trained) if trained is not None else list(named)
        self.params = [named[n].data for n in self.names]
        fed = recipe.federated
        if parallel_clients < 1:
            raise ValueError(f"parallel_clients must be at least 1, got {parallel_clients}")
        client_args = (model, self.names, fed.client, recipe.spec_augment, seed, device)
        self.client: ClientTrainer = (
            SequentialClientTrainer(*client_args)
            if parallel_clients == 1
            else ParallelClientTrainer(*client_args, group_size=parallel_clients)
        )
        self.server = ServerOptimizer(fed.server, self.names, self.params)
        self.users = sorted(store.users())
        counts = [store.user_num_utterances(u) for u in self.users]
        self.work = [
            expected_work(store.user_seconds(u), n, fed.client)
            for u, n in zip(self.users, counts, strict=True)
        ]
        self.update_bound = update_bound(fed.client, max(counts, default=1))
        # Audit canaries are extra users: sampled like the others, trained by nobody.
        self.audit = None
        self.population = self.users
        if recipe.privacy.audit_canaries:
            trained = dict(zip(self.names, self.params, strict=True))
            self.audit = CanaryAudit(recipe, seed, trained, self.users)
            self.population = self.users + self.audit.ids
            self.work += [0.0] * len(self.audit.ids)
        self.denominator = (
            expected_cohort(len(self.population), fed.cohort_size)
            if fed.sampling == "poisson"
            else min(fed.cohort_size, len(self.population))
        )
        self.clip_bound = recipe.privacy.clip_bound  # C_t: moves under adaptive clipping
        self.step = 0

    def my_users(self, step: int) -> list[str]:
        """This process's share of step `step`'s cohort."""
        fed = self.recipe.federated
        population = self.population
        cohort = sample_cohort(len(population), fed.cohort_size, fed.sampling, self.seed, step)
        cohort_list = cohort.tolist()
        shares = assign_users([self.work[i] for i in cohort_list], self.ctx.world_size)
        return [population[cohort_list[i]] for i in shares[self.ctx.rank]]

    def run_step(self) -> dict:
        """One central step; returns its stats (identical on every rank)."""
        step = self.step
        aggregator = StepAggregator(
            dict(zip(self.names, self.params, strict=True)),
            self.recipe.privacy,
            self.sigma_dp,
            self.denominator,
            self.update_bound,
            self.seed,
            step,
            self.device,
            self.clip_bound,
        )
        mine = self.my_users(step)
        if self.audit is not None:
            mine = self.audit.fold_in(aggregator, mine)
        users = prefetched(self.store.load_user, mine)
        for group in chunks(users, self.client.group_size):
            for user, result in self.client.train_group(self.params, group, step):
                aggregator.add(result.update, user, result.loss, result.local_steps, result.frames)
        grads, stats = aggregator.finish()
        fed = self.recipe.federated
        lr = exponential_decay_lr(step, fed.server.lr, fed.server.decay)
        self.server.step(grads, lr)
        adaptive = self.recipe.privacy.adaptive_clip
        if adaptive is not None:
            self.clip_bound = next_clip_bound(
                self.clip_bound, stats["unclipped_fraction"], adaptive.target_quantile, adaptive.lr
            )
        self.step += 1
        return {"step": step, "lr": lr, **stats}

    def state_dict(self) -> dict[str, torch.Tensor]:
        tensors = {f"model.{k}": v for k, v in self.model.state_dict().items()}
        tensors.update({f"server.{k}": v for k, v in self.server.state_dict().items()})
        tensors["step"] = torch.tensor(self.step, dtype=torch.int64)
        tensors["clip_bound"] = torch.tensor(self.clip_bound, dtype=torch.float64)
        return tensors

    def load_state_dict(self, tensors: dict[str, torch.Tensor]) -> None:
        self.model.load_state_dict(
            {k.removeprefix("model."): v for k, v in tensors.items() if k.startswith("model.")}
        )
        self.server.load_state_dict(
            {k.removeprefix("server."): v for k, v in tensors.items() if k.startswith("server.")}
        )
        self.step = int(tensors["step"])
        if "clip_bound" in tensors:  # checkpoints before adaptive clipping: the recipe's bound
            self.clip_bound = float(tensors["clip_bound"])
        # Frozen tensors live in the client's copy too; keep it in sync with the global model.
        self.client.load_frozen(self.model)
