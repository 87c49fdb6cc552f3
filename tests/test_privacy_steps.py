"""The privacy steps (privacy/steps.py), each alone, and the factory that orders them per recipe."""

import itertools
import math

import pytest
import torch
from pydantic import ValidationError

from pflbench.errors import UserError
from pflbench.privacy.adaptive import update_noise
from pflbench.privacy.clipping import layer_bounds, layer_norms
from pflbench.privacy.noise import noise_generator
from pflbench.privacy.steps import (
    NOISE_HEADROOM,
    AddClientNoise,
    AddServerNoise,
    ClipGlobal,
    ClipPerLayer,
    MeasureNorms,
    ReleaseUnclippedFraction,
    ZeroNonfinite,
    privacy_steps,
)
from pflbench.spec.models import AdaptiveClip, PrivacyRecipe

SHAPES = {"enc.w": (64, 48), "enc.b": (48,), "out.w": (31, 48), "out.b": (31,)}
C, SIGMA, S, SEED, STEP = 0.5, 0.02, 16.0, 3, 11


def random_update(scale: float = 1.0, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=generator) * scale for n, s in SHAPES.items()}


def copy(update: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in update.items()}


def total_norm(update: dict[str, torch.Tensor]) -> float:
    return float(layer_norms(list(update.values())).double().norm())


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return list(a) == list(b) and all(torch.equal(a[n], b[n]) for n in a)


def steps_for(sigma_dp: float = SIGMA, clip_bound: float = C, **privacy):
    return privacy_steps(PrivacyRecipe(**privacy), sigma_dp, clip_bound, S, SEED, "cpu")


# ----------------------------------------------------------------------------------------------
# Per-user steps


def test_zero_nonfinite_zeroes_a_broken_update_and_says_so():
    update = random_update()
    update["out.b"][3] = float("inf")
    facts = ZeroNonfinite().apply(update, "u", STEP, {})
    assert facts["nonfinite"] is True and not facts["norms"].any()
    assert all(not t.any() for t in update.values())
    finite = random_update()
    kept = copy(finite)
    facts = ZeroNonfinite().apply(finite, "u", STEP, {})
    assert facts["nonfinite"] is False
    assert torch.equal(facts["norms"], layer_norms(list(kept.values())))  # measured once
    assert same(finite, kept)


def test_without_clipping_fp32_norms_bound_every_element_and_nan_is_still_told_apart():
    """ZeroNonfinite(exact=False) (no clipping follows): fp32 norms within their error bound of
    the fp64 ones, and MeasureNorms' `largest` from them bounds every element, also for a layer
    that is one large element among many small ones; a NaN still zeroes the update, while finite
    elements whose fp32 squares overflow do not (the fp64 norms decide)."""
    fast = ZeroNonfinite(exact=False)
    for seed in range(20):
        update = random_update(scale=10.0 ** (seed % 7 - 3), seed=seed)
        update["enc.w"][seed % 64, seed % 48] = 1e3 * (seed + 1)  # one spike in a big layer
        exact = layer_norms(list(update.values()))
        seen = fast.apply(update, "u", STEP, {})
        assert seen["nonfinite"] is False
        error = (seen["norms"] - exact).abs() / exact
        assert bool((error <= seen["norm_error"]).all()) and float(error.max()) < 1e-5
        largest = max(float(t.abs().max()) for t in update.values())
        bound = MeasureNorms().apply(update, "u", STEP, seen)["largest"]
        assert largest <= bound <= 1.01 * float(exact.max())
    broken = random_update()
    broken["out.w"][0, 0] = float("nan")
    assert fast.apply(broken, "u", STEP, {})["nonfinite"] is True
    assert all(not t.any() for t in broken.values())
    huge = random_update(scale=1e25)  # fp32 squares overflow, fp64 ones do not
    kept = copy(huge)
    seen = fast.apply(huge, "u", STEP, {})
    assert seen["nonfinite"] is False and "norm_error" not in seen
    assert torch.equal(seen["norms"], layer_norms(list(kept.values()))) and same(huge, kept)


