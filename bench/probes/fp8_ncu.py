"""Where the blockwise FP8 GEMM's time goes on Hopper, read by Nsight Compute: the same shape through
our exact and blockwise kernels and torch's blockwise scaled matmul, each output checked against
float64 of the dequantised inputs first, then one call of each inside the NVTX range ``prof`` (the
range ``ncu --nvtx --nvtx-include prof/`` profiles; the checks and warm-up stay outside it).

Run by hand on a GPU machine, from this folder::

    ncu --clock-control none --nvtx --nvtx-include "prof/" --set detailed --section SourceCounters \\
        -o OUT/fp8 python3 fp8_ncu.py [M N K]

then ``ncu -i OUT/fp8.ncu-rep --page details`` for the sections (tensor pipe, issue slots, warp
stalls), and the kernel names, grids and register counts of torch's kernel beside ours."""
import sys

import torch

from fp8_accum import _err
from fp8_sm90 import _hopper, _inputs
from tileweave.bench.fp8 import torch_scaled_mm

BASE = {"BM": 128, "BN": 128, "BK": 128, "GROUP_M": 8}
VARIANTS = {  # name: (scaling, config)
    "exact_loader": ("tensorwise", dict(BASE, STAGES=5, num_warps=8, maxnreg=168, kernel="loader")),
    "exact_halves": ("tensorwise", dict(BASE, STAGES=4, num_warps=4, kernel="halves")),
    "block_halves": ("blockwise", dict(BASE, STAGES=4, num_warps=4, kernel="halves")),
    "block_plain": ("blockwise", dict(BASE, STAGES=5, num_warps=8, kernel="plain")),
    "block_staged": ("blockwise", dict(BASE, STAGES=5, num_warps=4, kernel="staged")),
}


def main(m: int, n: int, k: int) -> None:
    inputs = {s: _inputs(m, n, k, s) for s in ("tensorwise", "blockwise")}
    calls = {}
    for name, (scaling, config) in VARIANTS.items():
        a8, sa, w8, sb, ref = inputs[scaling]
        calls[name] = (lambda a8=a8, w8=w8, sa=sa, sb=sb, config=config:
                       _hopper(a8, w8, sa, sb, False, config=config))
    theirs, why = torch_scaled_mm("blockwise")
    a8, sa, w8, sb, ref = inputs["blockwise"]
    if theirs is not None:
        calls["block_torch"] = lambda: theirs(a8, w8.t(), sa, sb)
    else:
        print(f"torch blockwise: {why}")
    for name, call in calls.items():
        scaling = "blockwise" if name.startswith("block") else "tensorwise"
        err = _err(call().float(), inputs[scaling][4])
        print(f"{m}x{n}x{k} {name}: error {err:.1e}", flush=True)
        assert err < 1e-2, f"{name}: error {err}"
        for _ in range(20):
            call()
    torch.cuda.synchronize()
    for name, call in calls.items():
        torch.cuda.nvtx.range_push("prof")
        call()
        torch.cuda.nvtx.range_pop()
        print(f"profiled {name}", flush=True)
    torch.cuda.synchronize()


if __name__ == "__main__":
    shape = [int(v) for v in sys.argv[1:4]] if len(sys.argv) >= 4 else [8192, 8192, 8192]
    main(*shape)
