"""Accountants against the paper (002, Tables 1, 17, 18, 20), monotonicity, calibration round
trips, PLD <= RDP, budgets and statements."""

import json
import math
import warnings

import numpy as np
import pytest

from pflbench.errors import UserError
from pflbench.privacy.accountants import ACCOUNTANTS, calibrate_noise, compute_epsilon
from pflbench.privacy.accounting import SampledGaussian, sampled_gaussian
from pflbench.privacy.rdp import RDP_ORDERS, one_step_rdp, rdp_epsilon
from pflbench.privacy.statement import budget_noise, privacy_statement
from pflbench.spec.models import Budget

DELTA = 1e-9

# (z, q, T, epsilon, Renyi order) as printed in the paper (two significant digits). Rows that
# repeat across tables are listed once.
PAPER_ROWS = [
    # Table 17 (and Table 1, Table 20)
    (0.1024, 0.0295, 2006, 3.3e4, 1.1),
    (1.024, 0.0295, 2006, 13, 4.0),
    (5.12, 0.0295, 2006, 1.6, 25),
    (0.0512, 0.0295, 2006, 3.5e5, 1.1),
    (0.512, 0.0295, 2006, 72, 1.5),
    (2.56, 0.0295, 2006, 3.5, 10.0),
    (0.03072, 0.0295, 2006, 1.1e6, 1.1),
    (0.3072, 0.0295, 2006, 3.7e2, 1.1),
    (1.536, 0.0295, 2006, 6.5, 7.0),
    (0.02048, 0.0295, 2006, 2.6e6, 1.1),
    (2.048, 0.0295, 2006, 4.5, 9.0),
    (0.01024, 0.0295, 2006, 1.1e7, 1.1),
    (0.512, 0.00295, 2034, 13, 3.0),
    (2.048, 0.00295, 2006, 0.75, 25.0),
    (0.00512, 0.0295, 2006, 4.2e7, 1.1),
    (1.024, 0.00295, 2034, 2.1, 10.0),
    (1.024, 0.000295, 3390, 1.2, 15.0),
    (0.003072, 0.0295, 2006, 1.2e8, 1.1),
    (0.6144, 0.0295, 2006, 42, 2.0),
    (0.6144, 0.00295, 2034, 7.2, 3.0),
    (0.6144, 0.000295, 3390, 3.7, 6.0),
    (0.0018432, 0.0295, 2006, 4.5e8, 1.5),
    (0.18432, 0.0295, 2006, 2.3e4, 1.5),
    (0.36864, 0.0295, 2006, 2.7e2, 1.5),
    (0.36864, 0.00295, 2034, 45, 1.5),
    (0.36864, 0.000295, 3390, 16, 2.5),
    (0.001024, 0.0295, 2006, 1.1e9, 1.1),
    (0.2048, 0.0295, 2006, 1.1e3, 1.1),
    (0.2048, 0.00295, 2034, 2.7e2, 1.1),
    (0.2048, 0.000295, 3390, 94, 1.3),
    (0.0006144, 0.0295, 2006, 4.0e9, 1.5),
    (0.06144, 0.0295, 2006, 3.8e5, 1.5),
    (0.12288, 0.0295, 2006, 7.9e4, 1.5),
    # Table 18 (French / German)
    (0.003072, 0.1596, 2002, 1.2e8, 1.1),
    (0.768, 0.1596, 2002, 1.7e2, 1.5),
    (0.768, 0.01596, 2016, 14, 4.0),
    (0.768, 0.00532, 2068, 5.4, 5.0),
]
# The headline rows (Table 1): our best-order epsilon is within 5%.
HEADLINE_ROWS = [
    (0.6144, 0.00295, 2034, 7.2),
    (2.048, 0.0295, 2006, 4.5),
    (1.024, 0.0295, 2006, 13),
    (0.512, 0.0295, 2006, 72),
]
# The paper prints order 3.0 for this row (in Tables 1, 17 and 20) but its 7.2 is the value at
# order 4 (ours: 7.23 at order 4, 9.8 at order 3): a typo in the order column.
ORDER_TYPOS = {(0.6144, 0.00295, 2034): 4.0}


def paper_tolerance(printed: float) -> float:
    """5% plus half a unit of the second significant digit the paper rounded to."""
    half_unit = 0.5 * 10 ** (math.floor(math.log10(printed)) - 1)
    return 0.05 * printed + half_unit


