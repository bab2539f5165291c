"""The Hopper FP8 kernel (``tileweave.ops.compute.fp8_sm90``) against ours on ``tl.dot`` and torch's.

Run by hand: ``PYTHONPATH=src python3 bench/probes/fp8_sm90.py OUT``. First the check: odd shapes (M and
N off the tiles, a bias, float32 and bfloat16 outputs), each scaling, exact and fast accumulation,
against float64 of the dequantised inputs next to torch's error on the same inputs. Then, for a few
GEMM suite shapes and each scaling: the Hopper kernel on several tile/buffer configs, ``tileweave.matmul``
(routed to the Hopper kernel) and on the ``tl.dot`` kernel, ``torch._scaled_mm`` / ``torch.nn.functional.scaled_mm``, exact
(``use_fast_accum=False``) and fast. Times in ms (CUDA events, median of 5 batches of 20 calls, bf16
output), every timed variant's output checked first. Writes ``OUT/fp8_sm90.json`` and prints a table."""
import json
import os
import sys

import torch

import tileweave
from fp8_accum import _err, _ms  # the same timing and error as the earlier probe (run from this folder)
from tileweave.bench.fp8 import quantize_rows, quantize_weight, torch_scaled_mm
from tileweave.ops.compute import fp8_sm90, scaling as scaling_mod
from tileweave.tune.autotune import select_config

SHAPES = ((4096, 3072, 4096), (8192, 7168, 8192), (8192, 8192, 14336), (8192, 4096, 512), (16384, 8192, 8192),
          (4096, 768, 4096))
CHECK_SHAPES = ((1000, 1000, 384), (257, 520, 128), (4096, 4096, 8192))
EXACT = {"s4": {"BM": 128, "BN": 128, "BK": 128, "STAGES": 4, "GROUP_M": 8, "num_warps": 8},
         "s5": {"BM": 128, "BN": 128, "BK": 128, "STAGES": 5, "GROUP_M": 8, "num_warps": 8}}
FAST = {"w256": {"BM": 128, "BN": 256, "BK": 128, "STAGES": 3, "GROUP_M": 8, "num_warps": 8}}


def _hopper(a8, w8, sa, sb, fast, out_dtype=torch.bfloat16, bias=None, config=None):
    m, n = a8.shape[0], w8.shape[0]
    scales = scaling_mod.dense_scales("probe", m, n, a8.shape[1], sa, sb, fast_accum=fast)
    out = torch.empty(m, n, device="cuda", dtype=out_dtype)
    assert fp8_sm90.suits(a8, w8.t(), out, scales)
    fp8_sm90.launch(a8, w8.t(), out, bias, scales, config=config)
    return out


def _inputs(m, n, k, scaling):
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    a8, sa, a_deq = quantize_rows(x, scaling)
    w8, sb, w_deq = quantize_weight(w, scaling)
    return a8, sa, w8, sb, a_deq.double() @ w_deq.double().t()


def check() -> list[dict]:
    rows = []
    for m, n, k in CHECK_SHAPES:
        for scaling in ("tensorwise", "rowwise", "blockwise"):
            a8, sa, w8, sb, ref = _inputs(m, n, k, scaling)
            bias = torch.randn(n, device="cuda", dtype=torch.float32)
            for fast in ((False, True) if scaling != "blockwise" else (False,)):
                got = _hopper(a8, w8, sa, sb, fast, torch.float32, bias)
                row = {"m": m, "n": n, "k": k, "scaling": scaling, "fast": fast,
                       "err_f32": _err(got - bias, ref),
                       "err_bf16": _err(_hopper(a8, w8, sa, sb, fast).float(), ref)}
                if scaling != "blockwise":
                    try:  # torch takes dimensions that are multiples of 16 only
                        row["torch_err_f32"] = _err(torch._scaled_mm(a8, w8.t(), scale_a=sa, scale_b=sb,
                                                                     out_dtype=torch.float32, use_fast_accum=fast), ref)
                    except RuntimeError:
                        row["torch_err_f32"] = None
                rows.append(row)
                print(json.dumps({key: round(v, 8) if isinstance(v, float) else v for key, v in row.items()}),
                      flush=True)
    return rows


