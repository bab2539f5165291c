"""Host time of one reduce-scatter call, split by what the host does, on two GPUs: each backend verb
and each torch call inside the op is wrapped with a timer, and calls are issued while the GPU is kept
busy, so that no call waits for the GPU and the times are the host's alone.

    python3 scripts/host_probe.py [--out DIR]
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

import tileweave  # noqa: E402
from tileweave.runtime import driver  # noqa: E402
from tileweave.testing.emulated import run_ranks  # noqa: E402

SHAPE = (4096, 2048, 4096)  # M x K_local x N: the suite's llama3-8b o-proj at M=4096
CALLS = 40


def _timed(table, name, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        start = time.perf_counter_ns()
        try:
            return fn(*args, **kwargs)
        finally:
            table[name][0] += time.perf_counter_ns() - start
            table[name][1] += 1
    return wrapper


def _issue(op, a, b, device, table):
    op(a, b)
    torch.cuda.synchronize(device)
    dist.barrier()
    torch.cuda._sleep(int(0.3 * 1.4e9))  # GPU work ahead of the calls, so none waits for the GPU
    table.clear()
    start = time.perf_counter_ns()
    for _ in range(CALLS):
        op(a, b)
    total = (time.perf_counter_ns() - start) / CALLS / 1e3
    torch.cuda.synchronize(device)
    dist.barrier()
    return total


def _rank(rank, world):
    device = torch.device("cuda", rank)
    m, k, n = SHAPE
    a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    b = (torch.randn(n, k, device=device, dtype=torch.bfloat16) / k ** 0.5).t()
    table = collections.defaultdict(lambda: [0, 0])
    saved = {}
    for mod, names in ((driver, ("memcpy_async", "stream_wait_u32", "stream_write_u32")),
                       (torch, ("matmul", "addmm"))):
        for name in names:
            saved[(mod, name)] = getattr(mod, name)
            setattr(mod, name, _timed(table, f"{mod.__name__}.{name}", getattr(mod, name)))
    results = {}
    for transport in ("chunked", "store"):
        op = tileweave.GemmReduceScatter(policy="fused", transport=transport)
        op(a, b)
        backend = op._backend
        for name in ("comm_begin", "comm_end", "comm_copy", "comm_wait", "comm_write", "main_wait",
                     "main_write"):
            setattr(backend, name, _timed(table, f"backend.{name}", getattr(type(backend), name).__get__(backend)))
        for name in ("_finish", "_check_previous", "_chunked", "_decide"):
            if hasattr(op, name):
                setattr(op, name, _timed(table, f"op.{name}", getattr(type(op), name).__get__(op)))
        total = _issue(op, a, b, device, table)
        results[transport] = {"us_per_call": total,
                              "parts_us_per_call": {key: [v[0] / CALLS / 1e3, v[1] / CALLS] for key, v in table.items()}}
        for name in ("comm_begin", "comm_end", "comm_copy", "comm_wait", "comm_write", "main_wait", "main_write"):
            delattr(backend, name)
    fallback = tileweave.GemmReduceScatter(policy="fallback")
    results["fallback"] = {"us_per_call": _issue(fallback, a, b, device, table)}
    results["torch_matmul_only"] = {"us_per_call": _issue(lambda x, y: torch.matmul(x, y), a, b, device, table)}
    for (mod, name), fn in saved.items():
        setattr(mod, name, fn)
    return results


def _profile_rank(rank, world, m, k, n):
    """cProfile of the functional op's host path next to the same work written out by hand."""
    import cProfile
    import io
    import pstats

    device = torch.device("cuda", rank)
    a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    b = (torch.randn(n, k, device=device, dtype=torch.bfloat16) / k ** 0.5).t()
    group = dist.group.WORLD

    def by_hand():
        out = torch.empty((m // world, n), dtype=a.dtype, device=device)
        dist.reduce_scatter_tensor(out, torch.matmul(a, b), group=group)

    def ours():
        tileweave.gemm_reduce_scatter(a, b, group)

    results = {}
    for name, fn in (("by_hand", by_hand), ("ours", ours)):
        results[name] = {"us_per_call": _issue(lambda x, y: fn(), a, b, device, collections.defaultdict(list))}
        prof = cProfile.Profile()
        torch.cuda._sleep(int(0.3 * 1.4e9))
        prof.enable()
        for _ in range(CALLS):
            fn()
        prof.disable()
        torch.cuda.synchronize(device)
        dist.barrier()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(22)
        results[name]["profile"] = text.getvalue()
    return results


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--profile", default="", help="MxK_locxN: cProfile the functional op (auto policy)")
    args = parser.parse_args()
    if args.profile:
        m, k, n = (int(x) for x in args.profile.split("x"))
        ranks = run_ranks(2, _profile_rank, m, k, n, gpus=True, timeout_s=200)
        for name, r in ranks[0].items():
            print(f"[r0] {name}: {r['us_per_call']:.1f} us/call")
            print(r["profile"][-3200:])
        return
    ranks = run_ranks(2, _rank, gpus=True, timeout_s=200)
    with open(os.path.join(args.out, "host_probe.json"), "w") as f:
        json.dump(ranks, f, indent=1)
    for rank, res in enumerate(ranks):
        for name, r in res.items():
            print(f"[r{rank}] {name:18s} {r['us_per_call']:8.1f} us/call")
            for part, (us, count) in sorted(r.get("parts_us_per_call", {}).items(), key=lambda kv: -kv[1][0]):
                print(f"[r{rank}]     {part:28s} {us:8.1f} us  x{count:g}")


if __name__ == "__main__":
    main()
