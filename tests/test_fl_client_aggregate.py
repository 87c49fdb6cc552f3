"""The client update and the step aggregation, each alone, on random utterances."""

import math
import tempfile
from pathlib import Path

import pytest
import torch
from conftest import make_algorithm, make_mechanism
from pydantic import ValidationError

from pflbench.errors import UserError
from pflbench.fl.aggregate import StepAggregator
from pflbench.fl.algorithms import CLIENT_ALGORITHMS, AlgorithmContext, check_client_recipe
from pflbench.fl.algorithms.base import variational_noise_std
from pflbench.fl.bench import RandomUserStore
from pflbench.fl.client import ClientResult, SequentialClientTrainer, local_batches
from pflbench.fl.local_update import LocalUpdate
from pflbench.fl.user_state import UserStateStore
from pflbench.model.transformer import build_model
from pflbench.privacy.adaptive import combined_noise, update_noise
from pflbench.privacy.aggregate import ExactSum, _one_span
from pflbench.privacy.noise import add_gaussian_noise, client_noise_std, noise_generator
from pflbench.privacy.sampling import expected_cohort, sample_cohort
from pflbench.spec.models import (
    AdaptiveClip,
    ClientRecipe,
    FederatedVariationalNoise,
    PrivacyRecipe,
    Recipe,
    SpecAugmentRecipe,
)

STORE = RandomUserStore(num_users=3, utterances_per_user=6)


def _trainer(layer_drop=None, **client) -> tuple[torch.nn.Module, SequentialClientTrainer]:
    torch.manual_seed(0)
    model = build_model("tiny", 30, layer_drop=layer_drop)
    recipe = ClientRecipe(**{"local_steps": 2, "batch_seconds": 10.0, **client})
    names = [n for n, _ in model.named_parameters()]
    algorithm = make_algorithm(recipe, model, names, seed=1)
    trainer = SequentialClientTrainer(model, names, algorithm, SpecAugmentRecipe(), 1, "cpu")
    return model, trainer


def _globals(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach() for p in model.parameters()]


def _train(trainer, global_params, data, step: int, user: str) -> ClientResult:
    ((_, result),) = trainer.train_group(global_params, [(user, data)], step)
    return result


def test_delta_is_global_minus_local_and_keyed():
    model, trainer = _trainer()
    before = [p.clone() for p in _globals(model)]
    data = STORE.load_user("user00000")
    first = {
        k: v.clone() for k, v in _train(trainer, _globals(model), data, 3, "u0").update.items()
    }
    local = [p[0].clone() for p in trainer.update.params]
    for g, d, theta in zip(before, first.values(), local, strict=True):
        assert torch.equal(d, g - theta)
    assert all(torch.equal(a, b) for a, b in zip(before, _globals(model), strict=True))
    assert any(d.abs().sum() > 0 for d in first.values())
    # Another user in between must not leak into a repeat of the first (buffers are reused).
    _train(trainer, _globals(model), STORE.load_user("user00001"), 3, "u1")
    again = _train(trainer, _globals(model), data, 3, "u0")
    assert all(torch.equal(first[k], again.update[k]) for k in first)
    other_step = _train(trainer, _globals(model), data, 4, "u0")
    assert not all(torch.equal(first[k], other_step.update[k]) for k in first)
    # The backward's gradients are handed over, not accumulated into buffers kept on the model.
    assert all(leaf.grad is None for leaf in trainer.leaves)
    # Δ lies in one flat span, which the exact sum scales without gathering it.
    like = ExactSum(dict(first), max_abs=1.0)._scaled
    assert _one_span(list(other_step.update.values()), like) is not None


