"""The MoE pair ops on real GPUs against float64 references (bf16 and fp16). Skipped without CUDA GPUs;
with ``TILEWEAVE_GPU_RANKS=2`` on one GPU the ranks share it (``tileweave.testing.shared_gpu``)."""

import pytest

from gpus import RANKS, needs_two, one_gpu_per_rank
from support import moe_scenarios
from tileweave.testing.emulated import run_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu]
needs_own_gpus = one_gpu_per_rank("NCCL")
C = moe_scenarios.MoECase
TOL = {"bfloat16": 1e-2, "float16": 2e-3, "float32": 1e-5}
EXPECTED = {"fused": ("fused", "chunked"), "fallback": ("fallback", "fallback")}

CASES = [
    C(256, 512, 256, 8, 2, dtype="bfloat16", iters=3, repeat=True),                   # random, back to back
    C(100, 256, 128, 64, 6, dtype="float16", linear_layout=False, repeat=True,        # T not a tile multiple,
      unweighted=True),                                                               # weights None last
    C(96, 256, 192, 1, 1, dtype="bfloat16", routing="one_expert"),                    # E = 1, k = 1
    C(64, 256, 128, 64, 8, dtype="bfloat16", routing="skip_expert"),                  # k = 8, empty experts
    C(128, 256, 128, 8, 2, dtype="bfloat16", routing="one_expert"),                   # every pair to one expert
    C(128, 512, 128, 8, 2, dtype="float16", straggler=1, delay_s=0.05, iters=3),     # a late copy engine
]


@needs_two
@pytest.mark.parametrize("policy", ["fused", "fallback"])
def test_moe_pair_gpu(policy):
    cases = [C(**{**case.__dict__, "policy": policy}) for case in CASES]
    for rows in run_ranks(RANKS, moe_scenarios.pair_check, cases, gpus=True, timeout_s=300):
        assert len(rows) == sum(case.iters for case in cases)
        for row in rows:
            case = row["case"]
            assert (row["path0"], row["path1"]) == EXPECTED[policy], row
            assert row["plan_ok"] and row["gathered_exact"], row
            assert row["err0"] < TOL[case["dtype"]] and row["err1"] < TOL[case["dtype"]], row
            if case["repeat"] and row["it"] == case["iters"] - 1:
                assert row["repeat0"] and row["repeat1"], row


@needs_two
@needs_own_gpus
@pytest.mark.parametrize("policy", ["fused", "fallback"])
def test_moe_no_host_sync_gpu(policy):
    for result in run_ranks(RANKS, moe_scenarios.no_host_sync_check, policy, gpus=True, timeout_s=300):
        assert (result["path0"], result["path1"]) == EXPECTED[policy], result
        assert result["err0"] < TOL["bfloat16"] and result["finite1"], result


@needs_two
@needs_own_gpus
def test_moe_pair_captures_in_a_cuda_graph_on_its_fallback_gpu():
    for result in run_ranks(RANKS, moe_scenarios.graph_capture_check, gpus=True, timeout_s=300):
        assert result["paths"] == ("fallback", "fallback"), result
        assert result["err0"] < TOL["bfloat16"] and result["finite1"], result
        assert result["refused"] is not None and "cannot be captured" in result["refused"], result


@needs_two
def test_moe_bad_inputs_gpu():
    for result in run_ranks(RANKS, moe_scenarios.bad_inputs, gpus=True, timeout_s=300):
        for name, (kind, text) in moe_scenarios.BAD_INPUT_ERRORS.items():
            got = result["errors"][name]
            assert got is not None and got[0] == kind and text in got[1], (name, got)
        assert result["after_ok"]
