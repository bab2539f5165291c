"""The GEMM core's tile configurations on one GPU, next to cuBLAS: per local GEMM of the suite, the
default choice, whole tiles of two sizes and stream-K of two sizes. For choosing the thresholds of
``tileweave.tune.configs`` from measurements (the ``gemm`` bench section times the default only).

    python3 scripts/gemm_probe.py [--out DIR] [--m 1024,2048,...] [--below 0.95]

``--shapes 1024x768x4096,...`` times those instead; ``--narrow`` adds small-tile and warp-specialised
variants. ``--below`` keeps the shapes whose default ran under that ratio to cuBLAS in the last ``gemm`` section
given with ``--previous`` (all shapes without it). Prints one line per shape, writes JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

import tileweave  # noqa: E402
from tileweave.bench.suite import gemm_shapes, parse_ints  # noqa: E402
from tileweave.tune.autotune import time_ms  # noqa: E402
from tileweave.tune.configs import GemmConfig, choose_gemm_config  # noqa: E402

VARIANTS = {
    "dp128x256": GemmConfig(),
    "dp128x128": GemmConfig(block_n=128, num_stages=4),
    "sk128x128": GemmConfig(block_n=128, num_stages=4, stream_k=True),
    "sk128x256": GemmConfig(stream_k=True),
}
NARROW_VARIANTS = {
    "dp64x128": GemmConfig(block_m=64, block_n=128, num_stages=4, num_warps=4),
    "dp128x64": GemmConfig(block_n=64, num_stages=4, num_warps=4),
    "dp64x64": GemmConfig(block_m=64, block_n=64, num_stages=4, num_warps=4),
    "ws128x128": GemmConfig(block_n=128, num_stages=4, warp_specialize=True),
    "sk64x128": GemmConfig(block_m=64, block_n=128, num_stages=4, num_warps=4, stream_k=True),
}


def _host_us(fn, calls=50) -> float:
    # The host's time to issue one call (no sync inside), as the benchmark's host column.
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t0) / calls * 1e6
    torch.cuda.synchronize()
    return host


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=".")
    parser.add_argument("--m", default="1024,2048,4096,8192,16384")
    parser.add_argument("--previous", default=None, help="a gemm section JSON to select shapes from")
    parser.add_argument("--below", type=float, default=2.0)
    parser.add_argument("--shapes", default=None, help="MxNxK comma list instead of the suite's")
    parser.add_argument("--narrow", action="store_true", help="also small-tile and warp-specialised variants")
    args = parser.parse_args()
    variants = {**VARIANTS, **(NARROW_VARIANTS if args.narrow else {})}
    device = torch.device("cuda", 0)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    shapes = gemm_shapes(m_values=parse_ints(args.m, name="--m"))
    if args.shapes:
        from tileweave.bench.suite import GemmShape

        shapes = [GemmShape(**dict(zip("mnk", map(int, t.split("x")))), sources=("given",))
                  for t in args.shapes.split(",")]
    if args.previous:
        prev = {(s["m"], s["n"], s["k"]): s.get("x_cublas") for s in json.load(open(args.previous))["shapes"]}
        shapes = [s for s in shapes if (prev.get((s.m, s.n, s.k)) or 0) < args.below]
    g = torch.Generator(device=device).manual_seed(7)
    rows = []
    for s in shapes:
        a = torch.randn(s.m, s.k, device=device, dtype=torch.bfloat16, generator=g)
        w = torch.randn(s.n, s.k, device=device, dtype=torch.bfloat16, generator=g) / s.k ** 0.5
        ref = torch.matmul(a, w.t())
        row = {"m": s.m, "n": s.n, "k": s.k, "layer": s.sources[0],
               "default": choose_gemm_config(s.m, s.n, s.k, torch.bfloat16, num_sms=sms).key()}
        row["cublas"] = time_ms(lambda: torch.matmul(a, w.t()), device, warmup=10, iters=20, reps=7)
        for name, config in [("default", None), *variants.items()]:
            try:
                out = tileweave.matmul(a, w.t(), config=config)
                err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                if not err < 1e-2:
                    row[name] = f"wrong ({err:.2e})"
                    continue
                row[name] = time_ms(lambda: tileweave.matmul(a, w.t(), config=config), device,
                                    warmup=10, iters=20, reps=7)
                if name == "default":
                    row["host_us"] = _host_us(lambda: tileweave.matmul(a, w.t()))
            except Exception as e:  # noqa: BLE001 - a config that cannot run here is reported, not fatal
                row[name] = f"error: {type(e).__name__}: {str(e)[:80]}"
        rows.append(row)
        ratios = " ".join(f"{n}={row['cublas'] / row[n]:.2f}" if isinstance(row[n], float) else f"{n}={row[n]}"
                          for n in ["default", *variants])
        print(f"{s.m:6d}x{s.n:6d}x{s.k:6d} cublas {row['cublas'] * 1e3:8.1f} us host {row.get('host_us', 0):5.1f} us "
              f"{ratios}", flush=True)
    with open(os.path.join(args.out, "gemm_probe.json"), "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(device), "commit": os.environ.get("TILEWEAVE_GIT_COMMIT"),
                   "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
