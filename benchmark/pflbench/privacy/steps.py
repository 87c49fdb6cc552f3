"""The Gaussian mechanism's parts as small steps, each testable alone (after the "postprocessors"
of Apple's pfl-research); a privacy mechanism (privacy/mechanisms) builds them once, and again
only when its clip bound C_t moves (adaptive clipping).

Per-user steps change a user's update (name -> tensor) in place, before it goes into the sum,
and return what they saw, for the step's stats (never released) and for the next steps:

    ZeroNonfinite     a NaN/Inf update becomes zeros            {"nonfinite", "norms"}
                      (exact=False, before no clipping: fp32 norms, "norm_error")
    ClipGlobal        ‖Δ‖ ≤ C                                   {"norms", "clipped", "largest"}
                      (scale=False: the multiply left to the sum, "pending")
    ClipPerLayer      ‖Δ_h‖ ≤ C_h with Σ C_h² = C²              the same as ClipGlobal
    MeasureNorms      no clipping: only the norms               {"norms", "clipped", "largest"}
    AddClientNoise    + N(0, C²σ²S), from the user's own stream {"largest": None}

One pass over the update measures it: ZeroNonfinite's fp64 layer norms are NaN/Inf exactly where
the update holds a NaN/Inf, and the clipping reuses them. Without clipping nothing needs exact
norms (they feed statistics and the range bound only): ZeroNonfinite(exact=False) measures them
in fp32, six times cheaper, and falls back to fp64 only to tell a NaN/Inf from an fp32 overflow.
"largest" bounds every element after the step (an element is at most its layer's L2 norm), so
the exact sum skips its own range pass when the bound already proves the range (None: unknown,
the sum checks).

Aggregate steps make the averaged update's noise once: AddServerNoise adds N(0, (C·σ)²) to the
buffers the aggregator then adds to the exact sum (PrivacyMechanism.add_noise). Adaptive
clipping also releases the fraction of users within the bound (ReleaseUnclippedFraction), a
separate release of a count, not of the update. Steps that draw noise take the central step, which
keys their stream. `privacy_steps` builds them all from the recipe: it is the only place that
turns privacy.clipping and privacy.noise_placement into operations on updates.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

import torch
from torch import Tensor

from pflbench.privacy.adaptive import noisy_unclipped_fraction, update_noise
from pflbench.privacy.clipping import (
    ClipResult,
    clip_update,
    fast_layer_norms,
    layer_norms,
    zero_if_nonfinite,
)
from pflbench.privacy.noise import (
    add_gaussian_noise,
    client_noise_std,
    noise_generator,
    release_generator,
    server_noise_std,
)
from pflbench.spec.models import PrivacyRecipe

# Client-side noise widens the range of an update's elements in the fixed-point sum: it is taken
# as 40 std (a normal draw that far out has probability ~e^-800; ExactSum refuses one that is).
NOISE_HEADROOM = 40.0


class UserStep(Protocol):
    """Changes one user's update in place at central step `step`; returns what it saw of it
    (`seen`: what the steps before it returned), for the stats and the next steps."""

    def apply(self, update: dict[str, Tensor], user: str, step: int, seen: dict) -> dict: ...


class AggregateStep(Protocol):
    """Adds to the noise on the averaged update of central step `step`, in place."""

    def apply(self, noise: dict[str, Tensor], step: int) -> None: ...


# ----------------------------------------------------------------------------------------------
# Per-user steps


@dataclass(frozen=True)
class ZeroNonfinite:
    """Zero an update holding a NaN/Inf: zeros are inside every bound, so DP holds. `exact`:
    measure fp64 norms (what clipping needs); else fp32 ones with their error bound."""

    exact: bool = True

    def apply(self, update: dict[str, Tensor], user: str, step: int, seen: dict) -> dict:
        tensors = list(update.values())
        fast = None if self.exact else fast_layer_norms(tensors)
        if fast is not None and bool(torch.isfinite(fast[0]).all()):
            return {"nonfinite": False, "norms": fast[0], "norm_error": fast[1]}
        norms = layer_norms(tensors)  # exact: NaN/Inf only where the update holds one
        if zero_if_nonfinite(update, norms):
            return {"nonfinite": True, "norms": torch.zeros_like(norms)}
        return {"nonfinite": False, "norms": norms}


@dataclass(frozen=True)
class ClipGlobal:
    """Scale an update over the L2 bound C down to it. `scale=False` leaves the plain multiply
    to the exact sum's pass (clip_update's `pending`, in "pending"), where this is the last step
    before the sum."""

    bound: float

    def apply(
        self, update: dict[str, Tensor], user: str, step: int, seen: dict, scale: bool = True
    ) -> dict:
        clipped = clip_update(
            update, "global", self.bound, in_place=True, norms=seen.get("norms"), scale=scale
        )
        return _clipped_facts(clipped)


@dataclass(frozen=True)
class ClipPerLayer:
    """Clip each layer to its bound C_h (privacy/clipping.py: how `mode` splits C, what `rule`
    does to the layers under their bound); `scale` as ClipGlobal's."""

    bound: float
    mode: Literal["uniform", "dim"]
    rule: Literal["clip", "normalize"]

    def apply(
        self, update: dict[str, Tensor], user: str, step: int, seen: dict, scale: bool = True
    ) -> dict:
        clipped = clip_update(
            update,
            "perlayer",
            self.bound,
            perlayer_mode=self.mode,
            in_place=True,
            perlayer_rule=self.rule,
            norms=seen.get("norms"),
            scale=scale,
        )
        return _clipped_facts(clipped)


