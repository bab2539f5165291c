"""Compile the GEMM + AllReduce kernels for a GPU target without a GPU (Triton's front end, its CUDA
backend and ptxas run on the CPU): catches what the interpreter accepts and the compiler does not.

    PYTHONPATH=src:tests python -m support.compile_check [--quick]   # one line per variant, exit 1 on a failure

``--quick``: two variants (the one-shot kernel on constant flags with the epilogue, the two-shot kernel on
epoch flags without), for the CPU tests.

Run it in a process without ``TRITON_INTERPRET=1`` (the interpreter replaces the kernels' JIT objects).
"""

from __future__ import annotations

import itertools
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from tileweave.kernels import gemm_all_reduce as kernels

TARGET = GPUTarget("cuda", 90, 32)
_POINTERS = {"peer_offs_ptr": "*i64", "ready_sig_ptr": "*i64", "free_sig_ptr": "*i64", "done_sig_ptr": "*i64",
             "ready_ptr": "*i32", "sync_ptr": "*i32", "done_ptr": "*i32", "err_ptr": "*i32", "host_err_ptr": "*i32"}
_SCALARS = {"eps": "fp32", **{name: "i32" for name in ("value", "max_spin", "rank", "rows", "n", "stride_p", "stride_y",
                                                       "stride_r", "stride_res", "resid_offset")}}


def compile_variant(fn, dtype: str, constexprs: dict):
    """``fn`` compiled for ``TARGET`` with every data pointer of ``dtype`` ("bf16", "fp16", "fp32")."""
    names = fn.arg_names
    signature = {name: "constexpr" if name in constexprs else _SCALARS.get(name) or _POINTERS.get(name, f"*{dtype}")
                 for name in names}
    source = ASTSource(fn=fn, signature=signature,
                       constexprs={(names.index(name),): value for name, value in constexprs.items()})
    return triton.compile(source, target=TARGET, options={"num_warps": 4})


def variants():
    """(name, kernel, dtype, constexprs): both kernels, both protocols, with and without the epilogue."""
    for (fn, extra), constant, norm in itertools.product(
            ((kernels.oneshot_kernel, {}), (kernels.twoshot_kernel, {"MAX_BLOCKS": kernels.MAX_BLOCKS})),
            (False, True), (False, True)):
        dtype = "bf16" if norm else "fp16"
        constexprs = dict(WORLD=2 if constant else 8, BM=16 if norm else 2, BN=256, P=132, HAS_BIAS=not norm,
                          HAS_RESIDUAL=norm, HAS_NORM=norm, CONSTANT=constant, **extra)
        yield f"{fn.__name__} {dtype} constant={constant} norm={norm}", fn, dtype, constexprs


def main(argv: list[str]) -> int:
    failed = 0
    chosen = [v for v in variants() if "--quick" not in argv
              or v[0] in ("oneshot_kernel bf16 constant=True norm=True", "twoshot_kernel fp16 constant=False norm=False")]
    for name, fn, dtype, constexprs in chosen:
        try:
            compiled = compile_variant(fn, dtype, constexprs)
            print(f"ok {name}: {len(compiled.asm['ptx'])} bytes of PTX")
        except Exception as exc:  # noqa: BLE001 - reported per variant
            failed += 1
            print(f"FAILED {name}: {type(exc).__name__}: {exc}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