def timing() -> list[dict]:
    rows = []
    for m, n, k in SHAPES:
        for scaling in ("tensorwise", "rowwise", "blockwise"):
            a8, sa, w8, sb, ref = _inputs(m, n, k, scaling)
            theirs, _ = torch_scaled_mm(scaling)
            row = {"m": m, "n": n, "k": k, "scaling": scaling}
            for fast in ((False, True) if scaling != "blockwise" else (False,)):
                tag = "fast" if fast else "exact"
                for name, config in (FAST if fast else EXACT).items():
                    out = _hopper(a8, w8, sa, sb, fast, config=config)
                    row[f"hopper_{tag}_{name}_err"] = _err(out.float(), ref)
                    row[f"hopper_{tag}_{name}_ms"] = _ms(lambda: _hopper(a8, w8, sa, sb, fast, config=config))
                mode = scaling_mod.dense_scales("probe", m, n, k, sa, sb, fast_accum=fast).kernel_mode
                tl_config = select_config(m, n, k, a8.dtype, a8.device, num_sms=132, out_dtype=torch.bfloat16,
                                          scaling=mode)
                tl = lambda: tileweave.matmul(a8, w8.t(), scale_a=sa, scale_b=sb, use_fast_accum=fast,
                                              config=tl_config)
                row[f"tl_{tag}_err"] = _err(tl().float(), ref)
                row[f"tl_{tag}_ms"] = _ms(tl)
                ours = lambda: tileweave.matmul(a8, w8.t(), scale_a=sa, scale_b=sb, use_fast_accum=fast)
                row[f"matmul_{tag}_err"] = _err(ours().float(), ref)
                row[f"matmul_{tag}_ms"] = _ms(ours)
                if scaling != "blockwise":
                    call = lambda: torch._scaled_mm(a8, w8.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16,
                                                    use_fast_accum=fast)
                elif theirs is not None:
                    call = lambda: theirs(a8, w8.t(), sa, sb)
                else:
                    continue
                row[f"torch_{tag}_err"] = _err(call().float(), ref)
                row[f"torch_{tag}_ms"] = _ms(call)
            rows.append(row)
            best = {tag: min((v for key, v in row.items() if key.startswith(f"hopper_{tag}") and key.endswith("_ms")),
                             default=None) for tag in ("exact", "fast")}
            summary = {tag: round(row[f"torch_{tag}_ms"] / best[tag], 3) for tag in ("exact", "fast")
                       if best[tag] and f"torch_{tag}_ms" in row}
            print(json.dumps({key: round(v, 5) if isinstance(v, float) else v for key, v in row.items()}), flush=True)
            print(f"  {m}x{n}x{k} {scaling}: torch / best hopper {summary}; torch / matmul exact "
                  f"{round(row.get('torch_exact_ms', 0) / row['matmul_exact_ms'], 3)}; torch / tl exact "
                  f"{round(row.get('torch_exact_ms', 0) / row['tl_exact_ms'], 3)}", flush=True)
    return rows


HOST_SHAPES = ((4096, 4096, 512), (4096, 768, 4096))


def _graph_ms(fn) -> float:
    """Per call, replayed from a CUDA graph of 20 calls: the GPU's time without the host's."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(20):
            fn()
    return _ms(graph.replay) / 20


def host() -> list[dict]:
    """Host time per call (back-to-back calls, no synchronisation) against the GPU's time per call (graph
    replay), for small GEMMs where the host may be the bound; and where the FP8 call's host time goes."""
    import cProfile
    import pstats
    import time
    rows = []
    for m, k, n in HOST_SHAPES:
        a8, sa, w8, sb, _ = _inputs(m, n, k, "rowwise")
        xb, wb = torch.randn(m, k, device="cuda", dtype=torch.bfloat16), torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        calls = {"fp8_rowwise": lambda: tileweave.matmul(a8, w8.t(), scale_a=sa, scale_b=sb),
                 "bf16": lambda: tileweave.matmul(xb, wb.t()),
                 "torch_fp8_rowwise": lambda: torch._scaled_mm(a8, w8.t(), scale_a=sa, scale_b=sb,
                                                               out_dtype=torch.bfloat16)}
        row = {"m": m, "n": n, "k": k}
        for name, fn in calls.items():
            for _ in range(10):
                fn()
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(100):
                fn()
            row[f"{name}_host_us"] = (time.perf_counter() - start) * 1e4
            torch.cuda.synchronize()
            row[f"{name}_graph_ms"] = _graph_ms(fn)
            row[f"{name}_ms"] = _ms(fn)
        rows.append(row)
        print(json.dumps({key: round(v, 4) if isinstance(v, float) else v for key, v in row.items()}), flush=True)
    profile = cProfile.Profile()
    fn = calls["fp8_rowwise"]
    profile.enable()
    for _ in range(200):
        fn()
    profile.disable()
    pstats.Stats(profile).sort_stats("tottime").print_stats(15)
    return rows


def main() -> None:
    out_dir = sys.argv[1]
    result = {"gpu": torch.cuda.get_device_name(0), "commit": os.environ.get("TILEWEAVE_GIT_COMMIT"),
              "torch": torch.__version__, "host": host(), "check": check(), "timing": timing()}
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "fp8_sm90.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
