"""Decode-shaped bf16 GEMMs (M = 1-256 tokens) against the weight-read floor: cuBLAS (``x @ w.t()``),
``tileweave.matmul``'s default route, and split-K configurations (``tileweave.kernels.splitk``), on the
shard shapes of Llama-3-8B and -70B (qkv, o, gate_up, down) at TP 1, 2 and 8.

Every call reads a different copy of the weight (at least 256 MB of copies in turn, so L2 never holds the
next one, as in a decode step where each layer reads its own weights); times are CUDA-graph replays of
20 calls, the median of 5. Every variant's output is checked against float64 first. The floor is the
weight's bytes over the device's nominal HBM bandwidth (``PEAK_BW``); ``read_bw`` is what a plain read
(``torch.sum``) of 1 GiB reaches on the same device. Run by hand:
``PYTHONPATH=src python3 bench/probes/decode_splitk.py OUT [quick]``."""
import json
import statistics
import sys

import torch

import tileweave
from tileweave.ops.compute import splitk
from tileweave.tune.configs import choose_gemm_config
from tileweave.tune.splitk import SplitKConfig, choose_splitk_config

PEAK_BW = {"H100": 3.35e12, "H200": 4.8e12}
MODELS = {"llama3-8b": (4096, 14336, 32, 8, 128), "llama3-70b": (8192, 28672, 64, 8, 128)}
M_VALUES = (1, 8, 16, 32, 64, 128, 256)
VARIANTS = {
    "bn64_bk128_s4_p2": dict(block_n=64, block_k=128, num_stages=4, programs_per_sm=2),
    "bn64_bk128_s4_p2_tma": dict(block_n=64, block_k=128, num_stages=4, programs_per_sm=2, tma=True),
    "bn32_bk128_s4_p4_tma": dict(block_n=32, block_k=128, num_stages=4, programs_per_sm=4, tma=True),
    "bn64_bk256_s3_p2_tma": dict(block_n=64, block_k=256, num_stages=3, programs_per_sm=2, tma=True),
    "bn64_bk128_s6_p2_tma": dict(block_n=64, block_k=128, num_stages=6, programs_per_sm=2, tma=True),
    "bn32_bk256_s4_p2_tma": dict(block_n=32, block_k=256, num_stages=4, programs_per_sm=2, tma=True),
    "bn32_bk256_s4_x1_tma": dict(block_n=32, block_k=256, num_stages=4, splits=1, tma=True),
    "bn16_bk512_s4_x1_tma": dict(block_n=16, block_k=512, num_stages=4, splits=1, tma=True),
    "bn16_bk256_s6_p2_tma": dict(block_n=16, block_k=256, num_stages=6, programs_per_sm=2, tma=True),
}


