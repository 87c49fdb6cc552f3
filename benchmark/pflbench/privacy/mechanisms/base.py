"""The privacy-mechanism interface and its registry (after pfl-research's PrivacyMechanism and its
SplitPrivacyMechanism): one stateful object per run, built from the privacy recipe, owning
everything DP about a central step t:

    cohort(t)                              which users take part (what the accountant assumes)
    constrain_sensitivity(Δ, user, t)      per user, before the exact sum: a NaN/Inf update
                                           zeroed, clipped to C_t, client noise if placed there
    add_noise(noise, t)                    once: the step's noise on the average (the exact sum
                                           over `denominator`), into zeroed fp64 buffers the
                                           aggregator adds to the exact sum before rounding
    end_step(within, participants, t)      what it releases beside the average (adaptive
                                           clipping's noised fraction within C_t), and C_{t+1}
    state_dict() / load_state_dict()       its state, for an exact resume

and, as class methods that need no run, how it is accounted: `describe` is the description the
accountants analyse (privacy/accounting.py) at any scale (K, S, T), `statement` and
`accounted_as` the words a record uses for it. The aggregator (fl.aggregate) keeps only the exact
sum and named statistics; the simulator (fl.simulator) asks the mechanism who takes part.

The Gaussian mechanism of paper 002's Algorithm 1 is the base class; other mechanisms override
what differs (BandMF, bandmf.py: the cohorts and the noise). Built-in mechanisms are the modules
of this package; plug-ins register theirs in PRIVACY_MECHANISMS, and `privacy.mechanism` names
one, with `privacy.mechanism_options` checked by its `Options`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
from pydantic import BaseModel, ValidationError

from pflbench.errors import UserError
from pflbench.extension import ExtensionPoint
from pflbench.privacy.accounting import MechanismDescription, SampledGaussian
from pflbench.privacy.adaptive import next_clip_bound
from pflbench.privacy.clipping import layer_norms, measurement_error
from pflbench.privacy.sampling import expected_cohort, sample_cohort
from pflbench.privacy.steps import ClipGlobal, ClipPerLayer, privacy_steps
from pflbench.spec.models import NoOptions, PrivacyRecipe, Recipe
from pflbench.spec.registry import format_validation_error


@dataclass(frozen=True)
class MechanismContext:
    """What a run gives its mechanism: the population the cohorts are drawn from (users and audit
    canaries, by index), the noise σ_DP of the average relative to C (0: no DP), the run seed and
    the device of the updates."""

    users: Sequence[str]
    sigma_dp: float
    seed: int
    device: str


class PrivacyMechanism:
    """The Gaussian mechanism (paper 002, Algorithm 1): Poisson sampling at q = S/K (or a fixed
    cohort of S), each update clipped to C_t, and N(0, (C_t·σ_DP)²) added once to the average of
    the sum over qK (or S); under adaptive clipping C_t moves each step from the noised fraction
    of users within it. Its ε is the Poisson-subsampled Gaussian's with z = σ_DP·S."""

    Options: ClassVar[type[BaseModel]] = NoOptions  # privacy.mechanism_options
    STATEMENT: ClassVar[str] = (
        "{unit}-level DP: each sampled {unit}'s update clipped to L2 norm C, Gaussian noise of std"
        " C*sigma_dp on the average (sum divided by the expected cohort qK); Poisson-subsampled"
        " Gaussian mechanism with noise multiplier z = sigma_dp*qK, composed over T central steps"
    )

    def __init__(self, recipe: Recipe, context: MechanismContext):
        self.recipe, self.context = recipe, context
        self.privacy = recipe.privacy
        self.options = self.Options(**self.privacy.mechanism_options)
        self.denominator = self.expected_cohort(recipe, len(context.users))
        self._at_bound(self.privacy.clip_bound)

    @classmethod
    def check(cls, recipe: Recipe) -> None:
        """Raise ValueError where `recipe` does not fit this mechanism."""
        try:
            cls.Options(**recipe.privacy.mechanism_options)
        except ValidationError as exc:
            where = f"privacy.mechanism_options of {recipe.privacy.mechanism!r}"
            raise ValueError(format_validation_error(where, exc)) from None

    # Accounting: no run needed --------------------------------------------------------------------

    @classmethod
    def describe(
        cls, privacy: PrivacyRecipe, noise_multiplier: float, population: int, cohort: int,
        steps: int,
    ) -> MechanismDescription:  # fmt: skip
        """The mechanism at scale (K, S, T) with noise multiplier z = σ_DP·S, for accountants."""
        return SampledGaussian(noise_multiplier, cohort / population, steps)

    @classmethod
    def statement(cls, privacy: PrivacyRecipe, unit: str) -> str:
        """The record's `privacy.mechanism`: what the mechanism does, in words."""
        return cls.STATEMENT.format(unit=unit)

    @classmethod
    def accounted_as(cls, privacy: PrivacyRecipe, scale: dict) -> str:
        """How the accountants see a scale of the record (`privacy.simulated` or `extrapolated`)."""
        return (
            "the Poisson-subsampled Gaussian mechanism with noise multiplier z = sigma_dp * S ="
            f" {scale['noise_multiplier']:.6g}, sampling rate q = S/K = {scale['cohort']}/"
            f"{scale['population']}, composed over T = {scale['steps']} steps"
        )

    @classmethod
    def extrapolated_as(cls, privacy: PrivacyRecipe, scale: dict) -> str:
        """What the same noise is at the budget's extrapolated scale (`privacy.extrapolated`)."""
        return f"z = {scale['noise_multiplier']:.6g}"

    @classmethod
    def scale_record(cls, described: MechanismDescription) -> dict:
        """What a scale of the record states beyond its K, S, T, q and z (nothing here: they are
        the sampled Gaussian's parameters)."""
        return {}

    # Who takes part -------------------------------------------------------------------------------

    @classmethod
    def expected_cohort(cls, recipe: Recipe, population: int) -> float:
        """The denominator of the average: qK = min(S, K) for Poisson sampling, S for fixed
        cohorts (at most K)."""
        return expected_cohort(population, recipe.federated.cohort_size)

    def cohort(self, step: int) -> torch.Tensor:
        """Indices (sorted, int64) into `context.users` of the users taking part in step `step`."""
        fed = self.recipe.federated
        users, seed = len(self.context.users), self.context.seed
        return sample_cohort(users, fed.cohort_size, fed.sampling, seed, step)

    # One central step -----------------------------------------------------------------------------

    def _at_bound(self, clip_bound: float) -> None:
        """C_t and the steps that depend on it."""
        self.clip_bound = clip_bound
        context = self.context
        self.steps = privacy_steps(
            self.privacy, context.sigma_dp, clip_bound, self.denominator, context.seed,
            context.device,
        )  # fmt: skip
        self.client_noise = self.steps.client_noise

    def largest_element(self, update_bound: float) -> float:
        """A bound on every element of an update going into the sum (`update_bound`: that of an
        unclipped update)."""
        bound = update_bound if self.steps.bound is None else self.steps.bound
        return bound + self.steps.headroom

    def constrain_sensitivity(
        self, update: dict[str, torch.Tensor], user: str, step: int, scale_in_sum: bool = False
    ) -> dict:
        """Run the per-user steps on `update` in place; returns what they saw (privacy/steps.py)
        and `within`: whether the update was within C_t (adaptive clipping's bit).
        `scale_in_sum` (the aggregator's, for a mechanism whose constrain_sensitivity this is):
        where clipping is the last step, its multiply is left to the exact sum's pass over the
        update, in facts["pending"] (ExactSum.add's `factors`)."""
        facts: dict = {}
        last = len(self.steps.per_user) - 1
        for index, user_step in enumerate(self.steps.per_user):
            if scale_in_sum and index == last and isinstance(user_step, ClipGlobal | ClipPerLayer):
                facts |= user_step.apply(update, user, step, facts, scale=False)
            else:
                facts |= user_step.apply(update, user, step, facts)
        facts["within"] = float(torch.linalg.vector_norm(facts["norms"].double().cpu())) <= (
            self.clip_bound
        )
        return facts

    def check_clients(self, clients: float) -> None:
        """Client-side noise has std C·σ_DP on the average only with exactly `denominator`
        clients."""
        if self.client_noise and clients != self.denominator:
            raise ValueError(
                f"client-side noise needs exactly {self.denominator:g} clients per step (then the"
                f" average's noise std is C·σ_DP), got {clients:g}: use fixed-size cohorts"
            )

    @property
    def noises_average(self) -> bool:
        """Whether the average gets noise (add_noise): under DP, unless the clients add it."""
        return self.context.sigma_dp > 0 and not self.client_noise

    def add_noise(self, noise: dict[str, torch.Tensor], step: int) -> None:
        """Add step `step`'s noise on the average (the sum over `denominator`) to `noise` in
        place: zeroed fp64 tensors shaped like the average, which the aggregator adds, times the
        denominator, to the exact sum before anything is rounded (ExactSum.add_noise). A
        mechanism never sees the average itself: noise added to it once rounded would let one
        user move the release by more than C/denominator."""
        for aggregate_step in self.steps.aggregate:
            aggregate_step.apply(noise, step)

    def end_step(self, within: float, participants: float, step: int) -> dict:
        """After the noise: the statistics the mechanism releases beside the average (adaptive
        clipping: C_t and the noised fraction of the `participants`, users and canaries, whose
        update was within C_t), and its next C."""
        release = self.steps.unclipped_fraction
        if release is None:
            return {}
        fraction = release.apply(within, participants, step)  # DP-released: C_{t+1} follows
        released = {"clip_bound": self.clip_bound, "unclipped_fraction": fraction}
        adaptive = self.privacy.adaptive_clip
        self._at_bound(
            next_clip_bound(self.clip_bound, fraction, adaptive.target_quantile, adaptive.lr)
        )
        return released

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"clip_bound": torch.tensor(self.clip_bound, dtype=torch.float64)}

    def load_state_dict(self, tensors: dict[str, torch.Tensor]) -> None:
        if "clip_bound" in tensors:  # checkpoints before adaptive clipping: the recipe's bound
            self._at_bound(float(tensors["clip_bound"]))