def test_updates_held_for_later_clients_sum_as_one_at_a_time():
    """On a CPU with the exact sum's kernel, Δ buffers in turn keep each client's update through
    the next TERMS_PER_PASS - 1 results, and the aggregator's sum takes up to TERMS_PER_PASS in
    one pass: the same pseudo-gradient bit for bit as one buffer and one client per pass, for a
    cohort that leaves a remainder (added at finish). An algorithm with payload entries, or a
    plug-in's (whose hooks might keep a Δ buffer), keeps one buffer."""
    from pflbench.privacy.aggregate import TERMS_PER_PASS, adds_in_one_pass

    model, paired = _trainer()
    _, alone = _trainer()
    assert paired.updates_outlive == (TERMS_PER_PASS - 1 if adds_in_one_pass() else 0)
    alone.updates_outlive = 0
    alone.update = LocalUpdate(alone.update.params, alone.recipe)
    users = [(f"user{i % 3:05d}", STORE.load_user(f"user{i % 3:05d}")) for i in range(6)]
    grads = []
    for trainer in (paired, alone):
        privacy = PrivacyRecipe(clipping="global", clip_bound=0.05)
        like = dict(zip(trainer.names, _globals(model), strict=True))
        agg = StepAggregator(like, make_mechanism(privacy, users=6), 2, update_bound=10.0)
        for user, result in trainer.train_group(_globals(model), users, 2):
            held = trainer.updates_outlive
            agg.add(result.update, user, result.loss, result.local_steps, result.frames, held)
        grads.append(agg.finish()[0])
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))
    _, scaffold = _trainer(algorithm="scaffold")
    assert scaffold.updates_outlive == 0
    algorithm = make_algorithm(alone.recipe, model, alone.names, seed=1)
    algorithm.__class__ = type("Outside", (type(algorithm),), {})  # a plug-in's: this module's
    outside = SequentialClientTrainer(model, alone.names, algorithm, SpecAugmentRecipe(), 1, "cpu")
    assert outside.updates_outlive == 0


def test_a_block_layer_drop_skips_keeps_its_weights():
    """paper-255m trains with layer drop 0.3: a skipped block is not in the graph, so its
    gradient is zero and the client's step leaves it; the other tensors still train. With
    layer drop 1 every block is skipped at every step."""
    model, trainer = _trainer(layer_drop=1.0)
    update = _train(trainer, _globals(model), STORE.load_user("user00000"), 0, "u0").update
    moved = {name for name, delta in update.items() if delta.abs().sum() > 0}
    blocks = {name for name in update if name.startswith("blocks.")}
    assert blocks and not moved & blocks
    assert moved  # the layers outside the blocks (input projection, output head) trained
    model, trainer = _trainer(layer_drop=0.5)
    for step in range(4):  # some blocks skipped, some not: no step fails
        _train(trainer, _globals(model), STORE.load_user("user00001"), step, "u1")


def test_local_steps_and_epochs_schedule():
    gen = torch.Generator().manual_seed(0)
    seconds = [5.0] * 6  # 10 s batches: 3 per epoch
    assert len(local_batches(seconds, ClientRecipe(local_steps=7, batch_seconds=10.0), gen)) == 7
    recipe = ClientRecipe(local_steps=None, local_epochs=2, batch_seconds=10.0)
    batches = local_batches(seconds, recipe, gen)
    assert len(batches) == 6 and sorted(i for b in batches for i in b) == sorted(2 * list(range(6)))
    assert local_batches([], ClientRecipe(), gen) == []


def test_local_gradient_clipping_bounds_each_step():
    # One local step of lr 1 with C_loc = 1e-3: ‖Δ‖ ≤ 1e-3.
    model, trainer = _trainer(local_steps=1, lr=1.0, grad_clip=1e-3)
    result = _train(trainer, _globals(model), STORE.load_user("user00000"), 0, "u")
    norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(list(result.update.values()))))
    assert 0.9e-3 < norm <= 1e-3 * (1 + 1e-5)


def _algorithm(recipe: ClientRecipe, params: list[torch.Tensor]):
    """The recipe's algorithm over [G, ...] tensors (only their shapes matter to the hooks)."""
    context = AlgorithmContext(
        names=[str(i) for i in range(len(params))],
        params=[p[0] for p in params],
        seed=0,
        device="cpu",
        user_states=UserStateStore(Path(tempfile.mkdtemp())),
        sampling_rate=1.0,
    )
    return CLIENT_ALGORITHMS[recipe.algorithm](recipe, context)


