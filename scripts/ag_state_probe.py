"""Whether the fused AllGather+GEMM kernel's time on one shape depends on what the process ran before
(NOTES.md, entry 56): on two GPUs, in one process, cuBLAS and the plain kernel on the gathered GEMM, a
fresh op's fused call, an op whose workspace grew from a smaller shape first, the fresh op again, an
op created last and an op given a gather buffer allocated first in the process; then three interleaved
rounds of all of them and of both kernels reading each op's gather buffer and a regular tensor
allocated as late. Run it again with
``TORCH_SYMMMEM_IMPLICIT_POOL=0`` (symmetric tensors then bypass torch's pool of them).

    python3 scripts/ag_state_probe.py [--out DIR] [--shape 4096x12288x24576] [--first 4096x8192x28672]

Shapes are M x K x N_local (gpt3-175b fc1 at M=4096, TP=2 is 4096x12288x24576).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

import tileweave  # noqa: E402
from tileweave.runtime.backend import get_backend  # noqa: E402
from tileweave.testing.emulated import run_ranks  # noqa: E402
from tileweave.tune.autotune import time_ms  # noqa: E402


def _inputs(m, k, n, world, device, g):
    a = torch.randn(m // world, k, device=device, dtype=torch.bfloat16, generator=g)
    w = torch.randn(n, k, device=device, dtype=torch.bfloat16, generator=g) / k ** 0.5
    return a, w.t()


def _rank(rank, world, shape, first):
    device = torch.device("cuda", rank)
    g = torch.Generator(device=device).manual_seed(7 + rank)
    a, b = _inputs(*shape, world, device, g)
    gathered = torch.cat([a] * world)
    timed = {}
    # A gather buffer allocated before anything else of the process's GPU work, and given to an op
    # created last: if that op is fast, one early allocation carved for every workspace (an arena)
    # fixes the slowdown; if slow, what matters is not when the buffer was allocated.
    backend = get_backend(None, device)
    early = backend.allocate(a.numel() * world * a.element_size())

    def time(name, fn):
        fn()
        torch.cuda.synchronize(device)
        dist.barrier()
        timed[name] = time_ms(fn, device, warmup=10, iters=20, reps=5)

    def fused():
        return tileweave.AllGatherGemm(policy="fused", transport="mesh")

    time("cublas", lambda: torch.matmul(gathered, b))
    time("plain", lambda: tileweave.matmul(gathered, b))
    fresh = fused()
    time("fused_fresh", lambda: fresh(a, b))
    grown = fused()
    a0, b0 = _inputs(*first, world, device, g)
    time("fused_first_shape", lambda: grown(a0, b0))
    time("fused_grown", lambda: grown(a, b))
    time("fused_fresh_again", lambda: fresh(a, b))
    late = fused()
    time("fused_new_op", lambda: late(a, b))
    allocate = backend.allocate
    backend.allocate = lambda nbytes: early if nbytes == early.nbytes else allocate(nbytes)
    arena = fused()
    time("fused_early_buffer", lambda: arena(a, b))
    del backend.allocate  # the instance attribute hid the method
    # Then three rounds of everything, interleaved, so that a drift over the process's life (clocks,
    # heat) shows in every variant alike; the kernels also read A from each op's gather buffer (a
    # symmetric allocation) to tell the memory from the fused kernel. Each op's gather buffer holds the
    # gathered rows after its last call, and no peer writes into it until that op's next call.
    buffers = {name: op._ws.data.view(op._ws.backend.rank, a.dtype, (a.shape[0] * world, a.shape[1]))
               for name, op in (("fresh", fresh), ("new_op", late), ("early", arena))}
    # A regular (caching-allocator) tensor allocated as late as the last op's workspace: if the kernels
    # are slow on it too, the cause is where late memory lands, not symmetric memory.
    buffers["late_regular"] = buffers["new_op"].clone()
    for name, buf in buffers.items():
        timed[f"offset_2mb_{name}"] = float(buf.data_ptr() % (1 << 21))
    torch.cuda.synchronize(device)
    dist.barrier()
    for round_ in range(3):
        time(f"r{round_}_cublas", lambda: torch.matmul(gathered, b))
        time(f"r{round_}_plain", lambda: tileweave.matmul(gathered, b))
        time(f"r{round_}_fused_fresh", lambda: fresh(a, b))
        time(f"r{round_}_fused_new_op", lambda: late(a, b))
        time(f"r{round_}_fused_early_buffer", lambda: arena(a, b))
        for name, buf in buffers.items():
            time(f"r{round_}_cublas_from_{name}_buffer", lambda: torch.matmul(buf, b))
            time(f"r{round_}_plain_from_{name}_buffer", lambda: tileweave.matmul(buf, b))
    return timed


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--shape", default="4096x12288x24576")
    parser.add_argument("--first", default="4096x8192x28672")
    args = parser.parse_args()
    shape = tuple(int(x) for x in args.shape.split("x"))
    first = tuple(int(x) for x in args.first.split("x"))
    os.environ.setdefault("TILEWEAVE_TIMEOUT_S", "15")
    ranks = run_ranks(2, _rank, shape, first, gpus=True, timeout_s=300)
    with open(os.path.join(args.out, "ag_state_probe.json"), "w") as f:
        json.dump({"shape": shape, "first": first, "ranks": ranks}, f, indent=1)
    for key in ranks[0]:
        print(f"{key:20s} r0 {ranks[0][key]:8.3f}  r1 {ranks[1][key]:8.3f}")


if __name__ == "__main__":
    main()
