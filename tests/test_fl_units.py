"""Units of the simulator tested alone: sampling, server optimizers, lr schedule, assignment,
bucketed all-reduce helpers and layer selection for freezing."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pflbench.errors import UserError
from pflbench.fl.distributed import _buckets, assign_users
from pflbench.fl.freeze import layer_scores, select_trained
from pflbench.fl.server import ServerOptimizer, exponential_decay_lr
from pflbench.fl.server_optimizers import SERVER_OPTIMIZERS, trust_ratios
from pflbench.model.optim import trust_ratio
from pflbench.privacy.sampling import sample_cohort
from pflbench.seeds import keyed_seed, seed_global_draws
from pflbench.spec.models import LrDecay, ServerRecipe

# ---------------------------------------------------------------------------------------------
# Sampling


def test_poisson_cohort_is_keyed_and_has_rate_q():
    a = sample_cohort(1000, 100, "poisson", seed=3, step=7)
    assert torch.equal(a, sample_cohort(1000, 100, "poisson", seed=3, step=7))
    assert not torch.equal(a, sample_cohort(1000, 100, "poisson", seed=3, step=8))
    assert not torch.equal(a, sample_cohort(1000, 100, "poisson", seed=4, step=7))
    sizes = torch.tensor([len(sample_cohort(1000, 100, "poisson", 0, t)) for t in range(200)])
    assert abs(sizes.double().mean().item() - 100) < 3  # E = qK = 100, sd of the mean ≈ 0.67
    assert torch.all(a[1:] > a[:-1]) and a.max() < 1000


def test_fixed_cohort_has_exactly_s_distinct_users():
    c = sample_cohort(50, 8, "fixed", seed=1, step=2)
    assert len(c) == 8 and len(set(c.tolist())) == 8
    assert len(sample_cohort(5, 8, "fixed", seed=1, step=2)) == 5


def test_keyed_seed_is_stable():
    assert keyed_seed(1, 2, "u") == keyed_seed(1, 2, "u") != keyed_seed(1, 2, "v")


# ---------------------------------------------------------------------------------------------
# Server optimizers against hand-computed steps (θ = [3, 4], g = [1, 2], lr = 0.1)


def _one_step(optimizer: str, steps: int = 1, **kw) -> list[float]:
    theta = torch.tensor([3.0, 4.0])
    opt = ServerOptimizer(ServerRecipe(optimizer=optimizer, **kw), ["w"], [theta])
    for _ in range(steps):
        opt.step([torch.tensor([1.0, 2.0])], lr=0.1)
    return theta.tolist()


# One step of each registered optimizer with the recipe's defaults (ξ = 1e-6, no weight decay or
# momentum), by hand: a new optimizer needs its entry here (and the state it keeps, below).
XI = 1e-6
_U_ADAM = [1 / (1 + XI), 2 / (2 + XI)]  # step 1 is bias-corrected: m̂ = g, v̂ = g²
_LAMB_RATIO = 5 / math.hypot(*_U_ADAM)  # ‖θ‖/‖u‖
_LARS_RATIO = 0.001 * 5 / (math.hypot(1, 2) + XI)  # η‖θ‖/(‖g‖ + ξ)
FIRST_STEP_BY_HAND = {
    "lamb": [3 - 0.1 * _LAMB_RATIO * _U_ADAM[0], 4 - 0.1 * _LAMB_RATIO * _U_ADAM[1]],
    "adam": [3 - 0.1 * _U_ADAM[0], 4 - 0.1 * _U_ADAM[1]],
    "lars": [3 - 0.1 * _LARS_RATIO * 1, 4 - 0.1 * _LARS_RATIO * 2],
    "adagrad": [3 - 0.1 * 1 * (1 / 1 + XI), 4 - 0.1 * 2 * (1 / 2 + XI)],
    "sgd": [3 - 0.1 * 1, 4 - 0.1 * 2],
}
# The state each keeps, by checkpoint name (server.<slot>.<parameter>): checkpoints must load.
STATE_NAMES = {
    ("lamb", 0.0): {"count", "m.w", "v.w"},
    ("adam", 0.0): {"count", "m.w", "v.w"},
    ("lars", 0.0): {"count"},
    ("lars", 0.9): {"count", "momentum.w"},
    ("adagrad", 0.0): {"count", "acc.w"},
    ("sgd", 0.0): {"count"},
    ("sgd", 0.9): {"count", "momentum.w"},
}


@pytest.mark.parametrize("optimizer", list(SERVER_OPTIMIZERS))
def test_every_registered_optimizer_takes_its_hand_computed_first_step(optimizer):
    assert _one_step(optimizer) == pytest.approx(FIRST_STEP_BY_HAND[optimizer], rel=1e-6)
    assert _one_step(optimizer) != pytest.approx([3.0, 4.0], rel=1e-6)  # it moved


@pytest.mark.parametrize("optimizer", list(SERVER_OPTIMIZERS))
def test_every_registered_optimizer_keeps_its_state_under_stable_names(optimizer):
    for (name, momentum), names in STATE_NAMES.items():
        if name == optimizer:
            recipe = ServerRecipe(optimizer=optimizer, momentum=momentum)
            opt = ServerOptimizer(recipe, ["w"], [torch.tensor([3.0, 4.0])])
            assert set(opt.state_dict()) == names
    assert optimizer in {name for name, _ in STATE_NAMES}


def test_the_registry_holds_the_server_optimizers_and_refuses_unknown_names():
    assert list(SERVER_OPTIMIZERS) == ["lamb", "adam", "lars", "adagrad", "sgd"]
    assert all(SERVER_OPTIMIZERS[name].name == name for name in SERVER_OPTIMIZERS)
    with pytest.raises(UserError, match="unknown server optimizer 'adamw'; known: lamb, adam, "
                       "lars, adagrad, sgd"):  # fmt: skip
        ServerOptimizer(ServerRecipe(optimizer="adamw"), ["w"], [torch.zeros(2)])


def test_adagrad_optax_rule_starts_its_accumulator_at_optax_default():
    theta = torch.tensor([3.0, 4.0])
    opt = ServerOptimizer(ServerRecipe(optimizer="adagrad", adagrad_rule="optax"), ["w"], [theta])
    assert opt.state["acc"][0].tolist() == pytest.approx([0.1, 0.1])
    opt = ServerOptimizer(ServerRecipe(optimizer="adagrad"), ["w"], [theta])
    assert opt.state["acc"][0].tolist() == [0.0, 0.0]


def test_lamb_step_uses_trust_ratio_and_xi():
    xi = 0.5
    # Step 1 with bias correction: m̂ = g, v̂ = g², so u = g/(|g| + ξ).
    u = [1 / (1 + xi), 2 / (2 + xi)]
    ratio = 5.0 / math.hypot(*u)
    expected = [3 - 0.1 * ratio * u[0], 4 - 0.1 * ratio * u[1]]
    assert _one_step("lamb", eps=xi) == pytest.approx(expected, rel=1e-6)


def test_lamb_weight_decay_enters_the_trust_ratio():
    xi, lam = 0.5, 0.1
    u = [1 / (1 + xi) + lam * 3, 2 / (2 + xi) + lam * 4]
    ratio = 5.0 / math.hypot(*u)
    expected = [3 - 0.1 * ratio * u[0], 4 - 0.1 * ratio * u[1]]
    assert _one_step("lamb", eps=xi, weight_decay=lam) == pytest.approx(expected, rel=1e-6)


def test_adam_two_steps_with_bias_correction():
    b1, b2, eps = 0.9, 0.999, 1e-6
    theta, m, v = [3.0, 4.0], [0.0, 0.0], [0.0, 0.0]
    for t in (1, 2):
        for i, g in enumerate((1.0, 2.0)):
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            mhat, vhat = m[i] / (1 - b1**t), v[i] / (1 - b2**t)
            theta[i] -= 0.1 * mhat / (math.sqrt(vhat) + eps)
    assert _one_step("adam", steps=2, eps=eps) == pytest.approx(theta, rel=1e-6)


def test_lars_scales_by_norm_ratio_with_momentum():
    ratio = _LARS_RATIO
    step1 = [0.1 * ratio * 1, 0.1 * ratio * 2]
    # Second step: θ changed, so the ratio is recomputed; momentum 0.5 carries step 1.
    theta1 = [3 - step1[0], 4 - step1[1]]
    ratio2 = 0.001 * math.hypot(*theta1) / (math.hypot(1, 2) + XI)
    step2 = [0.5 * step1[0] + 0.1 * ratio2 * 1, 0.5 * step1[1] + 0.1 * ratio2 * 2]
    expected = [theta1[0] - step2[0], theta1[1] - step2[1]]
    assert _one_step("lars", steps=2, momentum=0.5) == pytest.approx(expected, rel=1e-6)


def test_adagrad_reference_rule_two_steps_by_hand():
    # The paper authors' rule: acc from 0, acc += g², θ -= lr·g·(1/√acc + ξ).
    theta = torch.tensor([3.0, 4.0, 5.0], dtype=torch.float64)
    recipe = ServerRecipe(optimizer="adagrad", eps=1e-8)
    assert recipe.adagrad_rule == "reference"
    opt = ServerOptimizer(recipe, ["w"], [theta])
    opt.step([torch.tensor([1.0, 2.0, 0.0], dtype=torch.float64)], lr=0.1)
    # acc = [1, 4, 0]: 1·(1/1 + ξ), 2·(1/2 + ξ); the never-moved coordinate has 0/0 → 0.
    expected = [3 - 0.1 * (1 + 1e-8), 4 - 0.1 * 2 * (0.5 + 1e-8), 5.0]
    assert theta.tolist() == pytest.approx(expected, rel=1e-12)
    assert theta[2] == 5.0
    opt.step([torch.tensor([0.5, -1.0, 0.0], dtype=torch.float64)], lr=0.1)
    # acc = [1.25, 5, 0]
    expected[0] -= 0.1 * 0.5 * (1 / math.sqrt(1.25) + 1e-8)
    expected[1] += 0.1 * 1.0 * (1 / math.sqrt(5.0) + 1e-8)
    assert theta.tolist() == pytest.approx(expected, rel=1e-12)
    assert theta[2] == 5.0 and opt.state["acc"][0].tolist() == [1.25, 5.0, 0.0]


def test_adagrad_reference_first_step_is_lr_per_coordinate_not_optax_sized():
    # The paper's pseudo-gradients are tiny (C = 0.01 over many parameters): the reference rule's
    # first step moves each coordinate by ~lr; optax's accumulator 0.1 shrinks it to lr·|g|/0.316.
    g = torch.full((4,), 1e-5)
    moved = {}
    for rule in ("reference", "optax"):
        theta = torch.zeros(4)
        ServerOptimizer(ServerRecipe(optimizer="adagrad", adagrad_rule=rule), ["w"], [theta]).step(
            [g], lr=0.015
        )
        moved[rule] = float(theta.abs().max())
    assert moved["reference"] == pytest.approx(0.015, rel=1e-4)
    assert moved["optax"] == pytest.approx(0.015 * 1e-5 / math.sqrt(0.1 + 1e-10), rel=1e-4)
    assert moved["reference"] / moved["optax"] > 30_000


def test_adagrad_reference_rule_never_makes_nan():
    theta = torch.tensor([1.0, 2.0, 3.0])
    opt = ServerOptimizer(ServerRecipe(optimizer="adagrad", eps=1e-8), ["w"], [theta])
    opt.step([torch.zeros(3)], lr=0.1)  # 0/0 everywhere
    assert theta.tolist() == [1.0, 2.0, 3.0]
    opt.step([torch.tensor([1e-30, 0.0, -1e-30])], lr=0.1)  # g² underflows to 0 in fp32
    assert torch.isfinite(theta).all() and theta.tolist() == pytest.approx([1.0, 2.0, 3.0])


def test_adagrad_optax_rule_step():
    eps = 1e-6
    expected = [3 - 0.1 * 1 / math.sqrt(0.1 + 1 + eps), 4 - 0.1 * 2 / math.sqrt(0.1 + 4 + eps)]
    assert _one_step("adagrad", eps=eps, adagrad_rule="optax") == pytest.approx(expected, rel=1e-6)


def test_lars_trust_ratio_is_one_where_the_parameter_norm_is_zero():
    # optax.scale_by_trust_ratio: where ‖θ‖ or ‖u‖ is 0 the ratio is 1, not the coefficient.
    theta = torch.zeros(2)
    ServerOptimizer(ServerRecipe(optimizer="lars"), ["w"], [theta]).step(
        [torch.tensor([1.0, 2.0])], lr=0.1
    )
    assert theta.tolist() == pytest.approx([-0.1, -0.2], rel=1e-6)
    ratios = trust_ratios(
        [torch.zeros(2), torch.ones(2), torch.ones(2)],
        [torch.ones(2), torch.zeros(2), torch.ones(2)],
        coefficient=0.001,
    )
    assert ratios.tolist() == pytest.approx([1.0, 1.0, 0.001])


def test_adam_weight_decay_is_added_to_the_direction_not_to_g():
    lam = 0.1
    u = [_U_ADAM[0] + lam * 3, _U_ADAM[1] + lam * 4]
    expected = [3 - 0.1 * u[0], 4 - 0.1 * u[1]]
    assert _one_step("adam", weight_decay=lam) == pytest.approx(expected, rel=1e-6)


def test_lars_without_momentum_puts_weight_decay_inside_the_trust_ratio():
    lam = 0.1
    u = [1 + lam * 3, 2 + lam * 4]
    ratio = 0.001 * 5.0 / (math.hypot(*u) + XI)
    expected = [3 - 0.1 * ratio * u[0], 4 - 0.1 * ratio * u[1]]
    assert _one_step("lars", weight_decay=lam) == pytest.approx(expected, rel=1e-6)


def test_lars_divides_by_the_update_norm_plus_xi():
    # The paper authors' code adds ξ (1e-6 by default, the recipe's eps) to ‖u‖; optax adds 0.
    ratio = 0.001 * 5 / (math.hypot(1, 2) + 0.5)
    expected = [3 - 0.1 * ratio * 1, 4 - 0.1 * ratio * 2]
    assert _one_step("lars", eps=0.5) == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_trust_ratios_match_fp64_at_paper_sizes(dtype):
    # fp32 norm accumulation is ~4e-5 relative off on a 2.36M-element tensor: the ratios that
    # LAMB and LARS apply must be within 1e-5 of ratios computed from the same tensors in fp64.
    generator = torch.Generator().manual_seed(0)
    shapes = [(3072, 768), (768, 2304), (768,)]
    params = [(torch.randn(s, generator=generator) * 0.05 + 0.01).to(dtype) for s in shapes]
    updates = [(torch.randn(s, generator=generator) * 1e-3).to(dtype) for s in shapes]
    ratios = trust_ratios(params, updates, coefficient=0.001, eps=1e-6).tolist()
    for param, update, ratio in zip(params, updates, ratios, strict=True):
        p64, u64 = param.double().numpy().ravel(), update.double().numpy().ravel()
        exact = 0.001 * math.sqrt(math.fsum(p64 * p64)) / (math.sqrt(math.fsum(u64 * u64)) + 1e-6)
        assert ratio == pytest.approx(exact, rel=1e-9)


def test_trust_ratio_adds_eps_to_the_update_norm():
    # The seed model's LARS (pflbench.central) divides by ‖u‖ + 1e-9; the server's by ‖u‖ + ξ.
    w, u = torch.tensor([6.0, 0.0, 2.0]), torch.tensor([2.0, 1.0, 0.0])
    assert trust_ratio(w, u, 0.01).tolist() == pytest.approx([0.03, 1.0, 1.0])
    assert trust_ratio(w, u, 0.01, eps=2.0).tolist() == pytest.approx([0.015, 1.0, 1.0])


def test_sgd_with_momentum_two_steps():
    # m1 = g, m2 = 0.9 g + g = 1.9 g: θ2 = θ − 0.1·(1 + 1.9)·g.
    expected = [3 - 0.29 * 1, 4 - 0.29 * 2]
    assert _one_step("sgd", steps=2, momentum=0.9) == pytest.approx(expected, rel=1e-6)


def test_sgd_weight_decay_two_steps():
    # θ1 = θ − 0.1·(g + 0.5θ) = 0.95θ − 0.1g; θ2 = 0.95θ1 − 0.1g.
    theta1 = [0.95 * 3 - 0.1 * 1, 0.95 * 4 - 0.1 * 2]
    expected = [0.95 * theta1[0] - 0.1 * 1, 0.95 * theta1[1] - 0.1 * 2]
    assert _one_step("sgd", steps=2, weight_decay=0.5) == pytest.approx(expected, rel=1e-6)


def test_server_state_roundtrip_resumes_identically():
    recipe = ServerRecipe(optimizer="lamb")
    a, b = torch.tensor([3.0, 4.0]), torch.tensor([3.0, 4.0])
    opt_a = ServerOptimizer(recipe, ["w"], [a])
    opt_a.step([torch.tensor([1.0, 2.0])], lr=0.1)
    opt_b = ServerOptimizer(recipe, ["w"], [b])
    b.copy_(a)
    opt_b.load_state_dict({k: v.clone() for k, v in opt_a.state_dict().items()})
    for opt in (opt_a, opt_b):
        opt.step([torch.tensor([-1.0, 0.5])], lr=0.1)
    assert torch.equal(a, b)


def test_lr_schedule_constant_then_exponential():
    decay = LrDecay(start=10, rate=0.5, transition=4)
    assert exponential_decay_lr(0, 0.2, decay) == exponential_decay_lr(10, 0.2, decay) == 0.2
    assert exponential_decay_lr(14, 0.2, decay) == pytest.approx(0.1)
    assert exponential_decay_lr(12, 0.2, decay) == pytest.approx(0.2 * 0.5**0.5)
    assert exponential_decay_lr(99, 0.2, LrDecay()) == 0.2


# ---------------------------------------------------------------------------------------------
# Distributed helpers


def test_greedy_assignment_balances_a_straggler():
    work = [100.0, 1, 1, 1, 1, 50, 50]
    shares = assign_users(work, 2)
    assert sorted(i for s in shares for i in s) == list(range(7))
    loads = sorted(sum(work[i] for i in s) for s in shares)
    assert loads == [102.0, 102.0]  # the straggler 100 + 2 small ones vs 50 + 50 + 2 small ones
    assert assign_users(work, 2) == shares  # deterministic on every rank
    assert assign_users([], 3) == [[], [], []]


def test_buckets_split_by_dtype_and_size(monkeypatch):
    monkeypatch.setattr("pflbench.fl.distributed.BUCKET_BYTES", 64)
    tensors = [torch.zeros(8, dtype=torch.int64), torch.zeros(8, dtype=torch.int64)]
    tensors += [torch.zeros(4), torch.zeros(4)]
    buckets = _buckets(tensors)
    assert [len(b) for b in buckets] == [1, 1, 2]


# ---------------------------------------------------------------------------------------------
# Layer freezing selection


def test_select_trained_top_and_bottom():
    scores = {"a": 5.0, "b": 1.0, "c": 3.0, "d": 0.5}
    sizes = {"a": 10, "b": 10, "c": 70, "d": 10}
    assert select_trained(scores, sizes, 10, "top") == ["a"]
    assert select_trained(scores, sizes, 10, "bottom") == ["b", "c", "d"]
    assert select_trained(scores, sizes, 80, "top") == ["a", "c"]
    # 003 stops at the first tensor that would overshoot p%: "b" would fit after "c", but the
    # walk has ended.
    assert select_trained(scores, sizes, 85, "top") == ["a", "c"]


def test_select_trained_never_goes_beyond_p_percent():
    scores = {"a": 5.0, "b": 1.0, "c": 3.0, "d": 0.5}
    sizes = {"a": 10, "b": 10, "c": 70, "d": 10}
    # "a" alone holds 10% > 1%: the top set is empty, so freezing the top freezes nothing ...
    assert select_trained(scores, sizes, 1, "bottom") == ["a", "b", "c", "d"]
    # ... and training only the top would train nothing: refused.
    with pytest.raises(UserError, match="holds 10% of the parameters, more than"):
        select_trained(scores, sizes, 1, "top")


@settings(max_examples=200, deadline=None)
@given(
    layers=st.lists(st.tuples(st.floats(0, 1e6), st.integers(1, 10**6)), min_size=1, max_size=30),
    percent=st.floats(0.01, 100),
)
def test_the_top_set_holds_at_most_p_percent(layers, percent):
    scores = {f"t{i}": score for i, (score, _) in enumerate(layers)}
    sizes = {f"t{i}": size for i, (_, size) in enumerate(layers)}
    bottom = set(select_trained(scores, sizes, percent, "bottom"))
    top = set(scores) - bottom
    assert sum(sizes[n] for n in top) <= percent / 100 * sum(sizes.values())
    if top:  # the top set is a prefix of the ranking
        ranked = sorted(scores, key=lambda n: (-scores[n], n))
        assert set(ranked[: len(top)]) == top
        assert select_trained(scores, sizes, percent, "top") == [n for n in scores if n in top]


def test_layer_scores_are_squared_gradient_sums_per_dimension():
    assert layer_scores({"w": 12.0, "b": 3.0}, {"w": 4, "b": 1}) == {"w": 3.0, "b": 3.0}


def test_seed_global_draws_seeds_as_torch_manual_seed_does():
    """The trainer seeds the model's draws without torch.manual_seed (its cost per client): the
    CPU stream after it is torch.manual_seed's, and another seed gives another stream."""
    torch.manual_seed(123)
    expected = (torch.rand(5), torch.randn(5), torch.randint(0, 10**6, (5,)))
    torch.manual_seed(7)  # a different state before
    seed_global_draws(123, "cpu")
    drawn = (torch.rand(5), torch.randn(5), torch.randint(0, 10**6, (5,)))
    assert all(torch.equal(a, b) for a, b in zip(expected, drawn, strict=True))
    seed_global_draws(124, "cpu")
    assert not torch.equal(torch.rand(5), expected[0])
