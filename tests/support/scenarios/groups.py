"""Several TP groups in one world: each group's fused ops against float64 of its own data, while the
other groups run theirs at the same time."""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

import tileweave
from support.scenarios.common import device_name, randn, rel_err


def _check_group(group: dist.ProcessGroup, tag: str, m_chunk: int, k: int, n: int, iters: int) -> dict:
    """AllGather+GEMM then GEMM+ReduceScatter on ``group``, ``iters`` calls with fresh inputs seeded by
    ``tag`` (every member rebuilds every member's shards): the largest relative error of each op."""
    device, rank, world = device_name(), dist.get_rank(group), dist.get_world_size(group)
    errors = {"ag": 0.0, "rs": 0.0}
    for it in range(iters):
        a_full = randn((m_chunk * world, k), torch.float32, tag, "a", it, device=device)
        w_full = randn((n * world, k), torch.float32, tag, "w", it, device=device)
        y = tileweave.all_gather_gemm(a_full.chunk(world)[rank], w_full.chunk(world)[rank].t(), group)
        ref = a_full.double() @ w_full.chunk(world)[rank].double().t()
        errors["ag"] = max(errors["ag"], rel_err(y, ref))
        # The reduce-scatter sums over the group: its rows are this group's data only.
        h_full = randn((m_chunk * world, n * world), torch.float32, tag, "h", it, device=device)
        z = tileweave.gemm_reduce_scatter(h_full.chunk(world, dim=1)[rank].contiguous(),
                                          w_full.chunk(world)[rank].contiguous(), group)
        ref = (h_full.double() @ w_full.double()).chunk(world)[rank]
        errors["rs"] = max(errors["rs"], rel_err(z, ref))
    return errors


def two_groups_check(rank: int, world: int, m_chunk: int, k: int, n: int, iters: int) -> dict:
    """The world split into groups of two consecutive ranks (as a ``(dp, tp)`` mesh makes its tp groups),
    every group running the same ops at once on different data; then, in the same processes, the whole
    world as one group (a process in two groups keeps their buffers apart), then the pairs again."""
    pairs = [dist.new_group([r, r + 1]) for r in range(0, world, 2)]  # collective: every rank makes every group
    mine = pairs[rank // 2]
    result = {"pair": _check_group(mine, f"pair{rank // 2}", m_chunk, k, n, iters)}
    result["world"] = _check_group(dist.group.WORLD, "world", m_chunk, k, n, iters)
    result["pair_again"] = _check_group(mine, f"pair{rank // 2}-again", m_chunk, k, n, iters)
    return result


def across_hosts_check(rank: int, world: int, m_chunk: int, k: int, n: int) -> dict:
    """With the world on two emulated hosts: the pairs within a host take the fused paths; the world
    group, across hosts, runs every op on its NCCL path, correctly, with one warning (rank 0, at the
    group's first call only)."""
    pairs = [dist.new_group([r, r + 1]) for r in range(0, world, 2)]
    result = {"pair": _check_group(pairs[rank // 2], "host-pair", m_chunk, k, n, 1)}
    result["pair_paths"] = f"{tileweave.last_path('all_gather_gemm')} {tileweave.last_path('gemm_reduce_scatter')}"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result["world"] = _check_group(dist.group.WORLD, "hosts", m_chunk, k, n, 2)
        result["world_paths"] = (f"{tileweave.last_path('all_gather_gemm')} "
                                 f"{tileweave.last_path('gemm_reduce_scatter')}")
        a = randn((m_chunk * world, k * world), torch.float32, "ar-a")
        b = randn((k * world, n), torch.float32, "ar-b")
        rows = slice(rank * k, (rank + 1) * k)
        y = tileweave.gemm_all_reduce(a[:, rows].contiguous(), b[rows].contiguous(), dist.group.WORLD)
        result["all_reduce"] = {"ar": rel_err(y, a.double() @ b.double())}
        result["all_reduce_path"] = tileweave.last_path("gemm_all_reduce")
    result["warnings"] = [str(w.message) for w in caught if "tileweave" in str(w.message)]
    return result
