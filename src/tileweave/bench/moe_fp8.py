"""FP8 rows of the ``moe`` section (``--dtype fp8 --scaling ...``), beside the bf16 rows of the same
inputs, each row's ``dtype`` naming its scaling (``fp8-rowwise``).

**The MoE pair**, ``layer0`` and ``layer1``: e4m3 tokens, activations and expert weights quantized with
each scaling by ``tileweave.bench.fp8`` (bf16 output). Variants, on the same float8 tensors:

* ``ours``: ``moe_all_gather_gemm`` / ``moe_gemm_reduce_scatter`` with ``scale_a``, ``scale_b``;
* ``torch``: NCCL all-gather of the float8 rows and their scales, the rows put in expert order by
  index, ``torch._scaled_grouped_mm`` (rowwise scales; a tensorwise call passes its scales broadcast
  to rowwise shapes, the same products), then for ``layer1`` the weighted ``index_add`` and NCCL
  reduce-scatter of the ``grouped`` baseline. torch has no blockwise grouped GEMM: blockwise rows run
  ``ours`` only, and only where H and F_loc are multiples of 128 (not DeepSeek-V2-Lite's F_loc = 704
  at two ranks).

Each variant is checked, before it is timed, against float64 of the dequantized operands
(``tileweave.bench.moe_reference`` on the dequantized inputs). A ``-fast`` scaling runs both with
``use_fast_accum=True``.

**The layer**, ``layer`` and ``layer-bwd``: ``ours`` only, the bf16 ``ours`` row's call
(``tileweave.bench.moe.make_call``: the forward under ``torch.no_grad``, or the forward and the backward
of the row's output gradient, returning the output, ``x.grad``, ``w0.grad`` and ``w1.grad``) on a
``TPMoE`` with the row's weights and ``fp8=recipe_of(scaling)`` (``tileweave.bench.block_fp8``: the
preset recipe, ``backward_fast_accum`` with a ``-fast`` name), on tileweave's default ops: all six
grouped GEMMs in float8 from the bf16 inputs and master weights, the router in fp32 as in the bf16 layer.
Blockwise where H and F_loc are multiples of 128. torch has no FP8 MoE layer (only the GEMM,
``torch._scaled_grouped_mm``): these rows compare with the bf16 ``ours`` (and baseline) rows of the same
part in the same run (the report's ``x bf16``). Each is checked, before it is timed, against the
bf16 rows' reference, float64 of the unquantized layer (``layer_check``): the float8 roundings of every
cast are part of the error, so the bounds are those of float8, not of the kernels.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable

import torch

from tileweave.bench import fp8
from tileweave.bench.block_fp8 import recipe_of
from tileweave.bench.moe_reference import bounded, errors, reference, rel_err
from tileweave.nn.moe_autograd import TILEWEAVE_OPS, gather_rows, reduce_scatter_rows, row_weights
from tileweave.ops.functional import moe_all_gather_gemm, moe_gemm_reduce_scatter
from tileweave.ops.moe import build_plan

LAYER_PARTS = ("layer", "layer-bwd")
"""The parts run on ``TPMoE(fp8=...)``, ``ours`` only."""
PARTS = ("layer0", "layer1", *LAYER_PARTS)
"""The parts with FP8 rows."""
VARIANTS = ("ours", "torch")
LAYER_RESULTS = ("out", "x.grad", "w0.grad", "w1.grad")
"""What a layer row returns: ``layer`` the output, ``layer-bwd`` all four."""

LAYER_TOLERANCE = 0.2
"""Relative Frobenius error bound of an FP8 layer row's output against float64 of the unquantized layer.
The forward casts x, w0, h and w1 to e4m3 whatever the scaling (3 mantissa bits: about 2.5% rms
rounding per element, about 3.5% per GEMM of two cast operands, and h adds its own): a correct layer's
output is 6-7% off, so the bound sits about three times above. Results unrelated to the reference
(another expert's or token's rows, a garbled scale) are 0.5 to 1.4 off. A result off by a uniform factor
is ``LAYER_GAIN_TOLERANCE``'s to catch: 1.1 times a correct output is only 0.12 off."""
LAYER_GRAD_TOLERANCE = 0.3
"""The bound for ``x.grad``, ``w0.grad`` and ``w1.grad``, which pass more casts than the output (the
output gradient, the SwiGLU's gradient, and for the weight gradients both operands again along the
tokens), in e5m2 (2 mantissa bits) with the tensorwise recipe: a correct layer's gradients are 8-10% off
with tensorwise, 6-8% with the other recipes, three times under the bound; the gradient of another
expert in an expert's place is 1.4 off."""
LAYER_GAIN_TOLERANCE = 0.04
"""How far from 1 the output's gain (``moe_reference.errors``: the factor of the reference that best fits
it) may be. Float8 rounding adds noise that hardly moves the gain: within 0.015 of 1 for a correct
output, fewest tokens per expert (the smoke shapes) included, while a factor on the output moves it by
that factor (1.1 times a correct output: 0.09 to 0.11 off)."""
LAYER_GRAD_GAIN_TOLERANCE = 0.1
"""The same for the gradients, looser: a weight gradient sums over each expert's tokens, so few tokens
carry its float8 noise and the gain moves more (up to 0.04 from 1 for a correct tensorwise ``w1.grad``
with 5-20 tokens per expert, 0.026 with the other recipes). A factor of 0.8 or 1.25 on a gradient
fails here; one of 1.1 (gain 0.06 to 0.13 off) is not reliably told from float8's noise."""


