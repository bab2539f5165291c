"""The launcher of the Hopper FP8 GEMM (``tileweave.kernels.gemm_fp8_sm90``), ``matmul``'s route for
float8 inputs on sm_90 where its operands suit TMA: ``a [M, K]`` row-major, ``b`` the transpose of a
row-major ``[N, K]`` weight (``weight.t()``), a contiguous output, every row pitch a multiple of 16 bytes.
"""

from __future__ import annotations

import functools

import torch

from tileweave.ops.compute.scaling import Scales

_GL_DTYPES = {}


def _gl_dtype(dtype: torch.dtype):
    if not _GL_DTYPES:
        from triton.experimental.gluon import language as gl

        _GL_DTYPES.update({torch.float8_e4m3fn: gl.float8e4nv, torch.float8_e5m2: gl.float8e5,
                           torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32})
    return _GL_DTYPES[dtype]


@functools.cache
def _is_sm90(index: int) -> bool:
    return torch.cuda.get_device_capability(index) == (9, 0)


def _rows_ok(t: torch.Tensor) -> bool:
    # Row-major with a row pitch TMA can take.
    return t.stride(1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0


def suits(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, scales: Scales | None) -> bool:
    """Whether ``c = a @ b`` with these tensors runs on the Hopper FP8 kernel."""
    if scales is None or not a.is_cuda or not _is_sm90(a.device.index or 0):
        return False
    return _rows_ok(a) and _rows_ok(b.t()) and _rows_ok(c) and c.is_contiguous()


def config_for(scales: Scales, out_dtype: torch.dtype) -> dict:
    """Tile, buffers and warps: 128 x 128 where each K step's product is summed in fp32 (three live
    register tiles: the sum, the product being added, the next one in flight), 128 x 256 with the
    tensor cores accumulating (a 16-bit output: a float32 tile of 128 x 256 leaves too little shared
    memory for the operand buffers)."""
    if scales.kernel_mode == "outer_fast" and out_dtype != torch.float32:
        return {"BM": 128, "BN": 256, "BK": 128, "STAGES": 3, "GROUP_M": 8, "num_warps": 8}
    return {"BM": 128, "BN": 128, "BK": 128, "STAGES": 4, "GROUP_M": 8, "num_warps": 8}


_KERNEL_MODES = {"outer": "outer", "outer_fast": "fast", "block": "block"}


def launch(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, bias: torch.Tensor | None, scales: Scales,
           *, config: dict | None = None, programs: int | None = None) -> None:
    """``c = (a * scale_a) @ (b * scale_b) (+ bias)`` on the Hopper kernel (``suits`` holds)."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from tileweave.kernels.gemm_fp8_sm90 import fp8_gemm_sm90_kernel

    cfg = dict(config or config_for(scales, c.dtype))
    bm, bn, bk = cfg["BM"], cfg["BN"], cfg["BK"]
    m, k = a.shape
    n = b.shape[1]
    weight = b.t()  # [N, K], row-major
    a_desc = TensorDescriptor.from_tensor(a, [bm, bk], gl.NVMMASharedLayout.get_default_for([bm, bk], _gl_dtype(a.dtype)))
    b_desc = TensorDescriptor.from_tensor(weight, [bn, bk],
                                          gl.NVMMASharedLayout.get_default_for([bn, bk], _gl_dtype(b.dtype)))
    c_desc = TensorDescriptor.from_tensor(c, [bm, bn], gl.NVMMASharedLayout.get_default_for([bm, bn], _gl_dtype(c.dtype)))
    sam, sak = scales.a_strides
    _, sbk, sbn = scales.b_strides
    tiles = -(-m // bm) * -(-n // bn)
    grid = (min(tiles, programs or torch.cuda.get_device_properties(a.device).multi_processor_count), )
    num_warps = cfg.pop("num_warps")
    fp8_gemm_sm90_kernel[grid](a_desc, b_desc, c_desc, scales.a, scales.b, bias if bias is not None else scales.a,
                               m, n, k, sam, sak, sbk, sbn, SCALING=_KERNEL_MODES[scales.kernel_mode],
                               HAS_BIAS=bias is not None, num_warps=num_warps, **cfg)