@pytest.mark.parametrize(("z", "q", "steps", "paper"), HEADLINE_ROWS)
def test_rdp_reproduces_table_1_within_5_percent(z, q, steps, paper):
    result = compute_epsilon(SampledGaussian(z, q, steps), DELTA, "rdp")
    assert result.epsilon == pytest.approx(paper, rel=0.05)
    assert result.library == "opacus" and result.details["orders"] == list(RDP_ORDERS)


@pytest.mark.parametrize(("z", "q", "steps", "paper", "order"), PAPER_ROWS)
def test_rdp_matches_every_table_row_at_the_papers_order(z, q, steps, paper, order):
    order = ORDER_TYPOS.get((z, q, steps), order)
    at_order, _ = rdp_epsilon(z, q, steps, DELTA, orders=(order,))
    assert abs(at_order - paper) <= paper_tolerance(paper)
    # Our grid holds the paper's order (or finer ones), so the epsilon we report is never looser.
    best = compute_epsilon(SampledGaussian(z, q, steps), DELTA, "rdp").epsilon
    assert best <= at_order * (1 + 1e-12)


def test_table_rows_with_our_order_grid():
    """25 of 37 rows give the paper's number at our best order. In the other 12 the paper's own
    order grid was coarser (e.g. no orders below 1.5): our best order is one the paper did not
    report and our epsilon is smaller, i.e. a tighter valid bound, never a looser one."""
    matching = 0
    for z, q, steps, paper, order in PAPER_ROWS:
        result = compute_epsilon(SampledGaussian(z, q, steps), DELTA)
        if abs(result.epsilon - paper) <= paper_tolerance(paper):
            matching += 1
        else:
            assert result.epsilon < paper and result.order != order, (z, q, steps)
    assert matching >= 25


@pytest.mark.parametrize(("z", "q", "steps", "paper"), [*HEADLINE_ROWS, (0.2048, 0.0295, 2006, 0)])
def test_pld_is_at_most_rdp(z, q, steps, paper):
    rdp = compute_epsilon(SampledGaussian(z, q, steps), DELTA, "rdp")
    pld = compute_epsilon(SampledGaussian(z, q, steps), DELTA, "pld")
    assert 0 < pld.epsilon <= rdp.epsilon
    assert pld.library == "dp_accounting" and pld.order is None
    assert pld.details["value_discretization_interval"] > 0


def test_pld_refuses_astronomical_epsilons_with_a_clear_error():
    with pytest.raises(UserError, match="rdp accountant"):
        compute_epsilon(SampledGaussian(1e-5, 0.5, 2000), DELTA, "pld")


@pytest.mark.parametrize("accountant", ["rdp", "pld"])
def test_epsilon_is_monotone(accountant):
    def eps(z=1.0, q=0.01, steps=500):
        return compute_epsilon(SampledGaussian(z, q, steps), 1e-6, accountant).epsilon

    by_noise = [eps(z=z) for z in (0.6, 0.8, 1.2, 2.0)]
    by_steps = [eps(steps=t) for t in (10, 100, 500, 2000)]
    by_rate = [eps(q=q) for q in (0.001, 0.01, 0.05, 0.2)]
    assert by_noise == sorted(by_noise, reverse=True) and len(set(by_noise)) == 4
    assert by_steps == sorted(by_steps) and len(set(by_steps)) == 4
    assert by_rate == sorted(by_rate) and len(set(by_rate)) == 4


def test_no_subsampling_matches_the_gaussian_rdp_curve():
    # q = 1: RDP of the Gaussian mechanism is T*alpha/(2 z^2) at every order alpha.
    eps, order = rdp_epsilon(2.0, 1.0, 10, 1e-5, orders=(8.0,))
    alpha, rdp = 8.0, 10 * 8.0 / (2 * 2.0**2)
    expected = (
        rdp + math.log((alpha - 1) / alpha) - (math.log(1e-5) + math.log(alpha)) / (alpha - 1)
    )
    assert eps == pytest.approx(expected) and order == alpha


