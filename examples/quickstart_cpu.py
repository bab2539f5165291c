"""tileweave on the CPU, two emulated ranks: python examples/quickstart_cpu.py"""
import torch
import torch.distributed as dist

import tileweave
from tileweave.testing.emulated import run_ranks


def rank_main(rank: int, world: int) -> float:
    group = dist.group.WORLD
    torch.manual_seed(0)                                   # the same full tensors on every rank
    a = torch.randn(64, 32)                                # M x K, sharded by rows below
    w = torch.randn(48, 32)                                # an nn.Linear weight [N, K]
    a_shard = a.chunk(world)[rank]                         # [M/W, K]
    w_col = w.chunk(world)[rank]                           # [N/W, K]
    y = tileweave.all_gather_gemm(a_shard, w_col.t(), group)          # [M, N/W]
    ref = a @ w_col.t()
    return float((y - ref).norm() / ref.norm())


if __name__ == "__main__":
    print(run_ranks(2, rank_main))                         # relative errors, one per rank
