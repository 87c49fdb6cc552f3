"""Noise: right std, same average for server and client placement, keyed streams, and an
aggregate that is bitwise independent of how users are grouped over workers. The exact sum's
tests that take `sum_path` run on both its CPU paths: the C kernel's one pass and torch's."""

import math
from fractions import Fraction

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pflbench.privacy import aggregate as exact_sum_module
from pflbench.privacy.aggregate import ExactSum
from pflbench.privacy.clipping import clip_update
from pflbench.privacy.noise import (
    add_gaussian_noise,
    client_noise_std,
    noise_generator,
    server_noise_std,
)

SHAPES = {"enc.w": (64, 48), "enc.ln": (48,), "out.w": (31, 48), "out.b": (31,)}


@pytest.fixture(params=["kernel", "torch"])
def sum_path(request, monkeypatch):
    """ExactSum's two CPU paths: the C kernel (where setup.py built it) and torch's passes."""
    if request.param == "kernel" and exact_sum_module._kernels is None:
        pytest.skip("the C kernel is not built here (setup.py found no C compiler)")
    if request.param == "torch":
        monkeypatch.setattr(exact_sum_module, "_kernels", None)
    return request.param


def zeros(dtype=torch.float32) -> dict[str, torch.Tensor]:
    return {name: torch.zeros(shape, dtype=dtype) for name, shape in SHAPES.items()}


def flat(update: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1).double() for t in update.values()])


def test_noise_std_and_mean():
    update = {"big": torch.zeros(400_000)}
    add_gaussian_noise(update, 0.3, noise_generator(seed=1, step=2))
    values = update["big"].double()
    # std of the std estimate is 0.3/sqrt(2n) ~ 3.4e-4: 1% is ~9 standard errors.
    assert float(values.std()) == pytest.approx(0.3, rel=0.01)
    assert abs(float(values.mean())) < 5 * 0.3 / math.sqrt(values.numel())


def test_std_formulas():
    assert server_noise_std(0.01, 3e-6) == pytest.approx(3e-8)
    assert client_noise_std(0.01, 3e-6, 204_800) == pytest.approx(3e-8 * math.sqrt(204_800))


def test_same_keys_give_identical_noise_and_other_keys_differ():
    def noise(seed, step, user=None, dtype=torch.float32):
        update = zeros(dtype)
        add_gaussian_noise(update, 1.0, noise_generator(seed, step, user))
        return flat(update)

    reference = noise(7, 3)
    assert torch.equal(reference, noise(7, 3))
    assert torch.equal(reference, noise(7, 3, dtype=torch.float64))  # drawn in fp32 always
    for other in (noise(8, 3), noise(7, 4), noise(7, 3, user=0), noise(7, 3, user="spk-0")):
        assert not torch.allclose(reference, other)
    assert not torch.allclose(noise(7, 3, user=1), noise(7, 3, user=2))
    # A user named "server" gets its own stream, not the server's.
    assert not torch.allclose(noise(7, 3), noise(7, 3, user="server"))


def test_server_and_client_placement_give_the_same_average_distribution():
    cohort, clip_bound, sigma_dp = 40, 0.5, 0.02
    generator = torch.Generator().manual_seed(0)
    users = [{"w": torch.randn(20_000, generator=generator) * 1e-3} for _ in range(cohort)]
    mean = sum(u["w"] for u in users) / cohort

    server = {"w": mean.clone()}
    add_gaussian_noise(server, server_noise_std(clip_bound, sigma_dp), noise_generator(0, 0))

    std = client_noise_std(clip_bound, sigma_dp, cohort)
    noisy = []
    for user_id, u in enumerate(users):
        update = {"w": u["w"].clone()}
        add_gaussian_noise(update, std, noise_generator(0, 0, user=user_id))
        noisy.append(update["w"])
    client = sum(noisy) / cohort

    expected_std = clip_bound * sigma_dp
    for average in (server["w"], client):
        residual = (average - mean).double()
        assert float(residual.std()) == pytest.approx(expected_std, rel=0.03)
        assert abs(float(residual.mean())) < 5 * expected_std / math.sqrt(residual.numel())


