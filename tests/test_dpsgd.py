"""Example-level DP-SGD through opacus (training: dpsgd-example, paper 003): per-example gradients
cover every trained tensor, clipping bounds each example (globally and per layer), the noise has
std z·C, the record's ε is opacus' accountant's, budgets of the other unit are refused, `submit`
refuses a tampered ε and the leaderboard labels the ε per example."""

from __future__ import annotations

import copy
import json
import math
import shutil
from fractions import Fraction
from pathlib import Path

import pytest
import torch
from hypothesis import Phase, example, given, settings
from hypothesis import strategies as st
from opacus.accountants import RDPAccountant
from safetensors.torch import load_file
from test_privacy_clipping import norm64, within
from test_run import (  # noqa: F401  (fixtures)
    EXAMPLE_LEVEL,
    TASK,
    _config,
    env,
    specs_dir,
    stop_and_resume,
)

from pflbench.checkpoint import latest_checkpoint, load_checkpoint
from pflbench.dpsgd import ExampleDPSGD
from pflbench.errors import UserError
from pflbench.model.transformer import CTCTransformer, ModelConfig, build_model, ctc_losses
from pflbench.privacy.clipping import layer_bounds
from pflbench.privacy.example import (
    EPSILON_TOLERANCE,
    clipping_words,
    example_epsilon,
    example_noise_multiplier,
    example_statement,
    expected_batch,
    sampling_rate,
)
from pflbench.privacy.example_optimizer import ExactClipDPOptimizer
from pflbench.results.leaderboard import render_leaderboard
from pflbench.results.rescore import DataOptions
from pflbench.results.schema import compute_record_id, load_record
from pflbench.results.submit import submit
from pflbench.runner import RunOptions, run
from pflbench.spec.models import Budget, Recipe
from pflbench.spec.registry import load_registry

BUDGET = "eps8-example"
# Positions without CAPE's random shifts and scaling: an utterance's forward is then the same
# alone or in a batch, so per-example gradients can be checked against one-example backwards.
PLAIN = ModelConfig(dim=64, layers=2, heads=2, mlp=128, dropout=0.0, layer_drop=0.0,
                    cape_global_shift=0.0, cape_local_shift=0.0,
                    cape_global_scaling=1.0)  # fmt: skip


@pytest.fixture(scope="module")
def utterances(tiny_task_data):
    return list(tiny_task_data.federated_train)[:12]


def trainer_for(utterances, clipping="global", clip=1.0, z=0.0, batch=4, trained=None,
                model=None, seed=0) -> ExampleDPSGD:  # fmt: skip
    recipe = Recipe.model_validate({
        "spec_augment": {"enabled": False},
        "fine_tune": {"optimizer": "sgd", "lr": 0.1, "steps": 3, "batch_seconds": 10.0},
        "privacy": {"clipping": clipping, "perlayer_mode": "dim", "clip_bound": clip},
        "example_dp": {"physical_batch": 3},
    })  # fmt: skip
    if model is None:
        torch.manual_seed(0)
        model = CTCTransformer(PLAIN, 30)
    names = [n for n, _ in model.named_parameters()]
    return ExampleDPSGD(model, utterances, recipe, z, batch, seed, "cpu", trained or names)