# The registry (more built-ins: modules of this package; plug-ins: pflbench.plugins).
PRIVACY_MECHANISMS = ExtensionPoint(
    "privacy mechanism",
    (("gaussian", PrivacyMechanism),),
    entry_type=PrivacyMechanism,
    classes=True,
)


def checks_plugin_bound(mechanism: PrivacyMechanism) -> bool:
    """Whether each update is measured after the mechanism's constrain_sensitivity
    (`check_within_clip_bound`): a plug-in's, under DP. Its ε assumes every update within C_t,
    and nothing else would notice one that is not (a leaky plug-in's record re-scores and
    re-accounts like any other); the mechanisms pflbench ships (classes of this package's
    modules) clip with a proven bound (privacy/clipping.py) and pay no extra pass. Decided by the
    class, not by the registry's origin: a class registered outside the plug-in loader (by a
    script or a library) is measured too."""
    shipped = type(mechanism).__module__.startswith(f"{__package__}.")
    return mechanism.context.sigma_dp > 0 and not shipped


def scales_in_sum(mechanism: PrivacyMechanism) -> bool:
    """Whether the aggregator may leave clipping's multiply to the exact sum
    (constrain_sensitivity's `scale_in_sum`): where the mechanism's constrain_sensitivity is the
    Gaussian mechanism's own (an override may read or change the clipped update afterwards) and
    nothing measures the update after it (`checks_plugin_bound`)."""
    own = type(mechanism).constrain_sensitivity is PrivacyMechanism.constrain_sensitivity
    return own and not checks_plugin_bound(mechanism)