@dataclass(frozen=True)
class MeasureNorms:
    """No clipping: the update stays as it is, its per-layer norms still go into the stats."""

    def apply(self, update: dict[str, Tensor], user: str, step: int, seen: dict) -> dict:
        norms = seen["norms"] if "norms" in seen else layer_norms(list(update.values()))
        error = seen.get("norm_error")  # fp32 norms (ZeroNonfinite(exact=False)): their bound
        largest = _largest(norms) if error is None else float((norms / (1 - error)).max())
        return {"norms": norms, "clipped": False, "largest": largest}


@dataclass(frozen=True)
class AddClientNoise:
    """Draw N(0, std²) for a user's update from that user's stream at this step (so the noise
    does not depend on which process trains the user, or when), as a term of its own
    (facts["client_noise"]): the exact sum adds the update and its noise each onto its grid, so
    the released sum is the exact sum of the updates plus noise no user's data moves. Added to
    the update in fp32 first, how the two round together would depend on the update."""

    std: float
    seed: int
    device: str

    def apply(self, update: dict[str, Tensor], user: str, step: int, seen: dict) -> dict:
        generator = noise_generator(self.seed, step, user=user, device=self.device)
        noise = {name: torch.zeros_like(t) for name, t in update.items()}
        add_gaussian_noise(noise, self.std, generator)
        return {"client_noise": noise}


def _clipped_facts(clipped: ClipResult) -> dict:
    # After clipping a layer's norm is at most its measured norm times its factor (the margin
    # keeps scaled layers under their bound; others are as measured).
    facts = {
        "norms": clipped.norms,
        "clipped": clipped.changed,
        "largest": _largest(clipped.norms * clipped.factors),
    }
    if clipped.pending is not None:
        facts["pending"] = clipped.pending
    return facts


def _largest(norms: Tensor) -> float:
    """A bound on every element of layers with these fp64 L2 norms: each element is at most its
    layer's norm; the factor covers the norms' measurement error (clipping.measurement_error,
    (n + H + 16)·2^-53 relative: under 2^-20 up to ~2^33 elements). A layer scaled in bf16 or
    fp16 may round an element up by the dtype's eps/2 beyond this, but not beyond the layer's
    bound (clipping.rounding_margin), and the sum needs no more: its max_abs is that bound."""
    return float(norms.max()) * (1 + 2.0**-20) if norms.numel() else 0.0