def one_example_gradient(trainer: ExampleDPSGD, utterance) -> dict[str, torch.Tensor]:
    """The raw gradient of one utterance's CTC loss, by plain autograd on a copy of the model."""
    from pflbench.data.batching import collate

    trained = trainer.module._module
    model = CTCTransformer(trained.cfg, trained.vocab_size).train()  # no opacus hooks
    model.load_state_dict(trained.state_dict())
    for param, theirs in zip(model.parameters(), trained.parameters(), strict=True):
        param.requires_grad_(theirs.requires_grad)
    batch = collate([utterance])
    log_probs, out_lens = model(batch.feats, batch.feat_lens)
    ctc_losses(log_probs, out_lens, batch.targets, batch.target_lens).sum().backward()
    return {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def assert_close_in_norm(actual: torch.Tensor, expected: torch.Tensor, rtol: float = 1e-4):
    """Equal up to float rounding, relative to the tensor's norm (sums differ in order)."""
    error = float((actual.double() - expected.double()).norm())
    assert error <= rtol * float(expected.double().norm()) + 1e-12, (error, expected.norm())


def grads(trainer: ExampleDPSGD) -> dict[str, torch.Tensor]:
    named = trainer.module._module.named_parameters()
    return {n: p.grad.clone() for n, p in named if p.requires_grad}


# ----------------------------------------------------------------------------------------------
# Per-example gradients, clipping, noise


def test_every_trained_tensor_gets_exact_per_example_gradients_and_frozen_ones_none(
    utterances,
):
    torch.manual_seed(0)
    model = CTCTransformer(PLAIN, 30)
    names = [n for n, _ in model.named_parameters()]
    frozen = {n for n in names if n.endswith(".bias")}
    trained = [n for n in names if n not in frozen]
    trainer = trainer_for(utterances, model=model, trained=trained)
    trainer.optimizer.zero_grad(set_to_none=True)
    part = [0, 1, 2, 3, 4]
    trainer._backward(part, torch.Generator().manual_seed(0))
    named = dict(model.named_parameters())
    for i in part:
        alone = one_example_gradient(trainer, utterances[i])
        assert set(alone) == set(trained)
        for name in trained:
            sample = named[name].grad_sample
            assert sample.shape == (len(part), *named[name].shape), name
            assert_close_in_norm(sample[i], alone[name])
    for name in frozen:
        assert named[name].grad is None and getattr(named[name], "grad_sample", None) is None


def test_blocks_skipped_by_layer_drop_give_zero_per_example_gradients(utterances):
    torch.manual_seed(0)
    model = build_model("tiny", 30, layer_drop=0.999999)  # every block skipped
    trainer = trainer_for(utterances, model=model)
    trainer.optimizer.zero_grad(set_to_none=True)
    trainer._backward([0, 1, 2], torch.Generator().manual_seed(0))
    for name, param in model.named_parameters():
        assert param.grad_sample.shape == (3, *param.shape)
        assert bool(param.grad_sample.any()) == (not name.startswith("blocks.")), name


# No shrinking: every example is a model's forward and backward, and a failure prints its input.
@settings(max_examples=8, deadline=None, phases=(Phase.explicit, Phase.reuse, Phase.generate))
@given(
    clipping=st.sampled_from(["global", "perlayer"]),
    log_clip=st.floats(-2, 3),
    chosen=st.lists(st.integers(0, 11), min_size=1, max_size=5, unique=True),
)
def test_each_examples_gradient_is_clipped_on_its_own(utterances, clipping, log_clip, chosen):
    """With z = 0, B·ĝ is Σ_i clip(g_i): each example's gradient scaled to C (global) or each
    tensor to its C_h (per layer, pflbench's dim allocation) where over it, none mixed with
    another's."""
    clip = 10.0**log_clip
    trainer = trainer_for(utterances, clipping=clipping, clip=clip, batch=len(chosen))
    names = [n for n, p in trainer.module._module.named_parameters()]
    sizes = [p.numel() for p in trainer.module._module.parameters()]
    bounds = dict(zip(names, layer_bounds(sizes, clip, "dim").tolist(), strict=True))
    expected = {n: torch.zeros_like(p) for n, p in trainer.module._module.named_parameters()}
    for i in chosen:
        raw = one_example_gradient(trainer, utterances[i])
        total = math.sqrt(sum(float(g.double().norm()) ** 2 for g in raw.values()))
        for name, g in raw.items():
            if clipping == "global":
                factor = min(1.0, clip / total)
            else:
                factor = min(1.0, bounds[name] / norm64(g))
            clipped = g * factor
            expected[name] += clipped
        # Each example alone: the privatized gradient is its clipped gradient, inside the bound.
        trainer.noised_gradient([i], step=0)
        alone = {n: g * len(chosen) for n, g in grads(trainer).items()}
        norms = {n: float(g.double().norm()) for n, g in alone.items()}
        if clipping == "global":
            assert math.sqrt(sum(v**2 for v in norms.values())) <= clip * (1 + 1e-5)
        else:
            assert all(norms[n] <= bounds[n] * (1 + 1e-5) for n in norms)
    trainer.noised_gradient(chosen, step=0)
    for name, g in grads(trainer).items():
        assert_close_in_norm(g * len(chosen), expected[name])


# Adversarial per-example gradients, clipped exactly. Each example is built against the bound:
# its norm (global: in total; per layer: each tensor's) at C, 1 ulp of fp32 around it, far over or
# under it, one value of exactly fp32(C) or the next above it, values near fp32's largest or in
# its subnormal range, zero, and tensors of one example at scales orders of magnitude apart.
KINDS = ["at", "above", "below", "random", "single-at", "single-above", "huge", "tiny", "mixed",
         "zero"]  # fmt: skip
SHAPES = [(1,), (7,), (4, 16), (3, 5, 4), (4096,)]


def adversarial_example(kind, shapes, targets, generator) -> list[torch.Tensor]:
    """One example's gradient (one fp32 tensor per shape) of `kind`; `targets`: the norm each
    tensor is built against (global: C for the example's total, per layer: C_h each)."""
    f64 = torch.float64

    def uniform(low, high):
        return float(torch.empty(1, dtype=f64).uniform_(low, high, generator=generator))

    directions = [torch.randn(s, generator=generator, dtype=f64) * 10 ** uniform(-6, 6)
                  for s in shapes]  # fmt: skip
    if kind == "zero":
        return [torch.zeros(s) for s in shapes]
    if kind.startswith("single"):
        values = [torch.zeros(s) for s in shapes]
        at = [torch.tensor(t, dtype=torch.float32) for t in targets]
        if kind == "single-above":
            at = [torch.nextafter(v, torch.tensor(math.inf)) for v in at]
        chosen = range(len(shapes)) if len(set(targets)) > 1 else [0]  # per layer: each tensor
        for h in chosen:
            values[h].view(-1)[int(torch.randint(values[h].numel(), (1,), generator=generator))] = (
                at[h]
            )
        return values
    if kind in ("huge", "tiny", "mixed"):
        ranges = {"huge": (30.0, 38.5), "tiny": (-46.0, -30.0)}
        values = []
        for h, d in enumerate(directions):
            low, high = ranges[kind] if kind != "mixed" else ranges[["huge", "tiny"][h % 2]]
            d = d / d.abs().max() * 10 ** uniform(low, high)
            values.append(d.clamp(-3.4e38, 3.4e38).float())
        return values
    ratio = {"at": 1.0, "above": 1 + 2.0**-23, "below": 1 - 2.0**-24}.get(kind)
    if len(set(targets)) > 1 or len(shapes) == 1:  # per layer (or one tensor): each to its own
        return [(d * t * (ratio or 10 ** uniform(-2, 2)) / d.norm()).float()
                for d, t in zip(directions, targets, strict=True)]  # fmt: skip
    total = math.sqrt(sum(float(d.norm()) ** 2 for d in directions))
    scale = targets[0] * (ratio or 10 ** uniform(-2, 2)) / total
    return [(d * scale).float() for d in directions]


@st.composite
def adversarial_batches(draw):
    """(clipping, C, shapes, per-example gradients [n, ...] per tensor): C an fp32 number."""
    clipping = draw(st.sampled_from(["global", "perlayer"]))
    bound = float(torch.tensor(10 ** draw(st.floats(-3.0, 4.0)), dtype=torch.float32))
    shapes = draw(st.lists(st.sampled_from(SHAPES), min_size=1, max_size=4))
    sizes = [math.prod(shape) for shape in shapes]
    if clipping == "perlayer":
        targets = layer_bounds(sizes, bound, "dim").tolist()
    else:
        targets = [bound] * len(shapes)
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    kinds = draw(st.lists(st.sampled_from(KINDS), min_size=1, max_size=6))
    examples = [adversarial_example(k, shapes, targets, generator) for k in kinds]
    samples = [torch.stack([example[h] for example in examples]) for h in range(len(shapes))]
    return clipping, bound, shapes, samples


def clipping_optimizer(params, clipping: str, bound: float, examples: int = 64):
    """The optimizer DP-SGD clips with (no noise, the exact sum left in summed_grad, on its
    grid)."""
    inner = torch.optim.SGD(params, lr=0.1)
    return ExactClipDPOptimizer(inner, clipping=clipping, clip_bound=bound, perlayer_mode="dim",
                                noise_multiplier=0.0, expected_batch_size=1,
                                max_examples=examples)  # fmt: skip


def within_on_grid(integers, grid: float, bound: float) -> bool:
    """Whether tensors of integers on a grid (value = integer / grid) have L2 norm <= bound, in
    exact arithmetic."""
    squares = sum(int(k) ** 2 for t in integers for k in t.flatten().tolist())
    return Fraction(squares) <= (Fraction(bound) * Fraction(grid)) ** 2


def assert_on_grid_within_bounds(integers, grid, clipping, bound, layer_bounds_):
    """What the sum adds of an example, exactly: ‖c_i‖ ≤ C, and per layer each ‖c_i,h‖ ≤ C_h."""
    assert within_on_grid(integers, grid, bound)
    if clipping == "perlayer":
        for tensor, layer_bound in zip(integers, layer_bounds_, strict=True):
            assert within_on_grid([tensor], grid, layer_bound), layer_bound


def assert_within_bounds(tensors, clipping, bound, layer_bounds_):
    """Exact arithmetic: ‖tensors‖ ≤ C, and per layer each ‖tensor_h‖ ≤ C_h."""
    assert within(tensors, bound), (norm64(torch.cat([t.flatten() for t in tensors])), bound)
    if clipping == "perlayer":
        for tensor, layer_bound in zip(tensors, layer_bounds_, strict=True):
            assert within([tensor], layer_bound), (norm64(tensor), layer_bound)


# Examples opacus' own clipping, C/(‖g‖ + 1e-6) in fp32, leaves over their bound (1000.00006 for
# one value 1 ulp over C = 1000; per layer 707.10681 over C_h = 707.10678).
@example(batch=("global", 1000.0, [(1,)], [torch.tensor([[1000.0001220703125]])]))
@example(batch=("perlayer", 1000.0, [(1,), (1,)],
                [torch.tensor([[0.0]]), torch.tensor([[707.1068725585938]])]))  # fmt: skip
@settings(max_examples=200, deadline=None)
@given(batch=adversarial_batches())
def test_every_examples_clipped_gradient_is_within_its_bound_exactly(batch):
    """Each example's contribution to the noised sum, as the optimizer computes it (clipped in
    fp32, then on the exact sum's grid), has
    ‖c_i‖ ≤ C (global) or ‖c_i,h‖ ≤ C_h for every tensor (per layer) in exact arithmetic, for
    gradients built at, 1 ulp over, far over and under the bound, near fp32's largest values and
    subnormal; and one over the bound lands on it, not far inside (a bound that zeroed every
    example would pass the first check)."""
    clipping, bound, shapes, samples = batch
    sizes = [math.prod(shape) for shape in shapes]
    layer_bounds_ = layer_bounds(sizes, bound, "dim").tolist()
    params = [torch.nn.Parameter(torch.zeros(shape)) for shape in shapes]
    examples = len(samples[0])
    # Each example alone: what it adds to the sum.
    for i in range(examples):
        optimizer = clipping_optimizer(params, clipping, bound)
        for param, sample in zip(params, samples, strict=True):
            param.grad_sample = sample[i : i + 1].clone()
        optimizer.clip_and_accumulate()
        on_grid = [param.summed_grad for param in params]
        assert all(t.dtype == torch.int64 for t in on_grid)
        assert_on_grid_within_bounds(on_grid, optimizer.grid, clipping, bound, layer_bounds_)
        contribution = [t.double() / optimizer.grid for t in on_grid]
        raw = [sample[i] for sample in samples]
        if clipping == "global" and not within(raw, bound * (1 + 1e-5)):
            assert norm64(torch.cat([c.flatten() for c in contribution])) >= bound * (1 - 1e-6)
        for tensor, c, layer_bound in zip(raw, contribution, layer_bounds_, strict=True):
            if clipping == "perlayer" and not within([tensor], layer_bound * (1 + 1e-5)):
                assert norm64(c) >= layer_bound * (1 - 1e-6)
    # The batch: every example's scaled gradient as stored, and the sum is theirs.
    optimizer = clipping_optimizer(params, clipping, bound)
    for param, sample in zip(params, samples, strict=True):
        param.grad_sample = sample.clone()
    optimizer.clip_and_accumulate()
    for i in range(examples):
        assert_within_bounds([p.grad_sample[i] for p in params], clipping, bound, layer_bounds_)
    for param in params:
        assert torch.equal(param.summed_grad, optimizer._on_grid(param.grad_sample).sum(dim=0))
    assert not bool(optimizer.last_clip.nonfinite.any())


@pytest.mark.parametrize("clipping", ["global", "perlayer"])
def test_an_example_with_a_nan_or_inf_gradient_contributes_zeros_and_is_counted(clipping):
    params = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2, 2))]
    optimizer = clipping_optimizer(params, clipping, 1.0)
    params[0].grad_sample = torch.tensor([[1.0, 2.0, 2.0], [math.inf, 0.0, 0.0],
                                          [0.1, 0.0, 0.0]])  # fmt: skip
    params[1].grad_sample = torch.tensor([[[0.0, 0.0], [0.0, 0.0]], [[1.0, 0.0], [0.0, 0.0]],
                                          [[math.nan, 0.0], [0.0, 0.0]]])  # fmt: skip
    optimizer.clip_and_accumulate()
    assert optimizer.last_clip.nonfinite.tolist() == [False, True, True]
    assert optimizer.last_clip.clipped == 1  # example 0 (norm 3); the zeroed ones not counted
    assert torch.equal(params[0].grad_sample[1:2], torch.zeros(1, 3))
    assert torch.equal(params[1].grad_sample[1:], torch.zeros(2, 2, 2))
    assert torch.equal(params[1].summed_grad, torch.zeros(2, 2, dtype=torch.int64))
    expected = torch.tensor([1.0, 2.0, 2.0]) * optimizer.last_clip.factors[0, 0].float()
    assert torch.equal(params[0].summed_grad, optimizer._on_grid(expected))


