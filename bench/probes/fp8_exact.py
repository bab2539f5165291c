"""Why the exact FP8 GEMM (each K step's product summed in fp32) trails torch's on large shapes: the
Hopper kernel's exact mode on 128 x 128 tiles next to its fast mode on the same tiles (what the tile
alone costs), the warp-specialised exact and blockwise kernel (a loader warp; ``maxnreg`` caps the
registers), and torch's scaled matmuls, on the TP block's large GEMMs. Every output checked against
float64 first. Run by hand from this folder: ``PYTHONPATH=../../src python3 fp8_exact.py OUT``."""
import json
import sys

import torch

from fp8_accum import _err, _ms
from fp8_sm90 import _hopper, _inputs
from tileweave.bench.fp8 import torch_scaled_mm

SHAPES = ((8192, 57344, 8192), (8192, 8192, 57344), (57344, 8192, 8192), (8192, 8192, 28672), (8192, 8192, 8192),
          (4096, 4096, 4096))
BASE = {"BM": 128, "BN": 128, "BK": 128, "GROUP_M": 8, "num_warps": 8}
VARIANTS = {  # name: (fast accumulation, config)
    "exact_s5": (False, dict(BASE, STAGES=5)),
    "fast128_s5": (True, dict(BASE, STAGES=5)),
    "fast256_s3": (True, dict(BASE, BN=256, STAGES=3)),
    "ws_exact_s4": (False, dict(BASE, STAGES=4, maxnreg=168)),
    "ws_exact_s5": (False, dict(BASE, STAGES=5, maxnreg=168)),
    "ws_exact_s6": (False, dict(BASE, STAGES=6, maxnreg=168)),
}


def main(out):
    rows = []
    for m, n, k in SHAPES:
        for scaling in ("tensorwise", "blockwise"):
            a8, sa, w8, sb, ref = _inputs(m, n, k, scaling)
            row = {"m": m, "n": n, "k": k, "scaling": scaling}
            variants = VARIANTS if scaling == "tensorwise" else {
                "block_s5": (False, dict(BASE, STAGES=5)), "ws_block_s5": (False, dict(BASE, STAGES=5, maxnreg=168)),
                "ws_block_s4": (False, dict(BASE, STAGES=4, maxnreg=168))}
            for name, (fast, config) in variants.items():
                try:
                    got = _hopper(a8, w8, sa, sb, fast, config=config)
                    row[f"{name}_err"] = _err(got.float(), ref)
                    row[f"{name}_ms"] = _ms(lambda: _hopper(a8, w8, sa, sb, fast, config=config))
                except Exception as e:  # a variant that fails to compile or launch: recorded
                    row[f"{name}_error"] = repr(e)[:300]
            if scaling == "tensorwise":
                for fast in (False, True):
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
    main(sys.argv[1])
