"""CUDA-graph capture of the ops and the layers (GPUs only)."""

from __future__ import annotations


import torch
import torch.distributed as dist

import tileweave
from tileweave.ops.compute import gemm_launch
from tileweave.nn import ColumnParallelLinear, RowParallelLinear
from support.scenarios.common import device_name, randn, rel_err, shared_ops_graphable


def captured(call, refill):
    """``(graph, what call returned)``: two eager calls on a side stream first, each after ``refill()``
    of its inputs (a shape's first call agrees on it with the other ranks, compiles kernels and sizes
    workspaces, none of which a graph can hold), then ``call`` captured in a CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            refill()
            call()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = call()
    return graph, result


def cuda_graph_unfused_gpu_check(rank: int, world: int, m_chunk: int = 512, k: int = 1024, n: int = 768) -> dict:
    """Both ops on the unfused path captured in one CUDA graph after an eager warm-up, replayed on
    fresh inputs copied into the captured buffers; each replay against float64."""
    device = device_name()
    ag, rs = tileweave.AllGatherGemm(policy="fallback"), tileweave.GemmReduceScatter(policy="fallback")
    x_ag = torch.empty((m_chunk, k), dtype=torch.bfloat16, device=device)
    x_rs = torch.empty((m_chunk * world, k), dtype=torch.bfloat16, device=device)
    w_ag = randn((n, k), torch.bfloat16, "cg-w1", rank, device=device) / k ** 0.5
    w_rs = randn((n, k), torch.bfloat16, "cg-w2", rank, device=device) / k ** 0.5
    graph, (y, z) = captured(lambda: (ag(x_ag, w_ag.t()), rs(x_rs, w_rs.t())),
                              lambda: (x_ag.normal_(), x_rs.normal_()))
    errors = []
    for it in range(3):
        shards = [randn((m_chunk, k), torch.bfloat16, "cg-xa", it, p, device=device) for p in range(world)]
        rows = [randn((m_chunk * world, k), torch.bfloat16, "cg-xr", it, p, device=device) for p in range(world)]
        weights = [randn((n, k), torch.bfloat16, "cg-w2", p, device=device) / k ** 0.5 for p in range(world)]
        x_ag.copy_(shards[rank])
        x_rs.copy_(rows[rank])
        graph.replay()
        torch.cuda.synchronize()
        ref_ag = torch.cat(shards).double() @ w_ag.double().t()
        ref_rs = sum(x.double() @ w.double().t() for x, w in zip(rows, weights))
        errors.append(max(rel_err(y, ref_ag), rel_err(z, ref_rs[rank * m_chunk:(rank + 1) * m_chunk])))
    return {"err": max(errors), "paths": tileweave.last_path("all_gather_gemm") + "," + tileweave.last_path("gemm_reduce_scatter")}


def cuda_graph_fused_gpu_check(rank: int, world: int, kind: str, m_chunk: int = 1024, k: int = 2048,
                               n: int = 1536, stream_k: bool | None = None) -> dict:
    """A graphable op on its fused path (``kind``: "ag-mesh", "ag-ring", "ag-chunked" or "rs-chunked")
    captured in a CUDA graph after eager warm-up calls, replayed on fresh inputs copied into the captured
    buffer: checked after each replay, after replays back to back without a host sync, and in an eager
    call on the same op after them (the 0/1 flags must be back where every call starts). ``stream_k``:
    AllGather+GEMM's option; the result says whether a launch took the stream-K tail."""
    device = device_name()
    dtype = torch.bfloat16
    op_name, transport = kind.split("-")
    rows = m_chunk if op_name == "ag" else m_chunk * world
    if op_name == "ag":
        op = tileweave.AllGatherGemm(policy="fused", transport=transport, graphable=True, stream_k=stream_k)
    else:
        op = tileweave.GemmReduceScatter(policy="fused", transport=transport, graphable=True)
    gemm_launch._fused_plans.clear()
    weights = [randn((n, k), dtype, "gf-w", p, device=device) / k ** 0.5 for p in range(world)]
    w = weights[rank]
    x = torch.empty((rows, k), dtype=dtype, device=device)
    graph, y = captured(lambda: op(x, w.t()), x.normal_)
    path = tileweave.last_path(op.op_name)

    def inputs(it):
        return [randn((rows, k), dtype, "gf-x", it, p, device=device) for p in range(world)]

    def ref(parts):
        if op_name == "ag":
            return torch.cat(parts).double() @ w.double().t()
        total = sum(part.double() @ wp.double().t() for part, wp in zip(parts, weights))
        return total[rank * m_chunk:(rank + 1) * m_chunk]

    errors = []
    for it in range(3):
        parts = inputs(it)
        x.copy_(parts[rank])
        y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        errors.append(rel_err(y, ref(parts)))
    parts = inputs(99)
    x.copy_(parts[rank])
    for _ in range(6):  # back to back: each replay waits on the flags the previous one left
        graph.replay()
    torch.cuda.synchronize()
    errors.append(rel_err(y, ref(parts)))
    parts = inputs(100)
    eager = op(parts[rank], w.t())
    torch.cuda.synchronize()
    errors.append(rel_err(eager, ref(parts)))
    dist.barrier()
    tail = any(plan.stream_k is not None for plan in gemm_launch._fused_plans.values())
    return {"err": max(errors), "errors": errors, "path": path, "stream_k": tail}


