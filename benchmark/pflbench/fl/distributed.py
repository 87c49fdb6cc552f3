"""Multi-process execution: torch.distributed from torchrun's environment, straggler-aware user
assignment, and bucketed all-reduce of flattened buffers.

A CUDA run's process group has two backends, NCCL for CUDA tensors and gloo for CPU tensors: the
aggregation's small float64 stats tensor is built on the host client by client and all-reduced
from there, and barriers and object collectives then go over gloo too. An NCCL-only group fails
on the first CPU tensor ("No backend type associated with device type cpu").
With one process there is no process group and every function here is a no-op, so the simulator
has a single code path.
"""

from __future__ import annotations

import heapq
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

BUCKET_BYTES = 64 * 2**20  # large enough to amortize latency, small enough to bound the copy
# Rank 0 may prepare data and train the seed model while the others wait at a barrier.
INIT_TIMEOUT = timedelta(hours=12)


@dataclass(frozen=True)
class DistContext:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def process_group_backend(device: str) -> str:
    """gloo on CPU; on CUDA, NCCL for CUDA tensors and gloo for CPU tensors."""
    return "cpu:gloo,cuda:nccl" if device.startswith("cuda") else "gloo"


def join_process_group(device: str, local_rank: int) -> None:
    """Initialize the default process group from the environment (MASTER_ADDR/PORT, RANK,
    WORLD_SIZE); on CUDA each process takes the GPU of its local rank."""
    if device.startswith("cuda"):
        torch.cuda.set_device(local_rank)
    dist.init_process_group(process_group_backend(device), timeout=INIT_TIMEOUT)


def init_from_env(device: str) -> DistContext:
    """Join the process group torchrun describes (RANK/WORLD_SIZE/LOCAL_RANK); one process (no
    group) if unset."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1:
        return DistContext()
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if not dist.is_initialized():
        join_process_group(device, local_rank)
    return DistContext(rank=rank, world_size=world_size, local_rank=local_rank)


def barrier(ctx: DistContext) -> None:
    if ctx.world_size > 1:
        dist.barrier()


def broadcast_from_main(value: bool, ctx: DistContext) -> bool:
    """Rank 0's `value` on every rank (one process: `value`)."""
    if ctx.world_size == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def assign_users(work: list[float], world_size: int) -> list[list[int]]:
    """Greedy longest-processing-time assignment: positions into `work`, per rank.

    The largest jobs go first, each to the currently least-loaded rank, so one user with hours of
    audio does not leave the other ranks idle (pfl-research's greedy scheduling). Deterministic:
    ties break by position and rank, so every rank computes the same assignment."""
    order = sorted(range(len(work)), key=lambda i: (-work[i], i))
    loads = [(0.0, rank) for rank in range(world_size)]
    assigned: list[list[int]] = [[] for _ in range(world_size)]
    for i in order:
        load, rank = heapq.heappop(loads)
        assigned[rank].append(i)
        heapq.heappush(loads, (load + work[i], rank))
    return [sorted(a) for a in assigned]


def one_process() -> bool:
    """No process group, or a group of one: there is nothing to all-reduce."""
    return not dist.is_initialized() or dist.get_world_size() == 1


def all_reduce_sum(tensors: list[torch.Tensor]) -> None:
    """In-place SUM across the ranks of the process group (one process: nothing to do),
    flattening tensors of one dtype and device into buckets of ≤ BUCKET_BYTES."""
    if one_process() or not tensors:
        return
    for bucket in _buckets(tensors):
        flat = _flatten_dense_tensors(bucket)
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        for target, reduced in zip(bucket, _unflatten_dense_tensors(flat, bucket), strict=True):
            target.copy_(reduced)


def _buckets(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    buckets: list[list[torch.Tensor]] = []
    size = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        last = buckets[-1][0] if buckets else None
        same_kind = last is not None and (last.dtype, last.device) == (t.dtype, t.device)
        if not same_kind or size + nbytes > BUCKET_BYTES:
            buckets.append([])
            size = 0
        buckets[-1].append(t)
        size += nbytes
    return buckets
