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

``--set interference`` asks what the transfer's own memory traffic costs the GEMM running next to it:
``ag2`` and ``cublas`` alone and with a concurrent copy of half the rows' bytes (``_copy``: at full
speed; ``_spread``: in 16 pieces spaced over half of cuBLAS's time by a one-thread sleep on the copy
stream, at about the rate NVLink delivers a shard; ``_quarter``: a quarter of the bytes at full speed),
and ``ag2_symm``, whose gather buffer is symmetric memory (a group of one), without a copy.
(``cublas_spread`` measures nothing on an H200: cuBLAS's persistent kernel leaves no room for the sleep
kernel, so the copies run after it.) Writes ``ag_interference_probe.json``.

``--set configs --configs g4,g16,s4ct0,k32s6`` times ``ag2`` alone and next to the full-speed copy for
the op's configuration and each change of it (``g``: tile rows per L2 group, ``s``: stages, ``k``:
K step, ``n``: tile columns, ``w``: warps, ``ct0``: pointer stores for C), with cuBLAS alone and next
to the copy. Writes ``ag_configs_probe.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import statistics
import sys
import time

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


def _operands(m, k, n, device):
    """Random bf16 operands (B as an nn.Linear weight read in place), the output, the SM count and the
    fused op's configuration for this shape (whole tiles)."""
    g = torch.Generator(device=device).manual_seed(m + k + n)
    a = torch.randn(m, k, device=device, dtype=torch.bfloat16, generator=g)
    w = torch.randn(n, k, device=device, dtype=torch.bfloat16, generator=g) / k ** 0.5
    out = torch.empty(m, n, device=device, dtype=torch.bfloat16)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    whole = dataclasses.replace(select_config(m, n, k, torch.bfloat16, device, num_sms=sms, stream_k=False),
                                stream_k=False, block_n2=0)
    return a, w.t(), out, sms, whole


