"""BandMF DP-FTRL (Choquette-Choo et al. 2023, "(Amplified) Banded Matrix Factorization: A unified
approach to private training", NeurIPS): DP noise correlated across central steps through a
b-banded strategy matrix C, so that much of it cancels in the sum of the steps' updates.

Strategy. The banded square root of the prefix-sum workload A (lower-triangular ones; Kalinin &
Lampert 2024, "Banded Square Root Matrix Factorization for Differentially Private Model
Training", NeurIPS): A = M·M with M lower-triangular Toeplitz, M[t, t-k] = r_k = C(2k, k)/4^k
(the coefficients of (1 - x)^(-1/2)); C keeps M's first b diagonals, a closed form where the
paper's BandMF optimizes C numerically. The mechanism releases Cx + z for the steps' averages x,
which the server sees as x + C⁻¹z: step t's average gets ẑ_t = (C⁻¹z)_t, by forward substitution
ẑ_t = z_t - Σ_{k=1}^{b-1} r_k ẑ_{t-k} (r_0 = 1), z_t ~ N(0, (C_clip·σ)² I) from the step's server
stream. The last b-1 ẑ are the mechanism's state: checkpointed, so a resume continues exactly.

Participation (cyclic Poisson, their Algorithm 2 with Poisson sampling in each part): each user
(audit canaries included) is put once, by a keyed hash of its id and the run seed, in one of b
groups; at step t only group t mod b is eligible, each of its users taking part with probability
q_b = b·S/K, so the expected cohort is S and a user's participations are at least b steps apart.

Accounting (accounting.BandMF, their Thm. 4): as private as the Poisson(q_b)-subsampled Gaussian
with noise multiplier z/max_j‖C e_j‖ over ⌈T/b⌉ steps, z = σ·S. A budget calibrates z for that
at its extrapolated scale with the same b (q_b = b·S_ext/K_ext; refused when above 1). The
record also states `sensitivity`, max over a user's participations of ‖C u‖: with participations
b apart a b-banded C's columns have disjoint supports, so it is √(Σ_{j∈P} ‖C e_j‖²) maximized
over the patterns P (participation_sensitivity).

The clip bound is fixed (no adaptive clipping: the correlated noise assumes one C_clip) and the
noise is the server's. With one band C = I and this is the Gaussian mechanism, bitwise.
"""

from __future__ import annotations

import functools
import math
from collections import deque

import numpy as np
import torch
from pydantic import Field, StrictInt

from pflbench.errors import UserError
from pflbench.privacy.accounting import BandMF as BandMFDescription
from pflbench.privacy.mechanisms.base import (
    PRIVACY_MECHANISMS,
    MechanismContext,
    PrivacyMechanism,
)
from pflbench.privacy.noise import noise_generator, server_noise_std
from pflbench.privacy.sampling import poisson_threshold
from pflbench.seeds import keyed_generator, keyed_seed
from pflbench.spec.models import PrivacyRecipe, Recipe, Strict


class BandMFOptions(Strict):
    bands: StrictInt = Field(
        ge=1, description="b: the strategy matrix's bands, and the groups of users."
    )


def strategy_coefficients(bands: int) -> np.ndarray:
    """r_0..r_{b-1}: r_k = C(2k, k)/4^k, the diagonals of the banded square root of A."""
    return np.array([math.comb(2 * k, k) / 4**k for k in range(bands)])


def strategy_matrix(bands: int, steps: int) -> np.ndarray:
    """C (steps x steps): lower-triangular Toeplitz, r_k on the k-th subdiagonal for k < b."""
    matrix = np.zeros((steps, steps))
    for k, r in enumerate(strategy_coefficients(min(bands, steps))):
        matrix += np.diag(np.full(steps - k, r), -k)
    return matrix


@functools.lru_cache(maxsize=256)
def column_norms(bands: int, steps: int) -> tuple[float, ...]:
    """‖C e_j‖ for j < T: column j holds r_0..r_{min(b, T-j)-1}."""
    squares = np.cumsum(strategy_coefficients(min(bands, steps)) ** 2)
    return tuple(math.sqrt(squares[min(bands, steps - j) - 1]) for j in range(steps))


