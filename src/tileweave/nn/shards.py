"""From a TP layer's shards back to the unsharded tensor."""

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