# ----------------------------------------------------------------------------------------------
# Aggregate steps


@dataclass(frozen=True)
class AddServerNoise:
    """Add N(0, std²) once to the averaged update (to the noise the aggregator adds to the exact
    sum: PrivacyMechanism.add_noise), from this step's server stream."""

    std: float
    seed: int
    device: str

    def apply(self, noise: dict[str, Tensor], step: int) -> None:
        generator = noise_generator(self.seed, step, device=self.device)
        add_gaussian_noise(noise, self.std, generator)


@dataclass(frozen=True)
class ReleaseUnclippedFraction:
    """Adaptive clipping's release (privacy/adaptive.py): the centred count of users within the
    bound over the expected cohort, plus ½ and N(0, bit_noise²) drawn on the CPU from a stream of
    its own (not a user's: no user id can collide with it)."""

    bit_noise: float
    denominator: float
    seed: int

    def apply(self, unclipped: float, participants: float, step: int) -> float:
        generator = release_generator(self.seed, step, "adaptive-clip")
        return noisy_unclipped_fraction(
            unclipped, participants, self.denominator, self.bit_noise, generator
        )


# ----------------------------------------------------------------------------------------------
# The factory


@dataclass(frozen=True)
class PrivacySteps:
    per_user: list[UserStep]  # on each user's update, in order, before the sum
    aggregate: list[AggregateStep]  # on the average, in order
    # Every element of an update going into the sum is at most `bound` (None: the update is not
    # clipped, its own bound holds) plus `headroom` (client noise).
    bound: float | None
    headroom: float
    # Each user noises its own update: the noiseless average never exists, and its noise is
    # right only when exactly `denominator` users took part.
    client_noise: bool
    unclipped_fraction: ReleaseUnclippedFraction | None  # with adaptive clipping


def privacy_steps(
    privacy: PrivacyRecipe,
    sigma_dp: float,
    clip_bound: float,
    denominator: float,
    seed: int,
    device: str,
) -> PrivacySteps:
    """The Gaussian mechanism's steps at clip bound `clip_bound` (C_t under adaptive clipping)."""
    # First: a NaN/Inf update has no norm. Only clipping needs the exact fp64 norms.
    per_user: list[UserStep] = [ZeroNonfinite(exact=privacy.clipping != "none")]
    bound = clip_bound  # bounds every element of a clipped update
    if privacy.clipping == "global":
        per_user.append(ClipGlobal(clip_bound))
    elif privacy.clipping == "perlayer":
        per_user.append(ClipPerLayer(clip_bound, privacy.perlayer_mode, privacy.perlayer_rule))
    else:
        per_user.append(MeasureNorms())
        bound = None

    headroom = 0.0
    client_noise = sigma_dp > 0 and privacy.noise_placement == "client"
    if client_noise:  # after clipping, which would shrink the noise below C·σ
        std = client_noise_std(clip_bound, sigma_dp, denominator)
        per_user.append(AddClientNoise(std, seed, device))
        headroom = NOISE_HEADROOM * std

    aggregate: list[AggregateStep] = []
    adaptive = privacy.adaptive_clip
    bit_noise = adaptive.bit_noise if adaptive is not None and sigma_dp > 0 else 0.0
    if sigma_dp > 0 and privacy.noise_placement == "server":
        # The bits take their share of σ_DP: the update gets the rest, σ_Δ > σ_DP.
        sigma = update_noise(sigma_dp, bit_noise) if bit_noise else sigma_dp
        aggregate.append(AddServerNoise(server_noise_std(clip_bound, sigma), seed, device))

    release = None
    if adaptive is not None:  # released even without DP (then with no noise): it moves C_t
        release = ReleaseUnclippedFraction(bit_noise, denominator, seed)
    return PrivacySteps(per_user, aggregate, bound, headroom, client_noise, release)