def tp_mlp_graph_gpu_check(rank: int, world: int, tokens: int = 4096, hidden: int = 2048, ffn: int = 8192) -> dict:
    """Run with ``TILEWEAVE_GRAPHABLE=1``: a sequence-parallel MLP's forward (inference, bf16) captured
    in a CUDA graph on the ops the TP layers share, replayed on fresh inputs, against float64. At these
    sizes ``auto`` takes both chunked transports (AllGather+GEMM at 69 GFLOP, GEMM+RS with K_loc 4096)."""
    device = device_name()
    dtype = torch.bfloat16
    full_up = {"weight": randn((ffn, hidden), torch.float32, "gm-up", device=device) / hidden ** 0.5,
               "bias": randn((ffn,), torch.float32, "gm-ub", device=device)}
    full_down = {"weight": randn((hidden, ffn), torch.float32, "gm-dn", device=device) / ffn ** 0.5,
                 "bias": randn((hidden,), torch.float32, "gm-db", device=device)}
    up = ColumnParallelLinear(hidden, ffn, device=device, dtype=dtype)
    down = RowParallelLinear(ffn, hidden, device=device, dtype=dtype)
    with torch.no_grad():
        up.load_full_state_dict(full_up)
        down.load_full_state_dict(full_down)
    rows = slice(rank * tokens // world, (rank + 1) * tokens // world)
    x = torch.empty((tokens // world, hidden), dtype=dtype, device=device)

    def forward():
        return down(torch.nn.functional.silu(up(x)))

    def reference(x_full):
        # The bf16 weights the layers hold, in float64.
        wu, bu = full_up["weight"].to(dtype).double(), full_up["bias"].to(dtype).double()
        wd, bd = full_down["weight"].to(dtype).double(), full_down["bias"].to(dtype).double()
        return (torch.nn.functional.silu(x_full.double() @ wu.t() + bu) @ wd.t() + bd)[rows]

    with torch.no_grad():
        graph, y = captured(forward, x.normal_)
        paths = tileweave.last_path("all_gather_gemm") + "," + tileweave.last_path("gemm_reduce_scatter")
        errors = []
        for it in range(3):
            x_full = randn((tokens, hidden), dtype, "gm-x", it, device=device)
            x.copy_(x_full[rows])
            graph.replay()
            torch.cuda.synchronize()
            errors.append(rel_err(y, reference(x_full)))
    dist.barrier()
    return {"err": max(errors), "paths": paths, "graphable": shared_ops_graphable()}