def test_the_expected_batch_holds_batch_seconds_of_audio_on_average():
    """B = round(batch_seconds / mean utterance length), at least 1 and at most N (by hand)."""
    seconds = [1.0, 2.0, 3.0, 4.0]  # mean 2.5 s
    assert expected_batch(seconds, 5.0) == 2
    assert expected_batch(seconds, 8.0) == 3  # 3.2 examples
    assert expected_batch(seconds, 0.5) == 1 and expected_batch(seconds, 1000.0) == 4
    with pytest.raises(UserError, match="needs training examples"):
        expected_batch([], 5.0)


def test_each_step_draws_a_poisson_batch_at_rate_b_over_n(utterances, monkeypatch):
    """The accountant covers Poisson batches: each example joins each step independently with
    probability q = B/N, so batch sizes vary as Binomial(N, q) and every example's rate is q.
    A fixed-size batch (variance 0), which the accountant does not cover, fails here."""
    trainer = trainer_for(utterances, batch=4)
    drawn: list[list[int]] = []
    monkeypatch.setattr(trainer, "noised_gradient", lambda chosen, step: drawn.append(chosen) or {})
    steps, n = 600, len(utterances)
    for _ in range(steps):
        trainer.run_step()
    q = 4 / n
    sizes = torch.tensor([len(batch) for batch in drawn], dtype=torch.float64)
    binomial_var = n * q * (1 - q)
    assert abs(sizes.mean().item() - n * q) < 5 * math.sqrt(binomial_var / steps)
    assert 0.6 < sizes.var().item() / binomial_var < 1.5  # ~7 standard errors either side
    counts = torch.bincount(torch.tensor([i for batch in drawn for i in batch]), minlength=n)
    assert all(abs(c - steps * q) < 5 * math.sqrt(steps * q * (1 - q)) for c in counts.tolist())