def participation_sensitivity(norms: tuple[float, ...] | np.ndarray, separation: int) -> float:
    """max over participation patterns P (steps at least `separation` apart) of √(Σ_{j∈P} n_j²),
    for the column norms n_j of a lower-triangular C with at most `separation` bands: the columns
    of such a pattern have disjoint supports, so ‖C u‖² = Σ_{j∈P} u_j² n_j² for every u with
    |u_j| <= 1 on P. A dynamic program over j: best(j) = max(best(j+1), n_j² + best(j+sep))."""
    squares = np.asarray(norms, dtype=float) ** 2
    best = np.zeros(len(squares) + separation)
    for j in reversed(range(len(squares))):
        best[j] = max(best[j + 1], squares[j] + best[j + separation])
    return math.sqrt(best[0])


class BandMF(PrivacyMechanism):
    """BandMF DP-FTRL with the banded square root strategy and cyclic Poisson participation (see
    the module docstring); clipping, global or per layer, is the Gaussian mechanism's."""

    Options = BandMFOptions
    STATEMENT = (
        "{unit}-level DP by BandMF DP-FTRL with {bands} bands: users split once into {bands}"
        " groups (a keyed hash of their id), group t mod {bands} eligible at step t, each of its"
        " {unit}s sampled with probability q_b = {bands}*S/K (cyclic Poisson: one {unit}'s"
        " participations are at least {bands} steps apart); each sampled {unit}'s update clipped"
        " to L2 norm C; the average (sum divided by the expected cohort S) gets the correlated"
        " noise (C^-1 z)_t, z_t ~ N(0, (C*sigma_dp)^2 I), C the {bands}-banded square root of the"
        " prefix-sum matrix (Kalinin & Lampert 2024), i.e. the release Cx + z"
    )

    def __init__(self, recipe: Recipe, context: MechanismContext):
        super().__init__(recipe, context)
        bands = self.options.bands
        self.rate = group_sampling_rate(bands, recipe.federated.cohort_size, len(context.users))
        self.groups = torch.tensor(
            [keyed_seed(context.seed, "bandmf-group", user) % bands for user in context.users],
            dtype=torch.int64,
        )
        self.coefficients = strategy_coefficients(bands).tolist()
        self.std = server_noise_std(self.clip_bound, context.sigma_dp)
        self.history: deque[dict[str, torch.Tensor]] = deque(maxlen=bands - 1)  # ẑ, newest last
        self.next_step = 0

    @classmethod
    def check(cls, recipe: Recipe) -> None:
        super().check(recipe)
        privacy = recipe.privacy
        refusal = None
        if privacy.adaptive_clip is not None:
            refusal = "adaptive_clip (its correlated noise assumes one clip bound)"
        elif privacy.noise_placement != "server":
            refusal = "noise_placement: client (its correlated noise is added by the server)"
        elif recipe.federated.sampling != "poisson":
            refusal = "federated.sampling: fixed (it samples cyclic Poisson cohorts of its own)"
        if refusal is not None:
            raise ValueError(f"privacy mechanism 'bandmf' does not support {refusal}")

    # Accounting -----------------------------------------------------------------------------------

    @classmethod
    def describe(
        cls, privacy: PrivacyRecipe, noise_multiplier: float, population: int, cohort: int,
        steps: int,
    ) -> BandMFDescription:  # fmt: skip
        bands = cls.Options(**privacy.mechanism_options).bands
        norms = column_norms(bands, steps)
        return BandMFDescription(
            noise_multiplier=noise_multiplier,
            sampling_rate=group_sampling_rate(bands, cohort, population),
            steps=steps,
            bands=bands,
            column_norm=max(norms),
            sensitivity=participation_sensitivity(norms, bands),
        )

    @classmethod
    def statement(cls, privacy: PrivacyRecipe, unit: str) -> str:
        bands = cls.Options(**privacy.mechanism_options).bands
        return cls.STATEMENT.format(unit=unit, bands=bands)

    @classmethod
    def accounted_as(cls, privacy: PrivacyRecipe, scale: dict) -> str:
        bandmf = scale["bandmf"]
        gaussian = bandmf["as_sampled_gaussian"]
        return (
            f"BandMF with {bandmf['bands']} bands (cyclic Poisson) and noise multiplier z ="
            f" sigma_dp * S = {scale['noise_multiplier']:.6g} over T = {scale['steps']} steps,"
            " by the amplification theorem for banded matrices (Choquette-Choo et al. 2023, Thm."
            " 4) the Poisson-subsampled Gaussian mechanism with noise multiplier z/max_j||C e_j||"
            f" = {gaussian['noise_multiplier']:.6g} (max_j||C e_j|| ="
            f" {bandmf['column_norm']:.6g}), sampling rate q_b = b*S/K = {bandmf['bands']}*"
            f"{scale['cohort']}/{scale['population']}, composed over ceil(T/b) ="
            f" {gaussian['steps']} steps"
        )

    @classmethod
    def extrapolated_as(cls, privacy: PrivacyRecipe, scale: dict) -> str:
        bandmf = scale["bandmf"]
        gaussian = bandmf["as_sampled_gaussian"]
        return (
            f"z = {scale['noise_multiplier']:.6g} with the same {bandmf['bands']} bands: q_b ="
            f" b*S/K = {bandmf['sampling_rate']:.6g} over ceil(T/b) = {gaussian['steps']} steps"
            f" with noise multiplier {gaussian['noise_multiplier']:.6g}"
        )

    @classmethod
    def scale_record(cls, described: BandMFDescription) -> dict:
        return {"bandmf": described.record()}

    # The run --------------------------------------------------------------------------------------

    def cohort(self, step: int) -> torch.Tensor:
        """Group `step` mod b, each of its users with probability q_b (the Gaussian mechanism's
        Poisson draws, so one band samples exactly as it does)."""
        generator = keyed_generator(self.context.seed, step, "cohort")
        draws = torch.rand(len(self.context.users), generator=generator)
        eligible = self.groups == step % self.options.bands
        return (eligible & (draws < poisson_threshold(self.rate))).nonzero().flatten()

    def add_noise(self, noise: dict[str, torch.Tensor], step: int) -> None:
        """noise += C_clip·σ·ẑ_t, ẑ_t = z_t - Σ_k r_k ẑ_{t-k} with z_t ~ N(0, I) drawn like the
        Gaussian mechanism's (fp32, per tensor in order, from the step's server stream)."""
        if step != self.next_step:
            raise ValueError(
                f"BandMF noise for step {step}, but its history ends at step {self.next_step - 1}:"
                " its noise correlates consecutive steps"
            )
        self.next_step += 1
        if self.context.sigma_dp == 0:
            return
        generator = noise_generator(self.context.seed, step, device=self.context.device)
        fresh = {
            name: torch.randn(t.shape, generator=generator, dtype=torch.float32, device=t.device)
            for name, t in noise.items()
        }
        for r, past in zip(self.coefficients[1:], reversed(self.history), strict=False):
            torch._foreach_add_(list(fresh.values()), [past[n] for n in fresh], alpha=-r)
        self.history.append(fresh)
        for name, tensor in noise.items():
            tensor.add_(fresh[name], alpha=self.std)

    def state_dict(self) -> dict[str, torch.Tensor]:
        state = super().state_dict()
        state["next_step"] = torch.tensor(self.next_step, dtype=torch.int64)
        for i, past in enumerate(self.history):  # oldest first
            state.update({f"history.{i}.{name}": t for name, t in past.items()})
        return state

    def load_state_dict(self, tensors: dict[str, torch.Tensor]) -> None:
        super().load_state_dict(tensors)
        self.next_step = int(tensors["next_step"])
        history: dict[int, dict[str, torch.Tensor]] = {}
        for key, tensor in tensors.items():
            if key.startswith("history."):
                index, name = key.removeprefix("history.").split(".", 1)
                history.setdefault(int(index), {})[name] = tensor.to(self.context.device)
        self.history.clear()
        self.history.extend(history[i] for i in sorted(history))


def group_sampling_rate(bands: int, cohort: int, population: int) -> float:
    """q_b = b·S/K: the rate in the eligible group that keeps the expected cohort at S; UserError
    when above 1 (the b groups of K/b users cannot supply S each)."""
    rate = bands * cohort / population
    if rate > 1:
        raise UserError(
            f"BandMF with {bands} bands needs at least b*S = {bands * cohort} users for cohorts of"
            f" S = {cohort}, got K = {population} (q_b = b*S/K = {rate:.3g} > 1): each step draws"
            " from one of b groups of K/b users; use fewer bands (privacy.mechanism_options) or a"
            " smaller cohort"
        )
    return rate


PRIVACY_MECHANISMS.register("bandmf", BandMF)
