"""Digests of tensors: what identifies a model's weights (a shipped seed model, a run's final
checkpoint) whatever the metadata saved beside them. Imports nothing of pflbench."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import Tensor


def tensors_digest(path: Path) -> str:
    """sha256 over a checkpoint's tensors (names, dtypes, shapes, bytes): identifies the weights
    independently of the sidecar's metadata."""
    return state_digest(load_file(str(path)))


def state_digest(tensors: dict[str, Tensor]) -> str:
    """tensors_digest of the checkpoint these tensors would be saved as."""
    h = hashlib.sha256()
    for name, t in sorted(tensors.items()):
        t = t.detach().to("cpu")
        h.update(f"{name}\t{t.dtype}\t{tuple(t.shape)}\n".encode())
        h.update(t.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())  # 0-dim too
    return h.hexdigest()