def _stacked(group: int, seed: int = 0) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Parameters and gradients of a few tensors (shapes like a model's), stacked [G, ...]."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [(48, 16), (16,), (3, 5, 7), (1,)]
    params = [torch.randn(group, *s, generator=gen) for s in shapes]
    grads = [torch.randn(group, *s, generator=gen) * 10.0 ** (i - 2) for i, s in enumerate(shapes)]
    return params, grads


@pytest.mark.parametrize("mu", [0.0, 0.5])
def test_one_client_rule_is_clip_grad_norm_and_sgd_bitwise(mu):
    """G = 1 performs exactly torch's clip_grad_norm_(foreach=True) and a foreach SGD step (with
    FedProx's mu (θ − θ_g) added first): one client at a time keeps its results bit for bit."""
    recipe = ClientRecipe(
        lr=0.3, grad_clip=0.5, fedprox_mu=mu, algorithm="fedprox" if mu else "fedavg"
    )
    params, grads = _stacked(1)
    theta = [p[0].clone() for p in params]  # θ at some local step
    global_params = [t + 0.01 * torch.randn_like(t) for t in theta]
    leaves = [t.clone().requires_grad_() for t in theta]
    for leaf, g in zip(leaves, grads, strict=True):
        leaf.grad = g[0].clone()
    with torch.no_grad():
        if mu:
            distance = torch._foreach_sub(leaves, global_params)
            torch._foreach_add_([p.grad for p in leaves], distance, alpha=mu)
        total = torch.nn.utils.clip_grad_norm_(leaves, recipe.grad_clip, foreach=True)
        torch._foreach_add_(leaves, [p.grad for p in leaves], alpha=-recipe.lr)
    assert total > recipe.grad_clip  # the clipping is active

    rule = LocalUpdate(params, recipe)
    rule.take_grads(grads)
    rule.start(global_params)
    torch._foreach_copy_(params, [t.unsqueeze(0) for t in theta])
    _algorithm(recipe, params).correct(rule)
    rule.step(idle=[])
    for leaf, p, g in zip(leaves, params, grads, strict=True):
        assert torch.equal(g[0], leaf.grad) and torch.equal(p[0], leaf.detach())
    delta = rule.finish()
    for d, g, leaf in zip(delta, global_params, leaves, strict=True):
        assert torch.equal(d[0], g - leaf.detach())


def test_fedprox_gradient_is_mu_times_distance():
    recipe = ClientRecipe(algorithm="fedprox", fedprox_mu=0.5, lr=0.1, grad_clip=1e6)
    params, grads = _stacked(2)
    rule = LocalUpdate(params, recipe)
    rule.start([torch.zeros_like(p[0]) for p in params])
    for i, p in enumerate(params):
        p.fill_(float(i % 3) - 1.0)
    rule.take_grads([torch.zeros_like(g) for g in grads])
    expected = [p - 0.1 * 0.5 * (p - 0.0) for p in params]
    _algorithm(recipe, params).correct(rule)
    rule.step(idle=[])
    for p, e in zip(params, expected, strict=True):
        torch.testing.assert_close(p, e)


def test_stacked_clients_step_alone_and_idle_ones_stay():
    """Each client's slice takes the step it would take alone (its own norm and clip factor);
    an idle slot (schedule ended) moves by nothing, not even with NaN gradients or weight noise."""
    recipe = ClientRecipe(lr=0.3, grad_clip=0.5, algorithm="fedprox", fedprox_mu=0.1)
    noisy = ClientRecipe(lr=0.3, grad_clip=0.5, algorithm="fvn", variational_noise={"std": 0.1})
    params, grads = _stacked(3, seed=1)
    global_params = [p[0] + 0.1 for p in params]
    theta = [p.clone() for p in params]
    grads[0][1] = float("nan")
    expected = []
    for i in (0, 2):
        alone_params, alone_grads = (
            [t[i : i + 1].clone() for t in theta],
            [g[i : i + 1].clone() for g in grads],
        )
        alone = LocalUpdate(alone_params, recipe)
        alone.take_grads(alone_grads)
        alone.start(global_params)
        torch._foreach_copy_(alone_params, [t[i : i + 1] for t in theta])
        _algorithm(recipe, alone_params).correct(alone)
        alone.step(idle=[])
        expected.append(alone_params)
    rule = LocalUpdate(params, recipe)
    rule.take_grads(grads)
    rule.start(global_params)
    torch._foreach_copy_(params, theta)
    noise = _algorithm(noisy, params)
    noise.start_group(rule, ["a", "b", "c"], step=0)
    noise.perturb(rule, [0, 2])
    assert all(torch.equal(p[1], t[1]) for p, t in zip(params, theta, strict=True))
    assert not torch.equal(params[0][0], theta[0][0])
    noise.unperturb(rule)
    assert all(torch.equal(p, t) for p, t in zip(params, theta, strict=True))
    _algorithm(recipe, params).correct(rule)
    rule.step(idle=[1])
    for slot, alone_params in zip((0, 2), expected, strict=True):
        for p, a in zip(params, alone_params, strict=True):
            torch.testing.assert_close(p[slot], a[0], rtol=1e-6, atol=1e-7)
    assert all(torch.equal(p[1], t[1]) for p, t in zip(params, theta, strict=True))
    assert all(torch.isfinite(p).all() for p in params)


def test_data_limit_and_variational_noise():
    data = STORE.load_user("user00002")
    gen = torch.Generator().manual_seed(0)
    limit = ClientRecipe(algorithm="data-limit", max_utterances=4)
    kept = _algorithm(limit, []).select_utterances(data, gen)
    assert len(kept) == 4 and {u.utt_id for u in kept} <= {u.utt_id for u in data}
    assert _algorithm(ClientRecipe(), []).select_utterances(data, gen) is data
    noise = FederatedVariationalNoise(std=0.03, ramp_steps=10)
    assert variational_noise_std(noise, 0) == 0 and variational_noise_std(noise, 5) == 0.015
    assert variational_noise_std(noise, 50) == 0.03
    model, plain = _trainer()
    _, noisy = _trainer(algorithm="fvn", variational_noise={"std": 0.01})
    a = _train(plain, _globals(model), data, 0, "u").update
    b = _train(noisy, _globals(model), data, 0, "u").update
    assert not all(torch.equal(a[k], b[k]) for k in a)
    # The noise perturbs the gradients only: the step sizes stay bounded by lr·C_loc·steps.
    bound = 0.2 * 1.0 * 2 * (1 + 1e-5)
    assert float(torch.stack(torch._foreach_norm(list(b.values()))).norm()) <= bound


# ---------------------------------------------------------------------------------------------
# Aggregation


def _aggregator(privacy: PrivacyRecipe, sigma_dp: float = 0.0, step: int = 0, like=None):
    like = like or {"a": torch.zeros(3), "b": torch.zeros(2)}
    mechanism = make_mechanism(privacy, users=2, sigma_dp=sigma_dp)  # denominator 2
    return StepAggregator(like, mechanism, step, update_bound=10.0)


def test_aggregate_clips_sums_and_averages():
    agg = _aggregator(PrivacyRecipe(clipping="global", clip_bound=1.0))
    agg.add({"a": torch.tensor([3.0, 0, 0]), "b": torch.tensor([4.0, 0])}, "u1", 1.0, 2, 10)
    agg.add({"a": torch.tensor([0.0, 0.5, 0]), "b": torch.tensor([0.0, 0])}, "u2", 3.0, 2, 10)
    grads, stats = agg.finish()
    # u1 (norm 5) is clipped to norm 1: [0.6, 0, 0], [0.8, 0]; u2 is inside the bound.
    torch.testing.assert_close(grads[0], torch.tensor([0.3, 0.25, 0.0]))
    torch.testing.assert_close(grads[1], torch.tensor([0.4, 0.0]))
    assert stats["clients"] == 2 and stats["loss"] == 2.0 and stats["local_steps"] == 4
    diag = stats["diagnostics"]
    assert diag["clipped_fraction"] == 0.5 and diag["private"] is False
    assert diag["layer_norm_mean"]["a"] == pytest.approx(1.75)
    assert diag["layer_norm_std"]["b"] == pytest.approx(2.0)


def test_nonfinite_update_is_zeroed_and_counted():
    agg = _aggregator(PrivacyRecipe(clipping="perlayer", clip_bound=1.0))
    agg.add({"a": torch.tensor([float("nan"), 0, 0]), "b": torch.ones(2)}, "bad", 9.0, 2, 10)
    agg.add({"a": torch.full((3,), 0.1), "b": torch.zeros(2)}, "good", 1.0, 2, 10)
    grads, stats = agg.finish()
    assert stats["nonfinite_updates"] == 1 and stats["loss"] == 1.0
    assert all(torch.isfinite(g).all() for g in grads)
    torch.testing.assert_close(grads[0], torch.full((3,), 0.05))


@pytest.mark.parametrize(
    "privacy",
    [
        {"clipping": "global", "clip_bound": 0.7},
        {"clipping": "perlayer", "clip_bound": 0.7, "perlayer_mode": "dim"},
        {"clipping": "perlayer", "clip_bound": 0.7, "perlayer_rule": "normalize"},
        {"clipping": "global", "clip_bound": 0.7, "noise_placement": "client"},
        {"clipping": "none"},
    ],
)
def test_clipping_s_multiply_in_the_sum_changes_no_bit(privacy):
    """The aggregator leaves clipping's multiply to the exact sum's pass (where clipping is the
    last per-user step): the same pseudo-gradient and stats, bit for bit, as clipping in place,
    over updates lying in one flat buffer (fl.local_update's Δ), clipped and not."""
    generator = torch.Generator().manual_seed(3)
    sizes = {"a": (40, 3), "b": (7,), "c": (11,)}
    updates = [torch.randn(138, generator=generator) * scale for scale in (0.05, 0.3, 2.0, 0.1)]
    sums = []
    for in_sum in (True, False):
        mechanism = make_mechanism(privacy, users=4, sigma_dp=0.3)
        like = {n: torch.zeros(s) for n, s in sizes.items()}
        agg = StepAggregator(like, mechanism, 5, update_bound=10.0)
        assert agg.scale_in_sum
        agg.scale_in_sum = in_sum
        for index, flat in enumerate(updates):
            pieces = flat.clone().split([math.prod(s) for s in sizes.values()])
            update = {n: p.view(sizes[n]) for n, p in zip(sizes, pieces, strict=True)}
            agg.add(update, f"u{index}", 1.0, 2, 10)
        sums.append(agg.finish())
    (fused, fused_stats), (in_place, in_place_stats) = sums
    assert all(torch.equal(a, b) for a, b in zip(fused, in_place, strict=True))
    assert fused_stats == in_place_stats


def test_only_the_gaussian_mechanism_s_own_steps_leave_the_multiply_to_the_sum():
    """A mechanism overriding constrain_sensitivity (which may read or change the clipped update)
    clips in place; so does one whose updates pflbench measures (an unshipped class under DP)."""
    from pflbench.privacy.mechanisms import PRIVACY_MECHANISMS, PrivacyMechanism, scales_in_sum

    class Logging(PrivacyMechanism):
        def constrain_sensitivity(self, update, user, step):
            return super().constrain_sensitivity(update, user, step)

    class Quiet(PrivacyMechanism):
        def add_noise(self, average, step):
            super().add_noise(average, step)

    PRIVACY_MECHANISMS.register("logging-here", Logging)
    PRIVACY_MECHANISMS.register("quiet-here", Quiet)
    privacy = {"clip_bound": 0.5, "clipping": "global"}
    for sigma_dp in (0.0, 0.5):
        shipped = make_mechanism({**privacy, "mechanism": "gaussian"}, 4, sigma_dp=sigma_dp)
        logging = make_mechanism({**privacy, "mechanism": "logging-here"}, 4, sigma_dp=sigma_dp)
        quiet = make_mechanism({**privacy, "mechanism": "quiet-here"}, 4, sigma_dp=sigma_dp)
        assert scales_in_sum(shipped) and not scales_in_sum(logging)
        assert scales_in_sum(quiet) == (sigma_dp == 0)  # measured under DP: in place
        update = {"w": torch.full((4,), 1.0)}
        agg = StepAggregator({"w": torch.zeros(4)}, logging, 0, update_bound=10.0)
        agg.add(update, "u0", 1.0, 1, 1)
        assert float(update["w"].norm()) <= 0.5  # clipped in place, as its override saw it


# Every placement/sampling combination a recipe allows; client noise with Poisson is refused.
ALLOWED = [("server", "poisson"), ("server", "fixed"), ("client", "fixed")]
K, S, C, SIGMA, WIDTH, STEPS = 40, 8, 0.5, 0.1, 400, 60


@pytest.mark.parametrize(("placement", "sampling"), ALLOWED)
def test_noise_std_on_the_average_is_c_sigma_for_every_allowed_configuration(placement, sampling):
    # The real cohort sampler and StepAggregator over many keyed steps; users send zero updates,
    # so what comes out is the noise on the average alone.
    privacy = PrivacyRecipe(clipping="global", clip_bound=C, noise_placement=placement)
    mechanism = make_mechanism(privacy, K, SIGMA, cohort=S, sampling=sampling, seed=11)
    # What it divides the sum by: qK (Poisson) or S (fixed).
    assert mechanism.denominator == (expected_cohort(K, S) if sampling == "poisson" else S)
    noise, ratios = [], []
    for step in range(STEPS):
        like = {"w": torch.zeros(WIDTH // 2), "b": torch.zeros(WIDTH // 2)}
        agg = StepAggregator(like, mechanism, step, update_bound=10.0)
        for user in mechanism.cohort(step).tolist():
            agg.add({name: torch.zeros_like(t) for name, t in like.items()}, f"u{user}", 0, 1, 1)
        grads, _ = agg.finish()
        step_noise = torch.cat(grads).double()
        noise.append(step_noise)
        ratios.append(float(step_noise.std()) / (C * SIGMA))
    pooled = float(torch.cat(noise).std()) / (C * SIGMA)
    assert abs(pooled - 1) < 0.05  # its standard error here is ~0.3%
    assert all(abs(r - 1) < 0.2 for r in ratios)  # and every step, not just on average
    assert abs(float(torch.cat(noise).mean())) < 5 * C * SIGMA / math.sqrt(STEPS * WIDTH)


def test_client_noise_with_poisson_sampling_is_refused_where_it_would_be_wrong():
    # Were it allowed: each of the |K_t| users adds std C·σ·√(qK), the sum is divided by qK, so
    # step t's noise has std C·σ·√(|K_t|/qK) on the average (none at all when |K_t| = 0).
    qk = expected_cohort(K, S)
    std = client_noise_std(C, SIGMA, qk)
    realized = {}
    for step in range(STEPS):
        cohort = sample_cohort(K, S, "poisson", seed=11, step=step).tolist()
        total = torch.zeros(WIDTH, dtype=torch.float64)
        for user in cohort:
            update = {"w": torch.zeros(WIDTH)}
            add_gaussian_noise(update, std, noise_generator(11, step, user=f"u{user}"))
            total += update["w"].double()
        ratio = float((total / qk).std()) / (C * SIGMA) if cohort else 0.0
        assert ratio == pytest.approx(math.sqrt(len(cohort) / qk), rel=0.15)
        realized[len(cohort)] = ratio
    assert min(realized.values()) < 0.8 and max(realized.values()) > 1.2  # far from C·σ
    # The recipe refuses the combination ...
    with pytest.raises(ValidationError, match="noise_placement: client needs federated.sampling"):
        Recipe(privacy={"noise_placement": "client"}, federated={"sampling": "poisson"})
    # ... and so does the aggregator, whatever it is handed: the client count must be qK.
    privacy = PrivacyRecipe(clipping="global", clip_bound=C, noise_placement="client")
    mechanism = make_mechanism(privacy, K, SIGMA, cohort=S, seed=11)
    agg = StepAggregator({"w": torch.zeros(WIDTH)}, mechanism, 0, update_bound=10.0)
    for user in range(S - 3):
        agg.add({"w": torch.zeros(WIDTH)}, f"u{user}", 0, 1, 1)
    with pytest.raises(ValueError, match="client-side noise needs exactly 8 clients"):
        agg.finish()


@pytest.mark.parametrize("placement", ["server", "client"])
def test_noise_std_on_the_average_is_c_sigma(placement):
    privacy = PrivacyRecipe(clipping="global", clip_bound=0.5, noise_placement=placement)
    like = {"w": torch.zeros(20_000)}
    agg = _aggregator(privacy, sigma_dp=0.1, like=like)
    for user in ("u1", "u2"):
        agg.add({"w": torch.zeros(20_000)}, user, 0.0, 1, 1)
    grads, stats = agg.finish()
    assert grads[0].std().item() == pytest.approx(0.5 * 0.1, rel=0.03)
    before = stats["diagnostics"]["update_norm_before_noise"]
    assert before == (0.0 if placement == "server" else None)
    again = _aggregator(privacy, sigma_dp=0.1, like=like)
    for user in ("u2", "u1"):  # order does not matter: streams are keyed by user
        again.add({"w": torch.zeros(20_000)}, user, 0.0, 1, 1)
    assert torch.equal(again.finish()[0][0], grads[0])
    assert math.isfinite(stats["diagnostics"]["update_norm_after_noise"])


def test_adaptive_clipping_noise_and_bits_spend_exactly_the_budgets_sigma():
    # Zero updates again: the average is the update noise alone, with std C_t·σ_Δ at the step's
    # bound C_t, and the released fraction is (all users within C_t)/qK plus N(0, f²).
    adaptive = AdaptiveClip(target_quantile=0.5, lr=0.2, bit_noise=0.02)
    privacy = PrivacyRecipe(clipping="global", clip_bound=C, adaptive_clip=adaptive)
    sigma = 0.03  # large enough that the bits' share shows: σ_Δ = 1.58·σ
    update_sigma = update_noise(sigma, adaptive.bit_noise)
    bound = 3 * C  # a bound the adaptation has moved to
    noise, fractions = [], []
    for step in range(STEPS):
        like = {"w": torch.zeros(WIDTH)}
        mechanism = make_mechanism(privacy, S, sigma, seed=5, clip_bound=bound)  # denominator S
        agg = StepAggregator(like, mechanism, step, update_bound=10.0)
        for user in range(S):
            agg.add({"w": torch.zeros(WIDTH)}, f"u{user}", 0, 1, 1)
        grads, stats = agg.finish()
        assert stats["clip_bound"] == bound
        assert mechanism.clip_bound != bound  # the release moved it for the next step
        noise.append(torch.cat(grads).double())
        fractions.append(stats["unclipped_fraction"])
    assert float(torch.cat(noise).std()) / (bound * update_sigma) == pytest.approx(1, abs=0.05)
    released = torch.tensor(fractions, dtype=torch.float64)
    assert float(released.mean()) == pytest.approx(1.0, abs=3 * adaptive.bit_noise / STEPS**0.5)
    assert float(released.std()) == pytest.approx(adaptive.bit_noise, rel=0.35)
    assert combined_noise(update_sigma, adaptive.bit_noise) == pytest.approx(sigma)


def test_adaptive_clipping_needs_clipping_on_the_server():
    with pytest.raises(ValidationError, match="adaptive_clip needs clipping"):
        PrivacyRecipe(clipping="none", adaptive_clip={})
    with pytest.raises(ValidationError, match="adaptive_clip needs noise_placement: server"):
        PrivacyRecipe(noise_placement="client", adaptive_clip={})


def test_a_recipe_setting_what_its_algorithm_ignores_is_refused():
    with pytest.raises(UserError, match="client algorithm 'fedavg' does not use fedprox_mu"):
        check_client_recipe(ClientRecipe(fedprox_mu=0.1))
    with pytest.raises(UserError, match="'data-limit' does not use variational_noise"):
        check_client_recipe(
            ClientRecipe(algorithm="data-limit", max_utterances=4, variational_noise={"std": 0.1})
        )
    with pytest.raises(UserError, match="'fedprox' needs fedprox_mu > 0"):
        check_client_recipe(ClientRecipe(algorithm="fedprox"))
    with pytest.raises(
        UserError, match="unknown client algorithm 'fedsgd'; known: fedavg, fedprox"
    ):
        check_client_recipe(ClientRecipe(algorithm="fedsgd"))
    check_client_recipe(ClientRecipe(algorithm="fvn", variational_noise={"std": 0.1}))


def test_the_noise_joins_the_exact_sum_so_the_release_depends_on_the_data_only_through_it():
    """The release is a rounding of (exact sum + noise): moving one user's update by d and the
    noise by -d/S gives bitwise the same average. Noise added after the sum is rounded fails
    this (how the sum rounds depends on the other users, so one user could move the release by
    more than C/S), whatever the noise's distribution."""
    from pflbench.privacy.mechanisms import PRIVACY_MECHANISMS, PrivacyMechanism

    class Preset(PrivacyMechanism):  # this test's noise: a given vector, drawn by nobody
        preset: torch.Tensor

        def add_noise(self, noise, step):
            noise["w"].add_(self.preset)

    PRIVACY_MECHANISMS.register("preset-noise-here", Preset)
    users, width, shift = 4, 64, 2.0**-10  # shift/users and its multiples are exact
    draws = [torch.Generator().manual_seed(i) for i in range(users)]
    updates = [torch.rand(width, generator=draw) / 10 for draw in draws]
    noise = torch.rand(width, dtype=torch.float64, generator=torch.Generator().manual_seed(9))

    def release(moved: float) -> torch.Tensor:
        privacy = {"clip_bound": 1.0, "clipping": "global", "mechanism": "preset-noise-here"}
        mechanism = make_mechanism(privacy, users, sigma_dp=0.5)
        mechanism.preset = noise - moved / users
        agg = StepAggregator({"w": torch.zeros(width)}, mechanism, 0, update_bound=10.0)
        for index, update in enumerate(updates):
            agg.add({"w": update + moved if index == 0 else update.clone()}, f"u{index}", 0, 1, 1)
        return agg.finish()[0][0]

    assert float(updates[0].norm()) + shift * width**0.5 < 1.0  # no update is clipped
    same = [torch.equal(release(0.0), release(k * shift)) for k in range(1, 9)]
    assert all(same), same


def test_exact_sum_adds_noise_on_its_grid_alike_in_its_fp64_and_int64_buffers():
    like = {"a": torch.zeros(3, 5), "b": torch.zeros(7)}
    terms = [{n: torch.randn(t.shape) for n, t in like.items()} for _ in range(3)]
    results = []
    for flushed in (False, True):
        exact = ExactSum(like, max_abs=10.0)
        for term in terms:
            exact.add({n: t.clone() for n, t in term.items()})
        if flushed:
            exact.buffers()  # the int64 sum, as before an all-reduce
        with_noise = exact.noise_buffers()
        assert all(t.dtype == torch.float64 and not t.any() for t in with_noise.values())
        for tensor in with_noise.values():
            tensor.add_(torch.full(tensor.shape, 0.25))
        exact.add_noise(3.0)  # 0.25 on the average of 3 terms: 0.75 on the sum
        results.append(exact.result(torch.float64))
    for name, term_sum in ((n, sum(t[n].double() for t in terms)) for n in like):
        torch.testing.assert_close(results[0][name], term_sum + 0.75)
        assert torch.equal(results[0][name], results[1][name])


def test_exact_sum_refuses_noise_it_was_not_given_or_cannot_hold():
    exact = ExactSum({"w": torch.zeros(4)}, max_abs=1.0)
    with pytest.raises(ValueError, match="noise_buffers"):
        exact.add_noise(1.0)
    exact.noise_buffers()["w"].fill_(float("nan"))
    with pytest.raises(ValueError, match="beyond its range"):
        exact.add_noise(1.0)
    exact.noise_buffers()["w"].fill_(2.0**30)  # ×2^42 on the grid of max_abs 1: past 2^62
    with pytest.raises(ValueError, match="beyond its range"):
        exact.add_noise(1.0)


def test_a_plug_in_mechanism_adding_less_noise_than_its_epsilon_assumes_is_refused():
    """Under DP a plug-in's noise on the average is measured (it is kept apart from the sum
    until added): one at 1% of C_t·σ_DP stops the run, naming it and the step; the Gaussian
    noise itself passes the test at every step, also BandMF-like noise scaled above it."""
    from pflbench.privacy.mechanisms import PRIVACY_MECHANISMS, PrivacyMechanism

    class Scaled(PrivacyMechanism):
        factor = 1.0

        def add_noise(self, noise, step):
            if self.factor is None:  # a NaN noise
                noise["w"][0] = float("nan")
                return
            generator = noise_generator(self.context.seed, step)
            std = self.factor * self.clip_bound * self.context.sigma_dp
            add_gaussian_noise(noise, std, generator)

    PRIVACY_MECHANISMS.register("scaled-noise-here", Scaled)
    privacy = {"clip_bound": 0.5, "clipping": "global", "mechanism": "scaled-noise-here"}

    def run(factor: float | None, steps: int) -> None:
        mechanism = make_mechanism(privacy, 4, sigma_dp=0.3)
        mechanism.factor = factor
        for step in range(steps):
            agg = StepAggregator(
                {"w": torch.zeros(300), "b": torch.zeros(3)}, mechanism, step, 10.0
            )
            for user in range(4):
                agg.add({"w": torch.full((300,), 0.01), "b": torch.zeros(3)}, f"u{user}", 0, 1, 1)
            agg.finish()

    run(1.0, 50)
    run(1.5, 5)
    for factor in (0.5, 0.01, None):  # (over 303 elements the test can tell 0.7)
        with pytest.raises(
            UserError, match="'scaled-noise-here' .* added noise of std .* at step 0"
        ):
            run(factor, 1)
