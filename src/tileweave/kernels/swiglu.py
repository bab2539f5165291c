"""The SwiGLU's backward for the MoE experts, in one pass over rows.

For row p: ``G[p]`` (the down projection's input gradient, before the routing weight), the forward's
pre-activations ``pre[p]`` interleaved (gate j at column 2j, up j at 2j + 1) and the routing weight
``w[p]``, it writes ``dgate | dup`` of ``dh = w[p] * G[p]`` through ``h = silu(gate) * up``, the scaled
activation ``w[p] * h[p]`` (the down projection's weight gradient reads it) and ``<G[p], h[p]>`` (the
routing weight's gradient). A program owns ``BR`` whole rows and walks their columns ``BC`` at a time in
order, so the row sums are the same on every call.
"""

import triton
import triton.language as tl


@triton.jit
def swiglu_grad_kernel(g_ptr, pre_ptr, w_ptr, dy_ptr, hs_ptr, dot_ptr, rows, N,
                       stride_gm, stride_pm, stride_dm, stride_hm,
                       BR: tl.constexpr, BC: tl.constexpr):
    offs_r = tl.program_id(0) * BR + tl.arange(0, BR)
    mask_r = offs_r < rows
    r64 = offs_r.to(tl.int64)[:, None]
    w = tl.load(w_ptr + offs_r, mask=mask_r, other=0.0)[:, None]
    dot = tl.zeros((BR,), dtype=tl.float32)
    for c in range(0, N, BC):
        offs_c = c + tl.arange(0, BC)
        mask = mask_r[:, None] & (offs_c < N)[None, :]
        g = tl.load(g_ptr + r64 * stride_gm + offs_c[None, :], mask=mask, other=0.0).to(tl.float32)
        offs_p = 2 * c + tl.arange(0, 2 * BC)
        pre = tl.load(pre_ptr + r64 * stride_pm + offs_p[None, :],
                      mask=mask_r[:, None] & (offs_p < 2 * N)[None, :], other=0.0)
        gate, up = tl.split(pre.reshape(BR, BC, 2))
        gate = gate.to(tl.float32)
        up = up.to(tl.float32)
        sig = 1.0 / (1.0 + tl.exp(-gate))
        silu = gate * sig
        h = silu * up
        dot += tl.sum(g * h, axis=1)
        dh = g * w
        tl.store(dy_ptr + r64 * stride_dm + offs_c[None, :],
                 (dh * up * sig * (1.0 + gate * (1.0 - sig))).to(dy_ptr.dtype.element_ty), mask=mask)
        tl.store(dy_ptr + r64 * stride_dm + N + offs_c[None, :], (dh * silu).to(dy_ptr.dtype.element_ty), mask=mask)
        tl.store(hs_ptr + r64 * stride_hm + offs_c[None, :], (h * w).to(hs_ptr.dtype.element_ty), mask=mask)
    tl.store(dot_ptr + offs_r, dot, mask=mask_r)
