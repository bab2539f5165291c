"""The MoE pair ops on emulated ranks (W CPU processes sharing a symmetric heap, the real kernels in
Triton's interpreter, a concurrent copy-engine thread) against float64 references of the unsharded
problem (``support.moe_reference``)."""

import pytest

from support import moe_scenarios
from tileweave.testing.emulated import run_ranks

C = moe_scenarios.MoECase
TOL = {"float16": 2e-3, "float32": 1e-5}
EXPECTED = {"fused": ("fused", "chunked"), "fallback": ("fallback", "fallback")}
"""The paths each policy takes at W > 1: layer 0, layer 1 (its overlapped path is the chunked one)."""


def _check(rows_per_rank, cases, world):
    for rows in rows_per_rank:
        assert len(rows) == sum(case.iters for case in cases)
        for row in rows:
            case = row["case"]
            paths = ("local", "local") if world == 1 else EXPECTED[case["policy"]]
            assert (row["path0"], row["path1"]) == paths, row
            assert row["plan_ok"], row
            assert row["err0"] < TOL[case["dtype"]], row
            assert row["err1"] < TOL[case["dtype"]], row
            assert row["gathered_exact"], row
            repeated = case["repeat"] and row["it"] == case["iters"] - 1
            assert (row["repeat0"], row["repeat1"]) == ((True, True) if repeated else (None, None)), row


# Few launches: each costs about a second in the interpreter. Spread over the three group sizes:
# random routing, every token to one expert, an expert with no tokens; k 1, 2, 6, 8; E 1, 8, 64; T
# not a multiple of any tile; a straggling copy engine; back-to-back calls with fresh routing; both
# paths; fp16 and fp32; both weight layouts.
@pytest.mark.parametrize("world,cases", [
    (1, [C(6, 32, 16, 8, 2, iters=1)]),                                         # a group of one: no communication
    (2, [C(12, 32, 16, 4, 2, straggler=1, delay_s=0.2, repeat=True,            # random, back to back, late rank,
           unweighted=True),                                                    # weights None on the last call
         C(3, 32, 24, 64, 2, dtype="float32", linear_layout=False, policy="fallback", iters=1,
           unweighted=True)]),                                                  # E = 64, weights None
    (3, [C(5, 32, 16, 1, 1, routing="one_expert", iters=1),                    # E = 1, k = 1, T = 15
         C(2, 32, 48, 8, 8, dtype="float32", iters=1, repeat=True)]),           # k = 8: every expert
    (4, [C(3, 32, 16, 8, 6, routing="skip_expert", straggler=0, delay_s=0.2)]),  # k = 6, expert 0 empty
])
def test_moe_pair(world, cases):
    _check(run_ranks(world, moe_scenarios.pair_check, cases), cases, world)


def test_bad_inputs():
    for result in run_ranks(2, moe_scenarios.bad_inputs):
        assert set(result["errors"]) == set(moe_scenarios.BAD_INPUT_ERRORS)
        for name, (kind, text) in moe_scenarios.BAD_INPUT_ERRORS.items():
            got = result["errors"][name]
            assert got is not None, f"{name}: nothing raised"
            assert got[0] == kind and text in got[1], (name, got)
        assert result["after_ok"]


def test_lost_peer_raises():
    # Rank 1's shard comes 3 s late; rank 0's tiles of it poll 200 times at most, then report it.
    results = run_ranks(2, moe_scenarios.gate_timeout_check, 1, 3.0, 200)
    assert results[0] is not None and results[0].startswith("CollectiveTimeout"), results
    assert "the shard of rank 1" in results[0], results
    assert results[1] is None, results  # rank 0's shard was on time
