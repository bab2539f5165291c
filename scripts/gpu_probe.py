"""Kernel-variant sweep and fused-op check on a multi-GPU box, in one process group.

    python3 scripts/gpu_probe.py --out $OUT [--phases gemm,check,fused]

gemm:  GEMM-core configs against torch.matmul on local shapes, the shape list split over the GPUs.
check: fused AG/RS correctness (bf16, odd shapes, both B layouts, bias, a delayed producer).
fused: steady-state AG/RS timings, fused vs NCCL+cuBLAS, on a few suite shapes.
Writes probe_<phase>.json under --out and prints a short table per phase.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

import tileweave  # noqa: E402
from tileweave.testing import scenarios  # noqa: E402
from tileweave.tune.autotune import time_ms  # noqa: E402
from tileweave.tune.configs import GemmConfig  # noqa: E402

GEMM_SHAPES = [  # (M, N, K) local GEMMs of the suite at TP=2 and TP=8
    (8192, 3072, 4096), (8192, 14336, 4096), (4096, 5120, 8192), (8192, 28672, 8192),
    (4096, 24576, 12288), (8192, 4096, 2048), (8192, 4096, 7168), (4096, 8192, 4096),
    (8192, 8192, 14336), (8192, 768, 4096), (2048, 1280, 8192), (8192, 4096, 512),
    (8192, 4096, 1792), (1024, 3072, 4096), (1024, 4096, 2048), (16384, 6144, 12288),
]
CONFIGS = {
    "d": GemmConfig(),  # 128x256x64, 3 stages, 8 warps, flattened, TMA stores
    "ptr_c": GemmConfig(c_tma=False),
    "ws": GemmConfig(warp_specialize=True),
    "s4": GemmConfig(num_stages=4),
    "g4": GemmConfig(group_m=4),
    "128x128": GemmConfig(block_n=128, num_stages=4),
    "128x128ws": GemmConfig(block_n=128, num_stages=4, warp_specialize=True),
    "256x128": GemmConfig(block_m=256, block_n=128, num_stages=3),
}

# Narrow or shallow local GEMMs (TP=8 shards, small M) that the large tiles leave under-occupied.
SMALL_SHAPES = [
    (1024, 768, 4096), (2048, 768, 4096), (4096, 768, 4096), (16384, 768, 4096),
    (1024, 1280, 8192), (2048, 1280, 8192), (4096, 1280, 8192), (8192, 1280, 8192),
    (1024, 4096, 512), (2048, 4096, 512), (1024, 4096, 1792), (2048, 4096, 1792),
    (1024, 3072, 4096), (1024, 5120, 8192), (1024, 14336, 4096), (1024, 3584, 4096),
]
SMALL_CONFIGS = {
    "d": GemmConfig(),
    "128x128": GemmConfig(block_n=128, num_stages=4),
    "128x128nf": GemmConfig(block_n=128, num_stages=4, flatten=False),
    "128x128k128": GemmConfig(block_n=128, block_k=128, num_stages=3),
    "64x128": GemmConfig(block_m=64, block_n=128, num_stages=4, num_warps=4),
    "64x256": GemmConfig(block_m=64, block_n=256, num_stages=4, num_warps=4),
    "128x64": GemmConfig(block_n=64, num_stages=4, num_warps=4),
    "64x64": GemmConfig(block_m=64, block_n=64, num_stages=5, num_warps=4),
    "64x128k128": GemmConfig(block_m=64, block_n=128, block_k=128, num_stages=3, num_warps=4),
}


def timed(fn, *, warmup=5, iters=10, reps=3):
    return time_ms(fn, torch.device("cuda"), warmup=warmup, iters=iters, reps=reps)


def rel_err(got, ref):
    got = got.double()
    if not torch.isfinite(got).all():
        return float("inf")
    return ((got - ref).norm() / ref.norm()).item()


def phase_gemm_small(rank, world, out_dir):
    phase_gemm(rank, world, out_dir, SMALL_SHAPES, SMALL_CONFIGS, "gemm_small")


def phase_gemm(rank, world, out_dir, shapes=GEMM_SHAPES, configs=CONFIGS, tag="gemm"):
    rows = []
    for i, (m, n, k) in enumerate(shapes):
        if i % world != rank:
            continue
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        ref = torch.matmul(a, w.t())
        t_ref = timed(lambda: torch.matmul(a, w.t()))
        auto = tileweave.matmul(a, w.t())
        for name, cfg in list(configs.items()) + [("auto", None)]:
            try:
                c = tileweave.matmul(a, w.t(), config=cfg)
                err = rel_err(c, ref.double())
                t = timed(lambda: tileweave.matmul(a, w.t(), config=cfg)) if err < 1e-2 else float("nan")
            except Exception as exc:  # a config that does not compile is a result too
                err, t = float("nan"), float("nan")
                print(f"[gemm] {m}x{n}x{k} {name}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
            rows.append({"m": m, "n": n, "k": k, "config": name, "err": err, "t_ours": t, "t_cublas": t_ref,
                         "ratio": t_ref / t if t == t else 0.0, "tflops": 2 * m * n * k / t / 1e9 if t == t else 0})
        del a, w, ref, auto
    all_rows = [None] * world
    dist.all_gather_object(all_rows, rows)
    if rank == 0:
        flat = [r for part in all_rows for r in part]
        json.dump(flat, open(os.path.join(out_dir, f"probe_{tag}.json"), "w"), indent=1)
        print("\n== gemm core: ratio to cuBLAS (higher is better) ==")
        names = list(configs) + ["auto"]
        print(f"{'shape':>20} {'cublas':>7} " + " ".join(f"{n:>9}" for n in names))
        for (m, n, k) in shapes:
            sel = {r["config"]: r for r in flat if (r["m"], r["n"], r["k"]) == (m, n, k)}
            tc = next(iter(sel.values()))["t_cublas"]
            print(f"{f'{m}x{n}x{k}':>20} {tc:7.3f} " + " ".join(f"{sel[x]['ratio']:9.3f}" for x in names))


def phase_check(rank, world, out_dir):
    C = scenarios.Case
    ag_cases = [C(m_chunk=1000, k=1000, n=3000, dtype="bfloat16", bias=True, iters=3),
                C(m_chunk=512, k=1001, n=640, dtype="bfloat16", weight_layout=False, iters=2),
                C(m_chunk=4096, k=4096, n=7168, dtype="bfloat16", iters=3),
                C(m_chunk=2048, k=4096, n=3072, dtype="bfloat16", iters=2, straggler=1, delay_s=0.05)]
    rs_cases = [C(m_chunk=1000, k=1000, n=3000, dtype="bfloat16", bias=True, iters=3),
                C(m_chunk=512, k=1001, n=640, dtype="bfloat16", weight_layout=False, iters=2),
                C(m_chunk=4096, k=4096, n=4096, dtype="bfloat16", iters=3)]
    res = {"ag": scenarios.all_gather_gemm_check(rank, world, ag_cases),
           "rs": scenarios.gemm_reduce_scatter_check(rank, world, rs_cases)}
    everyone = [None] * world
    dist.all_gather_object(everyone, res)
    if rank == 0:
        json.dump(everyone, open(os.path.join(out_dir, "probe_check.json"), "w"), indent=1)
        print("\n== fused correctness (bf16, rel. Frobenius error; bar 1e-2) ==")
        for r, part in enumerate(everyone):
            for op in ("ag", "rs"):
                for row in part[op]:
                    c = row["case"]
                    extra = row.get("gathered_exact", row.get("deterministic"))
                    print(f"rank{r} {op} mc={c['m_chunk']} k={c['k']} n={c['n']} it={row['iter']} "
                          f"path={row['path']} err={row['err']:.2e} exact/det={extra}")


def phase_fused(rank, world, out_dir):
    shapes = [("ag", 8192, 4096, 14336), ("ag", 8192, 8192, 8192), ("ag", 4096, 8192, 28672),
              ("ag", 2048, 8192, 8192), ("ag", 16384, 4096, 6144),
              ("rs", 8192, 8192, 8192), ("rs", 8192, 14336, 4096), ("rs", 4096, 28672, 8192),
              ("rs", 2048, 8192, 8192), ("rs", 16384, 4096, 4096)]
    rows = []
    group = dist.group.WORLD
    for kind, m, k, n in shapes:
        torch.manual_seed(rank + 1)
        if kind == "ag":
            a = torch.randn(m // world, k, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(n // world, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
            b = w.t()
            gathered = torch.empty(m, k, device="cuda", dtype=torch.bfloat16)
            op = tileweave.AllGatherGemm(policy="fused")

            def base():
                dist.all_gather_into_tensor(gathered, a)
                return torch.matmul(gathered, b)
            full = torch.empty(m, k, device="cuda", dtype=torch.bfloat16)
            dist.all_gather_into_tensor(full, a)
            t_gemm = timed(lambda: torch.matmul(full, b))
            t_core = timed(lambda: tileweave.matmul(full, b))
            ours = lambda: op(a, b)
        else:
            a = torch.randn(m, k // world, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(n, k // world, device="cuda", dtype=torch.bfloat16) / k ** 0.5
            b = w.t()
            rs_out = torch.empty(m // world, n, device="cuda", dtype=torch.bfloat16)
            op = tileweave.GemmReduceScatter(policy="fused")

            def base():
                dist.reduce_scatter_tensor(rs_out, torch.matmul(a, b))
                return rs_out
            t_gemm = timed(lambda: torch.matmul(a, b))
            t_core = timed(lambda: tileweave.matmul(a, b))
            ours = lambda: op(a, b)
        ref = base().clone()
        got = ours()
        err = rel_err(got, ref.double())
        dist.barrier()
        t_base = timed(base)
        dist.barrier()
        t_ours = timed(ours) if err < 2e-2 else float("nan")
        t = torch.tensor([t_gemm, t_base, t_ours, t_core], device="cuda")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        t_gemm, t_base, t_ours, t_core = t.tolist()
        e = 1 - (t_ours - t_gemm) / (t_base - t_gemm) if t_base > t_gemm else float("nan")
        rows.append({"op": kind, "m": m, "k": k, "n": n, "err": err, "t_gemm": t_gemm, "t_base": t_base,
                     "t_ours": t_ours, "t_core": t_core, "speedup": t_base / t_ours, "E": e})
        del op
        torch.cuda.empty_cache()
    if rank == 0:
        json.dump(rows, open(os.path.join(out_dir, "probe_fused.json"), "w"), indent=1)
        print("\n== fused timings (ms, max over ranks) ==")
        for r in rows:
            print(f"{r['op']} M={r['m']:5d} K={r['k']:5d} N={r['n']:5d} err={r['err']:.1e} gemm={r['t_gemm']:.3f} "
                  f"core={r['t_core']:.3f} base={r['t_base']:.3f} ours={r['t_ours']:.3f} x={r['speedup']:.3f} E={r['E']:.2f}")


def phase_host(rank, world, out_dir):
    """Host cost per call on a small shape: wall time of back-to-back calls, and a profile."""
    if rank != 0:
        return
    import cProfile
    import pstats
    a = torch.randn(1024, 2048, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, 2048, device="cuda", dtype=torch.bfloat16)
    for name, fn in (("torch", lambda: torch.matmul(a, w.t())), ("ours", lambda: tileweave.matmul(a, w.t()))):
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(200):
            fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(20):
                fn()
        g.replay()
        torch.cuda.synchronize()
        t3 = time.perf_counter()
        for _ in range(10):
            g.replay()
        torch.cuda.synchronize()
        t4 = time.perf_counter()
        print(f"[host] {name}: issue {1e6 * (t1 - t0) / 200:.1f} us/call, wall {1e6 * (t2 - t0) / 200:.1f} us/call, "
              f"graph replay {1e6 * (t4 - t3) / 200:.1f} us/call", flush=True)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(300):
        tileweave.matmul(a, w.t())
    prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(14)


def phase_rsvar(rank, world, out_dir):
    """GEMM+RS: the own-chunk wait before the chunk (default) against inside each tile (lazy)."""
    from tileweave.tune.configs import choose_gemm_config
    rows = []
    for m, k, n in [(8192, 8192, 8192), (8192, 14336, 4096), (4096, 28672, 8192), (2048, 8192, 8192),
                    (8192, 28672, 8192)]:
        torch.manual_seed(rank + 1)
        a = torch.randn(m, k // world, device="cuda", dtype=torch.bfloat16)
        b = (torch.randn(n, k // world, device="cuda", dtype=torch.bfloat16) / k ** 0.5).t()
        rs_out = torch.empty(m // world, n, device="cuda", dtype=torch.bfloat16)

        def base():
            dist.reduce_scatter_tensor(rs_out, torch.matmul(a, b))
            return rs_out
        ref = base().clone()
        t_gemm = timed(lambda: torch.matmul(a, b))
        t_base = timed(base)
        row = {"m": m, "k": k, "n": n, "t_gemm": t_gemm, "t_base": t_base}
        cfg = choose_gemm_config(m, n, k // world, torch.bfloat16, num_sms=132)
        for lazy in (False, True):
            op = tileweave.GemmReduceScatter(policy="fused", config=dataclasses.replace(cfg, lazy_wait=lazy))
            err = rel_err(op(a, b), ref.double())
            dist.barrier()
            row[f"lazy{int(lazy)}"] = timed(lambda: op(a, b)) if err < 2e-2 else float("nan")
            row[f"err{int(lazy)}"] = err
        t = torch.tensor([row["t_gemm"], row["t_base"], row["lazy0"], row["lazy1"]], device="cuda")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        row.update(zip(("t_gemm", "t_base", "lazy0", "lazy1"), t.tolist()))
        rows.append(row)
    if rank == 0:
        json.dump(rows, open(os.path.join(out_dir, "probe_rsvar.json"), "w"), indent=1)
        print("\n== GEMM+RS own-chunk wait: before the chunk vs inside each tile (ms, max over ranks) ==")
        for r in rows:
            print(f"M={r['m']:5d} K={r['k']:5d} N={r['n']:5d} gemm={r['t_gemm']:.3f} base={r['t_base']:.3f} "
                  f"before={r['lazy0']:.3f} (err {r['err0']:.1e}) inside={r['lazy1']:.3f} (err {r['err1']:.1e})")


def main_rank(rank, world, port, phases, out_dir):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
    for phase in phases:
        t0 = time.time()
        try:
            {"gemm": phase_gemm, "gemm_small": phase_gemm_small, "check": phase_check, "fused": phase_fused, "host": phase_host, "rsvar": phase_rsvar}[phase](rank, world, out_dir)
        except Exception:
            import traceback
            print(f"[rank {rank}] phase {phase} failed:\n{traceback.format_exc()}", flush=True)
            raise
        if rank == 0:
            print(f"[phase {phase}: {time.time() - t0:.1f} s]", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--phases", default="gemm,check,fused")
    args = parser.parse_args()
    for key in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
        os.environ[key] = "0" if key == "NCCL_NVLS_ENABLE" else "1"
    world = torch.cuda.device_count()
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(main_rank, args=(world, port, args.phases.split(","), args.out), nprocs=world)
