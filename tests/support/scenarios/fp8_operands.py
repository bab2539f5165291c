"""Which values each float8 cast of the TP linears reads: the operands of the three GEMMs of a step,
captured as the layer hands them to its ops, against ``support.fp8_reference``'s cast of the values
that the recipe's docstring names (``tileweave.nn.fp8``), value for value and scale for scale.

The layer's GEMM outputs are checked against float64 elsewhere (``fp8_layers``); a tolerance there
cannot tell whether a cast read the documented values or ones that differ by a rounding of the model's
dtype, which moves only the elements it carries across an e4m3 rounding boundary. Here every float8
element and scale must be the reference's exactly. Run in float16 on the CPU, whose rounding of an
activation (2^-11) differs from the float32 values that a fused producer casts, this catches a cast
taken from the model-dtype values where float32 ones, or the forward's float8 ones, are documented.

``Recording`` is a ``TPOps`` (the layers' public seam) that keeps a copy of every float8 operand and
calls tileweave's ops: a column layer's forward is its ``all_gather_gemm``, its input gradient its
``gemm_reduce_scatter``; a row layer's the other way round; the weight gradient is ``matmul`` in both.
"""

from __future__ import annotations

import torch

from support import fp8_reference
from support.fp8_reference import E4M3, FORMS, quantize32
from support.scenarios.common import device_name, randn
from tileweave.nn import ColumnParallelLinear, RowParallelLinear
from tileweave.nn.tp_ops import TILEWEAVE_OPS, TPOps

EPS = 1e-5


def _data(tag: str, m: int, k: int, n: int, dtype) -> tuple:
    """Full ``x [m, k]``, ``w [n, k]`` and ``dy [m, n]``, values of ``dtype`` held in float32: rows of
    ``x`` of magnitudes 2^-3 to 2^3 (per-row and per-block scales differ), small gradients."""
    g = torch.Generator().manual_seed(m * k + n)
    x = randn((m, k), torch.float32, tag, "x") * torch.exp2(torch.randint(-3, 4, (m, 1), generator=g).float())
    w = randn((n, k), torch.float32, tag, "w") / k ** 0.5
    dy = randn((m, n), torch.float32, tag, "dy") * 1e-3
    return tuple(t.to(dtype).float() for t in (x, w, dy))