def variants(part: str, scaling: str, inp, chosen: tuple[str, ...]) -> tuple[str, ...]:
    """Those of ``chosen`` (the run's ``--variants``, where ``ours`` stands for both) that run FP8 rows of
    ``part`` in ``scaling`` on ``inp`` (a row's ``Inputs``): none for blockwise scaling where H or F_loc is
    not a multiple of 128; ``torch`` for ``layer0`` and ``layer1`` where ``torch._scaled_grouped_mm`` takes
    the scales, on a GPU."""
    base, _ = fp8.split(scaling)
    device = inp.x_shard.device
    if base == "blockwise" and (inp.h % fp8.BLOCK or inp.f_loc % fp8.BLOCK):
        return ()
    out = ["ours"] if "ours" in chosen else []
    if ("ours" in chosen and part not in LAYER_PARTS and base != "blockwise" and device.type == "cuda"
            and hasattr(torch, "_scaled_grouped_mm")):
        out.append("torch")
    return tuple(out)


def rows(part: str, scaling: str, inp, chosen: tuple[str, ...], group, *, tol: float, layer: Callable,
         layer_ref: Callable[[], list[torch.Tensor]]) -> list[tuple[str, Callable, Callable]]:
    """The FP8 rows of ``part`` in ``scaling`` as ``(variant, make, check)``, one per variant of
    ``variants``: ``make()`` gives the call, ``check(results)`` their error and why they fail
    (``moe_reference.bounded``'s form). ``layer0``, ``layer1``: ``make_call`` on the row's ``FP8Inputs``,
    checked against float64 of the dequantized operands within ``tol``. ``layer``, ``layer-bwd``:
    ``layer(fp8=recipe)``, the bf16 row's ``make_call`` with the recipe, checked by ``layer_check``
    against ``layer_ref()``, float64 of the unquantized layer. Collective."""
    names = variants(part, scaling, inp, chosen)
    if not names:
        return []
    if part in LAYER_PARTS:
        return [("ours", functools.partial(layer, fp8=recipe_of(scaling)), layer_check(layer_ref()))]
    q = FP8Inputs(inp, scaling)
    check = bounded(rel_err, reference(part, "ours", q.deq, group, inp.x_shard.device), tol)
    return [(variant, functools.partial(make_call, part, variant, q, group), check) for variant in names]


def layer_check(ref: list[torch.Tensor]) -> Callable[[list[torch.Tensor]], tuple[float, str]]:
    """The check of an FP8 layer row's results (``LAYER_RESULTS``: the output, and with ``layer-bwd`` the
    gradients) against ``ref``, float64 of the unquantized layer: ``got -> (the largest relative
    Frobenius error, why they fail)``, "" where each result's error is within its bound
    (``LAYER_TOLERANCE``, ``LAYER_GRAD_TOLERANCE``) and its gain within its bound of 1
    (``LAYER_GAIN_TOLERANCE``, ``LAYER_GRAD_GAIN_TOLERANCE``)."""

    def check(got: list[torch.Tensor]) -> tuple[float, str]:
        found = errors(got, ref)
        bad = []
        for name, (err, gain) in zip(LAYER_RESULTS, found):
            bound, gain_bound = ((LAYER_TOLERANCE, LAYER_GAIN_TOLERANCE) if name == "out" else
                                 (LAYER_GRAD_TOLERANCE, LAYER_GRAD_GAIN_TOLERANCE))
            if not err <= bound:
                bad.append(f"{name} rel_err {err:.3g} > {bound:g}")
            elif not abs(gain - 1) <= gain_bound:
                bad.append(f"{name} gain {gain:.3g}, off 1 by more than {gain_bound:g}")
        return max(err for err, _ in found), ", ".join(bad)
    return check


