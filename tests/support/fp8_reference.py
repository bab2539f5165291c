"""The TP linears' FP8 training math in float64, written with plain torch, independently of the library.

Quantization: the amax of each group of a float32 matrix with torch reductions, ``scale = max(amax,
1e-12) / fp8_max`` (rounded up to a power of two where the recipe says so), ``(x / scale).clamp(...)``
cast by torch. The recipes' choices are restated here: per GEMM, which operand in which format, grouped
along which dimension (``FORMS``). Each layer's forward output and gradients are then the float64
products of the dequantized operands, per rank of the group, from the full unsharded tensors.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}

# Per recipe: (first operand's groups, second operand's groups, gradients' format, powers of two)
FORMS = {
    "tensorwise": ("tensor", "tensor", E5M2, False),
    "rowwise": ("row", "row", E4M3, True),
    "blockwise": ("1x128", "128x128", E4M3, False),
}


def quantize32(x: torch.Tensor, groups: str, dtype, pow2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)`` of float32 ``x [R, C]`` quantized along its rows in ``groups`` ("tensor", "row",
    "1x128", "128x128"): ``q [R, C]`` in ``dtype`` and the float32 scale of each group, ``[1, 1]``,
    ``[R, 1]``, ``[R, ceil(C/128)]`` or ``[ceil(R/128), ceil(C/128)]`` (blockwise groups pad with zeros
    to 128, which changes no amax)."""
    rows, cols = x.shape
    c128 = -(-cols // 128) * 128
    r128 = -(-rows // 128) * 128
    xp = F.pad(x.float(), (0, c128 - cols, 0, r128 - rows))  # zeros change no amax
    if groups == "tensor":
        amax = xp.abs().amax().reshape(1, 1)
        each = lambda s: s.expand(r128, c128)
    elif groups == "row":
        amax = xp.abs().amax(1, keepdim=True)
        each = lambda s: s.expand(r128, c128)
    elif groups == "1x128":
        amax = xp.view(r128, c128 // 128, 128).abs().amax(2)
        each = lambda s: s.repeat_interleave(128, 1)
    else:
        amax = xp.view(r128 // 128, 128, c128 // 128, 128).abs().amax((1, 3))
        each = lambda s: s.repeat_interleave(128, 0).repeat_interleave(128, 1)
    scale = amax.clamp(min=1e-12) / FP8_MAX[dtype]
    if pow2:
        scale = torch.exp2(torch.ceil(torch.log2(scale.double()))).float()
    q = (xp / each(scale)).clamp(-FP8_MAX[dtype], FP8_MAX[dtype]).to(dtype)
    return q[:rows, :cols], (scale[:rows] if groups in ("row", "1x128") else scale)


def expand_scale(scale: torch.Tensor, groups: str, rows: int, cols: int) -> torch.Tensor:
    """``quantize32``'s ``scale`` table repeated over the elements of its groups, ``[rows, cols]``."""
    if groups in ("1x128", "128x128"):
        scale = scale.repeat_interleave(128, 1)
    if groups == "128x128":
        scale = scale.repeat_interleave(128, 0)
    return scale[:rows, :cols].expand(rows, cols)


def qdq32(x: torch.Tensor, groups: str, dtype, pow2: bool) -> torch.Tensor:
    """float32 ``q * scale`` of float32 ``x [R, C]`` quantized along its rows in ``groups``
    (``quantize32``)."""
    q, scale = quantize32(x, groups, dtype, pow2)
    return q.float() * expand_scale(scale, groups, *x.shape)


def quantize_along_rows32(values: torch.Tensor, pieces: list[torch.Tensor], groups: str, dtype,
                          pow2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """An MoE weight gradient's operand: float32 ``values [P, C]`` quantized along its rows (the tokens),
    each of ``pieces`` (row indices: all rows, an expert's, or a group's) on its own, its transpose in
    ``groups`` ("tensor", "row", "1x128": per 128 rows from the piece's first, padded with zeros).
    ``(q [P, C] in dtype, the scale of each element [P, C])``; rows in no piece are zeros."""
    q = torch.zeros(values.shape, dtype=dtype)
    at = torch.zeros(values.shape, dtype=torch.float32)
    for rows in pieces:
        if len(rows):
            qt, scale = quantize32(values[rows].t(), groups, dtype, pow2)  # [C, n]
            q[rows] = qt.t()
            at[rows] = expand_scale(scale, groups, values.shape[1], len(rows)).t()
    return q, at


class Recipe:
    """One recipe's quantizers: ``a`` (first operand, along K; ``grad``: the gradients' format) and
    ``b`` (second operand as ``[N, K]``, along K), each giving float32 dequantized values."""

    def __init__(self, name: str) -> None:
        self.a_groups, self.b_groups, self.grad_dtype, self.pow2 = FORMS[name]

    def a(self, x: torch.Tensor, grad: bool = False) -> torch.Tensor:
        return qdq32(x, self.a_groups, self.grad_dtype if grad else E4M3, self.pow2)

    def b(self, x: torch.Tensor) -> torch.Tensor:
        return qdq32(x, self.b_groups, E4M3, self.pow2)


def column_parallel(recipe: str, x: torch.Tensor, w: torch.Tensor, bias, dy: torch.Tensor, world: int, rank: int,
                    *, save_gathered: bool = True, fused_norm: bool = False) -> dict:
    """ColumnParallelLinear's FP8 math for rank ``rank``: full ``x [M, K]``, full ``w [N, K]``, ``bias
    [N]`` or None, and the gradient ``dy [M, N]`` of the full output; float64 ``y`` and ``db`` of the
    rank's N slice, its ``dx`` rows, its ``dw``. The weight gradient's activation is the forward's
    float8 rows requantized along the tokens, or with ``save_gathered=False`` ``x`` itself quantized
    once; ``fused_norm``: ``x`` holds the float32 values of an RMSNorm fused into the layer's cast,
    which exist nowhere else, so the layer casts the forward's rows again and the weight gradient
    takes them whatever ``save_gathered``."""
    r = Recipe(recipe)
    m, n = x.shape[0], w.shape[0]
    rows, cols = slice(rank * m // world, (rank + 1) * m // world), slice(rank * n // world, (rank + 1) * n // world)
    shards = [x[p * m // world:(p + 1) * m // world] for p in range(world)]
    gathered = torch.cat([r.a(s) for s in shards])           # each rank's float8 rows, dequantized (float32)
    w_r = w[cols]
    y = gathered.double() @ r.b(w_r).double().t()
    dx_full = sum(r.a(dy[:, c], grad=True).double() @ r.b(w[c].t()).double().t()
                  for c in (slice(p * n // world, (p + 1) * n // world) for p in range(world)))
    dy_r = dy[:, cols]
    x_wgrad = gathered if save_gathered or fused_norm else x  # requantized from float8, or from the input
    dw = r.a(dy_r.t(), grad=True).double() @ r.b(x_wgrad.t()).double().t()
    out = {"y": y + (bias[cols].double() if bias is not None else 0), "dx": dx_full[rows], "dw": dw}
    if bias is not None:
        out["db"] = dy_r.double().sum(0)
    return out


def row_parallel(recipe: str, x: torch.Tensor, w: torch.Tensor, bias, dy: torch.Tensor, world: int, rank: int) -> dict:
    """RowParallelLinear's FP8 math for rank ``rank``: full ``x [M, K]``, ``w [N, K]`` (rank p holds the
    K slice p of both), ``bias [N]`` or None, ``dy [M, N]`` (rank p receives rows p); float64 ``y``
    rows, ``dx`` and ``dw`` of the rank's K slice, ``db``."""
    r = Recipe(recipe)
    m, k = x.shape
    rows = slice(rank * m // world, (rank + 1) * m // world)
    ks = [slice(p * k // world, (p + 1) * k // world) for p in range(world)]
    y_full = sum(r.a(x[:, c]).double() @ r.b(w[:, c]).double().t() for c in ks)
    gathered = torch.cat([r.a(dy[p * m // world:(p + 1) * m // world], grad=True) for p in range(world)])
    c = ks[rank]
    dx = gathered.double() @ r.b(w[:, c].t()).double().t()
    dw = r.a(gathered.t(), grad=True).double() @ r.b(r.a(x[:, c]).t()).double().t()
    out = {"y": y_full[rows] + (bias.double() if bias is not None else 0), "dx": dx, "dw": dw}
    if bias is not None:
        out["db"] = gathered.double().sum(0)
    return out


class _Linear(torch.autograd.Function):
    """``a @ w.T`` in float64 on one rank (a group of one) with a recipe's quantized operands: the
    forward's, the input gradient's and the weight gradient's, of a column-parallel layer (the weight
    gradient's gradient operand quantized from ``dy``) or a row-parallel one (requantized from the
    quantized ``dy``); the activation operand requantized from the forward's in both. Each operand is
    rounded to float32, then quantized, as the layers quantize their float32 tensors."""

    @staticmethod
    def forward(ctx, a, w, recipe: Recipe, kind: str):
        aq = recipe.a(a.float())
        ctx.save_for_backward(aq, w)
        ctx.recipe, ctx.kind = recipe, kind
        return aq.double() @ recipe.b(w.float()).double().t()

    @staticmethod
    def backward(ctx, dy):
        aq, w = ctx.saved_tensors
        r = ctx.recipe
        dy32 = dy.float()
        dyq = r.a(dy32, grad=True)
        dx = dyq.double() @ r.b(w.float().t()).double().t()
        dw = r.a((dy32 if ctx.kind == "column" else dyq).t(), grad=True).double() @ r.b(aq.t()).double().t()
        return dx, dw.to(w.dtype), None, None


def linear(recipe: str):
    """``references.transformer_block``'s ``linear`` for a block on one rank in this FP8 recipe."""
    r = Recipe(recipe)
    return lambda a, w, kind: _Linear.apply(a, w, r, kind)


# -- the producers fused into the linears' input cast (``tileweave.nn.fused_inputs``) ----------------------

def rms_norm32(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    """The float32 values that the fused RMSNorm casts, by its documented formula: ``rstd = 1 /
    sqrt(float32(sum(x * x) / H) + eps)`` with the sum of squares in float64, then ``(x * rstd) * w``, each
    float32 step correctly rounded (on the CPU ``torch.rsqrt`` divides 1 by a correctly rounded square
    root; ``torch.sqrt`` is not correctly rounded there)."""
    x = x.float()
    mean_sq = ((x.double() * x.double()).sum(1, keepdim=True) / x.shape[1]).float()
    y = x * torch.rsqrt(mean_sq + eps)
    return y if w is None else y * w.float()


def sigmoid32(g: torch.Tensor) -> torch.Tensor:
    """The fused SwiGLU's documented float32 sigmoid (``tileweave.kernels.fused_quantize``), step by step
    in torch's float32 operations on the CPU (each correctly rounded, none fused): ``-g`` held to [-87,
    87], ``n`` the nearest integer to it over ln 2 (halves up), ``r = (t - n * 0.693359375) + n *
    2.12194440e-4``, Cephes' degree-6 polynomial for ``exp(r)``, times ``2**n``, then ``1 / (1 + e)``; 0
    below ``g = -87``."""
    f = torch.float32

    def c(v: float) -> torch.Tensor:  # a constant as the kernel holds it: rounded to float32
        return torch.tensor(v, dtype=f)
    t = torch.clamp(-g, -87.0, 87.0)
    t = torch.where(torch.isnan(t), torch.zeros_like(t), t)
    n = torch.floor(t * c(1.44269502) + c(0.5))
    r = (t - n * c(0.693359375)) + n * c(2.12194440e-4)
    p = c(1.9875691500e-4) * r + c(1.3981999507e-3)
    for k in (8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
        p = p * r + c(k)
    p = (p * (r * r) + r) + c(1.0)
    two_n = torch.ldexp(torch.ones_like(n), n.to(torch.int32))
    sig = c(1.0) / (c(1.0) + p * two_n)
    return torch.where(g < -87.0, torch.zeros_like(sig), sig)


def swiglu32(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The float32 values that the fused SwiGLU casts: ``(g * sigmoid32(g)) * u``."""
    g = gate.float()
    return (g * sigmoid32(g)) * up.float()


def swiglu_epilogue32(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The float32 values that MoE layer 0's SwiGLU epilogue computes (and casts) from its float32
    accumulators ``gate``, ``up`` (``[R, F]`` each): ``gate / (1 + exp(-gate)) * up``, each step in float32
    numpy, as Triton's interpreter computes it (a GPU's ``exp`` and division may differ in last bits);
    ``silu`` of a large negative gate is -0.0 (``exp`` overflows)."""
    g, u = gate.float().numpy(), up.float().numpy()
    with np.errstate(over="ignore"):
        return torch.from_numpy(g / (np.float32(1.0) + np.exp(-g)) * u)


def rms_norm_backward64(x: torch.Tensor, w: torch.Tensor, eps: float, dy: torch.Tensor):
    """``(dx, dw)`` in float64 of ``x / sqrt(mean(x^2) + eps) * w`` for the gradient ``dy``, by autograd."""
    x64 = x.double().requires_grad_(True)
    w64 = w.double().requires_grad_(True)
    y = x64 / torch.sqrt((x64 * x64).mean(1, keepdim=True) + eps) * w64
    y.backward(dy.double())
    return x64.grad, w64.grad


def swiglu_backward64(gate: torch.Tensor, up: torch.Tensor, dh: torch.Tensor) -> torch.Tensor:
    """The float64 gradient of ``gate | up`` for the gradient ``dh`` of ``silu(gate) * up``, by autograd."""
    g = gate.double().requires_grad_(True)
    u = up.double().requires_grad_(True)
    (g * torch.sigmoid(g) * u).backward(dh.double())
    return torch.cat([g.grad, u.grad], 1)
