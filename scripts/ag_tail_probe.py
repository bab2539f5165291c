"""AllGather+GEMM's fused kernel with and without its partial last wave shared by K steps
(``AllGatherGemm(stream_k=...)``, NOTES.md entry 61), on two GPUs, against cuBLAS on the gathered GEMM,
in interleaved rounds so that the clocks' drift under the power cap falls on every variant alike.

    python3 scripts/ag_tail_probe.py [--out DIR] [--shapes 4096x12288x24576,...] [--rounds 3]

Shapes are M x K x N_local (gathered rows, depth, this rank's columns). Writes ``ag_tail_probe.json``
and prints, per shape, each variant's median over rounds and the tail's ratio to whole tiles.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

import tileweave  # noqa: E402
from tileweave.testing.emulated import run_ranks  # noqa: E402
from tileweave.tune.autotune import time_ms  # noqa: E402

# The suite's rows on the fused kernel at TP=2 (gpt3-175b fc1, llama3-70b gate_up and qkv), and one
# with K = 4096 (llama3-8b gate_up M=8192), which the heuristic leaves on whole tiles.
SHAPES = ("1024x12288x24576,2048x12288x24576,4096x12288x24576,8192x12288x24576,"
          "2048x8192x28672,4096x8192x28672,8192x8192x28672,8192x8192x5120,16384x8192x5120,8192x4096x14336")


def _rank(rank, world, shapes, rounds):
    device = torch.device("cuda", rank)
    g = torch.Generator(device=device).manual_seed(11 + rank)
    ops = {"whole": tileweave.AllGatherGemm(policy="fused", transport="mesh", stream_k=False),
           "tail": tileweave.AllGatherGemm(policy="fused", transport="mesh", stream_k=True)}
    results = {}
    for m, k, n in shapes:
        a = torch.randn(m // world, k, device=device, dtype=torch.bfloat16, generator=g)
        w = torch.randn(n, k, device=device, dtype=torch.bfloat16, generator=g) / k ** 0.5
        b = w.t()
        gathered = torch.empty(m, k, device=device, dtype=torch.bfloat16)
        dist.all_gather_into_tensor(gathered, a)
        ref = (gathered.float() @ b.float())
        row = {"err_" + name: ((op(a, b).float() - ref).norm() / ref.norm()).item() for name, op in ops.items()}
        calls = {"cublas": lambda: torch.matmul(gathered, b),
                 **{name: (lambda op=op: op(a, b)) for name, op in ops.items()}}
        times = {name: [] for name in calls}
        for _ in range(rounds):
            for name, fn in calls.items():
                fn()
                torch.cuda.synchronize(device)
                dist.barrier()
                times[name].append(time_ms(fn, device, warmup=10, iters=20, reps=5))
        row.update({name: statistics.median(v) for name, v in times.items()})
        row["rounds"] = times
        results[f"{m}x{k}x{n}"] = row
    return results


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--shapes", default=SHAPES)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    os.environ.setdefault("TILEWEAVE_TIMEOUT_S", "15")
    ranks = run_ranks(2, _rank, shapes, args.rounds, gpus=True, timeout_s=540)
    with open(os.path.join(args.out, "ag_tail_probe.json"), "w") as f:
        json.dump({"shapes": shapes, "ranks": ranks}, f, indent=1)
    print(f"{'shape':>20s} {'cublas':>8s} {'whole':>8s} {'tail':>8s} {'tail/whole':>10s} {'err tail':>9s}")
    for key in ranks[0]:
        worst = {name: max(r[key][name] for r in ranks) for name in ("cublas", "whole", "tail")}
        print(f"{key:>20s} {worst['cublas']:8.3f} {worst['whole']:8.3f} {worst['tail']:8.3f} "
              f"{worst['whole'] / worst['tail']:10.3f} {max(r[key]['err_tail'] for r in ranks):9.2e}")


if __name__ == "__main__":
    main()
