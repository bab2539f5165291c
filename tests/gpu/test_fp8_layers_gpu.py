"""FP8 training in the TP linears and the transformer block on GPUs (compiled kernels), bf16 parameters,
activations and outputs: each recipe's forward output and input, weight and bias gradients against
float64 of the same quantized math (``support.fp8_reference``), at one rank and at two, shapes whose M
and N are off the GPU tiles; the block's four linears each on the tensors it received. Skipped without
a GPU with FP8 tensor cores; the two-rank tests without two GPUs (or TILEWEAVE_GPU_RANKS=2 on one).
Also which values each cast reads: every float8 operand of a step equal, element for element, to the
reference's cast of the documented values (``support.scenarios.fp8_operands``), in bf16."""

import pytest
import torch

from gpus import RANKS, needs_gpu, needs_two
from support.scenarios import fp8_layers as scenarios
from support.scenarios.fp8_operands import fp8_operands_check
from tileweave.testing.emulated import run_ranks

pytestmark = [pytest.mark.gpu, needs_gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9), reason="needs FP8 tensor cores")]
# bf16 outputs of exactly quantized operands: bf16's rounding, and Hopper's FP8 MMA within a K step.
TOL = 1e-2

# (layer, recipe, M tokens over the group, in_features, out_features, bias, save_gathered, steps[, producer])
ONE_RANK = [("column", "blockwise", 4000, 1024, 2048, True, True, 2), ("row", "rowwise", 4000, 1024, 1000, True, True, 2),
            ("column", "tensorwise", 4000, 1024, 1000, False, False, 1),
            ("column", "rowwise", 4000, 1024, 1000, False, False, 1, "norm"),  # an RMSNorm, the input regathered
            ("row", "blockwise", 4000, 1024, 1024, True, True, 1, "swiglu")]
TWO_RANKS = [("column", "tensorwise", 4096, 1024, 2000, True, True, 2), ("row", "tensorwise", 4096, 2048, 1000, True, True, 1),
             ("column", "rowwise", 4000, 1024, 2000, False, False, 2), ("row", "rowwise", 4000, 2048, 1000, True, True, 1),
             ("column", "blockwise", 4000, 1024, 2048, True, True, 2), ("row", "blockwise", 4000, 2048, 1024, True, True, 1)]


def _check(rows):
    for row in rows:
        names = ("y", "dx", "dw") + (("db",) if row["case"][5] else ())
        for name in names + (("dnorm",) if "norm" in row["case"] else ()):
            assert row[name] < TOL, (name, row)
        assert row["dtypes"] == ["torch.bfloat16"], row


def test_fp8_linears_one_rank_gpu():
    for rows in run_ranks(1, scenarios.fp8_linear_check, ONE_RANK, "bfloat16", gpus=True, timeout_s=300):
        _check(rows)


@needs_two
@pytest.mark.multigpu
def test_fp8_linears_gpu():
    for rows in run_ranks(RANKS, scenarios.fp8_linear_check, TWO_RANKS, "bfloat16", gpus=True, timeout_s=300):
        _check(rows)


@pytest.mark.parametrize("ranks", [1, 2])
def test_fp8_block_gpu(ranks):
    if ranks > RANKS:
        pytest.skip("needs two CUDA GPUs (or TILEWEAVE_GPU_RANKS=2 on one)")
    cases = [(recipe, 1024, 2, 1000) for recipe in ("tensorwise", "rowwise", "blockwise")]
    for rows in run_ranks(ranks, scenarios.fp8_block_check, cases, "bfloat16", gpus=True, timeout_s=300):
        for row in rows:
            for layer in ("qkv", "o", "gate_up", "down"):
                for key in ("y", "dx", "dw") + (("dnorm",) if layer in ("qkv", "gate_up") else ()):
                    assert row[f"{layer}_{key}"] < TOL, (layer, key, row)
            for key in ("y_exact", "dx_exact"):
                assert row[key] < 0.15, (key, row)


# (layer, recipe, M tokens over the group, in_features, out_features, save_gathered, producer): a fused norm
# with the input gathered again, whose weight gradient once cast the norm's bf16 output; no SwiGLU, whose
# float64 exponential may differ from the CPU's in a last bit (tests/gpu/test_fused_quantize_gpu.py)
OPERANDS = [("column", recipe, 4000, 1024, 2048, False, "norm") for recipe in ("tensorwise", "rowwise", "blockwise")]
OPERANDS += [("column", "rowwise", 4000, 1024, 1000, True, "norm"), ("row", "blockwise", 4000, 1024, 1024, True, None)]


@pytest.mark.parametrize("ranks", [1, 2])
def test_fp8_casts_read_the_documented_values_gpu(ranks):
    if ranks > RANKS:
        pytest.skip("needs two CUDA GPUs (or TILEWEAVE_GPU_RANKS=2 on one)")
    for rows in run_ranks(ranks, fp8_operands_check, OPERANDS, "bfloat16", gpus=True, timeout_s=300):
        for row in rows:
            assert row["gemms"] == ["forward", "dgrad", "wgrad"], row
            assert row["differ"] == [], row