class FP8Inputs:
    """A row's float8 operands on this rank from its bf16 ``Inputs`` (``tileweave.bench.moe``): tokens
    and activations quantized per row (or tensor, or 1 x 128 block), expert weights per expert; and
    ``deq``, the same row's inputs as their dequantized float32 values (what the reference reads)."""

    def __init__(self, inp, scaling: str) -> None:
        base, self.fast = fp8.split(scaling)
        self.scaling = base
        self.inp = inp
        # bf16 on GPUs; Triton's interpreter (the smoke run) computes a bf16 output wrongly: float32 there
        self.out_dtype = torch.bfloat16 if inp.x_shard.is_cuda else torch.float32
        self.x8, self.sx, x_deq = fp8.quantize_rows(inp.x_shard, base)
        self.h8, self.sh, h_deq = fp8.quantize_rows(inp.h_rows, base)
        self.w0_8, self.s0, w0_deq = fp8.quantize_experts(inp.w0, base)   # [E, 2*F_loc, H]
        self.w1_8, self.s1, w1_deq = fp8.quantize_experts(inp.w1, base)   # [E, H, F_loc]
        self.deq = types.SimpleNamespace(**{**vars(inp), "x_shard": x_deq, "h_rows": h_deq, "w0": w0_deq,
                                            "w1": w1_deq})


def make_call(part: str, variant: str, q: FP8Inputs, group) -> Callable[[], list[torch.Tensor]]:
    """A closure running ``part`` once on ``variant`` (``ours`` or ``torch``) in FP8, its results in the
    form ``tileweave.bench.moe.make_call`` gives (per (token, slot) pair for ``layer0``)."""
    inp = q.inp
    out = dict(out_dtype=q.out_dtype, use_fast_accum=q.fast)
    if variant == "ours":
        plan = TILEWEAVE_OPS.plan(inp.ids_shard, inp.e, group)
        pairs = plan.pair_row.reshape(-1).long()
        if part == "layer0":
            w0 = q.w0_8.transpose(1, 2)
            return lambda: [moe_all_gather_gemm(q.x8, w0, plan, group, scale_a=q.sx, scale_b=q.s0, **out)[pairs]]
        h8, sh = _in_plan_order(q.h8, q.sh, pairs, q.scaling)
        w1 = q.w1_8.transpose(1, 2)
        return lambda: [moe_gemm_reduce_scatter(h8, w1, plan, inp.weights_shard, group, scale_a=sh, scale_b=q.s1,
                                                **out)]
    plan = build_plan(gather_rows(inp.ids_shard, group), num_experts=inp.e, world_size=1, validate=False)
    pairs = plan.pair_row.reshape(-1).long()
    ends = plan.offsets[1:]
    fast = q.fast

    def scaled_grouped_mm(a8, sa, w8, sb):  # in rowwise shapes: sa [P], sb [E, N]
        n = w8.shape[1]
        if sa.numel() == 1:
            sa = sa.reshape(1).expand(a8.shape[0])
        if q.scaling == "tensorwise":
            sb = sb.reshape(-1, 1).expand(-1, n)
        return torch._scaled_grouped_mm(a8, w8.transpose(1, 2), sa.reshape(-1).contiguous(), sb.contiguous(),
                                        offs=ends, out_dtype=torch.bfloat16, use_fast_accum=fast)

    if part == "layer0":
        def run0():
            x8 = gather_rows(q.x8.view(torch.uint8), group).view(q.x8.dtype)
            sx = gather_rows(q.sx.reshape(1, 1).expand(q.x8.shape[0], 1) if q.sx.dim() < 2 else q.sx, group)
            rows = plan.row_token.long()
            return [scaled_grouped_mm(x8[rows], sx[rows], q.w0_8, q.s0)[pairs]]
        return run0
    h8, sh = _in_plan_order(q.h8, q.sh, pairs, q.scaling)

    def run1():
        z = scaled_grouped_mm(h8, sh, q.w1_8, q.s1)
        z = z * row_weights(plan, gather_rows(inp.weights_shard, group))[:, None].to(z.dtype)
        total = torch.zeros((plan.tokens, inp.h), dtype=torch.float32, device=z.device)
        total.index_add_(0, plan.row_token.long(), z.float())
        return [reduce_scatter_rows(total.to(torch.bfloat16), group)]
    return run1


def _in_plan_order(h8: torch.Tensor, sh: torch.Tensor, pairs: torch.Tensor, scaling: str):
    """Rows given per (token, slot) pair, and their scales, placed in a plan's row order."""
    out = torch.empty_like(h8)
    out.view(torch.uint8)[pairs] = h8.view(torch.uint8)
    if scaling == "tensorwise":
        return out, sh
    placed = torch.empty_like(sh)
    placed[pairs] = sh
    return out, placed
