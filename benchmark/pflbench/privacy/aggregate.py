"""Exact, order-independent summation of user updates.

Floating-point addition is not associative, so summing the same users in another order or over
another number of processes changes the last bits of the aggregate. ExactSum quantizes each
term to a fixed-point int64 grid (a power-of-two step, so the quantization of a float is exact
up to one rounding) and sums integers: the result is bitwise identical for any grouping.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

# Sums stay below 2^62 in magnitude, one bit of headroom under int64's 2^63.
INT_BUDGET_BITS = 62


class ExactSum:
    """Fixed-point int64 accumulator of dict-of-tensor updates.

    `max_abs` bounds every element of one term (the clip bound C bounds every element of a
    clipped update); `max_terms` bounds the number of terms summed over all processes. Together
    they fix the quantization step so the int64 sum cannot overflow.
    """

    def __init__(self, like: dict[str, Tensor], max_abs: float, max_terms: int = 2**20):
        if not (max_abs > 0 and math.isfinite(max_abs)) or max_terms < 1:
            raise ValueError(f"need max_abs > 0 and max_terms >= 1, got {max_abs}, {max_terms}")
        self.max_abs = float(max_abs)
        self.max_terms = max_terms
        headroom = 2.0**INT_BUDGET_BITS / (max_terms * self.max_abs)
        self.scale = 2.0 ** math.floor(math.log2(headroom))
        self.terms = 0
        self._names = list(like)
        self._sums = [
            torch.zeros(t.shape, dtype=torch.int64, device=t.device) for t in like.values()
        ]

    def add(self, update: dict[str, Tensor], largest: float | None = None) -> None:
        """Add one term. `largest`: a proven bound on its elements (the privacy steps derive one
        from the norms they measured); within max_abs it spares the range pass, otherwise (or
        when None) every element is checked."""
        if list(update) != self._names:
            raise ValueError("update keys differ from the ExactSum's keys (or their order)")
        if self.terms >= self.max_terms:
            raise ValueError(f"ExactSum already holds max_terms={self.max_terms} terms")
        tensors = list(update.values())
        if largest is None or not largest <= self.max_abs:
            largest = float(torch.stack(torch._foreach_norm(tensors, float("inf"))).max())
            if not largest <= self.max_abs:  # also catches NaN
                raise ValueError(
                    f"an element of magnitude {largest} exceeds max_abs={self.max_abs}"
                )
        # Quantize: x·scale in fp64 (exact: a power of two), rounded half to even, as int64.
        scaled = torch._foreach_mul([t.to(torch.float64) for t in tensors], self.scale)
        torch._foreach_round_(scaled)
        torch._foreach_add_(self._sums, [s.to(torch.int64) for s in scaled])
        self.terms += 1

    def buffers(self) -> list[Tensor]:
        """The int64 sums, to all-reduce (SUM) across processes in place."""
        return self._sums

    def result(self, dtype: torch.dtype = torch.float32) -> dict[str, Tensor]:
        return {
            name: (total.to(torch.float64) / self.scale).to(dtype)
            for name, total in zip(self._names, self._sums, strict=True)
        }
