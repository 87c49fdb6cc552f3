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

    def add(self, update: dict[str, Tensor]) -> None:
        if list(update) != self._names:
            raise ValueError("update keys differ from the ExactSum's keys (or their order)")
        if self.terms >= self.max_terms:
            raise ValueError(f"ExactSum already holds max_terms={self.max_terms} terms")
        tensors = list(update.values())
        largest = float(torch.stack(torch._foreach_norm(tensors, float("inf"))).max())
        if not largest <= self.max_abs:  # also catches NaN
            raise ValueError(f"an element of magnitude {largest} exceeds max_abs={self.max_abs}")
        for total, tensor in zip(self._sums, tensors, strict=True):
            total.add_(torch.round(tensor.to(torch.float64) * self.scale).to(torch.int64))
        self.terms += 1

    def buffers(self) -> list[Tensor]:
        """The int64 sums, to all-reduce (SUM) across processes in place."""
        return self._sums

    def result(self, dtype: torch.dtype = torch.float32) -> dict[str, Tensor]:
        return {
            name: (total.to(torch.float64) / self.scale).to(dtype)
            for name, total in zip(self._names, self._sums, strict=True)
        }
