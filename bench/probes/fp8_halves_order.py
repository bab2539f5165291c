"""The two-half Hopper FP8 kernel with its warp groups issuing their MMAs in turn (``_half_compute``'s
``ORDER``) against the kernel as it is, exact and blockwise, on ``fp8_exact``'s shapes, torch's scaled
matmuls beside them; every output checked against float64 first. Run by hand from this folder:
``PYTHONPATH=../../src python3 fp8_halves_order.py OUT [blockwise] [quick]`` (``quick``: five shapes)."""
import json
import sys

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

from fp8_accum import _err, _ms
from fp8_exact import SHAPES
from fp8_sm90 import _hopper, _inputs
from tileweave.bench.fp8 import torch_scaled_mm
from tileweave.kernels import gemm_fp8_sm90 as k


@gluon.jit
def ordered_kernel(a_ptr, b_ptr, c_ptr, sa_ptr, sb_ptr, bias_ptr, M, N, K, stride_am, stride_bn,
                   stride_cm, stride_sam, stride_sak, stride_sbk, stride_sbn,
                   BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, GROUP_M: gl.constexpr,
                   STAGES: gl.constexpr, SCALING: gl.constexpr, HAS_BIAS: gl.constexpr):
    HM: gl.constexpr = BM // 2
    a_desc, b_desc, a_bufs, b_bufs = k._operands(a_ptr, b_ptr, M, N, K, stride_am, stride_bn, BM, BN, BK, STAGES)
    c_desc = tma.make_tensor_descriptor(c_ptr, [M, N], [stride_cm, 1], [HM, BN],
                                        gl.NVMMASharedLayout.get_default_for([HM, BN], c_ptr.dtype.element_ty))
    c_smem = gl.allocate_shared_memory(c_desc.dtype, [2, HM, BN], c_desc.layout)
    ready, empty = k._ring_barriers(STAGES, 2)
    turns = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(turns.index(0), count=1)
    mbarrier.init(turns.index(1), count=1)
    gl.warp_specialize([
        (k._half_compute, (c_desc, c_smem, ready, empty, a_bufs, b_bufs, sa_ptr, sb_ptr, bias_ptr, M, N, K,
                           stride_sam, stride_sak, stride_sbk, stride_sbn, 0, BM, BN, BK, GROUP_M, STAGES, SCALING,
                           HAS_BIAS, turns, True)),
        (k._half_compute, (c_desc, c_smem, ready, empty, a_bufs, b_bufs, sa_ptr, sb_ptr, bias_ptr, M, N, K,
                           stride_sam, stride_sak, stride_sbk, stride_sbn, 1, BM, BN, BK, GROUP_M, STAGES, SCALING,
                           HAS_BIAS, turns, True)),
        (k._ws_loader, (a_desc, b_desc, ready, empty, a_bufs, b_bufs, M, N, K, BM, BN, BK, GROUP_M, STAGES)),
    ], [4, 1], [232, 24])
    k._drop_barriers(ready, empty, STAGES)
    mbarrier.invalidate(turns.index(0))
    mbarrier.invalidate(turns.index(1))


HALVES = {"BM": 128, "BN": 128, "BK": 128, "GROUP_M": 8, "num_warps": 4, "kernel": "halves", "STAGES": 4}
PLAIN = {"BM": 128, "BN": 128, "BK": 128, "GROUP_M": 8, "num_warps": 8, "STAGES": 5}
LOADER = {"BM": 128, "BN": 128, "BK": 128, "GROUP_M": 8, "num_warps": 8, "maxnreg": 168, "kernel": "loader",
          "STAGES": 5}


QUICK = ((8192, 57344, 8192), (8192, 8192, 8192), (16384, 1536, 8192), (4096, 3072, 4096), (8192, 4096, 512))


def main(out, shapes=SHAPES, scalings=("blockwise", "tensorwise")):
    plain_halves = k.fp8_gemm_sm90_halves_kernel
    rows = []
    for m, n, kk in shapes:
        for scaling in scalings:
            a8, sa, w8, sb, ref = _inputs(m, n, kk, scaling)
            row = {"m": m, "n": n, "k": kk, "scaling": scaling}
            other = ("plain", PLAIN) if scaling == "blockwise" else ("loader", LOADER)
            for name, kernel, config in (("halves", plain_halves, HALVES), ("ordered", ordered_kernel, HALVES),
                                         (other[0], plain_halves, other[1])):
                k.fp8_gemm_sm90_halves_kernel = kernel
                try:
                    row[f"{name}_err"] = _err(_hopper(a8, w8, sa, sb, False, config=config).float(), ref)
                    row[f"{name}_ms"] = _ms(lambda: _hopper(a8, w8, sa, sb, False, config=config))
                except Exception as e:  # recorded, the next variant runs
                    row[f"{name}_error"] = repr(e)[:300]
                finally:
                    k.fp8_gemm_sm90_halves_kernel = plain_halves
            if scaling == "tensorwise":
                call = lambda: torch._scaled_mm(a8, w8.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
            else:
                theirs, _ = torch_scaled_mm(scaling)
                call = lambda: theirs(a8, w8.t(), sa, sb)
            row["torch_err"] = _err(call().float(), ref)
            row["torch_ms"] = _ms(call)
            rows.append(row)
            print(f"{m}x{n}x{kk} {scaling}: " + "  ".join(f"{key[:-3]} {v:.3f}" for key, v in row.items()
                                                          if key.endswith("_ms"))
                  + "".join(f"\n    {key}: {v}" for key, v in row.items() if key.endswith("_error"))
                  + f"\n    errors {[f'{v:.1e}' for key, v in row.items() if key.endswith('_err')]}", flush=True)
            del a8, w8, ref
            torch.cuda.empty_cache()
    with open(f"{out}/fp8_halves_order.json", "w") as fh:
        json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], QUICK if "quick" in sys.argv[2:] else SHAPES,
         ("blockwise", ) if "blockwise" in sys.argv[2:] else ("blockwise", "tensorwise"))