def clipped_users(count: int, clip_bound: float) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(123)
    users = []
    for _ in range(count):
        update = {n: torch.randn(s, generator=generator) * 0.1 for n, s in SHAPES.items()}
        users.append(clip_update(update, "perlayer", clip_bound).update)
    return users


def aggregate(users, groups, placement, clip_bound=1.0, sigma_dp=0.01, seed=5, step=9):
    """Simulate workers: each sums its group in the given order, then the int64 buffers are
    all-reduced (summed) and the noisy average is formed."""
    client_std = client_noise_std(clip_bound, sigma_dp, len(users))
    max_abs = clip_bound + 40 * client_std
    workers = []
    for group in groups:
        acc = ExactSum(zeros(), max_abs=max_abs, max_terms=1024)
        for user_id in group:
            update = {n: t.clone() for n, t in users[user_id].items()}
            if placement == "client":
                add_gaussian_noise(update, client_std, noise_generator(seed, step, user=user_id))
            acc.add(update)
        workers.append(acc)
    for buffers in zip(*(w.buffers() for w in workers), strict=True):  # the all-reduce
        total = torch.stack(buffers).sum(0)
        for b in buffers:
            b.copy_(total)
    average = {n: t / len(users) for n, t in workers[0].result().items()}
    if placement == "server":
        std = server_noise_std(clip_bound, sigma_dp)
        add_gaussian_noise(average, std, noise_generator(seed, step))
    return flat(average)


@pytest.mark.parametrize("placement", ["server", "client"])
def test_noisy_aggregate_is_bitwise_identical_for_any_grouping_and_order(placement, sum_path):
    users = clipped_users(13, clip_bound=1.0)
    one_worker = aggregate(users, [list(range(13))], placement)
    two_workers = aggregate(users, [[12, 3, 5, 0, 7, 1], [2, 11, 9, 4, 10, 8, 6]], placement)
    three_workers = aggregate(users, [[6, 2], [9, 0, 12, 4, 1], [3, 8, 5, 11, 7, 10]], placement)
    assert torch.equal(one_worker, two_workers)
    assert torch.equal(one_worker, three_workers)
    exact_mean = sum(flat(u) for u in users) / 13  # the noise is there, and only the noise
    assert float((one_worker - exact_mean).std()) == pytest.approx(0.01, rel=0.1)


def test_exact_sum_matches_the_float64_sum(sum_path):
    users = clipped_users(9, clip_bound=0.01)
    acc = ExactSum(zeros(), max_abs=0.01)
    for u in users:
        acc.add(u)
    exact = sum(flat(u) for u in users)
    got = flat(acc.result(torch.float64))
    assert acc.terms == 9
    assert float((got - exact).abs().max()) <= 9 / acc.scale  # one rounding per term


def test_the_unflushed_sum_is_the_int64_sums_bit_for_bit_and_result_ends_it(sum_path):
    """One process's sum skips the int64 buffer (its fp64 partial sum is the sum); a sum whose
    buffers were taken (to all-reduce) goes through int64: the same floats in every dtype."""
    users = clipped_users(9, clip_bound=0.01)
    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        direct, via_int64 = ExactSum(zeros(), max_abs=0.01), ExactSum(zeros(), max_abs=0.01)
        for u in users:
            direct.add(u)
            via_int64.add(u)
        assert all(b.dtype == torch.int64 for b in via_int64.buffers())
        got, want = direct.result(dtype), via_int64.result(dtype)
        assert all(t.dtype == dtype for t in got.values())
        assert all(torch.equal(got[n], want[n]) for n in want)
        with pytest.raises(ValueError, match="ended"):
            direct.add(users[0])
        with pytest.raises(ValueError, match="ended"):
            via_int64.buffers()


