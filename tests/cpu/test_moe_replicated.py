"""``TPMoE.replicated``, the MoE layer's decode mode (every rank holds all tokens, experts sharded on F,
a local plan, an all-reduce of the partials), on emulated ranks against a float64 reference written in
``support.moe_replicated_scenarios``: uneven and empty experts, k = 1 and k >= 2, odd token counts,
fresh weights and tokens per call, the fused residual + norm form, the same bits on every rank."""

import pytest

from support.moe_replicated_scenarios import replicated_check, replicated_errors_check
from tileweave.testing.emulated import run_ranks


@pytest.mark.parametrize("world, experts, top_k, count, hidden, ffn, empty, normalize", [
    (2, 5, 2, 7, 24, 32, 2, True),    # two experts never chosen, uneven counts on the rest
    (3, 4, 1, 5, 16, 24, 1, False),   # k = 1, weights not renormalised (else all 1)
    (3, 6, 3, 3, 16, 12, 0, True),    # k = 3, F_loc = 4
])
def test_replicated_mode_matches_float64_reference(world, experts, top_k, count, hidden, ffn, empty, normalize):
    results = run_ranks(world, replicated_check, experts, top_k, count, hidden, ffn, empty, normalize, 2)
    for r in results:
        assert min(r["gaps"]) > 1e-4, r  # the routing is far from a tie, so fp32 routes as float64 does
        assert max(r["errors"]) < 1e-5 and max(r["norm_errors"]) < 1e-5, r
        assert r["same"], r
        assert r["paths"] and None not in r["paths"], r
        for counts in r["counts"]:
            assert sum(counts) == count * top_k
            if empty:
                assert counts[-empty:] == [0] * empty, counts
            assert len(set(c for c in counts if c)) > 1 or top_k == experts, counts  # uneven
    assert results[0]["errors"] == results[-1]["errors"]


def test_replicated_mode_refuses_bad_tokens_on_every_rank():
    results = run_ranks(2, replicated_errors_check)
    for r in results:
        assert r["error"] is not None and "TPMoE.replicated: x must be [T, hidden=16]" in r["error"], r
        assert "rank 1" in r["error"], r
