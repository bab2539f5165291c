"""The fused transports of GEMM + AllReduce (placeholder: they run the unfused path until they land)."""

from __future__ import annotations

from tileweave.ops.all_reduce import nccl


class FusedTransport:
    def __init__(self, backend, *, graphable: bool, max_spin: int | None) -> None:
        self.backend = backend

    def prepare(self, path, m, n, dtype, norm) -> None:
        pass

    def run(self, path, a, b, bias, residual, norm_weight, eps, y, resid) -> None:
        nccl.run(self.backend, a, b, bias, residual, norm_weight, eps, y, resid)
