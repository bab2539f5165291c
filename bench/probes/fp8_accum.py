"""What FP8 accumulation precision costs, ours against torch's, on one GPU.

Run by hand: ``PYTHONPATH=src python3 bench/probes/fp8_accum.py OUT``. For a few GEMM suite shapes,
tensorwise and rowwise: ``tileweave.matmul`` and ``torch._scaled_mm``, each with ``use_fast_accum``
False (each K step's product summed in fp32) and True (the tensor cores accumulate across K steps);
tensorwise also ``use_fast_accum=False`` on two other tile configs (``EXACT_CONFIGS``); blockwise: ours
(the default config, and 128 x 128 tiles with warp specialisation) against
``torch.nn.functional.scaled_mm``. Times in ms (CUDA events, median of 5 batches of 20 calls, bf16
output); ``err``: relative error of a float32 output against float64 of the dequantised inputs (torch's
where it takes a float32 output). Writes ``OUT/fp8_accum.json`` and prints a table."""
import json
import os
import statistics
import sys

import torch

import tileweave
from tileweave.bench.fp8 import quantize_rows, quantize_weight, torch_scaled_mm
from tileweave.tune.configs import GemmConfig

SHAPES = ((4096, 3072, 4096), (8192, 7168, 8192), (8192, 8192, 14336), (8192, 4096, 512))
WS = GemmConfig(block_m=128, block_n=128, block_k=128, num_stages=4, num_warps=8, warp_specialize=True)
# use_fast_accum=False on other tiles than the default's: 128 x 128 (more programs, shorter MMA per stall)
# and 128 x 256 with warp specialisation (whether a waiting warp group leaves the MMA to the other)
EXACT_CONFIGS = {"mid": GemmConfig(block_m=128, block_n=128, block_k=128, num_stages=4, num_warps=8),
                 "big_ws": GemmConfig(block_m=128, block_n=256, block_k=128, group_m=16, num_stages=3, num_warps=8,
                                      warp_specialize=True)}


def _ms(fn) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 20)
    return statistics.median(times)


def _err(got, ref) -> float:
    return ((got.double() - ref).norm() / ref.norm()).item()


def main() -> None:
    out_dir = sys.argv[1]
    rows = []
    for m, n, k in SHAPES:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        for scaling in ("tensorwise", "rowwise", "blockwise"):
            a8, sa, a_deq = quantize_rows(x, scaling)
            w8, sb, w_deq = quantize_weight(w, scaling)
            ref = a_deq.double() @ w_deq.double().t()
            theirs, _ = torch_scaled_mm(scaling)
            row = {"m": m, "n": n, "k": k, "scaling": scaling}
            modes = (False, True) if scaling != "blockwise" else (False,)
            for fast in modes:
                tag = "fast" if fast else "exact"
                row[f"ours_{tag}_ms"] = _ms(lambda: tileweave.matmul(a8, w8.t(), scale_a=sa, scale_b=sb,
                                                                     use_fast_accum=fast))
                row[f"ours_{tag}_err"] = _err(tileweave.matmul(a8, w8.t(), scale_a=sa, scale_b=sb,
                                                               out_dtype=torch.float32, use_fast_accum=fast), ref)
                if scaling != "blockwise":
                    call = lambda: torch._scaled_mm(a8, w8.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16,
                                                    use_fast_accum=fast)
                    row[f"torch_{tag}_ms"] = _ms(call)
                    try:
                        row[f"torch_{tag}_err"] = _err(torch._scaled_mm(
                            a8, w8.t(), scale_a=sa, scale_b=sb, out_dtype=torch.float32, use_fast_accum=fast), ref)
                    except RuntimeError:
                        row[f"torch_{tag}_err"] = None
            if scaling == "tensorwise":
                for name, config in EXACT_CONFIGS.items():
                    row[f"ours_exact_{name}_ms"] = _ms(lambda: tileweave.matmul(a8, w8.t(), scale_a=sa, scale_b=sb,
                                                                                config=config))
            if scaling == "blockwise":
                row["ours_ws_ms"] = _ms(lambda: tileweave.matmul(a8, w8.t(), scale_a=sa, scale_b=sb, config=WS))
                row["ours_ws_err"] = _err(tileweave.matmul(a8, w8.t(), scale_a=sa, scale_b=sb, config=WS,
                                                           out_dtype=torch.float32), ref)
                if theirs is not None:
                    row["torch_exact_ms"] = _ms(lambda: theirs(a8, w8.t(), sa, sb))
            rows.append(row)
            print(json.dumps({key: round(v, 6) if isinstance(v, float) else v for key, v in row.items()}),
                  flush=True)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "fp8_accum.json"), "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(0), "commit": os.environ.get("TILEWEAVE_GIT_COMMIT"),
                   "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
