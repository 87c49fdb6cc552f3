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
    if backend != "inductor":
        return functools.partial(torch.compile, backend=backend)
    # Inductor's options stand for mode="reduce-overhead" (triton.cudagraphs) so as to turn its
    # tiling analysis off as well: on an H200 (torch 2.11, 2026-11-28) that analysis failed an
    # assertion in Triton code generation for paper-255m's graph once layer drop no longer broke
    # it. It only chooses tilings, and Meta's internal builds ship with it off.
    options = {"triton.cudagraphs": cuda_graphs, "triton.coalesce_tiling_analysis": False}
    return functools.partial(torch.compile, backend="inductor", options=options)
