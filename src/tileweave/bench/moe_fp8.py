"""FP8 rows of the ``moe`` section (``--dtype fp8 --scaling ...``): the MoE pair's two parts, ``layer0``
and ``layer1``, on e4m3 tokens, activations and expert weights quantized with each scaling by
``tileweave.bench.fp8`` (bf16 output), beside the bf16 rows of the same inputs.

Variants, on the same float8 tensors:

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
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable

import torch

from tileweave.bench import fp8
from tileweave.bench.moe_reference import bounded, reference, rel_err
from tileweave.nn.moe_autograd import TILEWEAVE_OPS, gather_rows, reduce_scatter_rows, row_weights
from tileweave.ops.functional import moe_all_gather_gemm, moe_gemm_reduce_scatter
from tileweave.ops.moe import build_plan

PARTS = ("layer0", "layer1")
"""The parts with FP8 rows."""
VARIANTS = ("ours", "torch")


def variants(scaling: str, inp, chosen: tuple[str, ...]) -> tuple[str, ...]:
    """Those of ``chosen`` (the run's ``--variants``, where ``ours`` stands for both) that run FP8 rows of
    ``scaling`` on ``inp`` (a row's ``Inputs``): none for blockwise scaling where H or F_loc is not a
    multiple of 128; ``torch`` where ``torch._scaled_grouped_mm`` takes the scales, on a GPU."""
    base, _ = fp8.split(scaling)
    device = inp.x_shard.device
    if base == "blockwise" and (inp.h % fp8.BLOCK or inp.f_loc % fp8.BLOCK):
        return ()
    out = ["ours"] if "ours" in chosen else []
    if "ours" in chosen and base != "blockwise" and device.type == "cuda" and hasattr(torch, "_scaled_grouped_mm"):
        out.append("torch")
    return tuple(out)


def rows(part: str, scaling: str, inp, chosen: tuple[str, ...], group, *, tol: float) -> list[
        tuple[str, Callable, Callable]]:
    """The FP8 rows of ``part`` in ``scaling`` as ``(variant, make, check)``, one per variant of
    ``variants``: ``make()`` gives the call (``make_call`` on the row's ``FP8Inputs``), ``check(results)``
    their error against float64 of the dequantized operands and why they fail beyond ``tol``
    (``moe_reference.bounded``). Collective."""
    names = variants(scaling, inp, chosen)
    if not names:
        return []
    q = FP8Inputs(inp, scaling)
    check = bounded(rel_err, reference(part, "ours", q.deq, group, inp.x_shard.device), tol)
    return [(variant, functools.partial(make_call, part, variant, q, group), check) for variant in names]


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
