"""AllGather+GEMM's fused kernel on one GPU with every shard already in place (its ready flags raised
before the launch), against the plain GEMM of the same configuration and cuBLAS on the gathered rows.
On 2x H200 the fused op ran 2-4% behind cuBLAS on its large rows (NOTES.md, entries 61 and 75), where
the plain GEMM is at par; this separates the kernel's own cost from the communication's.

    python3 scripts/ag_kernel_probe.py [--out DIR] [--shapes 8192x8192x28672,...] [--rounds 3]

Shapes are M x K x N_local (gathered rows, depth, this rank's columns), bf16, B an nn.Linear weight.
Variants: ``cublas``; ``plain`` (our kernel, MODE_PLAIN, the fused op's configuration without a
stream-K tail); ``ag2`` (MODE_AG, two ranks, rank 0, whole tiles); ``ag2_sk`` (the same with the
stream-K tail where the op's heuristic takes it); ``ag2_r1`` (rank 1: own rows second); ``ag4`` (four
chunks); ``ag2_copy`` (``ag2`` while a second stream copies a shard's bytes, as the copy engine does
during the op). Interleaved rounds, CUDA events, medians. Writes ``ag_kernel_probe.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from tileweave.ops import _launch  # noqa: E402
from tileweave.tune import heuristics  # noqa: E402
from tileweave.tune.autotune import select_config, time_ms  # noqa: E402

SHAPES = ("4096x4096x14336,8192x4096x14336,16384x4096x14336,16384x4096x3072,8192x8192x5120,16384x8192x5120,"
          "1024x8192x28672,2048x8192x28672,4096x8192x28672,8192x8192x28672,"
          "1024x12288x24576,2048x12288x24576,4096x12288x24576,8192x12288x24576")


def _ag(a_full, b, out, config, world, rank, programs):
    mc = a_full.shape[0] // world
    flags = torch.ones(world, dtype=torch.int32, device=a_full.device)
    err = torch.zeros(1, dtype=torch.int32, device=a_full.device)
    shard = a_full[rank * mc:(rank + 1) * mc]

    def call():
        _launch.launch(mode=_launch.MODE_AG, a=shard, b=b, c=out, bias=None, config=config, m_chunk=mc, rank=rank,
                       world=world, programs=programs, buf=a_full, flags=flags, err=err, epoch=1,
                       max_spin=1 << 24)
    return call, err


def probe(m, k, n, rounds, device):
    g = torch.Generator(device=device).manual_seed(m + k + n)
    a = torch.randn(m, k, device=device, dtype=torch.bfloat16, generator=g)
    w = torch.randn(n, k, device=device, dtype=torch.bfloat16, generator=g) / k ** 0.5
    b = w.t()
    out = torch.empty(m, n, device=device, dtype=torch.bfloat16)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    whole = dataclasses.replace(select_config(m, n, k, torch.bfloat16, device, num_sms=sms, stream_k=False),
                                stream_k=False, block_n2=0)
    sk = _launch.ag_stream_k_tail(m // 2, n, whole, 2, sms) and heuristics.all_gather_stream_k(
        m // 2, n, k, 2, whole.block_m, whole.block_n, sms)
    calls, errs = {}, {}
    calls["cublas"] = lambda: torch.matmul(a, b, out=out)
    calls["plain"] = lambda: _launch.launch(mode=_launch.MODE_PLAIN, a=a, b=b, c=out, bias=None, config=whole,
                                            m_chunk=m, programs=sms)
    calls["ag2"], errs["ag2"] = _ag(a, b, out, whole, 2, 0, sms)
    if sk:
        calls["ag2_sk"], errs["ag2_sk"] = _ag(a, b, out, dataclasses.replace(whole, stream_k=True), 2, 0, sms)
    calls["ag2_r1"], errs["ag2_r1"] = _ag(a, b, out, whole, 2, 1, sms)
    calls["ag4"], errs["ag4"] = _ag(a, b, out, whole, 4, 0, sms)
    side = torch.cuda.Stream(device)
    src = a[: m // 2]
    dst = torch.empty_like(src)
    ag2 = calls["ag2"]

    def ag2_copy():
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            dst.copy_(src)
        ag2()
        torch.cuda.current_stream(device).wait_stream(side)
    calls["ag2_copy"] = ag2_copy

    ref = (a.float() @ b.float())
    row = {"config": whole.key(), "stream_k_tail": bool(sk)}
    for name, fn in calls.items():
        out.fill_(float("nan"))
        fn()
        torch.cuda.synchronize(device)
        row["err_" + name] = ((out.float() - ref).norm() / ref.norm()).item()
        if name in errs:
            row["err_word_" + name] = int(errs[name].item())
    del ref
    times = {name: [] for name in calls}
    for r in range(rounds):
        # Mirror the order every other round, so that drift under the power cap falls on all alike.
        names = list(calls) if r % 2 == 0 else list(calls)[::-1]
        for name in names:
            times[name].append(time_ms(calls[name], device, warmup=5, iters=10, reps=5))
    row.update({name: statistics.median(v) for name, v in times.items()})
    row["rounds"] = times
    return row


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default=SHAPES)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    results = {}
    names = ("cublas", "plain", "ag2", "ag2_sk", "ag2_r1", "ag4", "ag2_copy")
    print("shape              config                      " + " ".join(f"{n:>8s}" for n in names)
          + "   (ms; ratios to cublas below)")
    for m, k, n in shapes:
        row = probe(m, k, n, args.rounds, device)
        results[f"{m}x{k}x{n}"] = row
        print(f"{m}x{k}x{n:<8d} {row['config'][:27]:27s} "
              + " ".join(f"{row[x]:8.3f}" if x in row else f"{'-':>8s}" for x in names))
        print(f"{'':46s} " + " ".join(f"{row['cublas'] / row[x]:8.3f}" if x in row else f"{'-':>8s}"
                                       for x in names)
              + "  err " + " ".join(f"{row['err_' + x]:.1e}" for x in names if 'err_' + x in row))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "ag_kernel_probe.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(device), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
