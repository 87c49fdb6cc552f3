"""Exact, order-independent summation of user updates.

Floating-point addition is not associative, so summing the same users in another order or over
another number of processes changes the last bits of the aggregate. ExactSum quantizes each
term to a fixed-point int64 grid (a power-of-two step, so the quantization of a float is exact
up to one rounding) and sums integers: the result is bitwise identical for any grouping.

The integers are summed in fp64 first: fp64 adds integers exactly while the sum stays within
2^53, so a run of terms goes into an fp64 partial sum (one vectorized pass per term, where an
int64 conversion and an int64 add take two) and the partial sum joins the int64 sum before it
could leave that range. The result is the int64 sum's, bit for bit. A sum that never left its
first run and is not all-reduced (one process, a cohort's worth of terms) needs no int64 buffer
at all: its partial sum is the sum.

On a CPU an fp32 or fp64 term is quantized and added in one pass by a small C kernel
(_kernels.c, built by setup.py where a C compiler is found): one read of the term and one read
and write of the partial sum, the integers torch's passes give. The same pass multiplies a
clipped term by its clipping factors (`add`'s `factors`), which spares clipping its own read and
write of the update, and takes up to TERMS_PER_PASS terms the caller holds for it (`add`'s
`held`: fl.client keeps that many clients' Δ), reading and writing the partial sum once for
all. A 4.89M-element fp32 term on the 2-core AMD EPYC: 1.6 ms alone, 0.96 ms per term four at a
time, against 4.4 for the passes below and ~1 more for clipping's multiply. Without the kernel,
and for bf16/fp16 terms, a term is quantized and added block by block, each block small enough
that its passes (widen, scale, round, add) run in cache: elementwise, so the integers are the
same, in ~40% less time than whole-term passes where the model's fp64 buffers exceed the cache
(5.8 → 3.7 ms on one thread). A GPU takes each pass over the whole term at once (one kernel
per pass).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

try:  # the one-pass CPU kernel (module docstring); without it, torch's passes
    from pflbench.privacy import _kernels
except ImportError:
    _kernels = None
from pflbench.privacy.clipping import apply_factors

# Sums stay below 2^62 in magnitude, one bit of headroom under int64's 2^63.
INT_BUDGET_BITS = 62
# fp64 holds every integer up to 2^53 exactly.
FP64_EXACT_BITS = 53
# Elements per block on a CPU: 4 MB of fp64 scratch; the fastest of 2^15..2^20 measured on the
# 2-core AMD EPYC for a 4.89M-element term.
CPU_BLOCK = 1 << 19
# The C kernel rounds by adding and subtracting 1.5·2^52, exact for integers up to 2^51.
KERNEL_BITS = 51
# The dtypes the C kernel reads, by its name for them.
KERNEL_KINDS = {torch.float32: "f", torch.float64: "d"}
# The most terms the C kernel adds in one pass (`add`'s `held`).
TERMS_PER_PASS = 4


class ExactSum:
    """Fixed-point int64 accumulator of dict-of-tensor updates.

    `max_abs` bounds every element of one term (the clip bound C bounds every element of a
    clipped update); `max_terms` bounds the number of terms summed over all processes. Together
    they fix the quantization step so the int64 sum cannot overflow.

    The sum is one flat int64 buffer; each term is scaled and rounded in preallocated scratch
    (a block on a CPU, the whole term on a GPU) and added to a flat fp64 partial sum (module
    docstring): a term costs a few passes over the model and no allocation, and `restart` reuses
    the buffers for the next sum.
    """

    def __init__(self, like: dict[str, Tensor], max_abs: float, max_terms: int = 2**20):
        if max_terms < 1:
            raise ValueError(f"need max_terms >= 1, got {max_terms}")
        self.max_terms = max_terms
        self._names = list(like)
        self._shapes = [t.shape for t in like.values()]
        self._sizes = [t.numel() for t in like.values()]
        self._dtypes = [t.dtype for t in like.values()]
        self._device = next(iter(like.values())).device if like else torch.device("cpu")
        total = sum(self._sizes)
        self._partial = torch.empty(total, dtype=torch.float64, device=self._device)
        # A CPU's scratch is one block (module docstring), a GPU's the whole term.
        self._block = max(1, min(total, CPU_BLOCK)) if self._device.type == "cpu" else None
        self._scaled: Tensor | None = None  # made by restart, in the dtype the scale allows
        self._noise: Tensor | None = None  # made by noise_buffers
        self.restart(max_abs)

    def restart(self, max_abs: float) -> None:
        """Begin a new, empty sum of terms bounded by `max_abs` in this one's buffers: a run's
        steps sum into one ExactSum instead of allocating (and the OS zeroing) a model-sized
        fp64 buffer each. It overwrites what `result` returned in fp64 (views of the buffer)."""
        if not (max_abs > 0 and math.isfinite(max_abs)):
            raise ValueError(f"need max_abs > 0, got {max_abs}")
        self.max_abs = float(max_abs)
        headroom = 2.0**INT_BUDGET_BITS / (self.max_terms * self.max_abs)
        self.scale = 2.0 ** math.floor(math.log2(headroom))
        self.terms = 0
        self._sum: Tensor | None = None  # made by the first flush (buffers(), or a full run)
        self._ended = False  # result() reuses the buffers
        # A term's integers are at most `largest_integer` in magnitude (the rounding of a value
        # at most max_abs·scale), so fp64 sums `terms_per_partial` of them exactly.
        largest_integer = math.ceil(self.max_abs * self.scale)
        self._largest_integer = largest_integer
        self.terms_per_partial = max(1, 2**FP64_EXACT_BITS // largest_integer)
        self._kernel_adds = (  # (a small max_terms leaves integers beyond the kernel's range)
            _kernels is not None
            and self._device.type == "cpu"
            and largest_integer <= 2**KERNEL_BITS
        )
        self._partial.zero_()
        self._partial_terms = 0
        # Terms waiting for the kernel's pass (add's `held`): each with its last readable add.
        self._held: list[tuple[list[tuple[Tensor, float]], int]] = []
        self._held_kind = ""
        dtype = scratch_dtype(self._dtypes, self._device, self.scale)
        if self._scaled is None or self._scaled.dtype != dtype:
            size = self._block or self._partial.numel()
            self._scaled = torch.empty(size, dtype=dtype, device=self._device)

    def add(
        self,
        update: dict[str, Tensor],
        largest: float | None = None,
        factors: Tensor | None = None,
        held: int = 0,
    ) -> None:
        """Add one term. `largest`: a proven bound on its elements (the privacy steps derive one
        from the norms they measured); within max_abs it spares the range pass, otherwise (or
        when None) every element is checked. `factors` (fp64 [H], clip_update's `pending`): the
        term is each tensor times its factor, the products `clipping.apply_factors` takes; taken
        in the C kernel's pass where it adds the term, else by apply_factors in place first
        (`largest` bounds the products). `held`: the caller keeps the term's tensors unchanged
        through that many more adds (and until `buffers` or `result`), so the C kernel may add it
        in one pass with later terms, up to TERMS_PER_PASS (module docstring); it is checked and
        counted now all the same."""
        self._check_open()
        if list(update) != self._names:
            raise ValueError("update keys differ from the ExactSum's keys (or their order)")
        if self.terms >= self.max_terms:
            raise ValueError(f"ExactSum already holds max_terms={self.max_terms} terms")
        tensors = list(update.values())
        if [t.numel() for t in tensors] != self._sizes:  # (the C kernel writes where they say)
            raise ValueError("update sizes differ from the ExactSum's")
        if self._scaled.dtype != torch.float64 and any(t.dtype == torch.float64 for t in tensors):
            raise ValueError("an fp64 update needs an ExactSum made like fp64 tensors")
        if factors is not None and factors.shape != (len(tensors),):
            raise ValueError(f"need one factor per tensor, got factors of shape {factors.shape}")
        span = _one_span(tensors, self._partial)
        kind = self._kernel_kind(tensors)
        proven = largest is not None and largest <= self.max_abs
        if factors is not None and not (kind is not None and proven):
            apply_factors(tensors, factors)  # (a range pass below measures the products)
            factors = None
        if not proven:
            measured = [t for t in tensors if t.numel()]  # (an empty tensor has no inf-norm)
            norms = torch._foreach_norm(measured, float("inf")) if measured else []
            largest = float(torch.stack(norms).max()) if norms else 0.0  # (a NaN stays NaN)
            if not largest <= self.max_abs:  # also catches NaN
                raise ValueError(
                    f"an element of magnitude {largest} exceeds max_abs={self.max_abs}"
                )
        # The released sum's sensitivity is the quantized term's norm, so rounding must not lift
        # a clipped term past C. fp32/bf16/fp16 terms round half to even: only their elements
        # below ~C·2^-18 are off the grid (whose step is ~C·2^-42), so rounding grows the norm
        # by at most ~d·2^-61 relative, inside clipping's measurement tolerance of d·2^-53. An
        # fp64 term has no such slack (an element just under C rounds up past it), so it rounds
        # toward zero.
        wide = any(t.dtype == torch.float64 for t in tensors)
        to_integer = Tensor.trunc_ if wide else Tensor.round_
        if kind is not None:
            self._add_by_kernel(kind, self._kernel_term(tensors, span, factors), held)
        else:
            self._add_held()
            self._make_room(1)
            if self._block is None:
                self._add_whole(tensors, span, to_integer)
            else:  # a span, or each tensor (no gather)
                pieces = [span] if span is not None else [t.reshape(-1) for t in tensors]
                self._add_blocks(pieces, to_integer)
            self._partial_terms += 1
        self.terms += 1

    def _make_room(self, count: int) -> None:
        """Flush the partial sum where `count` more terms could take it past 2^53."""
        if self._partial_terms + count > self.terms_per_partial:
            self._flush()

    def _kernel_kind(self, tensors: list[Tensor]) -> str | None:
        """The C kernel's name for the term's dtype where the kernel can add it (fp32 or fp64
        throughout, on this sum's device), else None."""
        if not self._kernel_adds:
            return None
        kinds = {KERNEL_KINDS.get(t.dtype) if t.device == self._device else None for t in tensors}
        return kinds.pop() if len(kinds) == 1 else None

    def _kernel_term(
        self, tensors: list[Tensor], span: Tensor | None, factors: Tensor | None
    ) -> list[tuple[Tensor, float]]:
        """The term as the C kernel reads it: flat contiguous pieces back to back over the
        partial sum, each with its factor; the span where all tensors share one factor."""
        multipliers = [1.0] * len(tensors) if factors is None else factors.tolist()
        if span is not None and len(set(multipliers)) == 1:
            return [(span, multipliers[0])]
        # (a negated or strided view is copied)
        pieces = [t.reshape(-1).resolve_neg().contiguous() for t in tensors]
        return list(zip(pieces, multipliers, strict=True))

    def _add_by_kernel(self, kind: str, term: list[tuple[Tensor, float]], held: int) -> None:
        """Hold the term (`add`'s `held`) or add it by the C kernel, in one pass with the terms
        held: when it is not held, TERMS_PER_PASS are waiting, or a held one could not wait for
        the next add."""
        if self._held and self._held_kind != kind:
            self._add_held()
        index = self.terms  # this term's; a held one is readable through add `last`
        address = _first_address(term)
        if address is not None and any(_first_address(w) == address for w, _ in self._held):
            raise ValueError("a held term's buffer was written before the sum read it")
        self._held.append((term, index + held))
        self._held_kind = kind
        full = len(self._held) >= min(TERMS_PER_PASS, self.terms_per_partial)
        if held == 0 or full or any(last == index for _, last in self._held):
            self._add_held()

    def _add_held(self) -> None:
        """Add the held terms in one pass, if any are held."""
        if self._held:
            terms, self._held = [term for term, _ in self._held], []
            self._make_room(len(terms))
            self._kernel_pass(self._held_kind, terms)
            self._partial_terms += len(terms)

    def _kernel_pass(self, kind: str, terms: list[list[tuple[Tensor, float]]]) -> None:
        """One pass of the C kernel over each piece of the terms, together (module docstring):
        it rounds fp32 half to even and fp64 toward zero, as `add` does."""
        if len({len(term) for term in terms}) > 1:  # a span beside tensors: split it
            terms = [self._per_tensor(term) for term in terms]
        address = self._partial.data_ptr()
        for pieces in zip(*terms, strict=True):
            (first, multiplier), *rest = pieces
            more = [value for piece, factor in rest for value in (piece.data_ptr(), factor)]
            _kernels.add_quantized(
                first.data_ptr(), kind, address, first.numel(), self.scale, multiplier, *more
            )
            address += first.numel() * self._partial.element_size()

    def _per_tensor(self, term: list[tuple[Tensor, float]]) -> list[tuple[Tensor, float]]:
        if len(term) == len(self._sizes):
            return term
        ((span, multiplier),) = term
        return [(piece, multiplier) for piece in span.split(self._sizes)]

    def _add_blocks(self, pieces: list[Tensor], to_integer) -> None:
        """Torch's passes block by block, each block's scratch in cache (module docstring)."""
        start = 0
        for piece in pieces:
            for offset in range(0, piece.numel(), self._block):
                values = piece[offset : offset + self._block]
                end = start + values.numel()
                scratch = self._scaled[: values.numel()]
                self._quantize(values, scratch, to_integer)
                self._partial[start:end].add_(scratch)  # integers within 2^53: exact
                start = end

    def _add_whole(self, tensors: list[Tensor], span: Tensor | None, to_integer) -> None:
        """One pass each over the whole term, into the whole-term scratch."""
        if span is None:  # separate tensors: gathered (and widened) first
            torch.cat([t.reshape(-1) for t in tensors], out=self._scaled)
            to_integer(self._scaled.mul_(self.scale))
        else:
            self._quantize(span, self._scaled, to_integer)
        self._partial.add_(self._scaled)  # integers, the sum within 2^53: exact

    def _quantize(self, values: Tensor, out: Tensor, to_integer) -> None:
        """out = values·scale (exact: a power of two), made an integer by `to_integer` (round
        half to even, or toward zero: `add`)."""
        if values.dtype == out.dtype:  # one pass fewer: no copy
            torch.mul(values, self.scale, out=out)
        else:  # widened by a vectorized copy (scratch_dtype)
            out.copy_(values)
            out.mul_(self.scale)
        to_integer(out)

    def _flush(self) -> None:
        """Move the fp64 partial sum into the int64 sum (integral values: the conversion is
        exact)."""
        if self._partial_terms == 0 and self._sum is not None:  # nothing to move
            return
        if self._sum is None:
            self._sum = self._partial.to(torch.int64)
        else:
            self._sum.add_(self._partial.to(torch.int64))
        self._partial.zero_()
        self._partial_terms = 0

    def buffers(self) -> list[Tensor]:
        """The int64 sums, to all-reduce (SUM) across processes in place."""
        self._check_open()
        self._add_held()
        self._flush()
        assert self._sum is not None
        return [self._sum]

    def norm(self) -> float:
        """The L2 norm of the sum so far (fp64)."""
        self._check_open()
        self._add_held()
        if self._sum is None:
            return float(torch.linalg.vector_norm(self._partial)) / self.scale
        self._flush()
        return float(torch.linalg.vector_norm(self._sum.to(torch.float64))) / self.scale

    def noise_buffers(self) -> dict[str, Tensor]:
        """Zeroed fp64 tensors shaped like the terms (one buffer, reused from sum to sum), for
        the noise `add_noise` adds to this sum."""
        if self._noise is None:
            self._noise = torch.zeros_like(self._partial)
        else:
            self._noise.zero_()
        return self._per_tensor_views(self._noise)

    def add_noise(self, multiplier: float) -> None:
        """Add what `noise_buffers` hold, times `multiplier` (the noise on an average times its
        denominator: the noise on the sum), rounded onto the sum's grid: what `result` then
        returns is a rounding of the exact sum plus noise no user's data moves (post-processing
        of the Gaussian mechanism). Noise added to an already rounded sum is not: how the sum
        rounds (to fp32, or to fp64 past 2^53) depends on the other users, so one user could move
        the release by more than their bound, up to ~2^-24 of the sum per element."""
        self._check_open()
        self._add_held()
        noise = self._noise
        if noise is None:
            raise ValueError("add_noise adds what noise_buffers hold: call it first")
        noise.mul_(multiplier * self.scale).round_()  # the noise's own rounding: no user's data
        largest = float(torch.linalg.vector_norm(noise, float("inf"))) if noise.numel() else 0.0
        if not largest < 2.0**INT_BUDGET_BITS:  # (NaN too) the sum's int64 range
            raise ValueError(
                f"noise of magnitude {largest / self.scale:.6g} on the sum, beyond its range"
            )
        fits = self._partial_terms * self._largest_integer + largest <= 2.0**FP64_EXACT_BITS
        if self._sum is None and fits:
            self._partial.add_(noise)  # integers, the sum within 2^53: exact
        else:
            self._flush()
            self._sum.add_(noise.to(torch.int64))

    def result(self, dtype: torch.dtype = torch.float32) -> dict[str, Tensor]:
        """The sum, in `dtype`, per tensor. It ends the sum: the values may lie in its buffers."""
        self._check_open()
        self._add_held()
        self._ended = True
        if self._sum is None:  # never flushed: the partial sum holds the integers, exactly
            values = self._partial.div_(self.scale)
        else:
            self._flush()
            values = self._sum.to(torch.float64).div_(self.scale)
        return self._per_tensor_views(values.to(dtype))

    def _per_tensor_views(self, flat: Tensor) -> dict[str, Tensor]:
        pieces = flat.split(self._sizes)
        return {
            name: piece.view(shape)
            for name, piece, shape in zip(self._names, pieces, self._shapes, strict=True)
        }

    def _check_open(self) -> None:
        if self._ended:
            raise ValueError("this ExactSum has ended: result() was called")


def adds_in_one_pass() -> bool:
    """Whether fp32/fp64 CPU terms are added by the C kernel here (module docstring)."""
    return _kernels is not None


def scratch_dtype(dtypes: list[torch.dtype], device: torch.device, scale: float) -> torch.dtype:
    """The dtype a term is quantized in. Scaling by a power of two is exact in fp32 as in fp64
    (|x|·scale < 2^62 cannot overflow, and a product small enough to be subnormal rounds to 0
    either way), and so is rounding to an integer: fp32 scratch quantizes bf16/fp16/fp32 terms
    exactly as fp64 would, at half the memory traffic, where the scale itself is an fp32 number.
    fp64 terms need fp64 scratch. On a CPU the term is widened first (a vectorized copy) into
    fp64 scratch: torch's CPU add of fp32 into fp64 takes a scalar casting loop, ~2x the time of
    the copy and an fp64 add together."""
    wide = (
        torch.float64 in dtypes
        or device.type == "cpu"
        or scale > torch.finfo(torch.float32).max  # a tiny max_abs·max_terms
    )
    return torch.float64 if wide else torch.float32


def _first_address(term: list[tuple[Tensor, float]]) -> int | None:
    """Where a kernel term's first element lies (None for a term of no elements): a caller that
    hands the sum a held term's buffer again has written over it (`add`'s `held`)."""
    return next((piece.data_ptr() for piece, _ in term if piece.numel()), None)


def _one_span(tensors: list[Tensor], like: Tensor) -> Tensor | None:
    """The tensors as one flat view, where they lie back to back in one storage with `like`'s
    size and device (fl.local_update's Δ buffer), else None."""
    first = tensors[0]
    if first.device != like.device or sum(t.numel() for t in tensors) != like.numel():
        return None
    storage, address = first.untyped_storage().data_ptr(), first.data_ptr()
    for t in tensors:
        if (
            not t.is_contiguous()
            or t.dtype != first.dtype
            or t.untyped_storage().data_ptr() != storage
            or t.data_ptr() != address
        ):
            return None
        address += t.numel() * t.element_size()
    return first.as_strided((like.numel(),), (1,))
