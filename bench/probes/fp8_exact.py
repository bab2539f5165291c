"""The exact and blockwise FP8 GEMMs (each K step's product summed in fp32) on the Hopper kernels
(``tileweave.ops.compute.fp8_sm90.kernel_of``): the loader-warp kernel (exact's default), the plain one
(blockwise's default), the two-half kernel (two MMA warp groups, each its half of a tile) and, in
blockwise, the same with each step's scales staged in shared memory by its loader warp, against torch's
scaled matmuls, on the TP block's large GEMMs and some of the ``gemm`` suite's smaller ones. Every
output checked against float64 first. Run by hand from this folder:
``PYTHONPATH=../../src python3 fp8_exact.py OUT [small] [blockwise]``."""
import json
import sys

import torch

from fp8_accum import _err, _ms
from fp8_sm90 import _hopper, _inputs
from tileweave.bench.fp8 import torch_scaled_mm

SHAPES = ((8192, 57344, 8192), (8192, 8192, 57344), (57344, 8192, 8192), (8192, 8192, 28672), (8192, 8192, 8192),
          (4096, 4096, 4096), (4096, 3072, 4096), (8192, 768, 4096), (8192, 4096, 512), (16384, 1536, 8192))
BASE = {"BM": 128, "BN": 128, "BK": 128, "GROUP_M": 8, "num_warps": 8}
LOADER = dict(BASE, maxnreg=168, kernel="loader")
HALVES = dict(BASE, num_warps=4, kernel="halves")
VARIANTS = {  # scaling: {name: (fast accumulation, config)}
    "tensorwise": {"loader_s5": (False, dict(LOADER, STAGES=5)), "halves_s4": (False, dict(HALVES, STAGES=4))},
    "blockwise": {"plain_s5": (False, dict(BASE, STAGES=5)), "halves_s4": (False, dict(HALVES, STAGES=4)),
                  "staged_s4": (False, dict(HALVES, STAGES=4, kernel="staged")),
                  "staged_s5": (False, dict(HALVES, STAGES=5, kernel="staged"))},
}


def main(out, shapes=SHAPES, scalings=("tensorwise", "blockwise")):
    rows = []
    for m, n, k in shapes:
        for scaling in scalings:
            a8, sa, w8, sb, ref = _inputs(m, n, k, scaling)
            row = {"m": m, "n": n, "k": k, "scaling": scaling}
            for name, (fast, config) in VARIANTS[scaling].items():
                try:
                    got = _hopper(a8, w8, sa, sb, fast, config=config)
                    row[f"{name}_err"] = _err(got.float(), ref)
                    row[f"{name}_ms"] = _ms(lambda: _hopper(a8, w8, sa, sb, fast, config=config))
                except Exception as e:  # a variant that fails to compile or launch: recorded
                    row[f"{name}_error"] = repr(e)[:300]
            if scaling == "tensorwise":
                for fast in (False, ):
                    call = lambda: torch._scaled_mm(a8, w8.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16,
                                                    use_fast_accum=fast)
                    row[f"torch_{'fast' if fast else 'exact'}_err"] = _err(call().float(), ref)
                    row[f"torch_{'fast' if fast else 'exact'}_ms"] = _ms(call)
            else:
                theirs, _ = torch_scaled_mm(scaling)
                if theirs is not None:
                    row["torch_block_err"] = _err(theirs(a8, w8.t(), sa, sb).float(), ref)
                    row["torch_block_ms"] = _ms(lambda: theirs(a8, w8.t(), sa, sb))
            rows.append(row)
            print(f"{m}x{n}x{k} {scaling}: " + "  ".join(
                f"{key[:-3]} {v:.3f}" for key, v in row.items() if key.endswith("_ms")), flush=True)
            errs = {key[:-4]: f"{v:.1e}" for key, v in row.items() if key.endswith("_err")}
            print(f"    errors {errs}" + "".join(f"\n    {key}: {v}" for key, v in row.items()
                                                 if key.endswith("_error")), flush=True)
            del a8, w8, ref
            torch.cuda.empty_cache()
    with open(f"{out}/fp8_exact.json", "w") as fh:
        json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    # "small": the shapes below 2^38 multiply-adds only; "blockwise": that scaling only
    small, block = "small" in sys.argv[2:], "blockwise" in sys.argv[2:]
    main(sys.argv[1], [s for s in SHAPES if not small or s[0] * s[1] * s[2] < 1 << 38],
         ("blockwise", ) if block else ("tensorwise", "blockwise"))
