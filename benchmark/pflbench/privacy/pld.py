"""The "pld" accountant: privacy loss distributions via dp_accounting (pessimistic
discretization, both halves of the add-or-remove relation): tighter than RDP.
"""

from __future__ import annotations

import functools
from importlib.metadata import version

from pflbench.privacy import rdp
from pflbench.privacy.accounting import Accountant, EpsilonResult, SampledGaussian

LIBRARY = "dp_accounting"

# PLD grid step on the privacy-loss axis, proportional to the RDP epsilon (an upper bound on the
# PLD one) so the grid has a bounded number of points: ~0.1 s per epsilon at T=2000, error of
# the (pessimistic, i.e. still valid) bound ~1e-4 relative. Beyond PLD_MAX_RDP_EPSILON the loss
# values overflow dp_accounting's grid; such epsilons mean "no privacy" anyway.
PLD_RELATIVE_INTERVAL = 1e-5
PLD_MIN_INTERVAL = 1e-3
PLD_MAX_INTERVAL = 500.0
PLD_MAX_RDP_EPSILON = 1e10


def pld_interval(rdp_epsilon: float) -> float:
    """PLD value discretization interval for a mechanism whose RDP epsilon is `rdp_epsilon`."""
    interval = PLD_RELATIVE_INTERVAL * rdp_epsilon
    return min(max(interval, PLD_MIN_INTERVAL), PLD_MAX_INTERVAL)


@functools.lru_cache(maxsize=4096)
def epsilon(mechanism: SampledGaussian, delta: float) -> EpsilonResult:
    import dp_accounting
    from dp_accounting import pld

    z, q, steps = mechanism.noise_multiplier, mechanism.sampling_rate, mechanism.steps
    rdp_epsilon = rdp.epsilon_at_most(
        PLD_MAX_RDP_EPSILON, mechanism, delta,
        "PLD accountant not run: epsilon is astronomically large, beyond what its discretized"
        " grid can represent",
    )  # fmt: skip
    interval = pld_interval(rdp_epsilon)
    accountant = pld.PLDAccountant(
        dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE,
        value_discretization_interval=interval,
    )
    event = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z))
    accountant.compose(dp_accounting.SelfComposedDpEvent(event, steps))
    return EpsilonResult(
        accountant="pld",
        library=LIBRARY,
        library_version=version(LIBRARY),
        epsilon=float(accountant.get_epsilon(delta)),
        delta=delta,
        noise_multiplier=z,
        sampling_rate=q,
        steps=steps,
        order=None,
        details={
            "value_discretization_interval": interval,
            "discretization_rule": (
                f"clip({PLD_RELATIVE_INTERVAL:g} * eps_rdp, {PLD_MIN_INTERVAL:g},"
                f" {PLD_MAX_INTERVAL:g})"
            ),
            "pessimistic_estimate": True,
            "event": f"SelfComposed(PoissonSampled({q}, Gaussian({z})), {steps})",
            "neighboring_relation": "add_or_remove_one",
        },
    )


def summary(details: dict) -> str:
    return f"interval {details['value_discretization_interval']:g}"


ACCOUNTANT = Accountant(
    name="pld",
    description="PLD (dp_accounting)",
    library=LIBRARY,
    epsilon=epsilon,
    summary=summary,
    calibrates=True,
    # dp_accounting's FFT convolutions: 1.2e-5 apart between two x86 CPUs (AVX2, AVX-512).
    agreement_rtol=1e-4,
)