@pytest.mark.parametrize("clipping", ["global", "perlayer"])
def test_the_noise_has_std_z_times_c_over_the_expected_batch(utterances, clipping):
    z, clip, batch = 1.7, 0.3, 4
    noisy = trainer_for(utterances, clipping=clipping, clip=clip, z=z, batch=batch)
    quiet = trainer_for(utterances, clipping=clipping, clip=clip, z=0.0, batch=batch)
    noisy.noised_gradient([0, 5, 7], step=3)
    quiet.noised_gradient([0, 5, 7], step=3)
    noise = torch.cat([(a - b).flatten() for a, b in
                       zip(grads(noisy).values(), grads(quiet).values(), strict=True)])  # fmt: skip
    n = noise.numel()
    std = float(noise.double().std())
    # The sample std of n normal draws is within 5/sqrt(2n) of sigma (relative) with
    # overwhelming probability.
    assert abs(std / (z * clip / batch) - 1) < 5 / math.sqrt(2 * n)
    assert abs(float(noise.double().mean())) < 5 * z * clip / batch / math.sqrt(n)
    # An empty Poisson batch is noise alone, and the step's keyed stream draws the same noise.
    noisy.noised_gradient([], step=3)
    empty = torch.cat([g.flatten() for g in grads(noisy).values()])
    torch.testing.assert_close(empty, noise, rtol=1e-5, atol=1e-7)


