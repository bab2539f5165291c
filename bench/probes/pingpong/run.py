"""Probe: the two-half FP8 kernel with its warp groups' MMAs in strict alternation (``v_pingpong``: scales
from global memory; ``v_pp_staged``: scales staged in shared memory by the loader warp), each in its own
process, checked against float64 (M, N off the tiles) and timed beside the default kernels and torch's.
``PYTHONPATH=../../../src python3 run.py OUT``."""
import importlib
import json
import os
import subprocess
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]

VARIANTS = {  # name: (module, kernel, scaling, launcher config kernel, stages)
    "pp_block_s4": ("v_pingpong", "fp8_gemm_sm90_pingpong_kernel", "blockwise", "halves", 4),
    "pp_staged_s5": ("v_pp_staged", "fp8_gemm_sm90_staged_kernel", "blockwise", "staged", 5),
    "pp_exact_s5": ("v_pingpong", "fp8_gemm_sm90_pingpong_kernel", "tensorwise", "halves", 5),
}
CHECKS = ((2000, 2000, 512), (1000, 2048, 2048))
TIMED = ((8192, 8192, 8192), (4096, 4096, 4096), (16384, 1536, 8192), (8192, 8192, 28672), (8192, 4096, 512))


def _inputs(m, n, k, scaling):
    from tileweave.bench.fp8 import quantize_rows, quantize_weight
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    a8, sa, a_deq = quantize_rows(x, scaling)
    w8, sb, w_deq = quantize_weight(w, scaling)
    return a8, sa, w8, sb, a_deq.double() @ w_deq.double().t()


def child(name, out_dir):
    from fp8_accum import _err, _ms
    from tileweave.ops.compute import fp8_sm90, scaling as scaling_mod
    from tileweave.runtime import triton_launch
    triton_launch.install_allocator()
    module, attr, scaling, kind, stages = VARIANTS[name]
    kern = getattr(importlib.import_module(module), attr)
    cfg = {"BM": 128, "BN": 128, "BK": 128, "GROUP_M": 8, "STAGES": stages, "num_warps": 4, "kernel": kind}
    rows = []
    for m, n, k in CHECKS + TIMED:
        a8, sa, w8, sb, ref = _inputs(m, n, k, scaling)
        scales = scaling_mod.dense_scales("matmul", m, n, k, sa, sb)
        out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        grid, tensors, ints, constexprs, options = fp8_sm90.arguments(a8, w8.t(), out, None, scales, config=cfg,
                                                                       programs=132)
        call = lambda: kern[(grid, )](*tensors, *ints, *constexprs, **options)
        call()
        torch.cuda.synchronize()
        row = {"variant": name, "shape": (m, n, k), "err": _err(out.float(), ref)}
        if (m, n, k) in TIMED:
            row["ms"] = _ms(call)
        rows.append(row)
        print(json.dumps(row), flush=True)
        del a8, w8, ref
        torch.cuda.empty_cache()
    with open(f"{out_dir}/{name}.json", "w") as fh:
        json.dump(rows, fh)


def base(out_dir):
    from fp8_accum import _err, _ms
    from fp8_sm90 import _hopper
    from tileweave.bench.fp8 import torch_scaled_mm
    cfgs = {"blockwise": {"halves": {"kernel": "halves", "num_warps": 4, "STAGES": 4},
                          "plain": {"kernel": "plain", "num_warps": 8, "STAGES": 5}},
            "tensorwise": {"loader": {"kernel": "loader", "num_warps": 8, "STAGES": 5, "maxnreg": 168}}}
    rows = []
    for m, n, k in TIMED:
        for scaling, kinds in cfgs.items():
            a8, sa, w8, sb, ref = _inputs(m, n, k, scaling)
            row = {"variant": "base", "scaling": scaling, "shape": (m, n, k)}
            for tag, extra in kinds.items():
                cfg = dict({"BM": 128, "BN": 128, "BK": 128, "GROUP_M": 8}, **extra)
                row[f"{tag}_err"] = _err(_hopper(a8, w8, sa, sb, False, config=cfg).float(), ref)
                row[f"{tag}_ms"] = _ms(lambda: _hopper(a8, w8, sa, sb, False, config=cfg))
            theirs, _ = torch_scaled_mm(scaling)
            row["torch_err"] = _err(theirs(a8, w8.t(), sa, sb).float(), ref)
            row["torch_ms"] = _ms(lambda: theirs(a8, w8.t(), sa, sb))
            rows.append(row)
            print(json.dumps(row), flush=True)
            del a8, w8, ref
            torch.cuda.empty_cache()
    with open(f"{out_dir}/base.json", "w") as fh:
        json.dump(rows, fh)


if __name__ == "__main__":
    out_dir = sys.argv[1]
    if len(sys.argv) > 2:
        (base if sys.argv[2] == "base" else lambda o: child(sys.argv[2], o))(out_dir)
        sys.exit(0)
    for name in (*VARIANTS, "base"):
        try:
            done = subprocess.run([sys.executable, __file__, out_dir, name], capture_output=True, text=True,
                                  timeout=120)
            print(f"== {name}: rc {done.returncode}\n{done.stdout[-2500:]}", flush=True)
            if done.returncode:
                print(done.stderr[-1200:], flush=True)
        except subprocess.TimeoutExpired as e:
            print(f"== {name}: timed out\n{(e.stdout or b'')[-2000:]}", flush=True)
