"""tileweave on GPUs: torchrun --nproc-per-node 2 examples/quickstart_gpu.py"""
import os

import torch
import torch.distributed as dist

import tileweave
from tileweave.nn import ColumnParallelLinear, RowParallelLinear

rank = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(rank)
dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
group, world = dist.group.WORLD, dist.get_world_size()
torch.manual_seed(0)                                   # the same full tensors on every rank
m, k, n = 8192, 4096, 14336
x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
w_up = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
w_down = torch.randn(k, n, device="cuda", dtype=torch.bfloat16) / n ** 0.5

# The ops: AllGather+GEMM (column-parallel input), GEMM+ReduceScatter (row-parallel output).
x_shard = x.chunk(world)[rank]                                                  # [M/W, K]
h = tileweave.all_gather_gemm(x_shard, w_up.chunk(world)[rank].t(), group)      # [M, N/W]
y_shard = tileweave.gemm_reduce_scatter(h, w_down.chunk(world, dim=1)[rank].t(), group)  # [M/W, K]
ref = ((x.float() @ w_up.float().t()).to(torch.bfloat16).float() @ w_down.float().t()).chunk(world)[rank]
print(f"rank {rank}: MLP relative error {float((y_shard.float() - ref).norm() / ref.norm()):.2e}, "
      f"paths {tileweave.last_path('all_gather_gemm')} / {tileweave.last_path('gemm_reduce_scatter')}")

# The same as sequence-parallel layers, forward and backward on the fused ops.
up = ColumnParallelLinear(k, n, bias=False, group=group, device="cuda", dtype=torch.bfloat16)
down = RowParallelLinear(n, k, bias=False, group=group, device="cuda", dtype=torch.bfloat16)
up.load_full_state_dict({"weight": w_up})
down.load_full_state_dict({"weight": w_down})
x_shard = x_shard.clone().requires_grad_()
down(up(x_shard)).float().square().mean().backward()
print(f"rank {rank}: grad norms {x_shard.grad.norm():.3f} {up.weight.grad.norm():.3f}")
dist.destroy_process_group()