# ----------------------------------------------------------------------------------------------
# Budgets and accounting


@pytest.mark.parametrize("accountant", ["opacus-rdp", "opacus-prv"])
def test_calibration_meets_the_budget_by_opacus_own_accountant(accountant):
    from opacus.accountants import create_accountant

    budget = Budget(name="b", unit="example", epsilon=3.0, delta=1e-6, accountant=accountant)
    q, steps = 32 / 5000, 200
    z = example_noise_multiplier(budget, q, steps)
    result = example_epsilon(z, q, steps, budget.delta, accountant)
    theirs = create_accountant(accountant.removeprefix("opacus-"))
    theirs.history = [(z, q, steps)]
    assert result.epsilon == theirs.get_epsilon(delta=budget.delta)
    assert budget.epsilon - EPSILON_TOLERANCE <= result.epsilon <= budget.epsilon
    assert result.library_version == __import__("opacus").__version__


@pytest.mark.parametrize(("z", "q"), [(0.5, 1e-4), (1.0, 0.003), (1.3, 0.05), (5.0, 0.7)])
def test_the_rdp_epsilon_is_opacus_accountants_own_bit_for_bit(z, q):
    # example_epsilon takes one step's curve from a cache instead of asking RDPAccountant for
    # each T; the ε and order must still be what opacus' accountant reports.
    for steps in (1, 3, 100, 1000):
        theirs = RDPAccountant()
        theirs.history = [(z, q, steps)]
        ours = example_epsilon(z, q, steps, 1e-5, "opacus-rdp")
        assert (ours.epsilon, ours.order) == theirs.get_privacy_spent(delta=1e-5)


