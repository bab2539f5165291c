"""The MoE pair and ``TPMoE`` in FP8 on real GPUs (one rank per GPU, or two sharing one): layer 0 (plain and
with the SwiGLU epilogue) and layer 1 with tensorwise, rowwise and blockwise scales against float64 of
the dequantized operands (``support.scenarios.fp8_moe``), bad FP8 arguments refused by name on every
rank; ``TPMoE(fp8=...)``'s forward and backward checked one cast and one GEMM at a time, in bfloat16 and
float32. Skipped without CUDA GPUs.

The layer is checked as the TP decoder's FP8 GPU tests check it (``support.fp8_moe_capture``), not by its
output and gradients against float64 of the same quantized math: on a GPU layer 0's output differs
from float64 of its operands by about 1e-4 (Hopper's FP8 MMA keeps fewer bits than fp32 inside one K
step), which moves some of ``h``, and in the backward of ``dy``, across a float8 rounding boundary, a
whole e4m3 step of 6-12%, and those flips compound through the layer (0.4-0.5% on the output, up to
1.7% on the input gradient, on one H200). So each cast must equal torch's own cast of the tensor the
GPU produced, bit for bit (the weight gradients' operands: torch's cast along each expert's tokens of
the gathered float8 rows dequantized, or of the SwiGLU backward's outputs; ``h``, which layer 0's
epilogue casts from float32 values it never writes: the reference cast of values within float32's room
of the SwiGLU of its pre-activations, ``support.fp8_moe_hcast``); each weight operand torch's
quantization of the checkpoint; each float8 GEMM, the weight gradients too, float64 of its own operands
within the tensor cores' bound; the SwiGLU's backward float64 of its own inputs within float32's. The
output and every gradient are compared with the exact (unquantized) layer, within
``END_TO_END_FACTOR`` times the quantization's own effect (its docstring: the derivation), which a wrong
scale or layout exceeds several times over. One run per case feeds the tests of a kind (``layer_run``),
each test one property.
"""

import dataclasses
import functools

import pytest

from gpus import RANKS, needs_two, one_gpu_per_rank
from support.moe_layer_scenarios import LayerCase
from support.scenarios import fp8_moe as scenarios
from support.scenarios import fp8_moe_layer as layer_scenarios
from tileweave.testing.emulated import run_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu]
TOL = {"float32": 3e-4, "float16": 2e-3, "bfloat16": 1e-2}
PATHS = {"fused": ("fused", "chunked"), "fallback": ("fallback", "fallback")}

# (scaling, tokens per rank, hidden, F_loc, experts, top-k, out dtype, swiglu, policy, straggler, delay_s)
PAIR_CASES = [
    ("tensorwise", 300, 256, 384, 8, 2, "bfloat16", True, "fused", 1, 0.05),
    ("rowwise", 257, 512, 200, 16, 4, "float32", False, "fused", -1, 0.0),
    ("blockwise", 130, 512, 256, 8, 2, "bfloat16", True, "fused", 0, 0.05),
    ("blockwise", 64, 256, 128, 4, 2, "float32", False, "fallback", -1, 0.0),
    ("rowwise", 96, 256, 136, 8, 8, "float16", True, "fallback", -1, 0.0),
]


@needs_two
def test_fp8_moe_pair_gpu():
    for rows in run_ranks(RANKS, scenarios.fp8_moe_pair_check, PAIR_CASES, 2, gpus=True, timeout_s=600):
        for row in rows:
            case = row["case"]
            tol = TOL[case[6]]
            assert row["err0"] < tol and row["err1"] < tol, row
            if case[7]:
                assert row["err_pre"] < tol, row
            assert (row["path0"], row["path1"]) == PATHS[case[8]], row
            assert row["gathered_exact"], row


@needs_two
def test_fp8_moe_bad_arguments_gpu():
    outcomes = run_ranks(RANKS, scenarios.fp8_moe_errors_check, gpus=True, timeout_s=300)
    assert all(o == outcomes[0] for o in outcomes)
    for name in ("no scales", "scale_a shape", "scale_b dtype", "blockwise K", "scale_a shape, one rank"):
        for layer in ("layer 0", "layer 1"):
            assert outcomes[0][f"{layer}: {name}"] != "no error", (layer, name)
    assert outcomes[0]["after"] == "ok"


LAYER_CASES = {
    "tensorwise-bf16": ("tensorwise", LayerCase(tokens=512, hidden=256, ffn=512, experts=8, top_k=2, dtype="bfloat16",
                                                steps=2, straggler=1)),
    "rowwise-bf16-regather": ("rowwise", LayerCase(tokens=256, hidden=256, ffn=384, experts=16, top_k=4,
                                                   dtype="bfloat16", save_gathered=False)),
    "blockwise-bf16": ("blockwise", LayerCase(tokens=384, hidden=256, ffn=512, experts=8, top_k=2, dtype="bfloat16")),
    "blockwise-fp32-fallback": ("blockwise", LayerCase(tokens=256, hidden=128, ffn=256, experts=4, top_k=2,
                                                       policy="fallback")),
}