def check_within_clip_bound(
    mechanism: PrivacyMechanism, update: dict[str, torch.Tensor], user: str, step: int
) -> float:
    """The update's fp64 L2 norm, proven within the mechanism's C_t (measurement error included:
    a tiny excess is still a false claim); returns that bound on every element of it. UserError
    naming the mechanism, its plug-in, the user and the step otherwise."""
    tensors = list(update.values())
    norm = float(torch.linalg.vector_norm(layer_norms(tensors)))
    error = measurement_error(sum(t.numel() for t in tensors), len(tensors))
    bound = norm * (1 + error)
    if not bound <= mechanism.clip_bound:  # NaN too
        name = mechanism.privacy.mechanism
        origin = PRIVACY_MECHANISMS.origin_of_unshipped(name)
        raise UserError(
            f"privacy mechanism {name!r} ({origin}) left user {user}'s"
            f" update at step {step} with L2 norm {norm:.9g}, over its clip bound C_t ="
            f" {mechanism.clip_bound:.9g}: the noise is calibrated to C_t, so the run's ε would"
            " be false. constrain_sensitivity must leave every update within C_t (clip with"
            " pflbench.privacy.clipping.clip_update, whose result is proven within it)"
        )
    return bound


# How unlikely a plug-in's honest noise is to be refused by check_noise_on_average, per step.
NOISE_CHECK_FALSE_REFUSAL = 1e-9


