"""The PRV accountant (prv_accountant): a third cross-check next to RDP and PLD."""

import math

import pytest
from test_privacy_accountants import HIGH_POP

from pflbench.errors import UserError
from pflbench.methods import check_budget
from pflbench.privacy import prv
from pflbench.privacy.accountants import ACCOUNTANTS, calibrate_noise, compute_epsilon
from pflbench.privacy.accounting import SampledGaussian, sampled_gaussian
from pflbench.privacy.statement import privacy_statement
from pflbench.spec.models import Budget

DELTA = 1e-9

# (z, q, T) rows of the paper (002, Tables 1 and 17) with RDP 7.23, 1.92, 4.44 and 3.70.
PAPER_ROWS = [
    (0.6144, 0.00295, 2034),
    (1.024, 0.00295, 2034),
    (2.048, 0.0295, 2006),
    (0.6144, 0.000295, 3390),
]


@pytest.mark.parametrize(("z", "q", "steps"), PAPER_ROWS)
def test_prv_agrees_with_pld_and_is_at_most_rdp(z, q, steps):
    """Tolerance: PLD's (pessimistic) ε lies within PRV's proven error bounds [lower, upper],
    which are at most 2 * eps_error (0.02 here) wide; PRV reports the upper bound."""
    rdp = compute_epsilon(SampledGaussian(z, q, steps), DELTA, "rdp").epsilon
    pld = compute_epsilon(SampledGaussian(z, q, steps), DELTA, "pld").epsilon
    result = compute_epsilon(SampledGaussian(z, q, steps), DELTA, "prv")
    details = result.details
    assert result.epsilon == details["epsilon_upper_bound"]
    assert details["epsilon_lower_bound"] <= pld <= result.epsilon <= rdp
    assert result.epsilon - pld <= 2 * details["eps_error"] == 2 * prv.PRV_EPS_ERROR
    assert result.library == "prv_accountant" and result.order is None


def test_the_paper_headline_row():
    # Table 1's eps7.2-high-pop: RDP 7.23, PLD 6.30, PRV's upper bound 6.31.
    assert compute_epsilon(
        SampledGaussian(0.6144, 0.00295, 2034), DELTA, "prv"
    ).epsilon == pytest.approx(6.31, abs=0.01)


def test_prv_refuses_very_large_epsilons_with_a_clear_error():
    with pytest.raises(UserError, match="PRV accountant not run.*rdp accountant"):
        compute_epsilon(SampledGaussian(0.01024, 0.0295, 2006), DELTA, "prv")  # RDP: 1.1e7


def test_a_numeric_failure_of_the_library_is_a_user_error(monkeypatch):
    # Without the guard, the library's own discretization check fails at RDP epsilon 4e4.
    monkeypatch.setattr(prv, "PRV_MAX_RDP_EPSILON", float("inf"))
    with pytest.raises(UserError, match="PRV accountant failed numerically"):
        compute_epsilon(SampledGaussian(0.02, 16 / 1200, 30), DELTA, "prv")


def test_statements_cross_check_with_prv_and_skip_it_where_it_cannot_compute():
    statement = privacy_statement(3e-6, 0.01, 1024, 34_753, 2006, DELTA, "fixed", HIGH_POP)
    simulated, extrapolated = statement["simulated"], statement["extrapolated"]
    assert set(simulated["epsilon"]) == set(extrapolated["epsilon"]) == set(ACCOUNTANTS)
    assert simulated["epsilon"]["prv"]["epsilon"] is None  # RDP 1.2e8 at the simulated scale
    assert "PRV accountant not run" in simulated["epsilon"]["prv"]["error"]
    assert extrapolated["epsilon"]["prv"]["epsilon"] == pytest.approx(6.31, abs=0.02)
    assert statement["claimed_by"] == "rdp"
    assert "PRV (prv_accountant, upper bound)" in statement["how"]
    assert "pld and prv are cross-checks" in statement["how"]


