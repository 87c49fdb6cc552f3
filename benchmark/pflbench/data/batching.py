"""Dynamic batching by seconds of audio (the paper's client batches are 120 s of CV audio)."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch

from pflbench.data.features import N_MELS
from pflbench.data.store import Utterance

BUCKET = 64  # utterances sorted by length together, to keep padding low


def chunks(items: Iterable, size: int) -> Iterator[list]:
    """Consecutive lists of `size` items (the last may be shorter), read lazily."""
    it = iter(items)
    while chunk := list(itertools.islice(it, size)):
        yield chunk


@dataclass
class Batch:
    feats: torch.Tensor  # [B, T, 80], zero padded
    feat_lens: torch.Tensor  # [B] int64
    targets: torch.Tensor  # [B, L] int64, padded with 0 (the blank)
    target_lens: torch.Tensor  # [B] int64
    utt_ids: list[str]
    user_ids: list[str]
    texts: list[str]  # normalized

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        """On `device`. `non_blocking`: a host batch goes to CUDA through pinned memory, so the
        host does not wait for the device (a plain copy waits for the stream)."""
        pin = non_blocking and torch.device(device).type == "cuda"

        def move(t: torch.Tensor) -> torch.Tensor:
            t = t.pin_memory() if pin and t.device.type == "cpu" else t
            return t.to(device, non_blocking=non_blocking)

        return Batch(
            move(self.feats), move(self.feat_lens), move(self.targets), move(self.target_lens),
            self.utt_ids, self.user_ids, self.texts,
        )  # fmt: skip


def dynamic_batches(
    seconds: Sequence[float], max_seconds: float, generator: torch.Generator | None = None
) -> list[list[int]]:
    """Index groups whose audio adds up to at most `max_seconds` (a longer item is alone).
    With a generator: shuffled, sorted by length within buckets, batch order shuffled; without:
    sorted by length (for evaluation)."""
    durations = torch.as_tensor(seconds, dtype=torch.float64)
    n = len(durations)
    if generator is None:
        order = torch.argsort(durations, stable=True).tolist()
    else:
        perm = torch.randperm(n, generator=generator)
        order = []
        for start in range(0, n, BUCKET):
            bucket = perm[start : start + BUCKET]
            order += bucket[torch.argsort(durations[bucket], stable=True)].tolist()
    batches: list[list[int]] = []
    current: list[int] = []
    total = 0.0
    for i in order:
        if current and total + seconds[i] > max_seconds:
            batches.append(current)
            current, total = [], 0.0
        current.append(i)
        total += seconds[i]
    if current:
        batches.append(current)
    if generator is not None:
        batches = [batches[j] for j in torch.randperm(len(batches), generator=generator).tolist()]
    return batches


def padded_size(n: int) -> int:
    """`n` rounded up to a number with at most three significant bits (…, 7, 8, 10, 12, 14, 16,
    20, 24, 28, 32, 40, …: four sizes an octave, under 25% padding): the few shapes a compiled
    local step sees, so that it replays instead of compiling or recording again."""
    step = 1 << max(0, n.bit_length() - 3)
    return -(-n // step) * step


def collate(items: Sequence[Utterance]) -> Batch:
    feat_lens = torch.tensor([len(u.feats) for u in items], dtype=torch.int64)
    target_lens = torch.tensor([len(u.tokens) for u in items], dtype=torch.int64)
    feats = torch.zeros(len(items), int(feat_lens.max()), N_MELS)
    targets = torch.zeros(len(items), int(target_lens.max()), dtype=torch.int64)
    for i, u in enumerate(items):
        feats[i, : len(u.feats)] = u.feats
        targets[i, : len(u.tokens)] = u.tokens
    return Batch(feats, feat_lens, targets, target_lens, [u.utt_id for u in items],
                 [u.user_id for u in items], [u.text for u in items])  # fmt: skip
