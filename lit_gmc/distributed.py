"""The few collectives the learner needs across data-parallel ranks, as functions that are identities on one process.

Rank 0 owns the rollout engine and the delay schedule; every other rank receives its share of each update's groups
(:func:`scatter_from_first`) and takes part in the reductions of per-step statistics (:func:`gather_rows`,
:func:`gather_ragged`, :func:`sum_across`). All of them act on the default process group, which Lightning's DDP
and the FSDP2 strategy (:class:`lit_gmc.strategies.FSDP2Strategy`, one data-parallel mesh dimension) span.

Written on ``torch.distributed`` directly: Lightning's strategy exposes ``broadcast`` and ``all_gather`` but no
scatter of Python objects and no gather of tensors whose first dimension differs between ranks.
"""

from __future__ import annotations

from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, distribute_tensor

T = TypeVar("T")


def rank_and_world() -> tuple[int, int]:
    """``(rank, world size)`` of the default group; ``(0, 1)`` without an initialised process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def scatter_from_first(shares: list[T] | None) -> T:
    """Rank 0 passes one picklable object per rank and gets its own back; every other rank passes ``None``."""
    rank, world = rank_and_world()
    if world == 1:
        assert shares is not None and len(shares) == 1
        return shares[0]
    if rank == 0 and (shares is None or len(shares) != world):
        raise ValueError(f"scatter_from_first needs {world} shares on rank 0, got {shares!r:.80}")
    received: list[Any] = [None]
    dist.scatter_object_list(received, shares if rank == 0 else None, src=0)
    return received[0]


def gather_rows(local: Tensor) -> Tensor:
    """Concatenate every rank's ``local`` along dim 0, in rank order; all ranks pass the same shape."""
    _, world = rank_and_world()
    if world == 1:
        return local
    if local.dtype == torch.bool:  # gloo has no boolean collectives
        return gather_rows(local.to(torch.uint8)).bool()
    parts = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(parts, local.contiguous())
    return torch.cat(parts)


def gather_ragged(local: Tensor) -> Tensor:
    """Like :func:`gather_rows` for 1-D tensors whose length differs between ranks (e.g. per-token values)."""
    _, world = rank_and_world()
    if world == 1:
        return local
    length = torch.tensor([local.numel()], device=local.device)
    lengths = gather_rows(length).tolist()  # (world,)
    padded = local.new_zeros(max(lengths))
    padded[: local.numel()] = local
    parts = gather_rows(padded).reshape(world, -1)  # (world, longest)
    return torch.cat([parts[r, :n] for r, n in enumerate(lengths)])


def sum_across(local: Tensor) -> Tensor:
    """The element-wise sum of ``local`` over ranks (a new tensor; ``local`` is unchanged)."""
    _, world = rank_and_world()
    if world == 1:
        return local
    total = local.clone()
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return total


def full_tensor(tensor: Tensor) -> Tensor:
    """The whole of a possibly FSDP2-sharded tensor; a collective every rank must join for a ``DTensor``."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def local_part(tensor: Tensor) -> Tensor:
    """This rank's shard of a ``DTensor``, or the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def like(reference: Tensor, tensor: Tensor) -> Tensor:
    """``tensor`` (whole, or already laid out like ``reference``) with ``reference``'s dtype, device and sharding."""
    if isinstance(reference, DTensor) and not isinstance(tensor, DTensor):
        whole = tensor.to(dtype=reference.dtype, device=reference.device)
        return distribute_tensor(whole, reference.device_mesh, reference.placements)
    return tensor.to(dtype=reference.dtype, device=reference.device)
