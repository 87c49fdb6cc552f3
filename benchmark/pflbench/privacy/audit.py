"""Empirical privacy audit of one run with canary users (Andrew et al., "One-shot Empirical
Privacy Estimation for Federated Learning", ICLR 2024), from the final model only.

    2N canaries c_j, each a seeded random direction scaled to the clip bound (per layer to C_h
    under per-layer clipping): j < N are inserted, j >= N held out (never inserted).
    An inserted canary is one more user of the population: sampled like any user, and when
    sampled its update c_j goes through the same clipping and noise as a real user's.
    At the end  ρ_j = cos(θ_0 − θ_T, c_j)   (a client's update is θ − θ_local and the server
    steps against the averaged one, so an inserted canary pulls θ_T − θ_0 towards −c_j).
    μ̂  = (mean ρ_inserted − mean ρ_held-out) / pooled std: for the Gaussian mechanism in high
         dimension both cosine distributions are Gaussian with std ≈ 1/√d (Andrew et al.), and
         telling them apart is exactly μ-GDP.
    ε̂  = the ε of μ̂-GDP at the run's δ, δ(ε) = Φ(−ε/μ + μ/2) − e^ε Φ(−ε/μ − μ/2) (Dong et al.).
    ε_lo: a bound that holds with the stated confidence, from threshold tests "inserted iff
         ρ >= τ" (see epsilon_lower_bound).

The equal-variance (μ-GDP) form is used rather than the two-Gaussian form with separately fitted
stds: at δ = 1e-9 the latter's ε is dominated by sampling error in the ratio of the stds (a 10%
mismatch alone gives ε ≈ 3 for identical means).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import torch
from scipy import optimize, special, stats
from torch import Tensor

from pflbench.errors import UserError
from pflbench.privacy.clipping import layer_bounds
from pflbench.seeds import keyed_generator
from pflbench.spec.models import Recipe

CANARY_PREFIX = "audit-canary-"
CONFIDENCE = 0.95  # of the lower bound
METHOD = (
    "one-shot canary audit (Andrew et al., ICLR 2024) on the final model: cosines of"
    " θ_0 − θ_T with inserted vs held-out canaries; ε of μ-GDP with μ = (mean inserted − mean"
    " held-out) / pooled std"
)
LOWER_BOUND_METHOD = (
    "threshold tests 'inserted iff cosine >= τ' at each inserted cosine τ; one-sided"
    " Clopper-Pearson upper bounds on FPR and FNR at level (1 − confidence)/(2·N) each"
    " (Bonferroni over the N thresholds and both rates); ε_lo = max over τ of"
    " log((1 − δ − FNR⁺)/FPR⁺) and log((1 − δ − FPR⁺)/FNR⁺), clipped at 0. Canaries are"
    " treated as independent trials, as in Andrew et al."
)


# ----------------------------------------------------------------------------------------------
# Canaries


def check_audit(recipe: Recipe) -> None:
    """An audit measures a DP mechanism: federated training with clipped updates."""
    if recipe.privacy.audit_canaries == 0:
        return
    if recipe.training != "federated":
        raise UserError(
            f"privacy.audit_canaries needs federated training (got training: {recipe.training})"
        )
    if recipe.privacy.clipping == "none":
        raise UserError(
            "privacy.audit_canaries needs clipped updates (privacy.clipping: none bounds no"
            " user's contribution, so there is no mechanism to audit)"
        )


def canary_ids(count: int) -> list[str]:
    return [f"{CANARY_PREFIX}{i:06d}" for i in range(count)]


def canary_update(
    index: int,
    seed: int,
    like: dict[str, Tensor],
    clip_bound: float,
    perlayer: bool,
    perlayer_mode: str = "dim",
) -> dict[str, Tensor]:
    """Canary `index`'s update: a Gaussian direction over the tensors of `like` (drawn on the
    CPU, so the same on every device), scaled to L2 norm `clip_bound` — with `perlayer`, each
    tensor to its own bound C_h, so it is clipped exactly like any user."""
    generator = keyed_generator(seed, "audit-canary", index)
    parts = [torch.randn(t.shape, generator=generator) for t in like.values()]
    norms = torch.stack([p.norm(dtype=torch.float64) for p in parts])
    if perlayer:
        bounds = layer_bounds([p.numel() for p in parts], clip_bound, perlayer_mode)
        scales = bounds / norms
    else:
        scales = torch.full_like(norms, clip_bound / float(norms.norm()))
    return {
        name: p.mul_(s).to(dtype=t.dtype, device=t.device)
        for (name, t), p, s in zip(like.items(), parts, scales.tolist(), strict=True)
    }


class CanaryAudit:
    """The canaries of one run: N inserted users plus N held out, and the start model θ_0."""

    def __init__(self, recipe: Recipe, seed: int, params: dict[str, Tensor], users: list[str]):
        check_audit(recipe)
        self.recipe, self.seed = recipe, seed
        self.count = recipe.privacy.audit_canaries
        self.ids = canary_ids(self.count)
        clash = set(self.ids) & set(users)
        if clash:
            raise UserError(f"user ids {sorted(clash)[:3]} clash with the audit canaries' ids")
        self.index = {cid: i for i, cid in enumerate(self.ids)}
        self.real_users = len(users)
        self.start = {n: p.detach().clone() for n, p in params.items()}

    def update(self, index: int, bound: float | None = None) -> dict[str, Tensor]:
        """Canary `index` at `bound` (the step's clip bound; default the recipe's C)."""
        privacy = self.recipe.privacy
        perlayer = privacy.clipping == "perlayer"
        bound = privacy.clip_bound if bound is None else bound
        return canary_update(index, self.seed, self.start, bound, perlayer, privacy.perlayer_mode)

    def fold_in(self, aggregator, users: list[str]) -> list[str]:
        """Add the sampled canaries among `users` to the step's aggregate, each at the step's
        clip bound (adaptive clipping moves it); return the real users."""
        for user in users:
            if user in self.index:
                aggregator.add_canary(self.update(self.index[user], aggregator.bound), user)
        return [u for u in users if u not in self.index]

    def participations(self, cohort: Callable[[int], Tensor], steps: int) -> np.ndarray:
        """How often each inserted canary was sampled in `steps` central steps; `cohort(t)`: the
        mechanism's cohort of step t (indices into the users, then the canaries)."""
        counts = np.zeros(self.count, dtype=np.int64)
        for step in range(steps):
            sampled = cohort(step)
            np.add.at(counts, sampled[sampled >= self.real_users].numpy() - self.real_users, 1)
        return counts

    def cosines(self, params: dict[str, Tensor]) -> tuple[np.ndarray, np.ndarray]:
        """(inserted, held-out) cosines between θ_0 − θ_T and each canary."""
        delta = {n: (self.start[n] - params[n].detach()).double() for n in self.start}
        values = [canary_cosine(delta, self.update(j)) for j in range(2 * self.count)]
        return np.array(values[: self.count]), np.array(values[self.count :])

    def finish(
        self,
        params: dict[str, Tensor],
        cohort: Callable[[int], Tensor],
        steps: int,
        simulated: dict,
    ) -> dict:
        """The audit record (privacy.audit) next to the accountants' ε at the simulated scale;
        `cohort(t)`: the mechanism's cohort of step t."""
        inserted, held_out = self.cosines(params)
        delta = simulated["delta"]
        mu = gdp_mu(inserted, held_out)
        counts = self.participations(cohort, steps)
        accountant = {
            name: (claim or {}).get("epsilon") for name, claim in simulated["epsilon"].items()
        }
        return {
            "method": METHOD,
            "canaries_inserted": self.count,
            "canaries_held_out": self.count,
            "canaries_sampled": int((counts > 0).sum()),
            "canary_participations": int(counts.sum()),
            "dimension": sum(t.numel() for t in self.start.values()),
            "cosines": cosine_summary(inserted, held_out),
            "canary_cosines": {"inserted": inserted.tolist(), "held_out": held_out.tolist()},
            "delta": delta,
            "mu": mu,
            "epsilon_estimate": gdp_epsilon(mu, delta),
            "epsilon_lower_bound": epsilon_lower_bound(inserted, held_out, delta, CONFIDENCE),
            "confidence": CONFIDENCE,
            "lower_bound_method": LOWER_BOUND_METHOD,
            "accountant_epsilon_simulated": accountant,
            "how": (
                "Compare the audit's ε with the accountants' ε at the SIMULATED scale (population"
                f" {simulated['population']} including the {self.count} inserted canaries, cohort"
                f" {simulated['cohort']}, {simulated['steps']} steps, noise multiplier"
                f" {simulated['noise_multiplier']:.6g}): the run's noise is σ_DP at that scale."
                " The extrapolated ε is a claim about another run and cannot be audited here."
            ),
        }


