"""Between torch's placements and the fused ops' row order: which dimension a placement shards here;
the row orders themselves (``from_rank_major``, ``to_rank_major``) in ``tileweave.nn.shards``."""

from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from tileweave.nn.shards import from_rank_major, to_rank_major

__all__ = ["from_rank_major", "is_replicate", "shard_dim", "to_rank_major"]


def shard_dim(placement: Placement, ndim: int) -> int | None:
    """The dimension a ``Shard`` placement splits, counted from 0 for a tensor of ``ndim`` dimensions;
    None for other placements."""
    if not isinstance(placement, Shard):
        return None
    return placement.dim % ndim if -ndim <= placement.dim < ndim else None


def is_replicate(placement: Placement) -> bool:
    return isinstance(placement, Replicate)
