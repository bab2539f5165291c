"""Each staged blockwise kernel variant in its own process: checked against float64 (M, N off the tiles),
then timed beside the two-half kernel and torch. ``PYTHONPATH=../../../src python3 run.py OUT``."""
import importlib
import json
import os
import subprocess
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

VARIANTS = ("v_pick4", )
CHECKS = ((2000, 2000, 512), (2000, 2048, 2048))
UNALIGNED = ((2000, 2000, 1792), )  # a weight-scale pitch TMA cannot step over (read as one row)
TIMED = ((8192, 8192, 8192), (4096, 4096, 4096), (16384, 1536, 8192), (8192, 8192, 28672), (8192, 4096, 512))
CONFIG = {"BM": 128, "BN": 128, "BK": 128, "GROUP_M": 8, "STAGES": 4, "num_warps": 4, "kernel": "staged"}


def _inputs(m, n, k):
    from tileweave.bench.fp8 import quantize_rows, quantize_weight
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    a8, sa, a_deq = quantize_rows(x, "blockwise")
    w8, sb, w_deq = quantize_weight(w, "blockwise")
    return a8, sa, w8, sb, a_deq.double() @ w_deq.double().t()


def _launcher(module, m, n, k, a8, sa, w8, sb, stages):
    from tileweave.ops.compute import fp8_sm90, scaling as scaling_mod
    from tileweave.runtime import triton_launch
    triton_launch.install_allocator()
    scales = scaling_mod.dense_scales("matmul", m, n, k, sa, sb)
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    cfg = dict(CONFIG, STAGES=stages)
    grid, tensors, ints, constexprs, options = fp8_sm90.arguments(a8, w8.t(), out, None, scales, config=cfg,
                                                                   programs=132)
    kern = module.fp8_gemm_sm90_staged_kernel
    return out, lambda: kern[(grid, )](*tensors, *ints, *constexprs, **options)


def child(name, out_dir):
    from fp8_accum import _err, _ms
    module = importlib.import_module(name)
    rows = []
    for shape in CHECKS + TIMED + UNALIGNED:
        m, n, k = shape
        a8, sa, w8, sb, ref = _inputs(m, n, k)
        for stages in (4, 5):
            out, call = _launcher(module, m, n, k, a8, sa, w8, sb, stages)
            call()
            torch.cuda.synchronize()
            row = {"variant": name, "shape": shape, "stages": stages, "err": _err(out.float(), ref)}
            if shape in TIMED:
                row["ms"] = _ms(call)
            rows.append(row)
            print(json.dumps(row), flush=True)
    with open(f"{out_dir}/{name}.json", "w") as fh:
        json.dump(rows, fh)


def base(out_dir):
    from fp8_accum import _err, _ms
    from fp8_sm90 import _hopper
    from tileweave.bench.fp8 import torch_scaled_mm
    theirs, _ = torch_scaled_mm("blockwise")
    halves = {"BM": 128, "BN": 128, "BK": 128, "GROUP_M": 8, "STAGES": 4, "num_warps": 4, "kernel": "halves"}
    plain = {"BM": 128, "BN": 128, "BK": 128, "GROUP_M": 8, "STAGES": 5, "num_warps": 8, "kernel": "plain"}
    rows = []
    for m, n, k in TIMED:
        a8, sa, w8, sb, ref = _inputs(m, n, k)
        row = {"variant": "base", "shape": (m, n, k)}
        for tag, cfg in (("halves", halves), ("plain", plain)):
            row[f"{tag}_err"] = _err(_hopper(a8, w8, sa, sb, False, config=cfg).float(), ref)
            row[f"{tag}_ms"] = _ms(lambda: _hopper(a8, w8, sa, sb, False, config=cfg))
        row["torch_err"] = _err(theirs(a8, w8.t(), sa, sb).float(), ref)
        row["torch_ms"] = _ms(lambda: theirs(a8, w8.t(), sa, sb))
        rows.append(row)
        print(json.dumps(row), flush=True)
    with open(f"{out_dir}/base.json", "w") as fh:
        json.dump(rows, fh)


if __name__ == "__main__":
    out_dir = sys.argv[1]
    if len(sys.argv) > 2:
        (base if sys.argv[2] == "base" else lambda o: child(sys.argv[2], o))(out_dir)
        sys.exit(0)
    for name in VARIANTS + ("base", ):
        env = dict(os.environ, CUDA_LAUNCH_BLOCKING="1") if name != "base" else os.environ
        done = subprocess.run([sys.executable, __file__, out_dir, name], capture_output=True, text=True, timeout=150,
                              env=env)
        print(f"== {name}: rc {done.returncode}")
        print(done.stdout[-3000:])
        if done.returncode:
            print(done.stderr[-1500:])