def test_the_clips_reuse_measured_norms_and_bound_every_element_after_them():
    """One measurement (ZeroNonfinite's) serves the clip; the clipped update equals one clipped
    from scratch; `largest` bounds every element, so the exact sum may skip its range pass."""
    for step in (ClipGlobal(C), ClipPerLayer(C, "dim", "clip"), MeasureNorms()):
        update, fresh = random_update(), random_update()
        seen = ZeroNonfinite().apply(update, "u", STEP, {})
        facts = step.apply(update, "u", STEP, seen)
        step.apply(fresh, "u", STEP, {})
        assert same(update, fresh)
        largest = max(float(t.abs().max()) for t in update.values())
        assert largest <= facts["largest"] <= 1.01 * float(layer_norms(list(update.values())).max())


def test_clip_global_bounds_the_norm_keeps_the_direction_and_reports_the_norms_before():
    update = random_update()  # norm ~70, far over C
    before = copy(update)
    facts = ClipGlobal(C).apply(update, "u", STEP, {})
    assert facts["clipped"] is True
    assert torch.equal(facts["norms"], layer_norms(list(before.values())))
    assert C * (1 - 1e-6) < total_norm(update) <= C
    scale = total_norm(update) / total_norm(before)
    for name in SHAPES:
        torch.testing.assert_close(update[name], before[name] * scale, rtol=1e-5, atol=0)
    small = random_update(scale=1e-4)  # norm ~7e-3, inside C: left bitwise alone
    kept = copy(small)
    assert ClipGlobal(C).apply(small, "u", STEP, {})["clipped"] is False
    assert same(small, kept)


@pytest.mark.parametrize("mode", ["uniform", "dim"])
@pytest.mark.parametrize("rule", ["clip", "normalize"])
def test_clip_per_layer_bounds_every_layer_by_its_rule(mode, rule):
    bounds = layer_bounds([math.prod(s) for s in SHAPES.values()], C, mode)
    update = random_update()
    update["out.b"] *= 1e-6  # one layer far under its bound
    before = copy(update)
    facts = ClipPerLayer(C, mode, rule).apply(update, "u", STEP, {})
    assert facts["clipped"] is True
    assert torch.equal(facts["norms"], layer_norms(list(before.values())))
    after = layer_norms(list(update.values()))
    assert bool((after <= bounds).all()) and total_norm(update) <= C
    if rule == "clip":  # the small layer stays as it was, the others shrink to their bound
        assert torch.equal(update["out.b"], before["out.b"])
        torch.testing.assert_close(after[:3], bounds[:3], rtol=1e-5, atol=0)
    else:  # every non-zero layer is rescaled to its bound, the small one up
        torch.testing.assert_close(after, bounds, rtol=1e-5, atol=0)


def test_measure_norms_leaves_the_update_alone():
    update = random_update()
    kept = copy(update)
    facts = MeasureNorms().apply(update, "u", STEP, {})
    assert facts["clipped"] is False
    assert torch.equal(facts["norms"], layer_norms(list(kept.values())))
    assert same(update, kept)


def test_client_noise_has_std_c_sigma_sqrt_denominator_from_the_user_s_stream():
    mechanism = steps_for(clipping="global", noise_placement="client")
    noise = mechanism.per_user[-1]
    assert isinstance(noise, AddClientNoise)
    update = {"w": torch.ones(400_000)}
    facts = noise.apply(update, "alice", STEP, {})
    # A term of its own, beside the update (which it leaves as it is): the exact sum adds both.
    assert list(facts) == ["client_noise"] and torch.equal(update["w"], torch.ones(400_000))
    drawn = facts["client_noise"]["w"]
    # The std estimate's relative standard error is 1/sqrt(2n) ~ 0.1%.
    assert float(drawn.double().std()) == pytest.approx(C * SIGMA * math.sqrt(S), rel=0.01)
    generator = noise_generator(SEED, STEP, user="alice")
    expected = torch.randn(400_000, generator=generator) * (C * SIGMA * math.sqrt(S))
    torch.testing.assert_close(drawn, expected, rtol=1e-6, atol=0)
    again = noise.apply(update, "alice", STEP, {})["client_noise"]["w"]
    other = noise.apply(update, "bob", STEP, {})["client_noise"]["w"]
    assert torch.equal(again, drawn) and not torch.allclose(other, drawn)


