"""The GEMM side of GEMM+ReduceScatter's pulling transport on one GPU, without its transfer: the cuBLAS
calls one rank issues on its caller's stream for B row blocks per owner, against one GEMM over all
rows (``t_gemm``, the benchmark's reference for E).

    python3 scripts/rs_blocks_probe.py [--out DIR] [--rows 4096x7168x4096,...] [--blocks 1,2,4,8]

Rows are M x K_loc x N (rows before the scatter, this rank's depth, columns), two ranks, bf16, B an
``nn.Linear`` weight read in place. For B blocks of ``M/2/B`` rows the stream runs what
``GemmReduceScatter._chunked_pull`` runs: the peer's rows block by block into the send buffer
(``torch.mm``), then the own rows block by block added in place onto the pulled partial
(``torch.addmm(out[r], own[r], b, out=out[r])``); for one block the own rows' GEMM writes ``out`` and
one add follows (``out.add_(recv)``). What the transfer costs next to these is not here
(``scripts/ag_kernel_probe.py --set interference`` measures that for a copy). Interleaved rounds, CUDA
events, medians. Writes ``rs_blocks_probe.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from tileweave.ops.gemm_reduce_scatter import blocks_for  # noqa: E402
from tileweave.tune.autotune import time_ms  # noqa: E402

# The suite's GEMM+ReduceScatter rows with M >= 4096 at TP=2 (llama3-8b o and down, llama3-70b o and
# down, gpt3-175b fc2).
ROWS = ",".join(f"{m}x{k}x{n}" for k, n in ((2048, 4096), (7168, 4096), (4096, 8192), (14336, 8192), (24576, 12288))
                for m in (4096, 8192, 16384))


def sequence(a, b, send, out, recv, blocks):
    """The caller's-stream GEMMs of one pulling call with ``blocks`` blocks per owner (rank 0)."""
    mc = out.shape[0]
    bounds = [mc * j // blocks for j in range(blocks + 1)]
    rows = [slice(bounds[j], bounds[j + 1]) for j in range(blocks)]
    peer, own = a[mc:], a[:mc]

    def call():
        for r in rows:
            torch.mm(peer[r], b, out=send[r])
        if blocks == 1:
            torch.mm(own, b, out=out)
            out.add_(recv)
        else:
            for r in rows:
                torch.addmm(out[r], own[r], b, out=out[r])
    return call


def probe(m, k, n, block_counts, rounds, device):
    g = torch.Generator(device=device).manual_seed(m + k + n)
    a = torch.randn(m, k, device=device, dtype=torch.bfloat16, generator=g)
    w = torch.randn(n, k, device=device, dtype=torch.bfloat16, generator=g) / k ** 0.5
    b = w.t()
    mc = m // 2
    full = torch.empty(m, n, device=device, dtype=torch.bfloat16)
    send = torch.empty(mc, n, device=device, dtype=torch.bfloat16)
    out = torch.empty(mc, n, device=device, dtype=torch.bfloat16)
    recv = torch.randn(mc, n, device=device, dtype=torch.bfloat16, generator=g)
    calls = {"t_gemm": lambda: torch.mm(a, b, out=full)}
    for blocks in block_counts:
        if mc // blocks >= 256:
            calls[f"B{blocks}"] = sequence(a, b, send, out, recv, blocks)
    # One block's own rows as the library's single-block call leaves them: the GEMM alone, and the add.
    calls["own_mm"] = lambda: torch.mm(a[:mc], b, out=out)
    calls["add"] = lambda: out.add_(recv)
    times = {name: [] for name in calls}
    for r in range(rounds):
        names = list(calls) if r % 2 == 0 else list(calls)[::-1]
        for name in names:
            times[name].append(time_ms(calls[name], device, warmup=3, iters=10, reps=5))
    row = {name: statistics.median(v) for name, v in times.items()}
    # The pushing transport's blocks, which a pull took too before it took at most two (04b7582).
    row["library_blocks"] = blocks_for(mc, k, n)
    row["rounds"] = times
    return row


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default=ROWS)
    parser.add_argument("--blocks", default="1,2,4,8")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    block_counts = [int(x) for x in args.blocks.split(",")]
    results = {}
    print(f"{'row':20s} {'lib':>3s} {'t_gemm':>8s} " + " ".join(f"{'B' + str(x):>8s}" for x in block_counts)
          + f" {'own_mm':>8s} {'add':>8s}   (ms; B / t_gemm below)")
    for spec in args.rows.split(","):
        m, k, n = (int(x) for x in spec.split("x"))
        row = probe(m, k, n, block_counts, args.rounds, device)
        results[spec] = row
        cells = [f"{row['B' + str(x)]:8.3f}" if "B" + str(x) in row else f"{'-':>8s}" for x in block_counts]
        print(f"{spec:20s} {row['library_blocks']:3d} {row['t_gemm']:8.3f} " + " ".join(cells)
              + f" {row['own_mm']:8.3f} {row['add']:8.3f}")
        ratios = [f"{row['B' + str(x)] / row['t_gemm']:8.3f}" if "B" + str(x) in row else f"{'-':>8s}"
                  for x in block_counts]
        print(f"{'':33s}" + " ".join(ratios))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "rs_blocks_probe.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(device), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
