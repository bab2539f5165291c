"""The FP8 GEMM at decode sizes (M = 1-256 tokens), where the weight read sets the time: ``default``, the
route of the tree it runs on (at 87b878f, run29: the Hopper kernel, 128-row tiles, one program per 128 x
128 output tile; since c2b28f8 up to 64 rows the stream-K tiles), the Triton kernel on narrow tiles with
the K steps of every tile dealt out over all SMs (stream-K), torch's scaled matmul, and bf16 cuBLAS on
the same weights. Every variant's output is checked against float64 of the dequantized operands first;
times are CUDA-graph replays of 20 calls (``fp8_sm90._graph_ms``). Run by hand from this folder:
``PYTHONPATH=../../src python3 decode_fp8_gemm.py OUT``."""
import json
import sys

import torch

import tileweave
from fp8_accum import _err  # the probes' error measure and graph timing (run from this folder)
from fp8_sm90 import _graph_ms
from tileweave.bench.fp8 import quantize_rows, quantize_weight, torch_scaled_mm
from tileweave.tune.configs import GemmConfig

SHAPES = {"llama3-8b o": (4096, 4096), "llama3-8b down": (4096, 14336), "llama3-70b o": (8192, 8192),
          "llama3-70b down": (8192, 28672)}
M_VALUES = (1, 8, 32, 64, 128, 256)
CONFIGS = {
    "sk64x128": GemmConfig(block_m=64, block_n=128, block_k=128, num_stages=4, num_warps=4, flatten=False,
                           stream_k=True),
    "sk64x64": GemmConfig(block_m=64, block_n=64, block_k=128, num_stages=6, num_warps=4, flatten=False,
                          stream_k=True),
    "sk16x64": GemmConfig(block_m=16, block_n=64, block_k=128, num_stages=6, num_warps=4, flatten=False,
                          stream_k=True),
}


def main(out):
    rows = []
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        for scaling in ("rowwise", "blockwise"):
            w8, sb, w_deq = quantize_weight(w, scaling)
            theirs, _ = torch_scaled_mm(scaling)
            for m in M_VALUES:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                a8, sa, a_deq = quantize_rows(x, scaling)
                ref = a_deq.double() @ w_deq.double().t()
                calls = {"default": lambda: tileweave.matmul(a8, w8.t(), scale_a=sa, scale_b=sb),
                         **{tag: (lambda cfg=cfg: tileweave.matmul(a8, w8.t(), scale_a=sa, scale_b=sb, config=cfg))
                            for tag, cfg in CONFIGS.items()},
                         "torch": lambda: theirs(a8, w8.t(), sa, sb),
                         "bf16_cublas": lambda: x @ w.t()}
                row = {"shape": name, "n": n, "k": k, "m": m, "scaling": scaling}
                for tag, call in calls.items():
                    try:
                        got = call()
                        if tag != "bf16_cublas":
                            row[f"{tag}_err"] = _err(got.float(), ref)
                        row[f"{tag}_ms"] = _graph_ms(call)
                    except Exception as e:  # noqa: BLE001 - a variant that does not run is recorded
                        row[f"{tag}_error"] = repr(e)[:200]
                rows.append(row)
                print(f"{name} M={m} {scaling}: " + "  ".join(
                    f"{key[:-3]} {v * 1000:.1f}" for key, v in row.items() if key.endswith("_ms")) + "  us; max err "
                    + f"{max((v for key, v in row.items() if key.endswith('_err')), default=0):.1e}", flush=True)
    with open(f"{out}/decode_fp8_gemm.json", "w") as fh:
        json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
