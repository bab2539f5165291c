"""The TP transformer block on emulated ranks against the unsharded block in float64: output, input
gradient, every parameter gradient; fused and Megatron-style (fallback) paths."""

import pytest

from tileweave.testing import scenarios
from tileweave.testing.emulated import run_ranks


@pytest.mark.parametrize("policy", ["fused", "fallback"])
def test_block_forward_and_gradients(policy):
    for result in run_ranks(2, scenarios.tp_block_check, 2, 16, policy):
        paths = result.pop("paths")
        assert paths == f"{policy},{policy}", paths
        for key, err in result.items():
            assert err < 1e-5, (key, result)
