"""Copy-engine GEMM+ReduceScatter on two GPUs: correctness, then timings next to the store transport
and NCCL+cuBLAS. On an expired wait it prints the copy-engine flag block, to show where a call stopped.

    python3 scripts/ce_probe.py --variant kernel_first [--out DIR]

Variants: kernel_first (the library's order), comm_first (copy-stream work queued before the launch),
noflat (the tile loop not flattened), programs120 (12 SMs left free), tile_gpu and chunk
(``GemmConfig.ce_release``: how tiles are counted for the copy stream).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

import tileweave  # noqa: E402
from tileweave.runtime import backend as backend_mod  # noqa: E402
from tileweave.testing.emulated import run_ranks  # noqa: E402
from tileweave.tune.autotune import select_config, time_ms  # noqa: E402

CHECKS = [(2000, 1000, 3000, True), (8192, 4096, 4096, False), (4096, 7168, 4096, False)]  # M, K_loc, N, bias
TIMED = [(8192, 7168, 4096), (8192, 14336, 8192), (4096, 2048, 4096)]


def _dump_flags(op, rank):
    ws = op._ws
    if ws is None or ws.ce_flags is None:
        return "no flags"
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        flags = ws.ce_flags.view(rank, torch.int32, (3 * 2 * 256,)).to("cpu", non_blocking=True)
        err = ws.err.to("cpu", non_blocking=True)
    event = torch.cuda.Event()
    event.record(side)
    import time
    deadline = time.monotonic() + 5
    while not event.query():
        if time.monotonic() > deadline:
            return "side stream blocked too"
        time.sleep(0.01)
    f = flags.view(3, 2, 256)
    nz = lambda t: {i: int(v) for i, v in enumerate(t.tolist()) if v}  # noqa: E731
    return {"counters_step0": nz(f[0, 0]), "arrival": {s: nz(f[1, s]) for s in range(2)},
            "sent_step0": nz(f[2, 0]), "err": int(err[0]), "ce_counts": {str(k): v for k, v in ws.ce_counts.items()}}


def _configure(op, variant, m, n, k, device):
    change = {"noflat": {"flatten": False}, "programs120": {"programs": 120},
              "tile_gpu": {"ce_release": "tile_gpu"}, "chunk": {"ce_release": "chunk"}}.get(variant)
    if change:
        op.config = dataclasses.replace(select_config(m, n, k, torch.bfloat16, device, num_sms=132), **change)


def _rank(rank, world, variant, quick=False):
    if variant == "comm_first":
        backend_mod.CudaBackend.launch_blocks = True
    device = torch.device("cuda", rank)
    results = {"variant": variant, "checks": [], "timed": []}
    ce = tileweave.GemmReduceScatter(policy="fused", transport="copy_engine")
    store = tileweave.GemmReduceScatter(policy="fused", transport="store")
    fallback = tileweave.GemmReduceScatter(policy="fallback")
    chunked = tileweave.GemmReduceScatter(policy="fused", transport="chunked", pull=False)
    g = torch.Generator(device=device).manual_seed(1234 + rank)
    for m, k, n, with_bias in CHECKS[:1] if quick else CHECKS:
        _configure(ce, variant, m, n, k, device)
        a = torch.randn(m, k, device=device, dtype=torch.bfloat16, generator=g)
        w = torch.randn(n, k, device=device, dtype=torch.bfloat16, generator=g) / k ** 0.5
        bias = torch.randn(n, device=device, dtype=torch.bfloat16, generator=g) if with_bias else None
        try:
            got = ce(a, w.t(), bias=bias)
            again = ce(a, w.t(), bias=bias)
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001 - reported with the flag block
            results["checks"].append({"shape": [m, k, n], "error": str(exc)[:300], "flags": _dump_flags(ce, rank)})
            return results
        ref = fallback(a, w.t(), bias=bias).float()
        partial = (a.float() @ w.float().t())
        full = torch.empty(m // world, n, device=device)
        dist.reduce_scatter_tensor(full, partial)
        if bias is not None:
            full += bias.float()
        err = ((got.float() - full).norm() / full.norm()).item()
        results["checks"].append({"shape": [m, k, n], "rel_err": err, "rel_err_nccl": ((ref - full).norm() / full.norm()).item(),
                                  "deterministic": bool(torch.equal(got, again))})
    os.environ["TILEWEAVE_DEBUG"] = "0"  # no synchronisation per call while timing
    for m, k, n in TIMED[:1] if quick else TIMED:
        a = torch.randn(m, k, device=device, dtype=torch.bfloat16, generator=g)
        w = torch.randn(n, k, device=device, dtype=torch.bfloat16, generator=g) / k ** 0.5
        row = {"shape": [m, k, n]}
        for name, op in (("fallback", fallback), ("store", store), ("chunked", chunked), ("copy_engine", ce)):
            if op is ce:
                _configure(ce, variant, m, n, k, device)
            try:
                op(a, w.t())  # compiles: ranks may take different times, so line them up after
                torch.cuda.synchronize()
                dist.barrier()
                row[name] = time_ms(lambda: op(a, w.t()), device, warmup=10, iters=20, reps=5)
            except Exception as exc:  # noqa: BLE001 - recorded, the other transports still run
                row[name] = float("nan")
                row[name + "_error"] = str(exc)[:300]
                return results | {"timed": results["timed"] + [row]}
        results["timed"].append(row)
    return results


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--variant", default="kernel_first", choices=["kernel_first", "comm_first", "noflat", "programs120", "tile_gpu", "chunk"])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--quick", action="store_true", help="one check and one timed shape")
    args = parser.parse_args()
    os.environ.setdefault("TILEWEAVE_DEBUG", "1")
    os.environ.setdefault("TILEWEAVE_TIMEOUT_S", "15")
    ranks = run_ranks(2, _rank, args.variant, args.quick, gpus=True, timeout_s=150)
    with open(os.path.join(args.out, f"ce_probe_{args.variant}.json"), "w") as f:
        json.dump(ranks, f, indent=1)
    for rank, res in enumerate(ranks):
        for c in res["checks"]:
            print(f"[{args.variant} r{rank}] check {c}")
        for t in res["timed"]:
            for key in t:
                if key.endswith("_error"):
                    print(f"[{args.variant} r{rank}] {t['shape']} {key}: {t[key]}")
            f, s, ch, c = (t.get(key, float("nan")) for key in ("fallback", "store", "chunked", "copy_engine"))
            print(f"[{args.variant} r{rank}] {t['shape']}: fallback {f:.3f}  store {s:.3f}  chunked {ch:.3f}  "
                  f"ce {c:.3f} ms  fallback/ce {f / c:.2f}x  fallback/chunked {f / ch:.2f}x")


if __name__ == "__main__":
    main()
