"""Where the chunked reduce-scatter spends its time, on two GPUs: per shape, NCCL+cuBLAS, the blocked
GEMMs alone (no communication), the chunked transport at several block sizes, and a profile of the
GPU work by kernel name (the host's side: host_probe.py at 6325990); the library's blocks also with
the owner pulling into its output (``pull=True``, the default at two ranks; the other variants push).

    python3 bench/probes/rs_chunked_probe.py [--out DIR] [--shapes 4096x2048x4096,...]

Shapes are M x K_local x N (the suite's llama3-8b o-proj at M=4096 is 4096x2048x4096). The default
shapes: one suite row whose owners' rows are one block (llama3-8b o M=8192) and the four rows of two
blocks (M=4096 of llama3-8b down, llama3-70b o and down, gpt3-175b fc2).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "src"))

import tileweave  # noqa: E402
from tileweave.ops.reduce_scatter.blocks import chunk_rows_for  # noqa: E402
from tileweave.testing.emulated import run_ranks  # noqa: E402
from tileweave.tune.autotune import time_ms  # noqa: E402

SHAPES = [(8192, 2048, 4096), (4096, 7168, 4096), (4096, 4096, 8192), (4096, 14336, 8192), (4096, 24576, 12288)]
# -1: one block per owner; 0: the library's choice (chunk_rows_for; a pulling call takes at most
# PULL_MAX_BLOCKS of those blocks per owner, so its `gemm_blocks_0` GEMMs are not the pull's).
BLOCK_ROWS = [1024, 2048, -1, 0]


def _profile(fn, device, calls=5):
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize(device)
    rows = []
    for e in prof.key_averages():
        total = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if total:
            rows.append((e.key[:60], e.count // calls, round(total / calls, 1)))
    return sorted(rows, key=lambda r: -r[2])[:8]


def _rank(rank, world, shapes):
    device = torch.device("cuda", rank)
    g = torch.Generator(device=device).manual_seed(99 + rank)
    fallback = tileweave.GemmReduceScatter(policy="fallback")
    out = []
    for m, k, n in shapes:
        a = torch.randn(m, k, device=device, dtype=torch.bfloat16, generator=g)
        w = torch.randn(n, k, device=device, dtype=torch.bfloat16, generator=g) / k ** 0.5
        b = w.t()
        row = {"shape": [m, k, n]}
        row["gemm"] = time_ms(lambda: torch.matmul(a, b), device, warmup=10, iters=20, reps=5)
        row["fallback"] = time_ms(lambda: fallback(a, b), device, warmup=10, iters=20, reps=5)
        for rows in BLOCK_ROWS:
            br = m // world if rows == -1 else rows or chunk_rows_for(m // world, k, n)
            row[f"gemm_blocks_{rows}"] = time_ms(lambda: [torch.matmul(a[i:i + br], b) for i in range(0, m, br)],
                                                 device, warmup=10, iters=20, reps=5)
            # Pushing, then the same blocks with the owner pulling (GemmReduceScatter(pull=True)): into
            # its output, or with one block into a private buffer while the own GEMM runs, then an add.
            for label, pull in (("chunked", False), ("chunked_pull", True)):
                op = tileweave.GemmReduceScatter(policy="fused", transport="chunked", pull=pull)
                op.chunk_rows = rows and br
                op(a, b)
                torch.cuda.synchronize(device)
                dist.barrier()
                row[f"{label}_{rows}"] = time_ms(lambda: op(a, b), device, warmup=10, iters=20, reps=5)
                if rows == 0:
                    profile = _profile(lambda: op(a, b), device)  # every rank calls the op; rank 0 reports
                    if rank == 0:
                        row[f"profile_{label}"] = profile
        out.append(row)
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--shapes", default="")
    args = parser.parse_args()
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")] if args.shapes else SHAPES
    os.environ.setdefault("TILEWEAVE_TIMEOUT_S", "15")
    ranks = run_ranks(2, _rank, shapes, gpus=True, timeout_s=400)
    with open(os.path.join(args.out, "rs_chunked_probe.json"), "w") as f:
        json.dump(ranks, f, indent=1)
    for r0, r1 in zip(*ranks):
        print(f"{r0['shape']}")
        for key in r0:
            if key.startswith("profile") or key == "shape":
                continue
            print(f"  {key:22s} r0 {r0[key]:8.3f}  r1 {r1[key]:8.3f}")
        for label in ("chunked", "chunked_pull"):
            for name, count, us in r0.get(f"profile_{label}", []):
                print(f"  prof {label:12s} r0 {us:8.1f} us  x{count:<3d} {name}")


if __name__ == "__main__":
    main()
