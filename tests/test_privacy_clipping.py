"""Clipping: bounds hold for every dtype/shape/scale, untouched layers stay bit-identical; the
fp64 norms the C kernel measures are torch's, bit for bit."""

import math
import platform
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pflbench.model.transformer import build_model
from pflbench.privacy import clipping
from pflbench.privacy.clipping import (
    clip_examples,
    clip_update,
    layer_bounds,
    layer_norms,
    zero_if_nonfinite,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
INSIDE = 1 - 1e-5  # "inside" means inside by more than the clipping margin
OUTSIDE = 1 + 1e-5  # ... and "over" means over by more than it


def norm64(tensor: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(tensor.double()))


def square_sum_upper(tensor: torch.Tensor) -> Fraction:
    """The exact sum of squares (as fractions) of fp64 and small tensors; for the others an upper
    bound within 2n·2^-53 relative: their squares are exact in fp64, and n of them summed in any
    order are off by less than n·2^-53 relative."""
    values = tensor.detach().double().cpu().numpy().ravel()
    if tensor.dtype == torch.float64 or len(values) <= 64:
        return sum((Fraction(float(v)) ** 2 for v in values), Fraction(0))
    return Fraction(float(np.sum(values * values))) * (1 + Fraction(2 * len(values), 2**53))


def within(tensors, bound: float) -> bool:
    """Whether the L2 norm of `tensors` together is <= bound in exact arithmetic."""
    return sum((square_sum_upper(t) for t in tensors), Fraction(0)) <= Fraction(bound) ** 2


@st.composite
def updates(draw):
    """A model-shaped update: 1-5 layers of random shapes, one dtype, per-layer scales spread
    over orders of magnitude (like LayerNorm vs attention deltas), fp16 kept in its normal range."""
    dtype = draw(st.sampled_from(DTYPES))
    low, high = (0.0, 2.0) if dtype == torch.float16 else (-4.0, 3.0)
    num_layers = draw(st.integers(1, 5))
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    update = {}
    for h in range(num_layers):
        shape = draw(st.lists(st.integers(1, 24), min_size=1, max_size=3))
        scale = 10 ** draw(st.floats(low, high))
        values = torch.randn(shape, generator=generator, dtype=torch.float64) * scale
        update[f"layer{h}.weight"] = values.to(dtype)
    return update


bound_ratios = st.floats(-2.0, 2.0).map(lambda e: 10**e)  # C relative to the update's norm


@settings(max_examples=150, deadline=None)
@given(update=updates(), ratio=bound_ratios)
def test_global_clip_bounds_norm_and_keeps_inside_updates(update, ratio):
    total = math.sqrt(sum(norm64(t) ** 2 for t in update.values()))
    bound = total * ratio
    original = {k: v.clone() for k, v in update.items()}
    result = clip_update(update, "global", bound)

    clipped_norm = math.sqrt(sum(norm64(t) ** 2 for t in result.update.values()))
    assert within(result.update.values(), bound)
    assert result.total_norm == pytest.approx(total, rel=1e-5)
    assert torch.allclose(
        result.norms.double(),
        torch.tensor([norm64(t) for t in original.values()], dtype=torch.float64),
        rtol=1e-5,
    )
    assert (result.factors <= 1).all() and result.norms.dtype == torch.float64
    for name, tensor in result.update.items():
        assert tensor.dtype == original[name].dtype
        assert torch.equal(update[name], original[name])  # not in place by default
    if total <= bound * INSIDE:
        assert all(torch.equal(result.update[k], original[k]) for k in original)
    elif total > bound:  # clipped to the bound, not far inside it (the rounding margin is tiny)
        eps = max(torch.finfo(t.dtype).eps for t in original.values())
        assert clipped_norm >= bound * (1 - 4 * eps - 1e-6)


@settings(max_examples=150, deadline=None)
@given(update=updates(), ratio=bound_ratios, mode=st.sampled_from(["uniform", "dim"]))
def test_perlayer_clip_bounds_every_layer_and_the_total(update, ratio, mode):
    total = math.sqrt(sum(norm64(t) ** 2 for t in update.values()))
    bound = total * ratio
    original = {k: v.clone() for k, v in update.items()}
    bounds = layer_bounds([t.numel() for t in update.values()], bound, mode).tolist()
    result = clip_update(update, "perlayer", bound, perlayer_mode=mode, in_place=True)

    assert result.update is not update
    for (name, tensor), layer_bound in zip(result.update.items(), bounds, strict=True):
        assert tensor.data_ptr() == update[name].data_ptr()  # in place
        assert within([tensor], layer_bound)
        if norm64(original[name]) <= layer_bound * INSIDE:
            assert torch.equal(tensor, original[name])
    assert within(result.update.values(), bound)


@given(
    sizes=st.lists(st.integers(1, 10**7), min_size=1, max_size=40),
    bound=st.floats(1e-8, 1e3),
)
def test_layer_bound_formulas_are_exact(sizes, bound):
    uniform = layer_bounds(sizes, bound, "uniform")
    dim = layer_bounds(sizes, bound, "dim")
    f64 = torch.float64
    expected_uniform = torch.tensor([bound / math.sqrt(len(sizes))] * len(sizes), dtype=f64)
    expected_dim = torch.tensor([bound * math.sqrt(d / sum(sizes)) for d in sizes], dtype=f64)
    assert uniform.dtype == dim.dtype == torch.float64
    assert torch.allclose(uniform, expected_uniform, rtol=1e-15, atol=0)
    assert torch.allclose(dim, expected_dim, rtol=1e-15, atol=0)
    # sum_h C_h^2 = C^2: per-layer clipping keeps the global sensitivity C.
    assert float((dim**2).sum()) == pytest.approx(bound**2, rel=1e-12)


def test_none_clipping_reports_norms_and_changes_nothing():
    update = {"a": torch.full((3,), 2.0), "b": torch.zeros(2)}
    result = clip_update(update, "none", 1e-3)
    assert torch.equal(result.factors, torch.ones(2))
    assert torch.equal(result.update["a"], update["a"])
    assert result.norms.tolist() == pytest.approx([math.sqrt(12), 0.0])


def test_zero_update_is_not_nan():
    result = clip_update({"a": torch.zeros(4), "b": torch.zeros(1)}, "perlayer", 1.0)
    assert torch.equal(result.update["a"], torch.zeros(4))
    assert torch.equal(result.factors, torch.ones(2))


def test_global_clip_scales_every_layer_by_one_factor():
    update = {"a": torch.tensor([3.0, 0.0]), "b": torch.tensor([0.0, 4.0])}  # norm 5
    result = clip_update(update, "global", 1.0)
    assert result.total_norm == pytest.approx(5.0)
    assert result.factors.tolist() == pytest.approx([0.2, 0.2], rel=1e-6)
    assert result.update["a"].tolist() == pytest.approx([0.6, 0.0], rel=1e-6)


def test_unknown_clipping_or_mode_is_rejected():
    update = {"a": torch.ones(2)}
    with pytest.raises(ValueError, match="clipping"):
        clip_update(update, "layerwise", 1.0)
    with pytest.raises(ValueError, match="mode"):
        clip_update(update, "perlayer", 1.0, perlayer_mode="sqrt")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_zero_if_nonfinite_zeroes_the_whole_update(dtype, bad):
    update = {"a": torch.ones(3, dtype=dtype), "b": torch.tensor([1.0, bad, 2.0], dtype=dtype)}
    assert zero_if_nonfinite(update) is True
    assert all(torch.equal(t, torch.zeros_like(t)) for t in update.values())


def test_zero_if_nonfinite_leaves_finite_updates_alone():
    update = {"a": torch.tensor([1e300, -3.0], dtype=torch.float64), "b": torch.ones(2)}
    before = {k: v.clone() for k, v in update.items()}
    assert zero_if_nonfinite(update) is False
    assert all(torch.equal(update[k], before[k]) for k in before)


def test_zero_if_nonfinite_with_empty_tensors():
    assert zero_if_nonfinite({"empty": torch.ones(0)}) is False
    update = {"empty": torch.ones(0), "b": torch.tensor([1.0, float("nan")])}
    assert zero_if_nonfinite(update) is True and torch.equal(update["b"], torch.zeros(2))
    assert zero_if_nonfinite({"empty": torch.ones(0, 3), "c": torch.ones(2)}) is False


# ----------------------------------------------------------------------------------------------
# Per-layer rules: "clip" (Definition 3) and "normalize" (the paper authors' code)

# Per-layer scale exponents down to where the dtype's squares are subnormal or underflow, and
# all-zero layers: the rules must keep ||Δ|| <= C for any input a client can send.
EXPONENTS = {
    torch.float16: (-7.0, 2.0),
    torch.bfloat16: (-40.0, 3.0),
    torch.float32: (-40.0, 3.0),
    torch.float64: (-300.0, 3.0),
}


@st.composite
def wide_updates(draw):
    dtype = draw(st.sampled_from(DTYPES))
    low, high = EXPONENTS[dtype]
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    update = {}
    for h in range(draw(st.integers(1, 6))):
        shape = draw(st.lists(st.integers(1, 24), min_size=1, max_size=3))
        scale = 0.0 if draw(st.integers(0, 5)) == 0 else 10 ** draw(st.floats(low, high))
        values = torch.randn(shape, generator=generator, dtype=torch.float64) * scale
        update[f"layer{h}.weight"] = values.to(dtype)
    return update


@settings(max_examples=300, deadline=None)
@given(
    update=wide_updates(),
    ratio=bound_ratios,
    mode=st.sampled_from(["uniform", "dim"]),
    rule=st.sampled_from(["clip", "normalize"]),
)
def test_both_perlayer_rules_keep_the_total_norm_within_c(update, ratio, mode, rule):
    total = math.sqrt(sum(norm64(t) ** 2 for t in update.values()))
    # C is the recipe's (the paper goes down to 1e-8); the update is whatever a client sends.
    # fp16 layers clipped below ~1e-2 land in fp16's subnormal range, where rounding is absolute:
    # the bound must hold there too (fp16's values are scaled in fp64 and rounded toward zero).
    bound = max(total * ratio, 1e-8)
    bounds = layer_bounds([t.numel() for t in update.values()], bound, mode).tolist()
    result = clip_update(update, "perlayer", bound, perlayer_mode=mode, perlayer_rule=rule)
    assert within(result.update.values(), bound)
    # clip bounds every layer by C_h; normalize does whenever it acts (||Δ|| > C).
    if rule == "clip" or result.total_norm > bound:
        for tensor, layer_bound in zip(result.update.values(), bounds, strict=True):
            assert within([tensor], layer_bound)
    assert all(torch.isfinite(t).all() for t in result.update.values())


@settings(max_examples=150, deadline=None)
@given(update=updates(), ratio=bound_ratios, mode=st.sampled_from(["uniform", "dim"]))
def test_normalize_sets_every_layer_to_its_bound_when_the_update_is_over_c(update, ratio, mode):
    total = math.sqrt(sum(norm64(t) ** 2 for t in update.values()))
    bound = total * ratio
    original = {k: v.clone() for k, v in update.items()}
    bounds = layer_bounds([t.numel() for t in update.values()], bound, mode).tolist()
    result = clip_update(update, "perlayer", bound, perlayer_mode=mode, perlayer_rule="normalize")
    if total <= bound * INSIDE:
        assert all(torch.equal(result.update[k], original[k]) for k in original)
        assert not result.changed
    elif total > bound * OUTSIDE:
        eps = max(torch.finfo(t.dtype).eps for t in original.values())
        for tensor, layer_bound in zip(result.update.values(), bounds, strict=True):
            assert norm64(tensor) == pytest.approx(layer_bound, rel=4 * eps + 1e-6)
        assert result.changed


@settings(max_examples=150, deadline=None)
@given(
    update=wide_updates(),
    exponents=st.lists(st.floats(-3.0, 3.0), min_size=1, max_size=5),
    ratio=bound_ratios,
    clipping=st.sampled_from(["global", "perlayer"]),
)
def test_examples_are_clipped_as_clip_update_clips_each_alone(update, exponents, ratio, clipping):
    """clip_examples (DP-SGD's per-example clipping): example i's rows get the factors
    clip_update gives example i alone, and each stays within C (and per layer C_h) exactly, in
    every dtype down to its subnormal range."""
    dtype = next(iter(update.values())).dtype
    if dtype == torch.float16:  # fp16's values stay finite
        exponents = [e / 3 for e in exponents]
    examples = [{k: (v.double() * 10**e).to(dtype) for k, v in update.items()} for e in exponents]
    total = math.sqrt(sum(norm64(t) ** 2 for t in examples[0].values()))
    bound = max(total * ratio, 1e-8)
    bounds = layer_bounds([t.numel() for t in update.values()], bound, "dim").tolist()
    samples = [torch.stack([example[k] for example in examples]) for k in update]
    result = clip_examples(samples, clipping, bound)
    assert not result.nonfinite.any()
    for i, example in enumerate(examples):
        alone = clip_update(example, clipping, bound)
        assert torch.allclose(result.factors[i], alone.factors, rtol=1e-12, atol=0)
        rows = [sample[i] for sample in samples]
        assert within(rows, bound)
        if clipping == "perlayer":
            assert all(within([row], b) for row, b in zip(rows, bounds, strict=True))
    assert result.clipped == sum(bool((f < 1).any()) for f in result.factors)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("clipping", ["global", "perlayer"])
def test_an_update_near_the_dtypes_largest_values_is_clipped_exactly(dtype, clipping):
    # ‖Δ‖ over ~1e38·C makes the factor subnormal in fp32, where its own rounding is absolute
    # (up to 2^-150): multiplied as fp32 it left ‖Δ‖ 2.3e-6 over C = 0.01. It is scaled in fp64
    # and rounded toward zero instead.
    for bound in [1e-3, 0.01, 0.1, 1.0]:
        for value in [3e38, 1e38, 2e37]:
            update = {"a": torch.tensor([value, 0.7 * value, -0.3 * value]).to(dtype)}
            result = clip_update(update, clipping, bound)
            assert within(result.update.values(), bound), (bound, value)
            assert norm64(result.update["a"]) >= bound * (1 - 4 * torch.finfo(dtype).eps - 1e-6)
            samples = [update["a"][None].clone()]
            clip_examples(samples, clipping, bound)
            assert within(samples, bound), (bound, value)


def test_the_two_rules_by_hand():
    # C = 1, uniform: C_h = 1/sqrt(2). Layer a is over its bound, layer b far inside it.
    update = {"a": torch.tensor([3.0, 4.0]), "b": torch.tensor([0.0, 0.1])}
    c_h = 1 / math.sqrt(2)
    clipped = clip_update(update, "perlayer", 1.0, perlayer_mode="uniform", perlayer_rule="clip")
    assert clipped.update["a"].tolist() == pytest.approx([0.6 * c_h, 0.8 * c_h], rel=1e-6)
    assert torch.equal(clipped.update["b"], update["b"])
    scaled = clip_update(
        update, "perlayer", 1.0, perlayer_mode="uniform", perlayer_rule="normalize"
    )
    assert scaled.update["a"].tolist() == pytest.approx([0.6 * c_h, 0.8 * c_h], rel=1e-6)
    assert scaled.update["b"].tolist() == pytest.approx([0.0, c_h], rel=1e-6)  # scaled up
    assert scaled.factors[1] == pytest.approx(c_h / 0.1, rel=1e-6)
    # ||Δ|| = 0.85 <= C: normalize leaves it alone although layer a is over C_h; clip does not.
    inside = {"a": torch.tensor([0.6, 0.6]), "b": torch.zeros(2)}
    left = clip_update(inside, "perlayer", 1.0, perlayer_mode="uniform", perlayer_rule="normalize")
    assert torch.equal(left.update["a"], inside["a"]) and not left.changed
    cut = clip_update(inside, "perlayer", 1.0, perlayer_mode="uniform", perlayer_rule="clip")
    assert norm64(cut.update["a"]) == pytest.approx(c_h, rel=1e-6) and cut.changed


def test_normalize_does_not_overshoot_a_layer_measured_on_subnormal_squares():
    # 1e-20² is subnormal in fp32: measured in fp32 its norm comes out 2.7e-6 too small, so
    # scaling it up by C_h / measured would overshoot C_h; fp64 squares measure it exactly.
    update = {"big": torch.full((4,), 1.0), "tiny": torch.full((4,), 1e-20)}
    result = clip_update(
        update, "perlayer", 1.0, perlayer_mode="uniform", perlayer_rule="normalize"
    )
    c_h = 1 / math.sqrt(2)
    assert within([result.update["tiny"]], c_h)
    assert norm64(result.update["tiny"]) == pytest.approx(c_h, rel=1e-5)
    assert norm64(result.update["big"]) == pytest.approx(c_h, rel=1e-6)


def test_unknown_perlayer_rule_is_rejected():
    with pytest.raises(ValueError, match="rule"):
        clip_update({"a": torch.ones(2)}, "perlayer", 1.0, perlayer_rule="rescale")


# ----------------------------------------------------------------------------------------------
# Exactness at the paper model's tensor sizes (paper-255m: 768 x 3072 MLP weights, 2.36M values)

PAPER_SHAPES = {"mlp.w1": (3072, 768), "attn.qkv": (768, 2304), "norm.weight": (768,)}


def paper_update(dtype: torch.dtype, seed: int, scale: float) -> dict[str, torch.Tensor]:
    """Layers whose scales differ by orders of magnitude, like a transformer's deltas."""
    generator = torch.Generator().manual_seed(seed)
    return {
        name: (torch.randn(shape, generator=generator) * scale * 10 ** (-h % 3)).to(dtype)
        for h, (name, shape) in enumerate(PAPER_SHAPES.items())
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "clipping,mode,rule",
    [("global", "dim", "clip"), ("perlayer", "dim", "clip"), ("perlayer", "uniform", "clip"),
     ("perlayer", "dim", "normalize"), ("perlayer", "uniform", "normalize")],
)  # fmt: skip
def test_clipping_is_exact_at_paper_sizes(dtype, clipping, mode, rule):
    # C = 0.01 (the paper's; fp16's values are subnormal there) and C = 1, against updates ~3x
    # over the bound: every layer the rule bounds and the total are <= their bounds in exact
    # arithmetic, not up to rounding.
    for seed, bound in enumerate([0.01, 1.0]):
        update = paper_update(dtype, seed, scale=3 * bound / math.sqrt(3072 * 768))
        result = clip_update(update, clipping, bound, perlayer_mode=mode, perlayer_rule=rule)
        assert result.changed
        assert within(result.update.values(), bound)
        if clipping == "perlayer":
            bounds = layer_bounds([t.numel() for t in update.values()], bound, mode).tolist()
            scaled = result.factors.tolist()
            for tensor, layer_bound, factor in zip(
                result.update.values(), bounds, scaled, strict=True
            ):
                assert within([tensor], layer_bound)
                # ... and a scaled layer lands at its bound, not far inside it (fp16's values at
                # C = 0.01 are subnormal, ~4e-6, and rounded toward zero: up to ~1% inside)
                if dtype != torch.float16 and factor != 1:
                    assert norm64(tensor) >= layer_bound * (1 - 4 * torch.finfo(dtype).eps)


def test_fp64_norms_measure_a_large_fp32_layer_exactly():
    # fp32 accumulation under-measures a 2.36M-element layer by ~4e-5 relative (then a layer
    # "clipped" to C_h stays above it); the fp64 norm is within 1e-12 of the exact one.
    layer = torch.randn(3072, 768, generator=torch.Generator().manual_seed(0)) * 1e-3
    exact = math.sqrt(math.fsum(np.square(layer.double().numpy().ravel())))
    (measured,) = clip_update({"w": layer}, "none", 1.0).norms.tolist()
    assert abs(measured - exact) <= 1e-12 * exact


# ----------------------------------------------------------------------------------------------
# The C kernel's fp64 norms of fp32 layers (privacy/_kernels.c)

needs_kernel = pytest.mark.skipif(
    clipping._kernels is None, reason="the C kernel is not built here (no C compiler at install)"
)


def torchs_norms(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack(torch._foreach_norm(tensors, 2, dtype=torch.float64))


@needs_kernel
@settings(max_examples=300, deadline=None)
@given(
    shapes=st.lists(st.lists(st.integers(0, 40), min_size=1, max_size=3), min_size=1, max_size=6),
    spread=st.floats(0.0, 16.0),
    seed=st.integers(0, 2**31),
    strided=st.booleans(),
)
def test_the_kernel_measures_fp32_layers_as_torch_does(shapes, spread, seed, strided):
    """Any shapes (empty ones and ones shorter than the kernel's 4 lanes included) and magnitudes
    spread over up to 2^±16 (so the order of the sum shows in the last bits): the kernel's norms
    equal torch's bit for bit. Strided views (which torch sums in memory order) are measured by
    torch: `layer_norms` gives torch's norms either way."""
    generator = torch.Generator().manual_seed(seed)
    tensors = [
        torch.randn(shape, generator=generator)
        * torch.randn(shape, generator=generator).mul(spread).exp2()
        for shape in shapes
    ]
    if strided:
        tensors = [t.transpose(0, -1) for t in tensors]
    else:
        assert torch.equal(clipping._kernel_layer_norms(tensors), torchs_norms(tensors))
    assert torch.equal(layer_norms(tensors), torchs_norms(tensors))


@needs_kernel
def test_the_kernel_measures_a_models_update_and_nonfinite_layers_as_torch_does():
    """The embedded task's model (78 layers up to 262,144 elements) as one flat update, as
    fl.local_update leaves Δ, and updates of random sizes up to 2^17 elements; then the model's
    with a NaN, an Inf, and both in some layers: NaN and Inf exactly where torch has them."""
    model = build_model("synth-cpu-m", 32)
    sizes = [p.numel() for p in model.parameters()]
    generator = torch.Generator().manual_seed(4)
    flat = torch.randn(sum(sizes), generator=generator) * 1e-3
    update = [v.view(p.shape) for v, p in zip(flat.split(sizes), model.parameters(), strict=True)]
    assert torch.equal(clipping._kernel_layer_norms(update), torchs_norms(update))
    lengths = torch.randint(1, 2**17, (40,), generator=generator).tolist()
    spread = [torch.randn(n, generator=generator).mul(6).exp2() for n in lengths]
    assert torch.equal(clipping._kernel_layer_norms(spread), torchs_norms(spread))
    update[3].view(-1)[7] = float("nan")
    update[10].view(-1)[0] = float("inf")
    update[20].view(-1)[-1] = float("-inf")
    update[20].view(-1)[5] = float("nan")
    got, want = clipping._kernel_layer_norms(update), torchs_norms(update)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.isinf(), want.isinf())
    assert got.isnan().tolist().count(True) == 2 and bool(got[10].isinf())
    finite = want.isfinite()
    assert torch.equal(got[finite], want[finite])
    # torch measures a one-element layer as |x|: a NaN's sign (x86's 0/0 is -NaN) cleared
    single = [torch.tensor([0.0]) / torch.tensor([0.0]), torch.tensor([-0.5]), torch.zeros(1)]
    bits = clipping._kernel_layer_norms(single).view(torch.int64)
    assert torch.equal(bits, torchs_norms(single).view(torch.int64))


def _norm_in_order(tensor: torch.Tensor, order: str) -> float:
    """The fp64 norm summed in 4 lanes as the kernel sums ("kernel": the lanes in order, then
    the tail one by one), or otherwise: the tail summed apart and then added, added into the
    lanes, or summed first; the lanes summed pairwise; one element after the other."""
    values = tensor.double().numpy().ravel()
    body = len(values) - len(values) % 4
    lanes = [0.0] * 4
    if body:  # (cumsum sums each lane element by element)
        lanes = [float(v) for v in np.cumsum(values[:body].reshape(-1, 4) ** 2, axis=0)[-1]]
    tail = [float(v) ** 2 for v in values[body:]]
    if order == "sequential":
        total = 0.0
        for value in values:
            total += float(value) ** 2
        return math.sqrt(total)
    if order == "tail into lanes":
        lanes = [lane + square for lane, square in zip(lanes, (tail + [0.0] * 4)[:4], strict=True)]
        tail = []
    total = 0.0
    if order == "tail first":
        for square in tail:
            total += square
        tail = []
    if order == "pairwise lanes":
        total += (lanes[0] + lanes[1]) + (lanes[2] + lanes[3])
    else:
        total = (((total + lanes[0]) + lanes[1]) + lanes[2]) + lanes[3]
    if order == "tail apart":
        apart = 0.0
        for square in tail:
            apart += square
        return math.sqrt(total + apart)
    for square in tail:
        total += square
    return math.sqrt(total)


@needs_kernel
def test_the_order_check_tells_other_orders_apart():
    """The kernel is used only where its norms are torch's on the probes: in the kernel's order
    the probes' norms are torch's, and in each other (the tail summed apart, into the lanes or
    first; the lanes pairwise; element by element; numpy's pairwise sum) several differ, so a
    torch that sums otherwise fails the check."""
    probes = clipping.order_probes()
    torchs = torchs_norms(probes).tolist()
    assert [_norm_in_order(p, "kernel") for p in probes] == torchs
    others = ["tail apart", "tail into lanes", "tail first", "pairwise lanes", "sequential"]
    for order in others:
        differing = sum(_norm_in_order(p, order) != t for p, t in zip(probes, torchs, strict=True))
        assert differing >= 3, order
    pairwise = [math.sqrt(float(np.sum(p.double().numpy() ** 2))) for p in probes]
    assert pairwise != torchs
    if platform.machine() in ("x86_64", "AMD64"):  # ATen sums this way on x86-64 (2.13)
        assert clipping.kernel_norms_are_torchs()


def test_layer_norms_are_the_same_with_the_kernel_and_without(monkeypatch):
    """What clipping sees does not depend on whether the kernel was built."""
    generator = torch.Generator().manual_seed(9)
    update = [torch.randn(shape, generator=generator) * 1e-3 for shape in ((64, 33), (5,), (7, 3))]
    with_kernel = layer_norms(update)
    monkeypatch.setattr(clipping, "_kernels", None)
    clipping.kernel_norms_are_torchs.cache_clear()
    try:
        assert not clipping.kernel_norms_are_torchs()
        assert torch.equal(layer_norms(update), with_kernel)
    finally:
        clipping.kernel_norms_are_torchs.cache_clear()