# ----------------------------------------------------------------------------------------------
# Aggregate steps and the adaptive release


def test_server_noise_has_std_c_sigma_from_the_step_s_stream():
    (noise,) = steps_for(clipping="global").aggregate
    average = {"a": torch.zeros(200_000), "b": torch.zeros(200_000)}
    noise.apply(average, STEP)
    values = torch.cat(list(average.values())).double()
    assert float(values.std()) == pytest.approx(C * SIGMA, rel=0.01)
    assert abs(float(values.mean())) < 5 * C * SIGMA / math.sqrt(values.numel())
    again = {"a": torch.zeros(200_000), "b": torch.zeros(200_000)}
    noise.apply(again, STEP)
    assert same(again, average)  # keyed by (seed, step): a resumed run draws the same noise
    moved = {"a": torch.zeros(200_000), "b": torch.zeros(200_000)}
    noise.apply(moved, STEP + 1)
    assert not torch.allclose(moved["a"], average["a"])


def test_adaptive_server_noise_is_c_t_sigma_delta_and_the_release_spends_the_rest():
    adaptive = AdaptiveClip(target_quantile=0.5, lr=0.2, bit_noise=0.015)
    bound = 4 * C  # the step's C_t, moved by the adaptation
    mechanism = steps_for(sigma_dp=SIGMA, clip_bound=bound, adaptive_clip=adaptive)
    (noise,) = mechanism.aggregate
    average = {"w": torch.zeros(400_000)}
    noise.apply(average, STEP)
    sigma_delta = update_noise(SIGMA, adaptive.bit_noise)
    assert sigma_delta > 1.3 * SIGMA  # the bits' share shows
    assert float(average["w"].double().std()) == pytest.approx(bound * sigma_delta, rel=0.01)
    release = mechanism.unclipped_fraction
    fractions = torch.tensor(
        [
            ReleaseUnclippedFraction(adaptive.bit_noise, S, SEED).apply(12.0, S, step)
            for step in range(2000)
        ],
        dtype=torch.float64,
    )
    assert release == ReleaseUnclippedFraction(adaptive.bit_noise, S, SEED)
    assert float(fractions.mean()) == pytest.approx(
        12.0 / S, abs=4 * adaptive.bit_noise / math.sqrt(2000)
    )
    assert float(fractions.std()) == pytest.approx(adaptive.bit_noise, rel=0.05)
    assert release.apply(12.0, S, STEP) == release.apply(12.0, S, STEP)  # keyed: a resume draws
    # the same; a stream of its own, not a user's noise stream
    user_stream = noise_generator(SEED, STEP, user="adaptive-clip")
    assert release.apply(12.0, S, STEP) != 0.75 + adaptive.bit_noise * float(
        torch.randn((), generator=user_stream, dtype=torch.float64)
    )


def test_without_dp_the_adaptive_release_is_the_exact_fraction():
    adaptive = AdaptiveClip(target_quantile=0.5, lr=0.2, bit_noise=0.03)
    mechanism = steps_for(sigma_dp=0.0, adaptive_clip=adaptive)
    assert mechanism.aggregate == []
    assert mechanism.unclipped_fraction.apply(12.0, S, STEP) == 12.0 / S
    # centred: 20 users taking part where 16 were expected, 12 of them within the bound
    assert mechanism.unclipped_fraction.apply(12.0, 20.0, STEP) == (12.0 - 10.0) / S + 0.5


# ----------------------------------------------------------------------------------------------
# The factory