def probe(m, k, n, rounds, device):
    a, b, out, sms, whole = _operands(m, k, n, device)
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
    calls["ag2_copy"] = _with_copy(calls["ag2"], a[: m // 2], device)
    return _measure(calls, errs, a, b, out, rounds, device, {"config": whole.key(), "stream_k_tail": bool(sk)})


def _with_copy(fn, src, device, pieces=1, gap_cycles=0):
    """``fn`` on the current stream while a second stream copies ``src`` (the copy engine), in
    ``pieces`` parts with a one-thread sleep of ``gap_cycles`` clocks before each."""
    side = torch.cuda.Stream(device)
    dst = torch.empty_like(src)
    rows = -(-src.shape[0] // pieces)

    def call():
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for lo in range(0, src.shape[0], rows):
                if gap_cycles:
                    torch.cuda._sleep(gap_cycles)
                dst[lo:lo + rows].copy_(src[lo:lo + rows])
        fn()
        torch.cuda.current_stream(device).wait_stream(side)
    return call


def _symmetric_buffer(like):
    """A symmetric-memory tensor shaped like ``like`` from a process group of one, or None."""
    import torch.distributed as dist
    try:
        from torch.distributed import _symmetric_memory as symm_mem
        if not dist.is_initialized():
            dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29533", rank=0, world_size=1,
                                    device_id=like.device)
        t = symm_mem.empty(like.shape, dtype=like.dtype, device=like.device)
        symm_mem.rendezvous(t, dist.group.WORLD.group_name)
        t.copy_(like)
        return t
    except Exception as e:  # the probe reports the variant as missing
        print(f"symmetric memory unavailable: {type(e).__name__}: {e}")
        return None


def interference(m, k, n, rounds, device):
    a, b, out, sms, whole = _operands(m, k, n, device)
    calls, errs = {}, {}
    calls["cublas"] = lambda: torch.matmul(a, b, out=out)
    calls["ag2"], errs["ag2"] = _ag(a, b, out, whole, 2, 0, sms)
    t_gemm = time_ms(calls["cublas"], device, warmup=3, iters=5, reps=3)
    # 16 pieces over half of the GEMM's time (the own rows' share at two ranks), at ~1.7 GHz.
    gap = int(0.5 * t_gemm * 1e-3 / 16 * 1.7e9)
    shard = a[: m // 2]
    for name in ("cublas", "ag2"):
        calls[name + "_copy"] = _with_copy(calls[name], shard, device)
        calls[name + "_spread"] = _with_copy(calls[name], shard, device, pieces=16, gap_cycles=gap)
        calls[name + "_quarter"] = _with_copy(calls[name], shard[: m // 8], device)
    symm = _symmetric_buffer(a)
    if symm is not None:
        calls["ag2_symm"], errs["ag2_symm"] = _ag(symm, b, out, whole, 2, 0, sms)
    return _measure(calls, errs, a, b, out, rounds, device, {"config": whole.key(), "gap_cycles": gap})


def _changed(config, spec):
    """``config`` changed as ``spec`` says: ``g<group_m>``, ``s<stages>``, ``k<block_k>``, ``n<block_n>``,
    ``w<num_warps>``, ``ct0``."""
    changes = {}
    for key, value in re.findall(r"(g|s|k|n|w|ct)(\d+)", spec):
        field = {"g": "group_m", "s": "num_stages", "k": "block_k", "n": "block_n", "w": "num_warps",
                 "ct": "c_tma"}[key]
        changes[field] = bool(int(value)) if key == "ct" else int(value)
    return dataclasses.replace(config, **changes)


def configs(m, k, n, rounds, device, specs):
    a, b, out, sms, whole = _operands(m, k, n, device)
    shard = a[: m // 2]
    calls, errs = {}, {}
    calls["cublas"] = lambda: torch.matmul(a, b, out=out)
    calls["cublas_copy"] = _with_copy(calls["cublas"], shard, device)
    for spec in ("op", *specs):
        config = whole if spec == "op" else _changed(whole, spec)
        calls[spec], errs[spec] = _ag(a, b, out, config, 2, 0, sms)
        calls[spec + "_copy"] = _with_copy(calls[spec], shard, device)
    return _measure(calls, errs, a, b, out, rounds, device, {"config": whole.key()})


def _measure(calls, errs, a, b, out, rounds, device, row):
    ref = (a.float() @ b.float())
    for name, fn in calls.items():
        out.fill_(float("nan"))
        fn()
        torch.cuda.synchronize(device)
        row["err_" + name] = ((out.float() - ref).norm() / ref.norm()).item()
        if name in errs:
            row["err_word_" + name] = int(errs[name].item())
    del ref
    times = {name: [] for name in calls}
    phases = []
    for r in range(rounds):
        # Mirror the order every other round, so that drift under the power cap falls on all alike.
        names = list(calls) if r % 2 == 0 else list(calls)[::-1]
        for name in names:
            t0 = time.time()
            times[name].append(time_ms(calls[name], device, warmup=5, iters=10, reps=5))
            phases.append((name, t0, time.time()))
    row.update({name: statistics.median(v) for name, v in times.items()})
    row["rounds"] = times
    row["phases"] = phases
    return row


def clocks_per_variant(results: dict, samples_path: str) -> dict:
    """Mean SM clock (MHz) and power (W) per shape and variant, from ``nvidia-smi --query-gpu=timestamp,
    clocks.sm,power.draw --format=csv,noheader,nounits -lms 20`` samples taken during the run, matched
    to each variant's timed phases (wall clock, this host)."""
    import datetime
    samples = []
    with open(samples_path) as f:
        for line in f:
            parts = [x.strip() for x in line.split(",")]
            try:
                stamp = datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
                samples.append((stamp, float(parts[1]), float(parts[2])))
            except (ValueError, IndexError):
                continue
    table = {}
    for shape, row in results.items():
        per = {}
        for name, t0, t1 in row.get("phases", []):
            inside = [(c, p) for t, c, p in samples if t0 <= t <= t1]
            per.setdefault(name, []).extend(inside)
        table[shape] = {name: (statistics.mean(c for c, _ in v), statistics.mean(p for _, p in v), len(v))
                        for name, v in per.items() if v}
    return table


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default=SHAPES)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--set", choices=("kernel", "interference", "configs"), default="kernel")
    parser.add_argument("--configs", default="g4,g16,s4ct0,k32s6", help="changes to time (--set configs)")
    parser.add_argument("--clocks", default="", help="nvidia-smi samples taken during the run (see "
                        "clocks_per_variant): print the mean SM clock and power per variant at the end")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    results = {}
    if args.set == "kernel":
        names, run = ("cublas", "plain", "ag2", "ag2_sk", "ag2_r1", "ag4", "ag2_copy"), probe
    elif args.set == "interference":
        names = ("cublas", "cublas_copy", "cublas_spread", "cublas_quarter", "ag2", "ag2_copy", "ag2_spread",
                 "ag2_quarter", "ag2_symm")
        run = interference
    else:
        specs = args.configs.split(",")
        names = ("cublas", "cublas_copy", *[x + y for x in ("op", *specs) for y in ("", "_copy")])

        def run(m, k, n, rounds, device):
            return configs(m, k, n, rounds, device, specs)
    print("shape              config                      " + " ".join(f"{n:>8s}" for n in names)
          + "   (ms; ratios to cublas below)")
    for m, k, n in shapes:
        row = run(m, k, n, args.rounds, device)
        results[f"{m}x{k}x{n}"] = row
        print(f"{m}x{k}x{n:<8d} {row['config'][:27]:27s} "
              + " ".join(f"{row[x]:8.3f}" if x in row else f"{'-':>8s}" for x in names))
        print(f"{'':46s} " + " ".join(f"{row['cublas'] / row[x]:8.3f}" if x in row else f"{'-':>8s}"
                                       for x in names)
              + "  err " + " ".join(f"{row['err_' + x]:.1e}" for x in names if 'err_' + x in row))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        name = {"kernel": "ag_kernel_probe.json", "interference": "ag_interference_probe.json",
                "configs": "ag_configs_probe.json"}[args.set]
        with open(os.path.join(args.out, name), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(device), "results": results}, f, indent=1)
    if args.clocks:
        time.sleep(0.2)
        for shape, per in clocks_per_variant(results, args.clocks).items():
            print(f"{shape:18s} " + "  ".join(f"{name} {c:.0f} MHz {p:.0f} W ({n})" for name, (c, p, n) in per.items()))


if __name__ == "__main__":
    main()