def check_audit_claim(
    privacy: dict | None, audit_canaries: int, where: str, per_canary: bool = True
) -> None:
    """A record's privacy.audit must be the audit its config asked for, its cosine summary and
    lower bound those of its per-canary cosines, and its μ, ε and accountant ε must follow from
    the summary and the privacy claim it sits in. `per_canary=False`: an older (stale) record,
    written before audits kept each canary's cosine, may lack them."""
    audit = (privacy or {}).get("audit")
    if audit is None:
        if audit_canaries:
            raise UserError(f"{where}: the config inserts audit canaries; privacy.audit is missing")
        return
    # What the audit ran is fixed by pflbench and the config: the canaries held out are as
    # many as those inserted, the bound's confidence and method are this module's.
    fixed = {
        "method": METHOD,
        "canaries_inserted": audit_canaries,
        "canaries_held_out": audit_canaries,
        "confidence": CONFIDENCE,
        "lower_bound_method": LOWER_BOUND_METHOD,
    }
    for key, value in fixed.items():
        if audit.get(key) != value:
            raise UserError(
                f"{where}: privacy.audit.{key} is {audit.get(key)!r}, expected {value!r} (the"
                " config's privacy.audit_canaries and pflbench's audit)"
            )
    values = audit.get("canary_cosines")
    if values is not None:
        check_canary_cosines(audit, values, audit_canaries, where)
    elif per_canary:
        raise UserError(
            f"{where}: privacy.audit.canary_cosines is missing: the cosine summary and the lower"
            " bound are checked against each canary's cosine (records of an older task version"
            " or numerics, filed before audits kept them, are exempt)"
        )
    simulated = privacy.get("simulated") or {}
    mu = mu_of(audit["cosines"])
    expected = {
        "delta": simulated.get("delta"),
        "mu": mu,
        "epsilon_estimate": gdp_epsilon(mu, audit["delta"]),
        "accountant_epsilon_simulated": {
            name: (claim or {}).get("epsilon")
            for name, claim in (simulated.get("epsilon") or {}).items()
        },
    }
    for key, value in expected.items():
        claimed = audit.get(key)
        same = (
            claimed == value
            if not isinstance(value, float)
            else isinstance(claimed, int | float) and math.isclose(claimed, value, rel_tol=1e-6)
        )
        if not same:
            raise UserError(f"{where}: privacy.audit.{key} is {claimed!r}, expected {value!r}")


