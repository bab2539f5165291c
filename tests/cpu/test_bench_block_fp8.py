"""The block section's FP8 rows (``tileweave.bench.block_fp8``) on emulated ranks, at world size 1 and 2,
on small fp32 blocks: each FP8 row is recorded with its dtype label, every FP8 variant is verified
against the float32 run of the same quantized math and passes, and the check catches a wrong variant."""

import pytest

from support.scenarios import block_bench_fp8 as scenarios
from tileweave.testing.emulated import run_ranks

# (widths, M tokens, scalings): blockwise needs every local feature count a multiple of 128.
CASES = {
    1: (dict(hidden=128, heads=8, kv_heads=4, ffn=128), 16, ("blockwise",)),
    2: (dict(hidden=64, heads=4, kv_heads=2, ffn=128), 16, ("tensorwise",)),
}


@pytest.mark.parametrize("world", [1, 2])
def test_block_fp8_rows_are_verified_beside_the_bf16_rows(world):
    widths, m, scalings = CASES[world]
    for result in run_ranks(world, scenarios.block_fp8_rows_check, widths, m, scalings):
        rows = {(r["dtype"] if "dtype" in r else "bf16", r["variant"]): r for r in result["rows"]}
        labels = [f"fp8-{s}" for s in scalings]
        assert sorted(rows) == sorted([("bf16", v) for v in ("torch", "base", "ours")]
                                      + [(d, v) for d in labels for v in ("torch", "ours")]), sorted(rows)
        # PyTorch async-TP and torch's blockwise scaled matmul run on CUDA devices only.
        assert rows["bf16", "torch"]["status"] == "n/a" and "CUDA" in rows["bf16", "torch"]["note"]
        for (dtype, variant), r in rows.items():
            if (dtype, variant) == ("bf16", "torch"):
                continue
            if (dtype, variant) == ("fp8-blockwise", "torch"):
                assert r["status"] == "n/a" and "CUDA" in r["note"], r
                continue
            assert r["status"] == "ok" and r["rel_err"] is not None and r["rel_err"] < r["tolerance"], r
            assert r["k"] == widths["hidden"] and r["n"] == widths["ffn"] and r["world_size"] == world, r
        tol = result["tolerance"]
        assert result["good"] < tol, result
        assert result["perturbed"] > tol and result["wrong_wgrad"] > tol, result