def test_exact_sum_rejects_what_could_overflow_or_is_broken(sum_path):
    acc = ExactSum({"w": torch.zeros(3)}, max_abs=1.0, max_terms=2)
    with pytest.raises(ValueError, match="max_abs"):
        acc.add({"w": torch.tensor([0.0, 1.5, 0.0])})
    with pytest.raises(ValueError, match="max_abs"):
        acc.add({"w": torch.tensor([0.0, float("nan"), 0.0])})
    with pytest.raises(ValueError, match="keys"):
        acc.add({"v": torch.zeros(3)})
    for size in (2, 4, 200_000):  # the C kernel writes where the sizes say: never past the sum
        with pytest.raises(ValueError, match="sizes differ"):
            acc.add({"w": torch.zeros(size)}, largest=0.0)
    acc.add({"w": torch.ones(3)})
    acc.add({"w": -torch.ones(3)})
    with pytest.raises(ValueError, match="max_terms"):
        acc.add({"w": torch.ones(3)})
    # The worst case (max_terms terms all at max_abs) still fits in int64.
    big = ExactSum({"w": torch.zeros(1)}, max_abs=3.0, max_terms=2**20)
    assert 2**20 * round(3.0 * big.scale) < 2**63


def test_noise_std_must_be_valid():
    with pytest.raises(ValueError):
        add_gaussian_noise(zeros(), -1.0, noise_generator(0, 0))
    with pytest.raises(ValueError):
        add_gaussian_noise(zeros(), float("nan"), noise_generator(0, 0))


def test_exact_sum_trusts_only_a_bound_within_range_and_checks_otherwise(sum_path):
    total = ExactSum({"w": torch.zeros(3)}, max_abs=1.0)
    total.add({"w": torch.tensor([0.5, -0.25, 1.0])}, largest=1.0)  # proven in range: no pass
    with pytest.raises(ValueError, match="magnitude 2.0 exceeds max_abs=1.0"):
        total.add({"w": torch.tensor([2.0, 0.0, 0.0])}, largest=None)
    with pytest.raises(ValueError, match="magnitude 3.0 exceeds"):
        total.add({"w": torch.tensor([3.0, 0.0, 0.0])}, largest=5.0)  # a bound over: checked
    assert torch.equal(
        total.result(torch.float64)["w"], torch.tensor([0.5, -0.25, 1.0], dtype=torch.float64)
    )