@functools.cache
def layer_run(name: str) -> list[dict]:
    recipe, case = LAYER_CASES[name]
    case = dataclasses.replace(case, tokens=case.tokens // 2 * RANKS)  # the cases' token counts are for 2 ranks
    return run_ranks(RANKS, layer_scenarios.tp_moe_fp8_check, recipe, case, gpus=True, timeout_s=600)


@needs_two
@pytest.mark.parametrize("name", list(LAYER_CASES))
def test_tp_moe_fp8_gpu_casts_weights_and_operands_are_torchs_bit_for_bit(name):
    """Every cast and weight operand torch's, bit for bit (h's within the room of
    ``support.fp8_moe_hcast``); every operand the tensor it must be (the gathered rows, the SwiGLU
    backward's and the weight gradients' inputs, the plan); the layer's output and weight gradients
    those of the captured GEMMs; each step ran each GEMM once."""
    _, case = LAYER_CASES[name]
    for result in layer_run(name):
        assert result["gap"] > 0.5, result["gap"]
        assert result["expected"], result["calls"]
        assert result["casts"] == [] and result["weights"] == [] and result["operands"] == [], result
        assert result["links"] == [], result["links"]
        assert result["dtypes"] == [result["dtype"]], result
        if case.policy == "fallback":
            assert result["paths"] == ("fallback", "fallback"), result["paths"]


@needs_two
@pytest.mark.parametrize("name", list(LAYER_CASES))
def test_tp_moe_fp8_gpu_gemms_match_float64_of_their_operands(name):
    """The four float8 GEMMs (and layer 0's pre-activations and SwiGLU output) and the two float8 weight
    gradients within the bound that leaves room for Hopper's FP8 MMA inside one K step
    (``fp8_checks.MMA_UNIT``: about 1e-3 of the terms' magnitudes, per 128 of K where a GEMM accumulates
    fast; a weight gradient's K step is 128 of an expert's rows), not float32's."""
    for result in layer_run(name):
        assert result["gemm_mma"] <= 1 and result["wgrad_mma"] <= 1, result


@needs_two
@pytest.mark.parametrize("name", list(LAYER_CASES))
def test_tp_moe_fp8_gpu_swiglu_backward_matches_float64_of_its_inputs(name):
    """Within float32's bound: the SwiGLU's backward is elementwise float32 math."""
    for result in layer_run(name):
        assert result["swiglu_grad"] <= 1, result


@needs_two
@pytest.mark.parametrize("name", list(LAYER_CASES))
def test_tp_moe_fp8_gpu_within_the_quantization_effect_of_the_exact_layer(name):
    """The output and every gradient within ``END_TO_END_FACTOR`` times the distance of the float64
    reference of the same quantized math from the exact layer (``effect``); ``quantized`` (the distance
    from that reference) is reported, not bounded: it is where float8 rounding flips show."""
    for result in layer_run(name):
        for key, e in result["end_to_end"].items():
            assert e["effect"] < layer_scenarios.EFFECT_MAX, (key, e)
            assert e["exact"] <= layer_scenarios.END_TO_END_FACTOR * e["effect"], (key, e)


@needs_two
@one_gpu_per_rank("NCCL")
def test_moe_benchmark_fp8_rows_verify_and_time_ours_and_torch(tmp_path):
    import json

    from tileweave.bench import moe

    assert moe.main(["--models", "qwen3-30b-a3b", "--tokens", str(1024 * RANKS), "--routing", "uniform",
                     "--parts", "layer0,layer1", "--variants", "ours", "--dtype", "fp8",
                     "--scaling", "tensorwise,rowwise,blockwise", "--warmup-s", "0.1", "--nproc", str(RANKS),
                     "--out", str(tmp_path), "--tag", "g"]) == 0
    (report,) = tmp_path.glob("g_moe_*.json")
    rows = json.loads(report.read_text())["measurements"]
    seen = {(r["layer"].split()[1], r["dtype"], r["variant"]) for r in rows}
    for part in ("layer0", "layer1"):
        assert (part, "fp8-blockwise", "ours") in seen and (part, "bf16", "ours") in seen, seen
        for scaling in ("tensorwise", "rowwise"):
            assert {(part, f"fp8-{scaling}", "ours"), (part, f"fp8-{scaling}", "torch")} <= seen, seen
    for r in rows:
        assert r["status"] == "ok" and r["ms"] > 0, r