def test_the_factory_orders_the_steps_each_recipe_asks_for():
    client_std = C * SIGMA * math.sqrt(S)
    clip_global = [ZeroNonfinite(), ClipGlobal(C)]
    cases = [
        ({"clipping": "none"}, 0.0, [ZeroNonfinite(exact=False), MeasureNorms()], [], None, 0.0),
        ({"clipping": "global"}, 0.0, clip_global, [], C, 0.0),
        (
            {"clipping": "global"},
            SIGMA,
            clip_global,
            [AddServerNoise(C * SIGMA, SEED, "cpu")],
            C,
            0.0,
        ),
        (
            {"perlayer_mode": "uniform", "perlayer_rule": "normalize"},
            SIGMA,
            [ZeroNonfinite(), ClipPerLayer(C, "uniform", "normalize")],
            [AddServerNoise(C * SIGMA, SEED, "cpu")],
            C,
            0.0,
        ),
        (
            {"clipping": "global", "noise_placement": "client"},
            SIGMA,
            [*clip_global, AddClientNoise(client_std, SEED, "cpu")],
            [],
            C,
            NOISE_HEADROOM * client_std,
        ),
        ({"clipping": "global", "noise_placement": "client"}, 0.0, clip_global, [], C, 0.0),
    ]
    for privacy, sigma_dp, per_user, aggregate, bound, headroom in cases:
        mechanism = steps_for(sigma_dp, **privacy)
        assert mechanism.per_user == per_user, privacy
        assert mechanism.aggregate == aggregate, privacy
        assert mechanism.bound == bound, privacy
        assert mechanism.headroom == pytest.approx(headroom, rel=1e-15), privacy
        assert mechanism.client_noise == isinstance(per_user[-1], AddClientNoise)
        assert mechanism.unclipped_fraction is None


def test_the_factory_builds_every_mechanism_the_recipe_allows_and_refuses_nothing_new():
    # Every combination the spec accepts builds, in the order zero → clip/measure → client noise,
    # and its per-user steps give the aggregator the facts its stats need.
    built = 0
    options = itertools.product(
        ["none", "global", "perlayer"],
        ["uniform", "dim"],
        ["clip", "normalize"],
        ["server", "client"],
        [None, AdaptiveClip(bit_noise=0.05)],
        [0.0, SIGMA],
    )
    for clipping, mode, rule, placement, adaptive, sigma_dp in options:
        fields = dict(clipping=clipping, perlayer_mode=mode, perlayer_rule=rule)
        fields |= dict(noise_placement=placement, adaptive_clip=adaptive)
        try:
            privacy = PrivacyRecipe(**fields)
        except ValidationError:
            continue
        mechanism = privacy_steps(privacy, sigma_dp, C, S, SEED, "cpu")
        first, second, *rest = mechanism.per_user
        assert first == ZeroNonfinite(exact=clipping != "none")  # clipping needs exact norms
        clip = {"none": MeasureNorms, "global": ClipGlobal, "perlayer": ClipPerLayer}[clipping]
        assert isinstance(second, clip)
        noisy = sigma_dp > 0
        client_noise = AddClientNoise(C * SIGMA * math.sqrt(S), SEED, "cpu")
        assert rest == ([client_noise] if noisy and placement == "client" else [])
        assert len(mechanism.aggregate) == int(noisy and placement == "server")
        assert (mechanism.unclipped_fraction is None) == (adaptive is None)
        facts: dict = {}
        update = random_update()
        for step in mechanism.per_user:
            facts |= step.apply(update, "u", STEP, facts)
        fp32_norms = {"norm_error"} if clipping == "none" else set()
        client_noise = {"client_noise"} if noisy and placement == "client" else set()
        assert (
            set(facts) == {"nonfinite", "norms", "clipped", "largest"} | fp32_norms | client_noise
        )
        assert facts["largest"] is not None  # the update's own bound: its noise is apart
        built += 1
    # Per σ: 3 clippings × 2 modes × 2 rules × 2 placements, and with adaptive clipping
    # 2 clippings × 2 modes × 2 rules on the server.
    assert built == 2 * (24 + 8)


def test_adaptive_bits_that_would_use_the_whole_budget_are_refused_as_before():
    # The one refusal in the factory is update_noise's, raised before any user is trained now
    # (it used to come at the end of the first step).
    with pytest.raises(UserError, match="bit_noise 0.01 must exceed"):
        steps_for(sigma_dp=SIGMA, adaptive_clip=AdaptiveClip(bit_noise=0.01))
    steps_for(sigma_dp=0.0, adaptive_clip=AdaptiveClip(bit_noise=0.01))  # no DP: nothing to split