def _quantized_in_fp64(values: torch.Tensor, scale: float) -> torch.Tensor:
    """The grid point of each value, computed the obvious way: x in fp64, times the power of two,
    rounded half to even."""
    return torch.round(values.double() * scale).to(torch.int64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_exact_sum_quantizes_narrow_updates_as_fp64_would(dtype, sum_path):
    """The sum quantizes in fp32 scratch: on half-way points, subnormals, values at max_abs and
    random values of every magnitude it lands on the grid point fp64 arithmetic gives."""
    max_abs = 0.75
    total = ExactSum({"w": torch.zeros(0, dtype=dtype)}, max_abs=max_abs, max_terms=2**10)
    generator = torch.Generator().manual_seed(3)
    magnitudes = torch.randn(4096, generator=generator, dtype=torch.float64).exp2() * 2.0**-30
    halfway = (torch.arange(-8, 9, dtype=torch.float64) + 0.5) / total.scale  # k + 1/2 on the grid
    tiny = torch.tensor([torch.finfo(dtype).tiny, torch.finfo(dtype).smallest_normal / 3])
    edges = torch.tensor([max_abs, -max_abs, 0.0, -0.0])
    values = torch.cat([
        (torch.rand(4096, generator=generator, dtype=torch.float64) * 2 - 1) * max_abs,
        magnitudes.clamp(max=max_abs) * torch.sign(torch.randn(4096, generator=generator)),
        halfway, tiny.double(), -tiny.double(), edges.double(),
    ]).to(dtype)  # fmt: skip
    total = ExactSum({"w": values}, max_abs=max_abs, max_terms=2**10)
    total.add({"w": values})
    total.add({"w": -values})
    total.add({"w": values})
    assert torch.equal(total.buffers()[0], _quantized_in_fp64(values, total.scale))
    assert total.result(torch.float64)["w"].shape == values.shape


def test_exact_sum_partial_fp64_sums_stay_exact_at_their_largest(sum_path):
    """Runs of terms are summed in fp64 before they join the int64 sum: with elements at
    ±max_abs (each partial sum near its largest, 2^53) between terms whose integers are odd (which
    fp64 would round away beyond 2^53), over several runs, the sum equals the integers' exact
    sum."""
    max_abs = 0.375  # not a power of two: max_abs·scale is not one either
    total = ExactSum({"w": torch.zeros(3)}, max_abs=max_abs, max_terms=2**12)
    ulp = 1 / total.scale  # one grid step
    large = torch.tensor([max_abs, -max_abs, max_abs])
    odd = torch.tensor([3 * ulp, -ulp, 2**-40 + ulp])  # odd integers, exact in fp32
    terms = ([large] * (total.terms_per_partial - 1) + [odd]) * 4
    generator = torch.Generator().manual_seed(5)
    terms += [(torch.rand(3, generator=generator) * 2 - 1) * max_abs for _ in range(7)]
    exact = [0] * 3
    for term in terms:
        total.add({"w": term})
        for i, quantized in enumerate(_quantized_in_fp64(term, total.scale).tolist()):
            exact[i] += quantized
    assert total.buffers()[0].tolist() == exact
    assert exact[0] > 2**53  # the int64 sum went beyond what one fp64 sum holds exactly
    largest_integer = math.ceil(max_abs * total.scale)
    assert (total.terms_per_partial + 1) * largest_integer > 2**53  # runs as long as exact


def test_exact_sum_keeps_fp64_updates_exact(sum_path):
    """On a CPU the scratch is fp64 whatever the terms' dtype (fp32 terms are widened by a copy),
    so an fp64 update is exact in a sum made like fp32 tensors too: each element toward zero on
    the grid (an fp64 term's rounding must not grow it). At 4 terms the integers reach 2^60,
    beyond the C kernel's range (torch's passes add them); at the default max_terms, 2^42."""
    for max_terms in (4, 2**20):
        step = 1 / ExactSum({"w": torch.zeros(1)}, max_abs=1.0, max_terms=max_terms).scale
        off_grid = [0.75 * step, -1.5 * step, 2.5 * step, -0.5 * step, 7.999 * step]
        values = torch.tensor([1 / 3, -step, 0.5 + 2**-40, *off_grid], dtype=torch.float64)
        for like in (values, values.float()):
            total = ExactSum({"w": like}, max_abs=1.0, max_terms=max_terms)
            total.add({"w": values})
            expected = torch.trunc(values * total.scale).to(torch.int64)
            assert torch.equal(total.buffers()[0], expected)


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    exponent=st.integers(-20, 10),
    on_grid=st.lists(st.floats(-0.25, 0.25), max_size=7),
    last_fraction=st.floats(1.01, 1.1),
    above_half=st.floats(0.0, 0.2),
)
def test_an_fp64_term_clipping_leaves_alone_stays_within_c_once_quantized(
    sum_path, exponent, on_grid, last_fraction, above_half
):
    """The released sum's sensitivity is the quantized term's norm. An fp64 update that clipping
    leaves alone, just under C: every element on the sum's grid but the last, which lies more
    than half a step below the grid point `top` that would take the norm past C (rounded half to
    even it would go there). In the sum it stays within C, exactly."""
    binade = 2.0**exponent  # every C in (binade, 2·binade] has the same grid step, 1/scale
    scale = ExactSum({"w": torch.zeros(1, dtype=torch.float64)}, max_abs=1.5 * binade).scale
    head = [math.floor(f * binade * scale) for f in on_grid]  # grid points, in steps
    top = math.floor(last_fraction * binade * scale)
    clip = math.sqrt(math.fsum(h * h for h in head) + (top - 0.1) ** 2) / scale
    total = ExactSum({"w": torch.zeros(len(head) + 1, dtype=torch.float64)}, max_abs=clip)
    assert total.scale == scale
    last = (top - 0.5 + above_half + 2**-6) / scale  # a fifth of a step under C at least
    values = torch.tensor([h / scale for h in head] + [last], dtype=torch.float64)
    result = clip_update({"w": values}, "global", clip)
    assert not result.changed  # just under C: clipping leaves it alone
    total.add(result.update)
    summed = total.result(torch.float64)["w"]
    assert sum(Fraction(float(v)) ** 2 for v in summed) <= Fraction(clip) ** 2


