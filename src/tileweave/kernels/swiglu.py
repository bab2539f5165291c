"""The SwiGLU's backward passes: ``h = silu(gate) * up`` gives ``dgate = dh * up * sig * (1 + gate * (1 - sig))``
and ``dup = dh * gate * sig`` for ``sig = sigmoid(gate)``, in float32.

``swiglu_grad_kernel``, the MoE experts': for row p: ``G[p]`` (the down projection's input gradient, before
the routing weight), the forward's pre-activations ``pre[p]`` interleaved (gate j at column 2j, up j at
2j + 1) and the routing weight ``w[p]``, it writes ``dgate | dup`` of ``dh = w[p] * G[p]``, the scaled
activation ``w[p] * h[p]`` (the down projection's weight gradient reads it) and ``<G[p], h[p]>`` (the
routing weight's gradient). A program owns ``BR`` whole rows and walks their columns ``BC`` at a time in
order, so the row sums are the same on every call.

``swiglu_backward_kernel``, the dense layers': ``dx = dgate | dup`` of ``x = gate | up`` (the two halves of
each row) and ``dh``, one ``BR x BC`` tile of gate, up and dh per program, each element read and written once.
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


@triton.jit
def swiglu_backward_kernel(dh_ptr, x_ptr, dx_ptr, M, F, stride_dhm, stride_xm, stride_dxm,
                           BR: tl.constexpr, BC: tl.constexpr):
    # grid: (row blocks, column blocks of the F columns of each half)
    offs_r = tl.program_id(0) * BR + tl.arange(0, BR)
    offs_c = (tl.program_id(1) * BC + tl.arange(0, BC))[None, :]
    mask = (offs_r < M)[:, None] & (offs_c < F)
    r64 = offs_r.to(tl.int64)[:, None]  # M * 2F can pass 2**31 elements
    dh = tl.load(dh_ptr + r64 * stride_dhm + offs_c, mask=mask, other=0.0).to(tl.float32)
    gate = tl.load(x_ptr + r64 * stride_xm + offs_c, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + r64 * stride_xm + F + offs_c, mask=mask, other=0.0).to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-gate))
    dgate = dh * up * sig * (1.0 + gate * (1.0 - sig))
    dup = dh * gate * sig
    tl.store(dx_ptr + r64 * stride_dxm + offs_c, dgate.to(dx_ptr.dtype.element_ty), mask=mask)
    tl.store(dx_ptr + r64 * stride_dxm + F + offs_c, dup.to(dx_ptr.dtype.element_ty), mask=mask)
