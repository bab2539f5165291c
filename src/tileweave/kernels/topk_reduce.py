"""The MoE top-k reduce: ``out[t] = sum_j w[t, j] * z[rows[t, j]]`` for a block of tokens, in one pass.

Each program owns ``BT`` tokens and ``BH`` columns; it reads every one of its tokens' k rows of ``z``
once, scales and sums them in fp32 in slot order j = 0, 1, ... (the same order on every call, so the
result is bitwise deterministic), and stores the sum once. The rows are gathered by index (pointer
loads), so ``z`` stays in the grouped GEMM's row order and no permuted copy is written.
"""

import triton
import triton.language as tl


@triton.jit
def topk_reduce_kernel(z_ptr, rows_ptr, w_ptr, out_ptr, n_tokens, H, topk,
                       stride_zm, stride_rt, stride_wt, stride_om,
                       BT: tl.constexpr, BH: tl.constexpr, HAS_W: tl.constexpr):
    pid_t = tl.program_id(0)
    pid_h = tl.program_id(1)
    offs_t = pid_t * BT + tl.arange(0, BT)
    offs_h = pid_h * BH + tl.arange(0, BH)
    mask_t = offs_t < n_tokens
    mask = mask_t[:, None] & (offs_h < H)[None, :]
    acc = tl.zeros((BT, BH), dtype=tl.float32)
    for j in range(0, topk):
        row = tl.load(rows_ptr + offs_t.to(tl.int64) * stride_rt + j, mask=mask_t, other=0).to(tl.int64)
        z = tl.load(z_ptr + row[:, None] * stride_zm + offs_h[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_W:
            w = tl.load(w_ptr + offs_t.to(tl.int64) * stride_wt + j, mask=mask_t, other=0.0).to(tl.float32)
            z = z * w[:, None]
        acc += z
    tl.store(out_ptr + offs_t.to(tl.int64)[:, None] * stride_om + offs_h[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=mask)
