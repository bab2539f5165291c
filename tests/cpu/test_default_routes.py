"""The default (``policy="auto"``) route of every row of the benchmark suite at two and eight ranks, on
a GPU host (not the interpreter, which always fuses): pinned, so that a change to the ops' planning
that moves a row to another route fails here and must be measured first."""

import pytest
import torch

import tileweave
from tileweave.bench.suite import M_VALUES, SUITE_LAYERS, local_shapes
from tileweave.ops.all_gather import rule as all_gather
from tileweave.ops.reduce_scatter import rule as reduce_scatter
from tileweave.ops.reduce_scatter.blocks import blocks_for

# AG rows: "fallback" (NCCL + cuBLAS), "chunked" (cuBLAS per shard) or "mesh" (the fused kernel).
# RS rows: "fallback", or "pull/<blocks per owner>" (two ranks) / "chunked/<blocks per owner>".
EXPECTED = {
    (2, "llama3-8b qkv", 1024): "fallback",
    (2, "llama3-8b qkv", 2048): "chunked",
    (2, "llama3-8b qkv", 4096): "chunked",
    (2, "llama3-8b qkv", 8192): "chunked",
    (2, "llama3-8b qkv", 16384): "mesh",
    (2, "llama3-8b gate_up", 1024): "chunked",
    (2, "llama3-8b gate_up", 2048): "chunked",
    (2, "llama3-8b gate_up", 4096): "mesh",
    (2, "llama3-8b gate_up", 8192): "mesh",
    (2, "llama3-8b gate_up", 16384): "mesh",
    (2, "llama3-70b qkv", 1024): "chunked",
    (2, "llama3-70b qkv", 2048): "chunked",
    (2, "llama3-70b qkv", 4096): "chunked",
    (2, "llama3-70b qkv", 8192): "mesh",
    (2, "llama3-70b qkv", 16384): "mesh",
    (2, "llama3-70b gate_up", 1024): "mesh",
    (2, "llama3-70b gate_up", 2048): "mesh",
    (2, "llama3-70b gate_up", 4096): "mesh",
    (2, "llama3-70b gate_up", 8192): "mesh",
    (2, "llama3-70b gate_up", 16384): "mesh",
    (2, "gpt3-175b fc1", 1024): "mesh",
    (2, "gpt3-175b fc1", 2048): "mesh",
    (2, "gpt3-175b fc1", 4096): "mesh",
    (2, "gpt3-175b fc1", 8192): "mesh",
    (2, "gpt3-175b fc1", 16384): "mesh",
    (2, "llama3-8b o", 1024): "fallback",
    (2, "llama3-8b o", 2048): "fallback",
    (2, "llama3-8b o", 4096): "pull/1",
    (2, "llama3-8b o", 8192): "pull/1",
    (2, "llama3-8b o", 16384): "pull/2",
    (2, "llama3-8b down", 1024): "fallback",
    (2, "llama3-8b down", 2048): "pull/1",
    (2, "llama3-8b down", 4096): "pull/2",
    (2, "llama3-8b down", 8192): "pull/2",
    (2, "llama3-8b down", 16384): "pull/2",
    (2, "llama3-70b o", 1024): "fallback",
    (2, "llama3-70b o", 2048): "pull/1",
    (2, "llama3-70b o", 4096): "pull/2",
    (2, "llama3-70b o", 8192): "pull/2",
    (2, "llama3-70b o", 16384): "pull/2",
    (2, "llama3-70b down", 1024): "fallback",
    (2, "llama3-70b down", 2048): "pull/1",
    (2, "llama3-70b down", 4096): "pull/2",
    (2, "llama3-70b down", 8192): "pull/2",
    (2, "llama3-70b down", 16384): "pull/2",
    (2, "gpt3-175b fc2", 1024): "fallback",
    (2, "gpt3-175b fc2", 2048): "pull/1",
    (2, "gpt3-175b fc2", 4096): "pull/2",
    (2, "gpt3-175b fc2", 8192): "pull/2",
    (2, "gpt3-175b fc2", 16384): "pull/2",
    (8, "llama3-8b qkv", 1024): "fallback",
    (8, "llama3-8b qkv", 2048): "fallback",
    (8, "llama3-8b qkv", 4096): "fallback",
    (8, "llama3-8b qkv", 8192): "chunked",
    (8, "llama3-8b qkv", 16384): "chunked",
    (8, "llama3-8b gate_up", 1024): "fallback",
    (8, "llama3-8b gate_up", 2048): "chunked",
    (8, "llama3-8b gate_up", 4096): "chunked",
    (8, "llama3-8b gate_up", 8192): "chunked",
    (8, "llama3-8b gate_up", 16384): "mesh",
    (8, "llama3-70b qkv", 1024): "fallback",
    (8, "llama3-70b qkv", 2048): "chunked",
    (8, "llama3-70b qkv", 4096): "chunked",
    (8, "llama3-70b qkv", 8192): "chunked",
    (8, "llama3-70b qkv", 16384): "chunked",
    (8, "llama3-70b gate_up", 1024): "chunked",
    (8, "llama3-70b gate_up", 2048): "chunked",
    (8, "llama3-70b gate_up", 4096): "mesh",
    (8, "llama3-70b gate_up", 8192): "mesh",
    (8, "llama3-70b gate_up", 16384): "mesh",
    (8, "gpt3-175b fc1", 1024): "chunked",
    (8, "gpt3-175b fc1", 2048): "chunked",
    (8, "gpt3-175b fc1", 4096): "mesh",
    (8, "gpt3-175b fc1", 8192): "mesh",
    (8, "gpt3-175b fc1", 16384): "mesh",
    (8, "llama3-8b o", 1024): "fallback",
    (8, "llama3-8b o", 2048): "fallback",
    (8, "llama3-8b o", 4096): "fallback",
    (8, "llama3-8b o", 8192): "fallback",
    (8, "llama3-8b o", 16384): "fallback",
    (8, "llama3-8b down", 1024): "fallback",
    (8, "llama3-8b down", 2048): "fallback",
    (8, "llama3-8b down", 4096): "fallback",
    (8, "llama3-8b down", 8192): "fallback",
    (8, "llama3-8b down", 16384): "fallback",
    (8, "llama3-70b o", 1024): "fallback",
    (8, "llama3-70b o", 2048): "fallback",
    (8, "llama3-70b o", 4096): "fallback",
    (8, "llama3-70b o", 8192): "fallback",
    (8, "llama3-70b o", 16384): "fallback",
    (8, "llama3-70b down", 1024): "fallback",
    (8, "llama3-70b down", 2048): "fallback",
    (8, "llama3-70b down", 4096): "fallback",
    (8, "llama3-70b down", 8192): "fallback",
    (8, "llama3-70b down", 16384): "fallback",
    (8, "gpt3-175b fc2", 1024): "fallback",
    (8, "gpt3-175b fc2", 2048): "fallback",
    (8, "gpt3-175b fc2", 4096): "fallback",
    (8, "gpt3-175b fc2", 8192): "fallback",
    (8, "gpt3-175b fc2", 16384): "chunked/2",
}


