"""``torch.compile`` of the fused ops on emulated or real ranks, checked against float64."""

from __future__ import annotations

import torch
import torch._dynamo
import torch.distributed as dist

import tileweave


def _randn(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float32)


def compile_check(rank: int, world: int) -> dict:
    """``torch.compile(fullgraph=True)`` of a column-parallel GEMM, ReLU and a row-parallel GEMM built
    from both fused ops: the graphs captured, the tileweave ops in them, and the compiled output's
    relative error against the same block computed in float64 from the unsharded inputs (every
    rank's shard of x and of both weights, made here from explicit seeds)."""
    tokens, hidden, ffn_loc, out_features = 16, 32, 24, 40
    shards = [_randn((tokens, hidden), 100 + p) for p in range(world)]
    w_col = [_randn((ffn_loc, hidden), 200 + p) for p in range(world)]  # rank p's rows of the up weight
    w_row = [_randn((out_features, ffn_loc), 300 + p) for p in range(world)]  # its columns of the down one
    group = dist.group.WORLD

    def block(x):
        h = tileweave.all_gather_gemm(x, w_col[rank].t(), group)
        return tileweave.gemm_reduce_scatter(torch.relu(h), w_row[rank].t(), group)

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(block, backend=backend, fullgraph=True)(shards[rank])
    nodes = [str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"]
    x = torch.cat(shards).double()
    full = sum(torch.relu(x @ wc.double().t()) @ wr.double().t() for wc, wr in zip(w_col, w_row))
    ref = full[rank * tokens:(rank + 1) * tokens]
    err = ((compiled.double() - ref).norm() / ref.norm()).item() if torch.isfinite(compiled).all() else float("inf")
    return {"graphs": len(graphs), "err": err, "shape": tuple(compiled.shape),
            "ops": sorted(n for n in nodes if "tileweave" in n)}
