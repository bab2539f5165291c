"""From a TP layer's shards back to the unsharded tensor, and between a sequence-sharded layout and
the fused ops' row order.

A tensor ``[..., S, ..., H]`` sharded on its sequence dimension ``d`` (``Shard(d)``) holds, on rank r,
the positions ``[r*S/W, (r+1)*S/W)`` of every sequence. The fused ops gather and scatter whole rows of
a 2-D ``[M, H]``, rank r's rows as one block: the *rank-major* order ``[W, ..., S/W, ..., H]``. The two
orders agree without a copy when every dimension before ``d`` has size 1 (``Shard(0)``, or a batch of
one); otherwise the conversion copies the full-sequence side once (autograd copies its gradient back
the same way)."""

from __future__ import annotations

import torch
import torch.distributed as dist


def gather_shards(shard: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    """The unsharded tensor whose axis ``dim`` the ranks of ``group`` split in rank order: every rank's
    ``shard`` (all of one shape) concatenated along ``dim``, detached, the same on every rank.
    Collective: every rank of ``group`` must call it."""
    parts = [torch.empty_like(shard) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, shard.detach().contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def from_rank_major(y: torch.Tensor, world: int, local_lead: torch.Size, dim: int) -> torch.Tensor:
    """``y [W * prod(local_lead), N]`` in rank-major row order -> ``[*lead, N]``, where ``lead`` is
    ``local_lead`` with dimension ``dim`` W times longer (a copy unless the dimensions before ``dim``
    have size 1)."""
    return y.view(world, *local_lead, y.shape[-1]).movedim(0, dim).flatten(dim, dim + 1)


def to_rank_major(x: torch.Tensor, world: int, dim: int) -> torch.Tensor:
    """``x [..., S, ..., K]`` -> ``[M, K]`` in rank-major row order for sequence dimension ``dim``
    (a copy unless the dimensions before ``dim`` have size 1). ``S`` must be divisible by ``world``."""
    return x.unflatten(dim, (world, x.shape[dim] // world)).movedim(dim, 0).reshape(-1, x.shape[-1])