def check_noise_on_average(
    mechanism: PrivacyMechanism, noise: dict[str, torch.Tensor], step: int
) -> None:
    """A plug-in mechanism's noise on the average at step `step`, measured (add_noise leaves it
    apart from the sum, in `noise`): finite, and not below the Gaussian mechanism's N(0, (C_t·
    σ_DP)²) per element, by a one-sided χ² test of its sum of squares over the d elements (an
    honest plug-in is refused with probability NOISE_CHECK_FALSE_REFUSAL; BandMF's ẑ_t = C⁻¹z_t
    has at least that variance too). The accountants assume that noise: one adding less (a wrong
    std or factor) would otherwise be filed as meeting its budget. UserError naming the
    mechanism, its plug-in and the step."""
    from scipy.stats import chi2  # (imported here: only plug-ins under DP need it)

    tensors = [t for t in noise.values() if t.numel()]
    elements = sum(t.numel() for t in tensors)
    if not elements:
        return
    squares = float(sum(torch.linalg.vector_norm(t.double()) ** 2 for t in tensors))
    std = mechanism.clip_bound * mechanism.context.sigma_dp
    least = std**2 * float(chi2.ppf(NOISE_CHECK_FALSE_REFUSAL, elements))
    if not squares >= least:  # NaN too
        name = mechanism.privacy.mechanism
        origin = PRIVACY_MECHANISMS.origin_of_unshipped(name)
        measured = (squares / elements) ** 0.5
        raise UserError(
            f"privacy mechanism {name!r} ({origin}) added noise of std {measured:.6g} per"
            f" element to the average at step {step}, under the C_t·σ_DP = {std:.6g} its ε is"
            " accounted for (a χ² test over its"
            f" {elements} elements): add_noise must add at least N(0, (C_t·σ_DP)²) to each"
        )


def mechanism_class(privacy: PrivacyRecipe) -> type[PrivacyMechanism]:
    """The registered class `privacy.mechanism` names (UserError listing the known ones)."""
    return PRIVACY_MECHANISMS[privacy.mechanism]


def check_mechanism_recipe(recipe: Recipe) -> None:
    """The recipe's mechanism is registered and the recipe fits it (UserError otherwise)."""
    try:
        mechanism_class(recipe.privacy).check(recipe)
    except ValueError as exc:
        raise UserError(str(exc)) from None