def test_example_budgets_cannot_be_mistaken_for_user_level_ones():
    from pflbench.methods import check_budget
    from pflbench.privacy.example import check_delta_below_one_over_n, check_example_recipe

    with pytest.raises(ValueError, match="takes no population, cohort, steps"):
        Budget(name="b", unit="example", epsilon=1, delta=1e-6, population=10, cohort=1, steps=5)
    with pytest.raises(ValueError, match="needs a DP budget"):
        Budget(name="b", unit="example", dp=False)
    with pytest.raises(UserError, match="opacus-rdp, opacus-prv"):
        check_budget(Budget(name="b", unit="example", epsilon=1, delta=1e-6), "budgets.yaml")
    with pytest.raises(UserError, match="not below 1/N"):
        check_delta_below_one_over_n(1e-3, 1000, "b")
    # a federated recipe carrying example_dp settings would ignore them: refused
    recipe = Recipe.model_validate({"example_dp": {"physical_batch": 8}})
    with pytest.raises(UserError, match="applies to training: dpsgd-example only"):
        check_example_recipe(recipe)
    normalize = {"training": "dpsgd-example", "privacy": {"perlayer_rule": "normalize"}}
    with pytest.raises(UserError, match="perlayer_rule: normalize"):
        check_example_recipe(Recipe.model_validate(normalize))


# ----------------------------------------------------------------------------------------------
# Runs, records, submit, leaderboard


@pytest.fixture(scope="module")
def dp_run(tmp_path_factory, tiny_cache_dir, tiny_task_data, specs_dir):  # noqa: F811
    """A finished run of dpsgd-example-perlayer-dim under the example-level budget."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PFLBENCH_CACHE", str(tiny_cache_dir))
        config = _config(specs_dir, "dpsgd-example-perlayer-dim", BUDGET)
        out = tmp_path_factory.mktemp("dpsgd") / "run"
        yield run(config, out_dir=out, options=RunOptions(progress=False)), config


def test_a_run_records_opacus_epsilon_per_example(dp_run, tiny_task_data):
    run_dir, config = dp_run
    record, _ = load_record(run_dir / "record.json")
    claim = record.privacy
    assert claim.dp and claim.unit == "example" and claim.claimed_by == "opacus-rdp"
    assert claim.extrapolated is None and "per example" in claim.how
    scale = claim.simulated
    examples = len(tiny_task_data.federated_train)
    assert scale.population == examples and scale.steps == config.recipe.fine_tune.steps
    assert scale.sampling_rate == scale.cohort / examples
    assert math.isclose(claim.sigma_dp * scale.cohort, scale.noise_multiplier, rel_tol=1e-12)
    assert claim.clip_bound == config.recipe.privacy.clip_bound
    item = scale.epsilon["opacus-rdp"]
    assert item.library == "opacus" and item.library_version == __import__("opacus").__version__
    accountant = RDPAccountant()
    accountant.history = [(scale.noise_multiplier, scale.sampling_rate, scale.steps)]
    assert item.epsilon == accountant.get_epsilon(delta=config.budget.delta)
    assert item.epsilon <= config.budget.epsilon and item.delta == config.budget.delta
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [x for x in lines if "loss" in x]
    assert [x["step"] for x in steps] == [0, 1, 2]
    assert [x["epsilon_rdp"] for x in steps][-1] == pytest.approx(item.epsilon)
    assert all(x["diagnostics"]["private"] is False for x in steps)
    # the model moved from the seed model
    final = load_file(run_dir / "checkpoints" / "final.safetensors")
    meta = json.loads((run_dir / "checkpoints" / "final.json").read_text())
    seed = load_file(meta["seed_checkpoint"])
    assert any(not torch.equal(final[k], seed[k]) for k in final)


@pytest.mark.parametrize("baseline", EXAMPLE_LEVEL)
def test_each_example_level_baseline_runs_without_noise(env, tmp_path, baseline):  # noqa: F811
    run_dir = run(
        _config(env, baseline), out_dir=tmp_path / "run", options=RunOptions(progress=False)
    )
    record, _ = load_record(run_dir / "record.json")
    claim = record.privacy
    assert not claim.dp and claim.unit == "example" and claim.simulated.noise_multiplier == 0
    assert claim.simulated.epsilon == {"opacus-rdp": None} and "infinite" in claim.how
    final, meta = load_checkpoint(run_dir / "checkpoints" / "final.safetensors")
    seed, _ = load_checkpoint(Path(meta["seed_checkpoint"]))
    moved = {name for name in final if not torch.equal(final[name], seed[name])}
    if baseline == "dpsgd-example-layerfreeze":  # frozen tensors: neither trained nor noised
        _, meta = load_checkpoint(latest_checkpoint(run_dir / "checkpoints", "step"))
        trained = set(meta["trained"])
        assert moved == trained and trained < set(final)
    else:
        assert moved == set(final)


def test_budgets_of_the_other_unit_are_refused(env, tmp_path):  # noqa: F811
    with pytest.raises(UserError, match="is user-level"):
        run(_config(env, "dpsgd-example-global", "eps7.2-high-pop"), out_dir=tmp_path / "a")
    with pytest.raises(UserError, match="is example-level"):
        run(_config(env, "perlayer-dim", BUDGET), out_dir=tmp_path / "b")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


@pytest.mark.slow
def test_kill_and_resume_ends_in_the_same_model(env, tmp_path):  # noqa: F811
    config = _config(env, "dpsgd-example-global", BUDGET)
    resumed = stop_and_resume(config, tmp_path / "killed")  # its wall time checked there
    straight = run(config, out_dir=tmp_path / "straight", options=RunOptions(progress=False))
    a = load_file(resumed / "checkpoints" / "final.safetensors")
    b = load_file(straight / "checkpoints" / "final.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def data(tiny_corpus_root, tiny_cache_dir) -> DataOptions:
    """Where `submit` reads the eval sets' references to re-score a run."""
    return DataOptions(data_root=tiny_corpus_root, cache_dir=tiny_cache_dir)