class Recording:
    """Tileweave's ops, each float8 call's operands kept as ``(op, a [M, K], scale_a, b [N, K], scale_b)``
    (``b`` and its scales transposed back to the form they were quantized in)."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.ops = TPOps(all_gather_gemm=self._wrap("all_gather_gemm", TILEWEAVE_OPS.all_gather_gemm),
                         gemm_reduce_scatter=self._wrap("gemm_reduce_scatter", TILEWEAVE_OPS.gemm_reduce_scatter),
                         shared_all_gather=TILEWEAVE_OPS.shared_all_gather,
                         matmul=self._wrap("matmul", TILEWEAVE_OPS.matmul))

    def _wrap(self, name, op):
        def call(a, b, *args, scale_a, scale_b, **kwargs):
            self.calls.append((name, a.clone(), scale_a.clone(), b.t().clone(), scale_b.t().clone()))
            return op(a, b, *args, scale_a=scale_a, scale_b=scale_b, **kwargs)
        return call


def _difference(got_q: torch.Tensor, got_s: torch.Tensor, ref: tuple) -> str:
    """Empty where a float8 operand and its scales are the reference's ``quantize32`` result: every element
    equal (columns past the reference's, a padded weight gradient's tokens, zero) and every scale; else
    what differs (how many elements and scales, and the first scale that does)."""
    q, s = ref
    cols = q.shape[1]
    elements = int((got_q[:, :cols].float() != q.float()).sum()) + int(got_q[:, cols:].float().count_nonzero())
    got_s = got_s.reshape(s.shape)
    scales = got_s != s
    if not elements and not scales.any():
        return ""
    first = f", first {got_s[scales][0].item():.9g} for {s[scales][0].item():.9g}" if scales.any() else ""
    return f"{elements} of {q.numel()} elements, {int(scales.sum())} of {s.numel()} scales{first}"


def _expected_column(recipe, x, norm_w, w, dy, world, rank, save_gathered) -> dict:
    """The casts of a column layer's step by the recipe's docstring: ``x`` the full input (the norm's
    input where ``norm_w`` is not None), ``dy`` the full output gradient."""
    a, b, grad_dtype, pow2 = FORMS[recipe]  # the groups of a GEMM's first and second operand
    m, n = x.shape[0], w.shape[0]
    mine = slice(rank * m // world, (rank + 1) * m // world)
    cols = slice(rank * n // world, (rank + 1) * n // world)
    # The forward casts the norm's float32 values, computed in its kernel, or the input as it is.
    values = x if norm_w is None else fp8_reference.rms_norm32(x, norm_w, EPS)
    shards = [values[p * m // world:(p + 1) * m // world] for p in range(world)]
    if save_gathered or norm_w is not None:  # the forward's float8 rows of every rank, requantized
        x_wgrad = torch.cat([fp8_reference.qdq32(s, a, E4M3, pow2) for s in shards])
    else:  # the input gathered again in its own dtype
        x_wgrad = x
    return {"forward": (quantize32(values[mine], a, E4M3, pow2), quantize32(w[cols], b, E4M3, pow2)),
            "dgrad": (quantize32(dy[:, cols], a, grad_dtype, pow2), quantize32(w[cols].t(), b, E4M3, pow2)),
            "wgrad": (quantize32(dy[:, cols].t(), a, grad_dtype, pow2), quantize32(x_wgrad.t(), b, E4M3, pow2))}


def _expected_row(recipe, values, w, dy, world, rank) -> dict:
    """The casts of a row layer's step: ``values`` the full ``[M, K]`` input of the GEMM (a SwiGLU's
    float32 values where it is fused), ``dy`` the full output gradient (rank p holds rows p)."""
    a, b, grad_dtype, pow2 = FORMS[recipe]  # the groups of a GEMM's first and second operand
    m, k = values.shape
    ks = slice(rank * k // world, (rank + 1) * k // world)
    dy_shards = [dy[p * m // world:(p + 1) * m // world] for p in range(world)]
    # Both weight-gradient operands requantized from float8: the gathered dy and the forward's x.
    dy_gathered = torch.cat([fp8_reference.qdq32(s, a, grad_dtype, pow2) for s in dy_shards])
    x8 = fp8_reference.qdq32(values[:, ks], a, E4M3, pow2)
    return {"forward": (quantize32(values[:, ks], a, E4M3, pow2), quantize32(w[:, ks], b, E4M3, pow2)),
            "dgrad": (quantize32(dy_shards[rank], a, grad_dtype, pow2), quantize32(w[:, ks].t(), b, E4M3, pow2)),
            "wgrad": (quantize32(dy_gathered.t(), a, grad_dtype, pow2), quantize32(x8.t(), b, E4M3, pow2))}


ORDER = {"column": {"all_gather_gemm": "forward", "gemm_reduce_scatter": "dgrad", "matmul": "wgrad"},
         "row": {"gemm_reduce_scatter": "forward", "all_gather_gemm": "dgrad", "matmul": "wgrad"}}


def fp8_operands_check(rank: int, world: int, cases: list[tuple], dtype: str = "float16") -> list[dict]:
    """Per case ``(layer, recipe, m, k, n, save_gathered, producer)`` (``producer``: "norm" for a column
    layer called with an RMSNorm, "swiglu" for a row layer taking gate | up, or None), one step in
    ``dtype``: ``"gemms"``, the GEMMs run, and ``"differ"``, the operands (``"wgrad b"``: the weight
    gradient's activation) whose float8 elements or scales are not the reference's cast of the
    documented values, and ``"details"``, how each differs."""
    device, torch_dtype = device_name(), getattr(torch, dtype)
    rows = []
    for case in cases:
        kind, recipe, m, k, n, save_gathered, producer = case
        x, w, dy = _data(f"operands-{case}", m, k, n, torch_dtype)
        rec, kwargs = Recording(), {}
        if kind == "column":
            layer = ColumnParallelLinear(k, n, bias=False, save_gathered=save_gathered, device=device,
                                         dtype=torch_dtype, fp8=recipe, ops=rec.ops)
            norm_w = None
            if producer == "norm":
                norm_w = (1 + 0.1 * randn((k,), torch.float32, f"operands-{case}", "norm")).to(torch_dtype).float()
                norm = kwargs["norm"] = torch.nn.RMSNorm(k, eps=EPS, device=device, dtype=torch_dtype)
                with torch.no_grad():
                    norm.weight.copy_(norm_w)
            x_in, dy_in = x[rank * m // world:(rank + 1) * m // world], dy[:, rank * n // world:(rank + 1) * n // world]
            expected = _expected_column(recipe, x, norm_w, w, dy, world, rank, save_gathered)
        else:
            layer = RowParallelLinear(k, n, bias=False, device=device, dtype=torch_dtype, fp8=recipe, ops=rec.ops)
            ks = slice(rank * k // world, (rank + 1) * k // world)
            x_in, values = x[:, ks], x
            if producer == "swiglu":  # x is the gate
                up = randn((m, k), torch.float32, f"operands-{case}", "up").to(torch_dtype).float()
                kwargs["swiglu"] = True
                x_in, values = torch.cat([x[:, ks], up[:, ks]], dim=1), fp8_reference.swiglu32(x, up)
            dy_in = dy[rank * m // world:(rank + 1) * m // world]
            expected = _expected_row(recipe, values, w, dy, world, rank)
        layer.load_full_state_dict({"weight": w})
        xin = x_in.to(device, torch_dtype).requires_grad_(True)
        layer(xin, **kwargs).backward(dy_in.to(device, torch_dtype))
        differ, details, gemms = [], [], []
        for op, qa, sa, qb, sb in rec.calls:
            gemm = ORDER[kind][op]
            gemms.append(gemm)
            ref_a, ref_b = expected[gemm]
            for side, got_q, got_s, ref in (("a", qa, sa, ref_a), ("b", qb, sb, ref_b)):
                how = _difference(got_q.cpu(), got_s.cpu(), ref)
                if how:
                    differ.append(f"{gemm} {side}")
                    details.append(f"{gemm} {side}: {how}")
        rows.append({"case": case, "gemms": gemms, "differ": differ, "details": details})
    return rows