@pytest.mark.parametrize(("z", "q"), [(0.3, 16 / 1200), (1.0, 0.003), (0.05, 0.5), (2.0, 1.0)])
def test_rdp_from_the_cached_one_step_curve_is_opacus_own_bit_for_bit(z, q):
    # A run's ε after each step reuses one step's curve; it must be what opacus computes for T
    # steps at once (the statement's and the metrics' ε are compared as numbers).
    from opacus.accountants.analysis import rdp as opacus_rdp

    grid = np.array(RDP_ORDERS, dtype=float)
    for steps in (1, 2, 7, 120, 2034):
        curve = opacus_rdp.compute_rdp(q=q, noise_multiplier=z, steps=steps, orders=grid)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            expected = opacus_rdp.get_privacy_spent(orders=grid, rdp=curve, delta=1e-9)
        assert rdp_epsilon(z, q, steps, 1e-9) == tuple(map(float, expected))
    with pytest.raises(ValueError, match="read-only"):
        one_step_rdp(z, q)[0] = 0.0  # the cache's curve cannot be changed by a caller


@pytest.mark.parametrize(("accountant", "target"), [("rdp", 7.2), ("rdp", 0.5), ("pld", 4.5)])
def test_calibration_round_trip(accountant, target):
    q, steps = 0.00295, 2034
    z = calibrate_noise(target, sampled_gaussian(q, steps), DELTA, accountant)
    assert compute_epsilon(SampledGaussian(z, q, steps), DELTA, accountant).epsilon <= target
    # smallest: 2e-4 less noise (twice the tolerance) breaks the target
    assert (
        compute_epsilon(SampledGaussian(z * (1 - 2e-4), q, steps), DELTA, accountant).epsilon
        > target
    )


def test_forward_then_inverse_recovers_the_noise():
    epsilon = compute_epsilon(SampledGaussian(0.6144, 0.00295, 2034), DELTA).epsilon
    assert calibrate_noise(epsilon, sampled_gaussian(0.00295, 2034), DELTA) == pytest.approx(
        0.6144, rel=2e-4
    )


@pytest.mark.parametrize(
    "args",
    [
        (0.0, 0.01, 100, 1e-5),
        (-1.0, 0.01, 100, 1e-5),
        (float("nan"), 0.01, 100, 1e-5),
        (1.0, 0.0, 100, 1e-5),
        (1.0, 1.5, 100, 1e-5),
        (1.0, 0.01, 0, 1e-5),
        (1.0, 0.01, 100, 1.0),
        (1.0, 0.01, 100, 0.0),
    ],
)
def test_invalid_mechanisms_are_user_errors(args):
    z, q, steps, delta = args
    with pytest.raises(UserError):
        compute_epsilon(SampledGaussian(z, q, steps), delta)


def test_invalid_accountant_and_target_are_user_errors():
    with pytest.raises(UserError, match="unknown accountant"):
        compute_epsilon(SampledGaussian(1.0, 0.01, 100), 1e-5, "moments")
    with pytest.raises(UserError, match="target epsilon"):
        calibrate_noise(0.0, sampled_gaussian(0.01, 100), 1e-5)
    with pytest.raises(UserError, match="unknown accountant"):
        calibrate_noise(1.0, sampled_gaussian(0.01, 100), 1e-5, "gdp")


HIGH_POP = Budget(
    name="eps7.2-high-pop",
    epsilon=7.2,
    delta=DELTA,
    population=69_506_000,
    cohort=204_800,
    steps=2034,
)
LOW_POP = Budget(
    name="eps4.5-low-pop",
    epsilon=4.5,
    delta=DELTA,
    population=6_950_600,
    cohort=204_800,
    steps=2006,
)


@pytest.mark.parametrize(("budget", "paper_sigma"), [(HIGH_POP, 3e-6), (LOW_POP, 1e-5)])
def test_budgets_give_the_papers_sigma_dp(budget, paper_sigma):
    noise = budget_noise(budget)
    assert noise["sigma_dp"] == pytest.approx(paper_sigma, rel=0.02)
    assert noise["sigma_dp"] == noise["noise_multiplier"] / budget.cohort
    assert noise["sampling_rate"] == budget.cohort / budget.population


def test_no_dp_budget_has_no_noise():
    assert budget_noise(Budget(name="none", dp=False))["sigma_dp"] == 0.0