def test_submit_refuses_a_tampered_epsilon(dp_run, specs_dir, data, tmp_path):  # noqa: F811
    """The honest run is filed; a record with its ε (or its unit) edited is refused."""
    run_dir, _ = dp_run
    registry = load_registry([specs_dir])
    accepted = submit(run_dir, tmp_path / "results", registry, data=data)
    assert accepted.path.parent.name == BUDGET

    raw = json.loads((run_dir / "record.json").read_text())
    tampered = copy.deepcopy(raw)
    tampered["privacy"]["simulated"]["epsilon"]["opacus-rdp"]["epsilon"] *= 0.5
    tampered["record_id"] = compute_record_id(tampered)
    copy_dir = tmp_path / "tampered"
    shutil.copytree(run_dir, copy_dir)
    (copy_dir / "record.json").write_text(json.dumps(tampered))
    with pytest.raises(UserError, match="opacus-rdp accountant gives"):
        submit(copy_dir, tmp_path / "other", registry, data=data)
    tampered = copy.deepcopy(raw)
    tampered["privacy"]["unit"] = "user"
    tampered["record_id"] = compute_record_id(tampered)
    (copy_dir / "record.json").write_text(json.dumps(tampered))
    with pytest.raises(UserError, match="privacy.unit is 'user'"):
        submit(copy_dir, tmp_path / "other", registry, data=data)
    # The statement's words and its other numbers are the runner's, field for field.
    for edit, field in [
        (lambda p: p.update(how="Example-level ε = 0.5 (tampered)"), "privacy.how"),
        (lambda p: p.update(mechanism="something else"), "privacy.mechanism"),
        (lambda p: p["simulated"].update(delta=0.5), "privacy.simulated.delta"),
    ]:
        tampered = copy.deepcopy(raw)
        edit(tampered["privacy"])
        tampered["record_id"] = compute_record_id(tampered)
        (copy_dir / "record.json").write_text(json.dumps(tampered))
        with pytest.raises(UserError, match=rf"{field}.* is .*, but pflbench's example-level"):
            submit(copy_dir, tmp_path / "other", registry, data=data)


def forged_run(dp_run, tmp_path: Path, z: float, examples: int, batch: int) -> Path:
    """A copy of the DP-SGD run whose claim is pflbench's own statement for (z, N, B): every ε in
    it is right for those numbers, so only checks against the run itself can refuse it."""
    run_dir, config = dp_run
    raw = json.loads((run_dir / "record.json").read_text())
    privacy = config.recipe.privacy
    steps = raw["privacy"]["simulated"]["steps"]
    forged = example_statement(
        z, privacy.clip_bound, clipping_words(privacy), examples, batch, steps, config.budget
    )
    tampered = {**copy.deepcopy(raw), "privacy": forged}
    tampered["record_id"] = compute_record_id(tampered)
    copy_dir = tmp_path / "tampered"
    shutil.copytree(run_dir, copy_dir)
    (copy_dir / "record.json").write_text(json.dumps(tampered))
    return copy_dir