def check_canary_cosines(audit: dict, values: dict, canaries: int, where: str) -> None:
    """The summary and the lower bound a record shows are those of its canaries' own cosines."""
    inserted, held_out = np.asarray(values["inserted"]), np.asarray(values["held_out"])
    if len(inserted) != canaries or len(held_out) != canaries:
        raise UserError(
            f"{where}: privacy.audit.canary_cosines holds {len(inserted)} inserted and"
            f" {len(held_out)} held-out cosines; the config's audit has {canaries} of each"
        )
    derived = {
        **{f"cosines.{k}": v for k, v in cosine_summary(inserted, held_out).items()},
        "epsilon_lower_bound": epsilon_lower_bound(inserted, held_out, audit["delta"], CONFIDENCE),
    }
    claimed = {f"cosines.{k}": v for k, v in audit["cosines"].items()}
    claimed["epsilon_lower_bound"] = audit["epsilon_lower_bound"]
    for key, value in derived.items():
        if not math.isclose(claimed[key], value, rel_tol=1e-9, abs_tol=1e-12):
            raise UserError(
                f"{where}: privacy.audit.{key} is {claimed[key]!r}, but the record's"
                f" canary_cosines give {value!r}"
            )


def canary_cosine(delta: dict[str, Tensor], canary: dict[str, Tensor]) -> float:
    dot = sum(float(torch.dot(delta[n].flatten(), c.double().flatten())) for n, c in canary.items())
    delta_norm = math.sqrt(sum(float(t.square().sum()) for t in delta.values()))
    canary_norm = math.sqrt(sum(float(c.double().square().sum()) for c in canary.values()))
    if delta_norm == 0:
        return 0.0  # the model did not move: nothing to see
    return dot / (delta_norm * canary_norm)