@settings(max_examples=300, deadline=None)
@given(
    wide=st.booleans(),
    log_terms=st.integers(11, 40),
    values=st.lists(st.floats(-1.0, 1.0, width=32), min_size=1, max_size=40),
    halves=st.lists(st.integers(-(2**20), 2**20), max_size=12),
)
def test_the_c_kernel_gives_the_integers_of_torch_s_passes(wide, log_terms, values, halves):
    """Wherever the C kernel adds a term (fp32 or fp64, integers up to 2^51: max_terms >= 2^11),
    its sum is torch's passes' bit for bit: random values, and values half way between grid
    points (k + 1/2 steps, where round half to even decides; fp64 rounds toward zero), of both
    signs, over four terms (in one pass)."""
    if exact_sum_module._kernels is None:
        pytest.skip("the C kernel is not built here (setup.py found no C compiler)")
    dtype = torch.float64 if wide else torch.float32
    scale = ExactSum({"w": torch.zeros(1)}, max_abs=1.0, max_terms=2**log_terms).scale
    grid = [(k + 0.5) / scale for k in halves]
    term = torch.tensor(values + grid, dtype=dtype)
    kernel, passes = (ExactSum({"w": term}, max_abs=1.0, max_terms=2**log_terms) for _ in "12")
    passes._kernel_adds = False  # torch's passes
    assert kernel._kernel_kind([term]) == ("d" if wide else "f")
    for summand in (term, -term, term.clone(), -term):  # the kernel's four in one pass
        kernel.add({"w": summand}, held=3)
        passes.add({"w": summand})
    assert torch.equal(kernel.buffers()[0], passes.buffers()[0])


def test_the_c_kernel_takes_only_what_it_adds_exactly():
    """Where the kernel is built: fp32 or fp64 terms throughout on the CPU at integers within
    2^51; a bf16 term, a mixed one, or a small max_terms take torch's passes."""
    if exact_sum_module._kernels is None:
        pytest.skip("the C kernel is not built here (setup.py found no C compiler)")
    total = ExactSum(zeros(), max_abs=0.01)
    assert total._kernel_kind(list(zeros().values())) == "f"
    assert total._kernel_kind(list(zeros(torch.float64).values())) == "d"
    assert total._kernel_kind(list(zeros(torch.bfloat16).values())) is None
    mixed = [torch.zeros(3), torch.zeros(3, dtype=torch.float64)]
    assert total._kernel_kind(mixed) is None
    assert ExactSum(zeros(), max_abs=0.01, max_terms=2**10)._kernel_kind(mixed[:1]) is None
    with pytest.raises(ValueError, match="kind"):
        exact_sum_module._kernels.add_quantized(0, "h", 0, 0, 1.0, 1.0)
    with pytest.raises(ValueError, match="n >= 0"):
        exact_sum_module._kernels.add_quantized(0, "f", 0, -1, 1.0, 1.0)
    with pytest.raises(ValueError, match="a factor for each term"):  # a second term's address alone
        exact_sum_module._kernels.add_quantized(0, "f", 0, 0, 1.0, 1.0, 0)


def test_scratch_is_narrow_only_on_a_gpu_for_narrow_terms_and_an_fp32_scale():
    from pflbench.privacy.aggregate import scratch_dtype

    cuda, cpu, f32 = torch.device("cuda"), torch.device("cpu"), torch.float32
    assert scratch_dtype([f32, torch.bfloat16], cuda, 2.0**40) == torch.float32
    assert scratch_dtype([f32, torch.float64], cuda, 2.0**40) == torch.float64
    assert scratch_dtype([f32], cpu, 2.0**40) == torch.float64
    # max_abs·max_terms below 2^-66: the scale is beyond fp32's range, x·scale would be inf.
    scale = ExactSum({"w": torch.zeros(3)}, max_abs=1e-30, max_terms=2**20).scale
    assert scale > torch.finfo(f32).max and scratch_dtype([f32], cuda, scale) == torch.float64


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_exact_sum_refuses_fp64_updates_in_narrow_cuda_scratch():
    values = torch.tensor([1 / 3, -(2**-60), 0.5 + 2**-40], dtype=torch.float64, device="cuda")
    narrow = ExactSum({"w": values.float()}, max_abs=1.0, max_terms=4)
    with pytest.raises(ValueError, match="fp64 update"):
        narrow.add({"w": values})