def _route(kind: str, m: int, n: int, k: int, world: int) -> str:
    """The route the op takes for a local GEMM ``[m, k] @ [k, n]`` under the default settings (the
    functions the ops' planners call, with the default op's options)."""
    dtype = torch.bfloat16
    if kind == "AG":
        return all_gather.auto_route(m, n, k, world, dtype, transport=tileweave.AllGatherGemm.default_transport)
    route = reduce_scatter.auto_route(m, n, k, world, dtype, pull=True)  # an op pulls unless graphable
    if route == "fallback":
        return route
    return f"{route}/{blocks_for(m // world, k, n, pull=route == 'pull')}"


@pytest.mark.parametrize("world", [2, 8])
def test_suite_rows_keep_their_default_routes(world):
    got = {}
    for layer in SUITE_LAYERS:
        for m in M_VALUES:
            s = local_shapes(layer, m=m, world_size=world)
            got[(world, layer.name, m)] = _route(layer.kind, s.gemm_m, s.gemm_n, s.gemm_k, world)
    expected = {key: route for key, route in EXPECTED.items() if key[0] == world}
    assert got == expected
    # The table is not trivial: every route occurs at two ranks.
    if world == 2:
        assert {r.split("/")[0] for r in got.values()} == {"fallback", "chunked", "mesh", "pull"}
