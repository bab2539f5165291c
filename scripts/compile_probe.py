"""Compile the GEMM core for sm_90 on a machine without a GPU and summarise what the compiler made of a
configuration's K loop: the MMA ops (async or not), their waits, the shared-memory buffers (pipeline
depth), registers and spills (ptxas), so a slow configuration can be looked at without GPU time.

    python3 scripts/compile_probe.py --configs "64x128w4s6,64x64+32w4s6" [--mode ag --world 2] [--out DIR]

A configuration is ``BMxBN[+BN2]w<warps>s<stages>[ct0][nf]`` (``ct0``: pointer stores for C, ``nf``: no
flattened loop). Writes each TTGIR and PTX to ``--out`` and prints one line per configuration.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

from tileweave.kernels.gemm import fused_gemm_kernel  # noqa: E402
from tileweave.ops import _launch  # noqa: E402

POINTERS = ("a_ptr", "buf_ptr", "b_ptr", "c_ptr", "bias_ptr", "peer_offs_ptr", "peer_flags_ptr", "flags_ptr",
            "err_ptr", "part_ptr", "locks_ptr")


def parse(spec: str) -> dict:
    m = re.fullmatch(r"(\d+)x(\d+)(?:\+(\d+))?w(\d+)s(\d+)(ct0)?(nf)?", spec)
    if not m:
        raise SystemExit(f"bad configuration {spec!r}")
    bm, bn, bn2, warps, stages, ct0, nf = m.groups()
    return dict(BM=int(bm), BN=int(bn), BN2=int(bn2 or 0), num_warps=int(warps), num_stages=int(stages),
                C_TMA=not ct0, FLATTEN=not nf)


def compile_one(spec: str, b_nk: bool, programs: int = 132, mode: int = 0, world: int = 1):
    p = parse(spec)
    signature = {name: "*bf16" for name in POINTERS}
    for name in ("flags_ptr", "err_ptr", "locks_ptr", "peer_offs_ptr", "peer_flags_ptr"):
        signature[name] = "*i32"
    signature["part_ptr"] = "*fp32"
    for name in ("epoch", "m_chunk", "N", "K", "rank", "stride_am", "stride_ak", "stride_bk", "stride_bn",
                 "stride_cm", "stride_cn"):
        signature[name] = "i32"
    signature["max_spin"] = "i64"
    constexprs = dict(BM=p["BM"], BN=p["BN"], BN2=p["BN2"], BK=64, GROUP_M=8, P=programs, MODE=mode, WORLD=world,
                      B_NK=b_nk, HAS_BIAS=False, USE_TMA=True, C_TMA=p["C_TMA"], FLATTEN=p["FLATTEN"],
                      WARP_SPECIALIZE=False, PRECISION=None, LAZY_WAIT=False, COPY_ENGINE=False, RING=False,
                      CE_RELEASE=0, STREAM_K=False, TIMELINE=False)
    assert set(constexprs) == set(_launch._CONSTEXPR_NAMES)
    for name in constexprs:
        signature[name] = "constexpr"
    signature = {name: signature[name] for name in fused_gemm_kernel.arg_names}
    # 16-byte aligned pointers and strides divisible by 16, as the library's launches have them.
    attrs = {(fused_gemm_kernel.arg_names.index(n),): [["tt.divisibility", 16]]
             for n in (*POINTERS, "stride_am", "stride_bk", "stride_bn", "stride_cm", "N", "K", "m_chunk")
             if n not in ("stride_bn",) or b_nk}
    src = triton.compiler.ASTSource(fused_gemm_kernel, signature, constexprs, attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=p["num_warps"], num_stages=p["num_stages"]))


def summary(kernel) -> str:
    ttgir = kernel.asm["ttgir"]
    dots = re.findall(r"ttng\.warp_group_dot [^\n]*", ttgir)
    is_async = sum("isAsync = true" in d for d in dots)
    waits = len(re.findall(r"ttng\.warp_group_dot_wait", ttgir))
    allocs = re.findall(r"ttg\.local_alloc[^\n]*!ttg\.memdesc<([0-9x]+)x", ttgir)
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    res = subprocess.run([os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump"),
                          "-res-usage", f.name], capture_output=True, text=True).stdout
    os.unlink(f.name)
    regs = re.search(r"REG:(\d+)", res)
    spill = re.search(r"STACK:(\d+)", res)
    return (f"dots {len(dots)} (async {is_async}) dot_waits {waits} smem_buffers {allocs} "
            f"regs {regs.group(1) if regs else '?'} stack {spill.group(1) if spill else '?'} "
            f"shared {kernel.metadata.shared} B")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--configs", required=True)
    parser.add_argument("--b-nk", action="store_true", help="B as an nn.Linear weight [N, K]")
    parser.add_argument("--mode", choices=("plain", "ag", "rs"), default="plain")
    parser.add_argument("--world", type=int, default=1, help="ranks (ag, rs)")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    mode = ("plain", "ag", "rs").index(args.mode)
    for spec in args.configs.split(","):
        kernel = compile_one(spec, args.b_nk, mode=mode, world=args.world if mode else 1)
        print(f"{spec:18s} {summary(kernel)}")
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            for ext in ("ttgir", "ptx"):
                with open(os.path.join(args.out, f"{spec}.{ext}"), "w") as f:
                    f.write(kernel.asm[ext])


if __name__ == "__main__":
    main()
