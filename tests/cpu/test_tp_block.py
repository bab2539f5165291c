"""The TP transformer block on emulated ranks against the unsharded block in float64: output, input
gradient, every parameter gradient; fused and Megatron-style (fallback) paths."""

import pytest

from support import scenarios
from tileweave.testing.emulated import run_ranks


@pytest.mark.parametrize("world, policy, heads, kv_heads", [(2, "fused", 4, 2), (2, "fallback", 4, 2),
                                                           (4, "fused", 8, 4)])
def test_block_forward_and_gradients(world, policy, heads, kv_heads):
    for result in run_ranks(world, scenarios.tp_block_check, 2, 16, policy, heads, kv_heads):
        paths = result.pop("paths")
        # The fused policy's reduce-scatter runs its default transport, the chunked one.
        assert paths == {"fused": "fused,chunked", "fallback": "fallback,fallback"}[policy], paths
        for key, err in result.items():
            assert err < 1e-5, (key, result)


def test_block_benchmark_variants_compute_the_block():
    # The benchmark's NCCL-style reference and tileweave's variant, each against float64; the floor
    # runs the same shapes; the layers get their own ops back afterwards.
    for result in run_ranks(2, scenarios.block_bench_variants_check, 1, 32):
        for key in ("base_y", "base_dx", "ours_y", "ours_dx", "ours_check"):
            assert result[key] < 1e-5, (key, result)
        assert result["ours_path"] == "ag fused, rs chunked", result
        assert result["floor_shape"] and result["restored"], result


@pytest.mark.parametrize("world, heads, kv_heads", [(2, 4, 2), (3, 6, 3)])
def test_block_loads_a_transformers_llama_layer(world, heads, kv_heads):
    # A Llama decoder layer of transformers in float64 is the reference: its state dict loads by its
    # own names (rotate-half query and key rows), the outputs agree, full_state_dict gives it back, and
    # a wrong shape or an unknown tensor is refused by name.
    for result in run_ranks(world, scenarios.block_hf_layer_check, 2, 6, heads, kv_heads):
        assert result["y"] < 1e-5 and result["round_trip"] == 0 and result["names"], result
        assert "'mlp.up_proj.weight' must have shape" in result["bad_shape"], result
        assert "mlp.bias" in result["extra"], result


@pytest.mark.parametrize("world, batch", [(2, 3), (3, 2)])
def test_layers_and_block_take_sequence_sharded_inputs(world, batch):
    # [B, S/W, H] in, the positions [r*S/W, (r+1)*S/W) of every sequence: the TP linears (and their
    # replicated form on [B, S, H]) and the block, forward and backward, against float64.
    for result in run_ranks(world, scenarios.seq_sharded_check, batch, 4 * world):
        for key, err in result.items():
            assert err < 1e-5, (key, result)