def test_statement_at_simulated_and_extrapolated_scale():
    statement = privacy_statement(3e-6, 0.01, 1024, 34_753, 2006, DELTA, "fixed", HIGH_POP)
    json.dumps(statement, allow_nan=False)  # JSON-ready, no NaN/inf
    simulated, extrapolated = statement["simulated"], statement["extrapolated"]
    assert statement["dp"] is True
    assert simulated["noise_multiplier"] == pytest.approx(0.003072)
    assert simulated["epsilon"]["rdp"]["epsilon"] == pytest.approx(1.2e8, rel=0.05)  # Table 1
    assert extrapolated["noise_multiplier"] == pytest.approx(0.6144)
    assert extrapolated["epsilon"]["rdp"]["epsilon"] == pytest.approx(7.2, rel=0.05)
    pld, rdp = extrapolated["epsilon"]["pld"]["epsilon"], extrapolated["epsilon"]["rdp"]["epsilon"]
    assert pld <= rdp
    assert "fixed-size" in statement["how"] and "Extrapolated" in statement["how"]
    # a fixed-size statement says its epsilons do not cover fixed cohorts; a Poisson one is plain
    assert "do not cover fixed cohorts" in statement["how"]
    poisson = privacy_statement(3e-6, 0.01, 1024, 34_753, 2006, DELTA, "poisson", HIGH_POP)
    assert "fixed" not in poisson["how"]


def test_statement_without_noise_says_no_dp():
    statement = privacy_statement(0.0, 0.01, 1024, 34_753, 2000, DELTA, "poisson", None)
    assert statement["dp"] is False and statement["extrapolated"] is None
    assert statement["simulated"]["epsilon"] == dict.fromkeys(ACCOUNTANTS)


def test_statement_records_a_skipped_pld_instead_of_failing():
    statement = privacy_statement(1e-9, 0.01, 1000, 2000, 2000, DELTA, "poisson", None)
    pld = statement["simulated"]["epsilon"]["pld"]
    assert pld["epsilon"] is None and "rdp accountant" in pld["error"]
    assert statement["simulated"]["epsilon"]["rdp"]["epsilon"] > 1e10


def test_statement_rejects_bad_scales():
    with pytest.raises(UserError, match="cohort"):
        privacy_statement(1e-5, 0.01, 5000, 1000, 100, DELTA, "poisson", None)
    with pytest.raises(UserError, match="sampling"):
        privacy_statement(1e-5, 0.01, 10, 1000, 100, DELTA, "uniform", None)


def test_statement_names_the_claiming_accountant_and_the_user_unit():
    statement = privacy_statement(3e-6, 0.01, 1024, 34_753, 2006, DELTA, "fixed", HIGH_POP)
    assert statement["claimed_by"] == "rdp" and statement["unit"] == "user"
    assert "pseudo" not in statement["mechanism"] + statement["how"]
    pld_budget = HIGH_POP.model_copy(update={"accountant": "pld"})
    statement = privacy_statement(
        3e-6, 0.01, 1024, 34_753, 2006, DELTA, "fixed", pld_budget, accountants=("rdp",)
    )
    assert statement["claimed_by"] == "pld" and "pld" in statement["extrapolated"]["epsilon"]


def test_statement_on_pseudo_users_says_the_guarantee_is_per_pseudo_user():
    statement = privacy_statement(
        3e-6, 0.01, 1024, 34_753, 2006, DELTA, "fixed", HIGH_POP, pseudo_users=True
    )
    assert statement["unit"] == "pseudo-user"
    assert statement["mechanism"].startswith("pseudo-user-level DP")
    assert "not everything one speaker said" in statement["how"]


def test_statement_refuses_more_steps_than_the_budget_covers():
    with pytest.raises(UserError, match=r"3000 central steps .* T = 2034; .* would be 7\.70"):
        privacy_statement(3e-6, 0.01, 1024, 34_753, 3000, DELTA, "fixed", HIGH_POP)


def test_an_epsilon_below_rdp_s_reach_calibrates_by_pld_and_rdp_says_why_it_cannot():
    """RDP's largest order bounds its ε from below whatever the noise (~0.0125 at q 1e-5, T 100,
    δ 1e-9): it refuses a target of 0.01 saying so, and PLD, which its calibration no longer
    brackets by RDP's answer, reaches it at a moderate noise multiplier."""
    family = sampled_gaussian(1e-5, 100)
    with pytest.raises(UserError, match="out of the rdp accountant's reach.*largest order"):
        calibrate_noise(0.01, family, 1e-9, "rdp")
    z = calibrate_noise(0.01, family, 1e-9, "pld")
    assert 0.1 < z < 10
    assert compute_epsilon(family(z), 1e-9, "pld").epsilon <= 0.01
    assert compute_epsilon(family(z * 0.99), 1e-9, "pld").epsilon > 0.01
