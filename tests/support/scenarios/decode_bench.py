"""Rank functions for the decode benchmark's tests (``tests/cpu/test_bench_decode.py``)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from tileweave.bench import decode
from tileweave.bench.timing import DistAgreement


def refused_baseline_check(rank: int, world: int) -> list[dict]:
    """``run_case`` on a one-row case with a baseline that raises on every rank before its collective
    (as torch's scaled matmul refuses a shape), one that runs, and tileweave's stand-in raising: the
    records as every rank returns them."""
    group = dist.group.WORLD
    agree = DistAgreement(group, torch.device("cpu"))
    opts = decode.Options(out=Path("."), smoke=True)
    x = torch.full((1, 4), float(rank + 1))
    reference = (x * sum(range(1, world + 1)) / (rank + 1),)

    def run(row):
        return (row(x),)

    case = decode.Case(section="gemm_ar", name="toy", m=1, run=run, reference=reference, dtype="fp8-blockwise")

    def summed(t):
        out = t.clone()
        dist.all_reduce(out, group=group)
        return out

    def refused(t):
        raise RuntimeError("CUDA error: CUBLAS_STATUS_NOT_SUPPORTED when calling `cublasLtMatmulAlgoGetHeuristic`")

    rows = {"torch": refused, "nccl": summed, "tileweave": refused}
    return [decode.run_case(case, variant, row, opts, agree, None, 1e-6) for variant, row in rows.items()]
