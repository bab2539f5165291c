"""The GEMM core's tile configurations on one GPU, next to cuBLAS: per local GEMM of the suite, the
default choice, whole tiles of two sizes and stream-K of two sizes. For choosing the thresholds of
``tileweave.tune.configs`` from measurements (the ``gemm`` bench section times the default only).

    python3 scripts/gemm_probe.py [--out DIR] [--m 1024,2048,...] [--below 0.95]

``--shapes 1024x768x4096,...`` times those instead; ``--narrow`` adds small-tile and warp-specialised
variants. ``--timeline 1024x768x4096,...`` runs one stream-K launch per shape with the kernel's
per-program TIMELINE record (when each program finished its whole-tile waves, each segment's main loop
and its store or fix-up) and prints medians and maxima per phase. ``--below`` keeps the shapes whose default ran under that ratio to cuBLAS in the last ``gemm`` section
given with ``--previous`` (all shapes without it). Prints one line per shape, writes JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

import tileweave  # noqa: E402
from tileweave.bench.suite import gemm_shapes, parse_ints  # noqa: E402
from tileweave.tune.autotune import time_ms  # noqa: E402
from tileweave.tune.configs import GemmConfig, choose_gemm_config  # noqa: E402

VARIANTS = {
    "dp128x256": GemmConfig(),
    "dp128x128": GemmConfig(block_n=128, num_stages=4),
    "sk128x128": GemmConfig(block_n=128, num_stages=4, stream_k=True),
    "sk128x256": GemmConfig(stream_k=True),
}
NARROW_VARIANTS = {
    "dp64x128": GemmConfig(block_m=64, block_n=128, num_stages=4, num_warps=4),
    "dp128x64": GemmConfig(block_n=64, num_stages=4, num_warps=4),
    "dp64x64": GemmConfig(block_m=64, block_n=64, num_stages=4, num_warps=4),
    "ws128x128": GemmConfig(block_n=128, num_stages=4, warp_specialize=True),
    "sk64x128": GemmConfig(block_m=64, block_n=128, num_stages=4, num_warps=4, stream_k=True),
}


def _host_us(fn, calls=50) -> float:
    # The host's time to issue one call (no sync inside), as the benchmark's host column.
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t0) / calls * 1e6
    torch.cuda.synchronize()
    return host


def timeline(m: int, n: int, k: int, config: GemmConfig, device: torch.device) -> dict:
    """One stream-K launch with the kernel's TIMELINE record: per program, when it started, finished
    its whole-tile waves, and each stream-K segment's start, main loop and end (store or partial and
    fix-up). Returns medians and maxima of each phase in microseconds, and the launch's span."""
    from tileweave.kernels.gemm import TIMELINE_SLOTS, fused_gemm_kernel
    from tileweave.ops import _launch

    a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=device, dtype=torch.bfloat16) / k ** 0.5
    captured = {}

    def capture(tensors, unspecialized, ints, constexprs, num_warps, num_stages, programs, compile_only=False):
        captured.update(tensors=tensors, unspecialized=unspecialized, ints=ints, constexprs=constexprs,
                        num_warps=num_warps, num_stages=num_stages, programs=programs)

    real = _launch._run
    _launch._run = capture
    try:
        out = torch.empty(m, n, device=device, dtype=torch.bfloat16)
        _launch.launch(mode=_launch.MODE_PLAIN, a=a, b=w.t(), c=out, bias=None, config=config, m_chunk=m,
                       programs=torch.cuda.get_device_properties(device).multi_processor_count)
    finally:
        _launch._run = real
    programs = captured["programs"]
    record = torch.zeros(programs, int(TIMELINE_SLOTS), dtype=torch.int64, device=device)
    tensors = list(captured["tensors"])
    tensors[8] = record  # err_ptr carries the record in a TIMELINE launch
    names = {**dict(zip(_launch._CONSTEXPR_NAMES, captured["constexprs"])), "TIMELINE": True}
    for _ in range(3):  # warm: the last launch is the one recorded
        record.zero_()
        fused_gemm_kernel[(programs,)](*tensors, *captured["unspecialized"], *captured["ints"], **names,
                                       num_warps=captured["num_warps"], num_stages=captured["num_stages"])
    torch.cuda.synchronize(device)
    err = ((out.float() - (a @ w.t()).float()).norm() / (a @ w.t()).float().norm()).item()
    t = record.cpu().double()
    start = t[:, 0].min()
    us = lambda x: (x / 1e3).tolist()  # noqa: E731

    def phase(a_slot, b_slot):
        valid = (t[:, a_slot] > 0) & (t[:, b_slot] > 0)
        d = (t[valid, b_slot] - t[valid, a_slot]) / 1e3
        return {"n": int(valid.sum()), "median_us": float(d.median()) if len(d) else 0.0,
                "max_us": float(d.max()) if len(d) else 0.0}

    return {"m": m, "n": n, "k": k, "config": config.key(), "programs": programs, "rel_err": err,
            "span_us": float((t[:, 14].max() - start) / 1e3), "start_skew_us": float((t[:, 0].max() - start) / 1e3),
            "dp_waves": phase(0, 1),
            "segments": [{"mainloop": phase(2 + 3 * i, 3 + 3 * i), "finish": phase(3 + 3 * i, 4 + 3 * i)}
                         for i in range(4)],
            "end_after_start_us": us((t[:, 14] - start).sort().values)[-5:]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=".")
    parser.add_argument("--m", default="1024,2048,4096,8192,16384")
    parser.add_argument("--previous", default=None, help="a gemm section JSON to select shapes from")
    parser.add_argument("--below", type=float, default=2.0)
    parser.add_argument("--shapes", default=None, help="MxNxK comma list instead of the suite's")
    parser.add_argument("--narrow", action="store_true", help="also small-tile and warp-specialised variants")
    parser.add_argument("--timeline", default=None,
                        help="MxNxK comma list: one stream-K launch each with the kernel's per-program record")
    args = parser.parse_args()
    if args.timeline:
        device = torch.device("cuda", 0)
        records = []
        for shape in args.timeline.split(","):
            m, n, k = (int(x) for x in shape.split("x"))
            for name in ("sk128x128", "sk128x256"):
                r = timeline(m, n, k, VARIANTS[name], device)
                records.append(r)
                segs = " ".join(f"seg{i}: loop {sg['mainloop']['median_us']:.1f}/{sg['mainloop']['max_us']:.1f} "
                                f"finish {sg['finish']['median_us']:.1f}/{sg['finish']['max_us']:.1f} (n={sg['mainloop']['n']})"
                                for i, sg in enumerate(r["segments"]) if sg["mainloop"]["n"])
                print(f"{shape} {name} P={r['programs']} span {r['span_us']:.1f} us, start skew "
                      f"{r['start_skew_us']:.1f}, waves {r['dp_waves']['median_us']:.1f}/{r['dp_waves']['max_us']:.1f}, "
                      f"{segs} err {r['rel_err']:.1e}", flush=True)
        with open(os.path.join(args.out, "gemm_timeline.json"), "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(device), "commit": os.environ.get("TILEWEAVE_GIT_COMMIT"),
                       "records": records}, f, indent=1)
        return 0
    variants = {**VARIANTS, **(NARROW_VARIANTS if args.narrow else {})}
    device = torch.device("cuda", 0)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    shapes = gemm_shapes(m_values=parse_ints(args.m, name="--m"))
    if args.shapes:
        from tileweave.bench.suite import GemmShape

        shapes = [GemmShape(**dict(zip("mnk", map(int, t.split("x")))), sources=("given",))
                  for t in args.shapes.split(",")]
    if args.previous:
        prev = {(s["m"], s["n"], s["k"]): s.get("x_cublas") for s in json.load(open(args.previous))["shapes"]}
        shapes = [s for s in shapes if (prev.get((s.m, s.n, s.k)) or 0) < args.below]
    g = torch.Generator(device=device).manual_seed(7)
    rows = []
    for s in shapes:
        a = torch.randn(s.m, s.k, device=device, dtype=torch.bfloat16, generator=g)
        w = torch.randn(s.n, s.k, device=device, dtype=torch.bfloat16, generator=g) / s.k ** 0.5
        ref = torch.matmul(a, w.t())
        row = {"m": s.m, "n": s.n, "k": s.k, "layer": s.sources[0],
               "default": choose_gemm_config(s.m, s.n, s.k, torch.bfloat16, num_sms=sms).key()}
        row["cublas"] = time_ms(lambda: torch.matmul(a, w.t()), device, warmup=10, iters=20, reps=7)
        for name, config in [("default", None), *variants.items()]:
            try:
                out = tileweave.matmul(a, w.t(), config=config)
                err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                if not err < 1e-2:
                    row[name] = f"wrong ({err:.2e})"
                    continue
                row[name] = time_ms(lambda: tileweave.matmul(a, w.t(), config=config), device,
                                    warmup=10, iters=20, reps=7)
                if name == "default":
                    row["host_us"] = _host_us(lambda: tileweave.matmul(a, w.t()))
            except Exception as e:  # noqa: BLE001 - a config that cannot run here is reported, not fatal
                row[name] = f"error: {type(e).__name__}: {str(e)[:80]}"
        rows.append(row)
        ratios = " ".join(f"{n}={row['cublas'] / row[n]:.2f}" if isinstance(row[n], float) else f"{n}={row[n]}"
                          for n in ["default", *variants])
        print(f"{s.m:6d}x{s.n:6d}x{s.k:6d} cublas {row['cublas'] * 1e3:8.1f} us host {row.get('host_us', 0):5.1f} us "
              f"{ratios}", flush=True)
    with open(os.path.join(args.out, "gemm_probe.json"), "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(device), "commit": os.environ.get("TILEWEAVE_GIT_COMMIT"),
                   "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