@pytest.mark.parametrize("field", ["population", "cohort"])
def test_submit_refuses_a_claim_at_another_n_or_b(dp_run, specs_dir, data, tmp_path, field):  # noqa: F811
    """A claim for more examples N (or a smaller expected batch B) than the data hold, made by
    pflbench's own calibration and statement, passes every check of the record alone; the
    training data refuse it."""
    _, config = dp_run
    simulated = load_record(dp_run[0] / "record.json")[0].privacy.simulated
    examples, batch, steps = simulated.population, simulated.cohort, simulated.steps
    examples, batch = (examples * 2, batch) if field == "population" else (examples, batch - 1)
    z = example_noise_multiplier(config.budget, sampling_rate(examples, batch), steps)
    forged = forged_run(dp_run, tmp_path, z, examples, batch)
    with pytest.raises(UserError, match=rf"privacy.simulated.{field} is .*, but the training data"):
        submit(forged, tmp_path / "results", load_registry([specs_dir]), data=data)


def test_submit_refuses_more_noise_than_the_budget_prescribes(dp_run, specs_dir, data, tmp_path):  # noqa: F811
    """z doubled and the claim restated for it: every ε in it is right for that z, and lower
    than the run's; the run added the budget's z, so it is refused."""
    _, config = dp_run
    simulated = load_record(dp_run[0] / "record.json")[0].privacy.simulated
    z = 2 * simulated.noise_multiplier
    forged = forged_run(dp_run, tmp_path, z, simulated.population, simulated.cohort)
    claim = load_record(forged / "record.json")[0].privacy.simulated
    assert claim.epsilon["opacus-rdp"].epsilon < config.budget.epsilon / 2
    with pytest.raises(UserError, match=r"privacy.sigma_dp is .* but budget .* prescribes z ="):
        submit(forged, tmp_path / "results", load_registry([specs_dir]), data=data)


def test_the_leaderboard_labels_the_epsilon_per_example(dp_run, specs_dir):  # noqa: F811
    run_dir, config = dp_run
    record, _ = load_record(run_dir / "record.json")
    budgets = {name: loaded.spec for name, loaded in load_registry([specs_dir]).budgets.items()}
    text = render_leaderboard([record], {TASK: 1}, budgets)
    row = next(line for line in text.splitlines() if "dpsgd-example-perlayer-dim" in line)
    epsilon = record.privacy.simulated.epsilon["opacus-rdp"].epsilon
    assert f"{epsilon:.3g} opacus-rdp, per example" in row
    assert "not comparable" in text and "per example" in text.split(row)[0]
    # cohort and central steps: the batch B and steps T its ε is computed at
    cells = [c.strip() for c in row.split("|")]
    after_epsilon = cells.index(f"{epsilon:.3g} opacus-rdp, per example") + 1  # σ_DP, C, ...
    simulated = record.privacy.simulated
    assert cells[after_epsilon + 2 : after_epsilon + 4] == [
        f"{simulated.cohort:g}",
        str(config.recipe.fine_tune.steps),
    ]


def test_the_noise_joins_the_exact_sum_of_the_examples_before_anything_is_rounded():
    """Two batches whose clipped gradients add up to the same value (exactly), with the same
    noise draws, release the same gradient bit for bit: the release depends on the examples
    only through their exact sum. Summed in fp32 first, 1 + 2^-24 + 2^-24 rounds to 1 (ties to
    even), not to 1 + 2^-23, so the two would differ by an ulp the other examples decide."""

    def release(values: list[float]) -> torch.Tensor:
        param = torch.nn.Parameter(torch.zeros(1))
        optimizer = ExactClipDPOptimizer(
            torch.optim.SGD([param], lr=0.1), clipping="global", clip_bound=10.0,
            perlayer_mode="dim", noise_multiplier=1e-6, expected_batch_size=3, max_examples=3,
        )  # fmt: skip
        optimizer.generator = torch.Generator().manual_seed(0)
        param.grad_sample = torch.tensor([[v] for v in values])
        optimizer.clip_and_accumulate()
        optimizer.add_noise()
        return param.grad.clone()

    tiny = 2.0**-24
    assert float(torch.tensor([1.0, tiny, tiny]).sum()) == 1.0  # fp32 would lose them
    assert torch.equal(release([1.0, tiny, tiny]), release([1.0 + 2 * tiny, 0.0, 0.0]))