def one_buffer(update: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The update as back-to-back views of one flat buffer, as fl.local_update leaves Δ."""
    buffer = torch.cat([t.reshape(-1) for t in update.values()])
    pieces = buffer.split([t.numel() for t in update.values()])
    return {n: p.view(t.shape) for (n, t), p in zip(update.items(), pieces, strict=True)}


@pytest.mark.parametrize("block", [7, 1000, 2**18])
def test_a_cpu_sum_block_by_block_holds_each_elements_own_integer(monkeypatch, block):
    """On a CPU a term is quantized and added in blocks, which cut across tensors (separate
    ones) and through a flat buffer: the int64 sum is still Σ round(x·scale) element by element,
    computed here in fp64 over the whole term."""
    from pflbench.privacy import aggregate

    monkeypatch.setattr(aggregate, "CPU_BLOCK", block)
    monkeypatch.setattr(aggregate, "_kernels", None)  # torch's passes, not the C kernel's one
    users = clipped_users(5, clip_bound=0.5)
    separate, spans = ExactSum(zeros(), max_abs=0.5), ExactSum(zeros(), max_abs=0.5)
    assert separate._scaled.numel() == min(block, flat(users[0]).numel())
    for user in users:
        separate.add(user)
        spans.add(one_buffer(user))
    want = sum(torch.round(flat(u) * separate.scale).to(torch.int64) for u in users)
    assert torch.equal(separate.buffers()[0], want)
    assert torch.equal(spans.buffers()[0], want)


def test_an_update_lying_in_one_flat_buffer_sums_exactly_as_separate_tensors(sum_path):
    """Δ as views of one buffer (fl.local_update) is scaled in place of being gathered: the same
    integers. Views that are not back to back take the gather path."""
    from pflbench.privacy.aggregate import _one_span

    users = clipped_users(7, clip_bound=0.5)
    sizes = [t.numel() for t in zeros().values()]
    separate, spans = ExactSum(zeros(), max_abs=0.5), ExactSum(zeros(), max_abs=0.5)
    for user in users:
        views = one_buffer(user)
        assert _one_span(list(views.values()), spans._partial) is not None
        separate.add({n: t.clone() for n, t in user.items()})
        spans.add(views)
    assert torch.equal(separate.buffers()[0], spans.buffers()[0])
    like = separate._partial
    pieces = [t.clone() for t in users[0].values()]
    assert _one_span(pieces, like) is None  # separate allocations
    buffer = torch.zeros(like.numel() + 1)
    shifted = [p.view(-1) for p in buffer[1:].split(sizes)]
    assert _one_span(shifted, like) is not None
    assert _one_span(shifted[::-1], like) is None  # out of order
    assert _one_span([p.double() for p in shifted], like) is None  # separate allocations
    assert _one_span(shifted[:-1], like) is None  # short of the sum's size


def test_strided_and_negated_views_sum_as_their_copies(sum_path):
    """Tensors that are strided views (every other element of a buffer whose other elements are
    out of range) add as their contiguous copies do: no element is read from beside them; so do
    negated views (torch's lazy negation) and a term holding an empty tensor."""
    users = clipped_users(3, clip_bound=0.5)
    strided, dense = ExactSum(zeros(), max_abs=0.5), ExactSum(zeros(), max_abs=0.5)
    for user in users:
        views = {
            n: torch.stack([t, torch.full_like(t, 7.0)], dim=-1)[..., 0] for n, t in user.items()
        }
        assert not any(v.is_contiguous() for v in views.values())
        strided.add(views, largest=0.5)
        dense.add(user)
    assert torch.equal(strided.buffers()[0], dense.buffers()[0])
    negated, copied = ExactSum(zeros(), max_abs=0.5), ExactSum(zeros(), max_abs=0.5)
    for user in users:
        views = {n: torch._neg_view(t) for n, t in user.items()}
        assert all(v.is_neg() for v in views.values())
        negated.add(views, largest=0.5)
        copied.add({n: -t for n, t in user.items()})
    assert torch.equal(negated.buffers()[0], copied.buffers()[0])
    empty = {"w": torch.zeros(0), "b": torch.tensor([0.25, -0.5])}
    total = ExactSum(empty, max_abs=0.5)
    total.add(empty)  # no bound given: measured, the empty tensor included
    assert total.result(torch.float64)["b"].tolist() == [0.25, -0.5]


def test_a_restarted_sum_is_a_fresh_one_bit_for_bit(sum_path):
    """A run's steps sum into one ExactSum (restart): after a step that ended through the int64
    buffer or the fp64 one, at another bound (another scale), the sum is a fresh ExactSum's."""
    users = clipped_users(6, clip_bound=0.5)
    reused = ExactSum(zeros(), max_abs=0.5)
    for u in users:
        reused.add(u)
    reused.buffers()  # the int64 path, as when all-reduced
    reused.result()
    for max_abs, through_int64 in ((0.01, False), (0.5, True), (2.0**-30, False)):
        reused.restart(max_abs)
        fresh = ExactSum(zeros(), max_abs=max_abs)
        assert reused.scale == fresh.scale and reused.terms == 0
        for u in clipped_users(4, clip_bound=max_abs):
            reused.add(u)
            fresh.add(u)
        if through_int64:
            assert torch.equal(reused.buffers()[0], fresh.buffers()[0])
        got, want = reused.result(torch.float64), fresh.result(torch.float64)
        assert all(torch.equal(got[n], want[n]) for n in want)
    with pytest.raises(ValueError, match="max_abs"):
        reused.restart(float("nan"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize(
    "clipping, mode, rule",
    [("global", "dim", "clip"), ("perlayer", "dim", "clip"), ("perlayer", "uniform", "normalize")],
)
def test_clipping_s_multiply_left_to_the_sum_gives_the_clipped_update_s_integers(
    sum_path, dtype, clipping, mode, rule
):
    """clip_update(scale=False) leaves its plain multiplies to ExactSum.add's `factors`: the sum
    is the in-place clipped update's bit for bit, over one flat buffer (one kernel call at one
    factor for global clipping) or separate tensors, with the bound proven or measured (the
    products are then taken first and measured), and a layer scaled toward zero (a bound in fp32's
    subnormal range) taken by clipping itself."""
    generator = torch.Generator().manual_seed(7)
    raw = [
        {n: (torch.randn(s, generator=generator) * 0.3).to(dtype) for n, s in SHAPES.items()}
        for _ in range(4)
    ]
    like = {n: t.clone() for n, t in raw[0].items()}
    for bound in (0.5, 1e-37) if dtype == torch.float32 else (0.5,):
        clip = dict(perlayer_mode=mode, perlayer_rule=rule, in_place=True)
        scaled, left = ExactSum(like, max_abs=bound), ExactSum(like, max_abs=bound)
        for index, update in enumerate(raw):
            update = {n: t * (bound / 0.5) for n, t in update.items()}
            done = clip_update({n: t.clone() for n, t in update.items()}, clipping, bound, **clip)
            pending = one_buffer(update) if index % 2 else update
            result = clip_update(pending, clipping, bound, scale=False, **clip)
            assert result.pending is not None
            assert torch.equal(result.factors, done.factors)
            largest = float((done.norms * done.factors).max()) * (1 + 2**-20)
            scaled.add(done.update, largest=largest)
            proven = largest if index < 2 else None
            left.add(result.update, largest=proven, factors=result.pending)
        assert torch.equal(flat(scaled.result(torch.float64)), flat(left.result(torch.float64)))
        if bound < 1e-30 and clipping == "global":  # fp32's subnormal range: every layer
            assert bool((result.pending == 1).all())  # scaled toward zero by clipping
            assert bool((result.factors < 1).all())
    with pytest.raises(ValueError, match="one factor per tensor"):
        two = torch.ones(2, dtype=torch.float64)
        ExactSum(like, max_abs=1.0).add(like, largest=1.0, factors=two)
    with pytest.raises(ValueError, match="in_place"):
        clip_update(like, "global", 1.0, scale=False)


@settings(max_examples=200, deadline=None)
@given(
    wide=st.booleans(),
    values=st.lists(st.floats(-1.0, 1.0, width=32), min_size=1, max_size=40),
    factor=st.floats(2.0**-30, 1.0),
)
def test_the_c_kernel_multiplies_as_torch_does_before_it_quantizes(wide, values, factor):
    """The kernel's product with a factor (rounded to fp32 for an fp32 term) is torch's in-place
    multiply's, bit for bit, then quantized as the term's own values are."""
    if exact_sum_module._kernels is None:
        pytest.skip("the C kernel is not built here (setup.py found no C compiler)")
    dtype = torch.float64 if wide else torch.float32
    term = torch.tensor(values, dtype=dtype)
    kernel, passes = (ExactSum({"w": term}, max_abs=1.0) for _ in "12")
    passes._kernel_adds = False
    factors = torch.tensor([factor], dtype=torch.float64)
    for summand in (term, -term):
        kernel.add({"w": summand.clone()}, largest=1.0, factors=factors)
        passes.add({"w": summand.clone()}, largest=1.0, factors=factors)
    assert torch.equal(kernel.buffers()[0], passes.buffers()[0])


@pytest.mark.parametrize("wide", [False, True])
def test_held_terms_sum_together_to_the_same_integers(sum_path, wide):
    """Terms added `held` share the C kernel's pass with later ones, up to TERMS_PER_PASS (fp32,
    fp64; spans beside separate tensors; with clipping factors): a term held for fewer adds ends
    the wait early, a held term is added before a term of another kind and before buffers() and
    result(); the sum is the unheld sum's bit for bit. A held term's buffer written again before
    the sum read it is refused, not summed."""
    from pflbench.privacy.aggregate import TERMS_PER_PASS

    dtype = torch.float64 if wide else torch.float32
    generator = torch.Generator().manual_seed(11)
    terms = [
        {n: (torch.randn(s, generator=generator) * 0.1).to(dtype) for n, s in SHAPES.items()}
        for _ in range(11)
    ]
    factors = torch.tensor([0.5, 1.0, 0.25, 0.75], dtype=torch.float64)
    like = {n: t.clone() for n, t in terms[0].items()}
    plain, held = ExactSum(like, max_abs=0.5), ExactSum(like, max_abs=0.5)
    narrow = {n: t.to(torch.bfloat16) for n, t in terms[0].items()}
    kept = []  # the held terms' tensors, unchanged as `held` promises
    passes = []
    for index, term in enumerate(terms):
        views = one_buffer(term) if index % 3 else {n: t.clone() for n, t in term.items()}
        scaled = factors if index % 2 else None
        plain.add({n: t.clone() for n, t in views.items()}, largest=0.5, factors=scaled)
        kept.append(views)
        waiting = len(held._held)
        held.add(views, largest=0.5, factors=scaled, held=1 if index == 5 else TERMS_PER_PASS)
        passes.append(waiting + 1 if not held._held else 0)
        if index == 8 and not wide:  # a bf16 term: torch's passes, the held ones first
            plain.add({n: t.clone() for n, t in narrow.items()})
            held.add({n: t.clone() for n, t in narrow.items()}, held=3)
    if sum_path == "kernel":  # four at once; the term held for one add ends the wait at six
        assert passes[:7] == [0, 0, 0, TERMS_PER_PASS, 0, 0, 3]
    assert torch.equal(plain.buffers()[0], held.buffers()[0])
    assert held._held == []
    alone, unheld = ExactSum(like, max_abs=0.5), ExactSum(like, max_abs=0.5)
    alone.add(terms[0], largest=0.5, held=2)
    unheld.add(terms[0], largest=0.5)
    assert torch.equal(flat(alone.result(torch.float64)), flat(unheld.result(torch.float64)))
    if sum_path == "kernel":
        reused = ExactSum(like, max_abs=0.5)
        buffer = one_buffer(terms[1])
        reused.add(buffer, largest=0.5, held=2)
        with pytest.raises(ValueError, match="held term's buffer was written"):
            reused.add(buffer, largest=0.5, held=2)
    empty = {"e": torch.zeros(0), "w": torch.tensor([0.25, -0.5])}  # (no element to tell by)
    twice = ExactSum(empty, max_abs=0.5)
    for _ in range(2):
        twice.add({n: t.clone() for n, t in empty.items()}, largest=0.5, held=1)
    assert twice.result(torch.float64)["w"].tolist() == [0.5, -1.0]
