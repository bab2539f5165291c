"""FP8 GEMM on the Hopper kernels, the `gemm` suite's weakest blockwise rows: the two-half kernels' buffers
against the default route.

Run by hand: ``PYTHONPATH=src python3 bench/probes/fp8_narrow_tiles.py OUT [routes|kmajor|exact]``.
For suite shapes where 128 x 128 tiles leave part of the last wave of SMs idle, and a few where they do
not, next to torch's scaled matmul and the default route (``matmul``), all on the same inputs (bf16
output); "routes", "kmajor", "exact" (``variants``): the library's kernels on 4 and 5 buffers, blockwise
with either ``scale_a`` layout, and tensorwise and rowwise. Every output is checked against float64 of
the dequantised inputs before its timing. Times in ms: CUDA events, median of 5 batches of 20 calls; the variants run in three
rounds, each in a rotated order, and the median of the rounds is reported; two seconds of bf16 GEMMs
first bring the clocks up. Writes ``OUT/fp8_narrow_tiles_<set>.json`` and prints a table."""
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
import tileweave  # noqa: E402
from fp8_accum import _err, _ms  # noqa: E402
from tileweave.bench.fp8 import quantize_rows, quantize_weight, torch_scaled_mm  # noqa: E402
from tileweave.ops.compute import fp8_sm90, scaling as scaling_mod  # noqa: E402
from tileweave.runtime import triton_launch  # noqa: E402

# (M, N, K): the wave-bound rows first, then rows whose tiles fill their waves
SHAPES = ((4096, 768, 4096), (2048, 1280, 8192), (4096, 1280, 8192), (1024, 5120, 8192), (2048, 3584, 4096),
          (1024, 7168, 8192), (16384, 768, 4096), (8192, 1280, 8192), (4096, 3072, 4096), (8192, 8192, 8192),
          (1024, 4096, 7168), (8192, 8192, 14336))
TOL = 1e-2


def _config(bn, stages, kernel="halves"):
    return {"BM": 128, "BN": bn, "BK": 128, "GROUP_M": 8, "STAGES": stages, "num_warps": 4, "kernel": kernel}


def _library(a8, w8, scales, out, config):
    fp8_sm90.launch(a8, w8.t(), out, None, scales, config=config)


def variants(m, n, k, which):
    """``which`` "routes": the library's two-half and staged kernels on 4 and 5 buffers; "kmajor": the
    two-half kernel with ``scale_a`` K-major (``quantize``'s layout; torch gets its own M-major copy);
    "exact": tensorwise and rowwise with each K step summed in fp32, the default route (the loader-warp
    kernel) against the two-half kernel's turns."""
    if which == "kmajor":  # the staged kernel reads M-major scale_a only (since it lost on K-major ones)
        return {"route": None, "halves_s4": (128, 4), "halves_s5": (128, 5)}
    if which == "routes":
        return {"route": None, "halves_s4": (128, 4), "halves_s5": (128, 5), "staged_s4": (128, 4, "staged"),
                "staged_s5": (128, 5, "staged")}
    if which == "exact":
        return {"route": None, "halves_s4": (128, 4), "halves_s5": (128, 5)}
    raise ValueError(f"unknown set {which!r}: routes, kmajor or exact")


def run_shape(m, n, k, which, scaling="blockwise") -> list[dict]:
    torch.manual_seed(m + n + k)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    a8, sa, a_deq = quantize_rows(x, scaling)
    w8, sb, w_deq = quantize_weight(w, scaling)
    ref = a_deq.double() @ w_deq.double().t()
    torch_sa = sa
    if which == "kmajor":
        sa = sa.contiguous()
    scales = scaling_mod.dense_scales("probe", m, n, k, sa, sb)
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    torch_fn, _ = torch_scaled_mm(scaling)
    calls = {"torch": lambda: torch_fn(a8, w8.t(), torch_sa, sb, out_dtype=torch.bfloat16)}
    for name, v in variants(m, n, k, which).items():
        if v is None:
            calls[name] = lambda: tileweave.matmul(a8, w8.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16,
                                                   out=out)
        else:
            calls[name] = lambda v=v: _library(a8, w8, scales, out, _config(*v))
    rows = {}
    for name, fn in calls.items():
        try:
            out.fill_(float("nan"))
            got = fn()
            got = out if got is None or name != "torch" else got
            torch.cuda.synchronize()
            rows[name] = {"err": _err(got.float(), ref), "times": []}
        except Exception as e:  # noqa: BLE001 - a probe records what fails and goes on
            rows[name] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    names = [nm for nm, r in rows.items() if "err" in r and r["err"] < TOL]
    for r in range(3):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            rows[name]["times"].append(_ms(calls[name]))
    result = []
    for name, r in rows.items():
        ms = statistics.median(r["times"]) if r.get("times") else None
        result.append({"m": m, "n": n, "k": k, "scaling": scaling, "variant": name, "ms": ms,
                       **{kk: v for kk, v in r.items()}})
    return result


def main() -> None:
    out_dir = sys.argv[1]
    which = sys.argv[2] if len(sys.argv) > 2 else "routes"
    triton_launch.install_allocator()
    x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    start = time.perf_counter()
    while time.perf_counter() - start < 2.0:
        x @ x
        torch.cuda.synchronize()
    rows = []
    for scaling in (("tensorwise", "rowwise") if which == "exact" else ("blockwise", )):
        for m, n, k in SHAPES:
            rows += run_shape(m, n, k, which, scaling)
            base = {r["variant"]: r for r in rows if (r["m"], r["n"], r["k"], r["scaling"]) == (m, n, k, scaling)}
            t = base["torch"].get("ms") or float("nan")
            cells = [f"{v}={r['ms']:.4f}({t / r['ms']:.2f})" if r.get("ms")
                     else f"{v}=fail:{r.get('error', r.get('err'))}" for v, r in base.items()]
            print(f"{scaling} {m}x{n}x{k} " + " ".join(cells), flush=True)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"fp8_narrow_tiles_{which}.json"), "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(0), "commit": os.environ.get("TILEWEAVE_GIT_COMMIT"), "set": which,
                   "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
