"""GEMM + AllReduce on emulated ranks against float64 references (tileweave.testing.decode_scenarios)."""

import pytest

from tileweave.testing import decode_scenarios as scenarios
from tileweave.testing.decode_scenarios import DecodeCase as C
from tileweave.testing.emulated import run_ranks


def _check(per_rank):
    """Every call within its tolerance, and bitwise the same outputs on every rank."""
    for rows in per_rank:
        for row in rows:
            assert row["err"] < row["tol"], row
            assert row["out_is_y"], row
    for rows in per_rank[1:]:
        assert [row["sums"] for row in rows] == [row["sums"] for row in per_rank[0]]


def test_fallback_path():
    cases = [C(m=5, k=24, n=40, policy="fallback", bias=True),
             C(m=7, k=24, n=40, policy="fallback", residual=True, norm=True, dtype="float32"),
             C(m=3, k=8, n=16, policy="fallback", residual=True, weight_layout=False),
             C(m=3, k=8, n=16, policy="auto", dtype="bfloat16", residual=True, norm=True)]
    per_rank = run_ranks(2, scenarios.all_reduce_check, cases)
    _check(per_rank)
    assert {row["path"] for row in per_rank[0]} == {"fallback"}