def cosine_summary(inserted: np.ndarray, held_out: np.ndarray) -> dict:
    return {
        "inserted_mean": float(np.mean(inserted)),
        "inserted_std": float(np.std(inserted, ddof=1)),
        "held_out_mean": float(np.mean(held_out)),
        "held_out_std": float(np.std(held_out, ddof=1)),
    }


# ----------------------------------------------------------------------------------------------
# Estimates


def gdp_mu(inserted: Sequence[float], held_out: Sequence[float]) -> float:
    """(mean inserted − mean held-out) / pooled std; inf where the std is 0 and the means differ."""
    if len(inserted) < 2 or len(held_out) < 2:
        raise ValueError("need at least two inserted and two held-out cosines")
    return mu_of(cosine_summary(np.asarray(inserted, float), np.asarray(held_out, float)))


def mu_of(summary: dict) -> float:
    """μ̂ from a cosine_summary (what the record keeps, so a submitted audit can be rechecked)."""
    gap = summary["inserted_mean"] - summary["held_out_mean"]
    pooled = math.sqrt((summary["inserted_std"] ** 2 + summary["held_out_std"] ** 2) / 2)
    if pooled == 0:
        return math.inf if gap > 0 else 0.0
    return max(gap, 0.0) / pooled


def gdp_delta(mu: float, epsilon: float) -> float:
    """δ(ε) of μ-GDP: Φ(−ε/μ + μ/2) − e^ε Φ(−ε/μ − μ/2) (Dong, Roth & Su 2022, Cor. 2.13)."""
    if mu < 0 or epsilon < 0:
        raise ValueError(f"need mu >= 0 and epsilon >= 0, got {mu}, {epsilon}")
    if mu == 0:
        return 0.0
    if math.isinf(mu):
        return 1.0
    first = special.log_ndtr(-epsilon / mu + mu / 2)
    second = epsilon + special.log_ndtr(-epsilon / mu - mu / 2)
    return float(math.exp(first) * -math.expm1(second - first))


def gdp_epsilon(mu: float, delta: float) -> float:
    """The smallest ε >= 0 with δ(ε) <= δ for μ-GDP (inf for μ = inf)."""
    if not 0 < delta < 1:
        raise ValueError(f"need 0 < delta < 1, got {delta}")
    if math.isinf(mu):
        return math.inf
    if gdp_delta(mu, 0.0) <= delta:
        return 0.0
    high = 1.0
    while gdp_delta(mu, high) > delta:
        high *= 2
    return float(optimize.brentq(lambda e: gdp_delta(mu, e) - delta, 0.0, high, xtol=1e-10))


def clopper_pearson_upper(successes: np.ndarray, trials: int, alpha: float) -> np.ndarray:
    """One-sided upper Clopper-Pearson bound at level alpha: P(p <= bound) >= 1 − alpha."""
    successes = np.asarray(successes)
    bound = stats.beta.ppf(1 - alpha, successes + 1, np.maximum(trials - successes, 1))
    return np.where(successes >= trials, 1.0, bound)


def epsilon_lower_bound(
    inserted: Sequence[float], held_out: Sequence[float], delta: float, confidence: float
) -> float:
    """ε that the mechanism exceeds with probability >= `confidence` (LOWER_BOUND_METHOD).

    (ε, δ)-DP bounds every test: TPR <= e^ε·FPR + δ and TNR <= e^ε·FNR + δ. The optimal
    threshold of "inserted iff ρ >= τ" lies at an inserted cosine (raising τ to the next one
    only removes false positives), so the N inserted cosines are the thresholds tried."""
    inserted = np.sort(np.asarray(inserted, float))
    held_out = np.sort(np.asarray(held_out, float))
    n_in, n_out = len(inserted), len(held_out)
    alpha = (1 - confidence) / (2 * n_in)
    false_negatives = np.arange(n_in)  # τ = the k-th smallest inserted cosine
    false_positives = n_out - np.searchsorted(held_out, inserted, side="left")
    fnr = clopper_pearson_upper(false_negatives, n_in, alpha)
    fpr = clopper_pearson_upper(false_positives, n_out, alpha)
    with np.errstate(divide="ignore", invalid="ignore"):
        bounds = np.concatenate([np.log((1 - delta - fnr) / fpr), np.log((1 - delta - fpr) / fnr)])
    bounds = bounds[np.isfinite(bounds)]
    return float(max(0.0, bounds.max())) if bounds.size else 0.0
