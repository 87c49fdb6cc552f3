"""torch.compile as training uses it: the local step (fl.client) and `pflbench bench model`."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch


def uses_cuda_graphs(backend: str | None, device: str) -> bool:
    """Whether the loss compiles with CUDA graphs (inductor's reduce-overhead, on CUDA: the eager
    step is launch-bound there)."""
    return backend == "inductor" and str(device).startswith("cuda")


def step_compiler(
    backend: str | None, cuda_graphs: bool = False
) -> Callable[[Callable], Callable] | None:
    """torch.compile with `backend` (None: run eagerly), with CUDA graphs when asked."""
    if backend is None:
        return None
    mode = "reduce-overhead" if cuda_graphs else None
    return functools.partial(torch.compile, backend=backend, mode=mode)