def shapes(quick: bool):
    out = []
    for model, (h, f, heads, kv, hd) in MODELS.items():
        for tp in ((1, 8) if quick else (1, 2, 8)):
            out += [(f"{model} qkv tp{tp}", (heads + 2 * kv) * hd // tp, h),
                    (f"{model} o tp{tp}", h, h // tp),
                    (f"{model} gate_up tp{tp}", 2 * f // tp, h),
                    (f"{model} down tp{tp}", h, f // tp)]
    return out


def peak_bw() -> float:
    name = torch.cuda.get_device_name()
    return next((bw for key, bw in PEAK_BW.items() if key in name), 3.35e12)


def read_bw() -> float:
    x = torch.empty(1 << 29, dtype=torch.bfloat16, device="cuda").normal_()
    ms = graph_ms(lambda: x.sum())
    return x.numel() * 2 / (ms * 1e-3)


def graph_ms(call, iters: int = 20, reps: int = 5) -> float:
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            call()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / iters)
    return statistics.median(times)


def err(got, ref) -> float:
    got = got.double()
    return float((got - ref).norm() / ref.norm().clamp_min(1e-30))


def main(out: str, quick: bool = False):
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    bw = peak_bw()
    meta = {"gpu": torch.cuda.get_device_name(), "peak_bw": bw, "read_bw": read_bw(), "sms": sms,
            "torch": torch.__version__}
    print(meta, flush=True)
    rows = []
    for name, n, k in shapes(quick):
        wbytes = n * k * 2
        copies = max(1, min(64, -(-(256 << 20) // wbytes)))
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5 for _ in range(copies)]
        for m in (M_VALUES[:4] if quick else M_VALUES):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = x.double() @ ws[0].double().t()
            state = {"i": 0}

            def rotate():
                w = ws[state["i"] % copies]
                state["i"] += 1
                return w

            tile = choose_gemm_config(m, n, k, torch.bfloat16, num_sms=sms)
            calls = {"cublas": lambda: x @ rotate().t(),
                     "default": lambda: tileweave.matmul(x, rotate().t()),
                     "tile": lambda: tileweave.matmul(x, rotate().t(), config=tile)}
            plans = {}
            for tag, fields in VARIANTS.items():
                if m > 64:
                    continue
                bm = 16 if m <= 16 else 32 if m <= 32 else 64
                cfg = SplitKConfig(block_m=bm, **fields)

                def call(cfg=cfg, tag=tag):
                    w = rotate()
                    outp = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
                    plan = plans.get(tag)
                    if plan is None:
                        plans[tag] = splitk.launch(x, w.t(), outp, None, cfg, num_sms=sms)
                    else:
                        splitk.relaunch(plan, x, w.t(), outp, None)
                    return outp
                calls["sk_" + tag] = call
            row = {"shape": name, "n": n, "k": k, "m": m, "floor_ms": wbytes / bw * 1e3,
                   "route": str(choose_splitk_config(m, n, k, torch.bfloat16, num_sms=sms))}
            for tag, fn in calls.items():
                try:
                    state["i"] = 0
                    got = fn()
                    row[f"{tag}_err"] = err(got, ref)
                    if row[f"{tag}_err"] > 1e-2:
                        row[f"{tag}_error"] = f"error {row[f'{tag}_err']:.2e}"
                        continue
                    row[f"{tag}_ms"] = graph_ms(fn)
                except Exception as e:  # noqa: BLE001 - recorded, the others still run
                    row[f"{tag}_error"] = repr(e)[:300]
            sk = {key: v for key, v in row.items() if key.startswith("sk_") and key.endswith("_ms")}
            best = min(sk, key=sk.get) if sk else None
            row["best_sk"] = best
            rows.append(row)
            print(f"{name:26s} M={m:4d} floor {row['floor_ms'] * 1e3:7.1f} cublas {row.get('cublas_ms', 0) * 1e3:7.1f} "
                  f"default {row.get('default_ms', 0) * 1e3:7.1f} best {best} {sk.get(best, 0) * 1e3:7.1f} us "
                  f"| floor/cublas {row['floor_ms'] / row.get('cublas_ms', 1e9):.2f} "
                  f"floor/best {row['floor_ms'] / sk.get(best, 1e9):.2f} "
                  f"cublas/best {row.get('cublas_ms', 0) / sk.get(best, 1e9):.2f}", flush=True)
            errs = {key: v for key, v in row.items() if key.endswith("_error")}
            if errs:
                print("   ", errs, flush=True)
        del ws
        torch.cuda.empty_cache()
    with open(f"{out}/decode_splitk.json", "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    # Per variant: geomean of floor/time over the M <= 64 rows, and rows below cuBLAS.
    import math
    for tag in ["default", "tile", "cublas"] + ["sk_" + t for t in VARIANTS]:
        for lo, hi in ((1, 16), (17, 64), (65, 256)):
            sel = [r for r in rows if lo <= r["m"] <= hi and f"{tag}_ms" in r]
            vals = [r["floor_ms"] / r[f"{tag}_ms"] for r in sel]
            over = [r["cublas_ms"] / r[f"{tag}_ms"] for r in sel if "cublas_ms" in r]
            lose = sum(1 for v in over if v < 1)
            if vals:
                print(f"{tag:24s} M {lo}-{hi}: floor/ours {math.exp(sum(map(math.log, vals)) / len(vals)):.3f}, "
                      f"cublas/ours {math.exp(sum(map(math.log, over)) / len(over)):.3f} over {len(vals)} rows; "
                      f"slower than cuBLAS on {lose}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], quick=len(sys.argv) > 2 and sys.argv[2] == "quick")
