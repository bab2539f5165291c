"""A rank whose first launch of a kernel takes longer than the host's bound on a wait for a peer, as a
cold Triton compile on a GPU can: emulated in the interpreter (which compiles nothing) by a sleep at the
first launch of each named kernel, at the interpreter's launch entry (``support.launches``' seam)."""

from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist
import triton
from triton.runtime.interpreter import InterpretedFunction

import tileweave
from support.launches import TRITON_VERSIONS


@contextlib.contextmanager
def slow_first_launches(seconds: float, kernels: set[str]):
    """Within the block, the first launch of each kernel named in ``kernels`` sleeps ``seconds``
    before it runs; later launches run at once."""
    if ".".join(triton.__version__.split(".")[:2]) not in TRITON_VERSIONS:
        raise RuntimeError(f"support.slow_compile wraps InterpretedFunction.run of Triton {TRITON_VERSIONS}, "
                           f"this is {triton.__version__}: check that it is still the launch entry")
    original = InterpretedFunction.run
    pending = set(kernels)

    def run(self, *args, grid, warmup, **kwargs):
        if not warmup and self.fn.__name__ in pending:
            pending.discard(self.fn.__name__)
            time.sleep(seconds)
        return original(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = run
    try:
        yield
    finally:
        InterpretedFunction.run = original


SLOW = {"fused_gemm_kernel", "grouped_gemm_kernel"}
"""The kernels rank 1 compiles slowly: the dense GEMM (the unfused dense paths' ``matmul`` on the CPU)
and the grouped GEMM (the MoE ops)."""


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double() - ref).norm() / ref.norm()).item()


def first_calls_check(rank: int, world: int, seconds: float) -> dict:
    """Each op's first call on its unfused path (its last collective comes before its GEMM, so nothing
    in the call itself waits for the slow rank's compile), then the next op's first call, whose
    agreement would wait for it. Rank 1 compiles slowly. Returns each call's error against float64
    references built here from the unsharded inputs, or what it raised."""
    g = torch.Generator().manual_seed(7)
    mc, k, n, e, topk = 4, 8, 8, 4, 2
    a = torch.randn(mc * world, k, generator=g)
    b = [torch.randn(k, n, generator=g) for _ in range(world)]
    x = torch.randn(mc * world, k, generator=g)
    ids = torch.randint(0, e, (mc * world, topk), generator=g)
    w0 = [torch.randn(e, k, n, generator=g) for _ in range(world)]
    mine = slice(rank * mc, (rank + 1) * mc)
    results = {}
    context = slow_first_launches(seconds, SLOW) if rank == 1 else contextlib.nullcontext()
    with context:
        try:
            ag = tileweave.AllGatherGemm(policy="fallback")(a[mine], b[rank])
            results["all_gather_gemm"] = _rel(ag, a.double() @ b[rank].double())
            rs = tileweave.GemmReduceScatter(policy="fallback")(a[:, :k], b[rank])
            results["gemm_reduce_scatter"] = _rel(rs, sum(a.double() @ bp.double() for bp in b)[mine])
            plan = tileweave.moe_plan(ids[mine], num_experts=e)
            y = tileweave.MoEAllGatherGemm(policy="fallback")(x[mine], w0[rank], plan)
            ref = torch.stack([x[t].double() @ w0[rank][ids[t, j]].double()
                               for t in range(mc * world) for j in range(topk)])
            order = plan.pair_row.flatten().long()
            results["moe_all_gather_gemm"] = _rel(y[order], ref)
            again = tileweave.moe_plan(ids[mine], num_experts=e)  # the next agreement
            results["moe_plan"] = float(not torch.equal(again.offsets, plan.offsets))
        except tileweave.TileweaveError as exc:
            results["raised"] = f"{type(exc).__name__}: {exc}"
    dist.barrier()
    return results
