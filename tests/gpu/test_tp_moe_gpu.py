"""The TP MoE layer on real GPUs (one rank per GPU, or two sharing one) against the unsharded float64 MoE: output, input
gradient and every parameter gradient, fused and fallback paths, bf16 and fp16, Mixtral-like and
many-expert shapes. Skipped without CUDA GPUs."""

import dataclasses

import pytest

from gpus import RANKS, needs_two, one_gpu_per_rank
from tileweave.testing.emulated import run_ranks
from support.moe_layer_scenarios import LayerCase, tp_moe_check

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu]
needs_own_gpus = one_gpu_per_rank("NCCL")
TOL = {"bfloat16": 1e-2, "float16": 2e-3, "float32": 1e-5}

CASES = {
    "uniform-k2-bf16": LayerCase(tokens=512, hidden=256, ffn=512, experts=8, top_k=2, dtype="bfloat16", steps=2),
    "skewed-k1-fp16": LayerCase(tokens=256, hidden=128, ffn=256, experts=16, top_k=1, routing="skewed",
                                dtype="float16", normalize_topk=False),
    "empty-k6-bf16-regather": LayerCase(tokens=384, hidden=128, ffn=256, experts=64, top_k=6, routing="empty",
                                        empty_experts=8, dtype="bfloat16", save_gathered=False),
    "k8-fp16-fallback": LayerCase(tokens=256, hidden=128, ffn=256, experts=8, top_k=8, dtype="float16",
                                  policy="fallback"),
    "straggler-fp32": LayerCase(tokens=128, hidden=64, ffn=128, experts=4, top_k=2, dtype="float32", straggler=1),
}


@needs_two
@pytest.mark.parametrize("name", list(CASES))
def test_tp_moe_gpu_matches_float64_reference(name):
    case = CASES[name]
    case = dataclasses.replace(case, tokens=case.tokens // 2 * RANKS)  # the cases' token counts are for 2 ranks
    for rank, result in enumerate(run_ranks(RANKS, tp_moe_check, case, gpus=True)):
        assert result["gap"] > 0.5, result["gap"]
        for step, errors in enumerate(result["steps"]):
            for key, err in errors.items():
                assert err < TOL[case.dtype], (name, rank, step, key, errors)
        assert result["round_trip"]
        assert result["paths"][0] in ("fused", "chunked", "fallback"), result["paths"]
        if case.policy == "fallback":
            assert result["paths"] == ("fallback", "fallback"), result["paths"]


@needs_two
@needs_own_gpus
def test_moe_benchmark_verifies_and_times_every_variant(tmp_path):
    # One small row of every part: each variant verified against float64 on the GPUs, then timed.
    import json

    from tileweave.bench import moe

    assert moe.main(["--models", "qwen3-30b-a3b", "--tokens", str(1024 * RANKS), "--routing", "zipf",
                     "--warmup-s", "0.1", "--nproc", str(RANKS), "--out", str(tmp_path), "--tag", "g"]) == 0
    (report,) = tmp_path.glob("g_moe_*.json")
    rows = json.loads(report.read_text())["measurements"]
    assert len(rows) == sum(len(moe.part_variants(part)) for part in moe.PARTS)
    for r in rows:
        assert r["status"] == "ok" and r["ms"] > 0 and r["mem_peak_mb"] is not None, r