def test_prv_is_a_cross_check_only():
    with pytest.raises(UserError, match="unknown accountant 'prv' for calibrating noise"):
        calibrate_noise(7.2, sampled_gaussian(0.00295, 2034), DELTA, "prv")
    budget = Budget(  # a name: checked when specs are loaded
        name="b", epsilon=7.2, delta=DELTA, population=10**6, cohort=1000, steps=10,
        accountant="prv",
    )  # fmt: skip
    with pytest.raises(UserError, match="b.yaml: unknown accountant that calibrates noise 'prv'; "
                       "known: rdp, pld"):  # fmt: skip
        check_budget(budget, "b.yaml")
    assert not ACCOUNTANTS["prv"].calibrates


@pytest.mark.parametrize(("z", "q", "steps"), [PAPER_ROWS[0], (1.0, 0.01, 10), (0.3, 0.05, 200)])
def test_the_lower_bound_lies_under_every_builtin_accountant_and_close_to_pld(z, q, steps):
    """What a plug-in accountant's ε is checked against (accountants.check_not_below_lower_bound):
    no upper bound may lie under it, and within its coarser grid it is PLD's ε."""
    described = SampledGaussian(z, q, steps)
    lower, at_steps = prv.lower_bound(described, DELTA)
    pld = compute_epsilon(described, DELTA, "pld").epsilon
    assert at_steps == steps
    for name in ACCOUNTANTS:
        assert lower <= compute_epsilon(described, DELTA, name).epsilon
    error = max(prv.FLOOR_EPS_ERROR, prv.FLOOR_RELATIVE_EPS_ERROR * compute_epsilon(
        described, DELTA, "rdp").epsilon)  # fmt: skip
    assert pld - lower <= 2 * error


def test_the_lower_bound_composes_fewer_steps_where_prv_cannot_run_all():
    """RDP ε above 1,000 at T = 300, beyond PRV's range, and PRV's discretization fails at the
    273 steps that are within it: the bound is PRV's at fewer steps (composing more never lowers
    ε), so it still lies under PLD's ε at T; None where not even one step's RDP ε is in range."""
    described = SampledGaussian(0.3, 0.5, 300)
    lower, at_steps = prv.lower_bound(described, DELTA)
    at = SampledGaussian(0.3, 0.5, at_steps)
    assert 1 <= at_steps < 273 and compute_epsilon(at, DELTA, "rdp").epsilon <= 1e3
    assert 0 < lower <= compute_epsilon(described, DELTA, "pld").epsilon
    assert prv.lower_bound(SampledGaussian(0.01, 0.9, 10), DELTA) is None


def _gaussian_epsilon(mu: float, delta: float) -> float:
    """The exact ε(δ) of the Gaussian mechanism with sensitivity-to-noise ratio mu (Balle and
    Wang 2018): δ(ε) = Φ(μ/2 - ε/μ) - e^ε Φ(-μ/2 - ε/μ), solved for ε by bisection."""
    from scipy.stats import norm

    def delta_at(eps: float) -> float:
        return norm.cdf(mu / 2 - eps / mu) - math.exp(eps) * norm.cdf(-mu / 2 - eps / mu)

    low, high = 0.0, 100.0
    for _ in range(200):
        mid = (low + high) / 2
        low, high = (low, mid) if delta_at(mid) <= delta else (mid, high)
    return high


@pytest.mark.parametrize(
    ("z", "steps", "delta"), [(1.0, 1, 1e-5), (4.0, 10, 1e-9), (20.0, 50, 1e-6)]
)
def test_the_lower_bound_lies_under_the_exact_epsilon_without_subsampling(z, steps, delta):
    """At q = 1, T steps of the Gaussian mechanism are one Gaussian mechanism of ratio √T/z,
    whose ε is known exactly: the bound is under it, by at most its grid's error."""
    exact = _gaussian_epsilon(math.sqrt(steps) / z, delta)
    lower, at_steps = prv.lower_bound(SampledGaussian(z, 1.0, steps), delta)
    assert at_steps == steps and exact - 2 * prv.FLOOR_EPS_ERROR <= lower <= exact


def test_the_lower_bound_is_none_where_prv_fails_at_every_step_count(monkeypatch):
    """Then nothing is checked (accountants.check_not_below_lower_bound passes the value)."""

    def fails(*args):
        raise RuntimeError("Discrete mean differs from continuous mean significantly.")

    monkeypatch.setattr(prv, "prv_bounds", fails)
    prv.lower_bound.cache_clear()  # a cached bound would not call it
    assert prv.lower_bound(SampledGaussian(1.0, 0.01, 8), DELTA) is None
