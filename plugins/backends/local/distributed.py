"""Data-parallel plumbing for the local backend (torchrun, gloo on CPU or nccl on GPU).

Kept apart from the backend so that a single-process run never touches ``torch.distributed``
beyond :func:`is_initialized`, and so the helpers can be tested on their own. Every function is
a no-op (or the trivial answer) when no process group is running.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import torch

BUCKET_BYTES = 64 * 2**20
"""Gradients are all-reduced in flat buckets of about this size: one collective per bucket
instead of one per tensor, without a full second copy of a large model's gradients."""


def init_from_env(backend: str | None = None) -> bool:
    """Initialise the default process group from torchrun's env vars when ``WORLD_SIZE > 1``.

    Returns True if a process group is (now) running. ``backend`` defaults to nccl when CUDA is
    available and gloo otherwise. Safe to call twice.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return True
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    if backend is None:
        import torch

        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        import torch

        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend=backend)  # reads MASTER_ADDR/PORT, RANK, WORLD_SIZE
    return True


def is_initialized() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if is_initialized() else 1


def rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if is_initialized() else 0


def is_main() -> bool:
    """True on the one process that writes files (rank 0, or the only process)."""
    return rank() == 0


def barrier() -> None:
    import torch.distributed as dist

    if world_size() > 1:
        dist.barrier()


def _buckets(tensors: Sequence[torch.Tensor], limit: int) -> Iterable[list[torch.Tensor]]:
    """Consecutive groups of same-dtype/device tensors of at most ``limit`` bytes (or one)."""
    bucket: list[torch.Tensor] = []
    size = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        same_kind = not bucket or (t.dtype == bucket[0].dtype and t.device == bucket[0].device)
        if bucket and (size + nbytes > limit or not same_kind):
            yield bucket
            bucket, size = [], 0
        bucket.append(t)
        size += nbytes
    if bucket:
        yield bucket


def all_reduce_mean_(tensors: Sequence[torch.Tensor], bucket_bytes: int = BUCKET_BYTES) -> None:
    """Average ``tensors`` in place across ranks (every rank must pass the same shapes in the
    same order). Used on gradients, so every rank then takes the same optimizer step."""
    import torch
    import torch.distributed as dist

    n = world_size()
    if n <= 1:
        return
    for bucket in _buckets(list(tensors), bucket_bytes):
        flat = torch.cat([t.reshape(-1) for t in bucket])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        flat.div_(n)
        offset = 0
        for t in bucket:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()


def broadcast_(tensors: Sequence[torch.Tensor], src: int = 0) -> None:
    """Overwrite ``tensors`` with rank ``src``'s values, so all ranks start from one model even
    if a builder's initialisation was not seeded."""
    import torch.distributed as dist

    if world_size() <= 1:
        return
    for t in tensors:
        dist.broadcast(t.data, src=src)


def gather_to_main(obj: object) -> list[Any] | None:
    """Every rank's ``obj`` as a list on rank 0 (``None`` elsewhere); ``[obj]`` without a group.

    Lets rank 0 alone write a checkpoint that still holds each rank's RNG state.
    """
    import torch.distributed as dist

    n = world_size()
    if n <= 1:
        return [obj]
    out: list[Any] | None = [None] * n if rank() == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


def broadcast_object(obj: object, src: int = 0) -> Any:
    """Rank ``src``'s ``obj`` on every rank (``obj`` itself without a group): e.g. the folder
    rank 0 wrote, which the other ranks then read."""
    import torch.distributed as dist

    if world_size() <= 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]
