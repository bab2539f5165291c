"""FP8 rows of the ``block`` section: the same block trained in float8, one row per ``--scaling``.

For each scaling the row's block is built again with an FP8 recipe, ``TPTransformerBlock(...,
fp8=recipe)``, from the bf16 block's weights (its state copied), and runs the same step on the same
input and output gradient. The recipe of a ``--scaling`` name (``recipe_of``) is the preset
``Float8Recipe.tensorwise()``, ``.rowwise()`` or ``.blockwise()`` (tensorwise and rowwise already
accumulate fast in the forward GEMM); a ``-fast`` name (``tensorwise-fast``, ``rowwise-fast``) also
sets ``backward_fast_accum=True``, so that all three GEMMs of each linear accumulate fast.

Variants (the bf16 block's ``floor`` and ``base`` have no FP8 row):

* ``ours``: the FP8 block on tileweave's ops (``TILEWEAVE_OPS``: the fused FP8 ops and
  ``tileweave.matmul`` for the weight gradient);
* ``torch``: the same FP8 block with all three float8 GEMMs of each linear on NCCL collectives and
  torch's own scaled matmul (``fp8_ops`` over ``torch_matmul``): the float8 rows and their scales
  all-gathered, then ``torch._scaled_mm`` (tensorwise, rowwise) or ``torch.nn.functional.scaled_mm``
  (blockwise); the scaled matmul to a partial in the output dtype, then a reduce-scatter. The
  quantization (``tileweave.ops.compute.quantize``) is the recipe's in both variants.

Each variant is checked, before it is timed, against a float32 run of the same quantized math: the
FP8 block on ``fp8_ops`` over ``dequantized_matmul``, whose GEMMs multiply the dequantized operands in
float32 (relative Frobenius errors: output and input gradient below ``TOLERANCE``, weight gradients
below ``WGRAD_TOLERANCE``).

A tensorwise scale is each rank's own (the recipe quantizes every shard alone), so gathered rows carry
one scale per source rank: the ``torch`` variant's all-gather then runs one tensorwise scaled matmul per
rank's rows (one in all at world size 1).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

import tileweave
from tileweave.bench import fp8, fp8_comm
from tileweave.bench import variants as V
from tileweave.nn.block import TPTransformerBlock
from tileweave.nn.fp8 import Float8Recipe
from tileweave.nn.tp_ops import TPOps

TOLERANCE = 2e-2
"""Relative Frobenius error bound of an FP8 variant's output and input gradient against the float32 run
of the same quantized math. Both quantize the same way, but the tensor cores sum float8 products with
fewer bits than float32 keeps, so a GEMM's rounded output, and from there the next quantization, can
differ by a step: the bound sits several times above a correct block's error, and well below what a
wrong scale, a wrong rank's rows or an output perturbed by 10% give (0.1 and more)."""
WGRAD_TOLERANCE = 0.2
"""The bound for the weight gradients, which pass through two more quantizations (both operands
quantized again along the tokens) and cancel over the tokens, so that a correct block's error there is
about ten times its output's; a wrong scale or a transposed operand give 1 and more."""

ScaledMatmul = Callable[..., torch.Tensor]
"""``mm(a [M, K], b [K, N], *, scale_a, scale_b, out_dtype, use_fast_accum)`` with ``tileweave.matmul``'s
float8 operands and scales."""


def recipe_of(scaling: str) -> Float8Recipe:
    """The FP8 recipe of a ``--scaling`` name (module docstring)."""
    base, fast = fp8.split(scaling)
    recipe = getattr(Float8Recipe, base)()
    return dataclasses.replace(recipe, backward_fast_accum=True) if fast else recipe


def _dequantize_a(a: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 ``a [M, K]`` times its scales: one element, ``[M, 1]`` or ``[M, K/128]``."""
    if scale.numel() == 1:
        return a.float() * scale.reshape(())
    if scale.shape[1] == 1:
        return a.float() * scale
    return a.float() * scale.repeat_interleave(fp8.BLOCK, dim=1)[:, :a.shape[1]]


def _dequantize_b(b: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 ``b [K, N]`` times its scales: one element, ``[1, N]`` or ``[K/128, ceil(N/128)]``."""
    if scale.numel() == 1:
        return b.float() * scale.reshape(())
    if tuple(scale.shape) == (1, b.shape[1]):
        return b.float() * scale
    full = scale.repeat_interleave(fp8.BLOCK, dim=0).repeat_interleave(fp8.BLOCK, dim=1)
    return b.float() * full[:b.shape[0], :b.shape[1]]


def dequantized_matmul(a, b, *, scale_a, scale_b, out_dtype, use_fast_accum=False) -> torch.Tensor:
    """The reference's GEMM: the dequantized operands multiplied in float32, rounded to ``out_dtype``."""
    return (_dequantize_a(a, scale_a) @ _dequantize_b(b, scale_b)).to(out_dtype)


def torch_matmul(scaling: str, device: torch.device) -> tuple[ScaledMatmul | None, str]:
    """torch's scaled matmul for the block's GEMMs in ``scaling`` on ``device`` (``fp8.torch_scaled_mm``),
    or ``(None, why)``. Blockwise 1 x 128 scales go to torch M-major, as it wants them."""
    base, _ = fp8.split(scaling)
    fn, note = fp8.torch_scaled_mm(base)
    if fn is None:
        return None, note
    if base == "blockwise" and torch.device(device).type != "cuda":
        return None, "torch's blockwise scaled matmul (torch.nn.functional.scaled_mm) runs on CUDA devices only"

    def mm(a, b, *, scale_a, scale_b, out_dtype, use_fast_accum=False):
        if base == "blockwise":
            scale_a = fp8.m_major(scale_a)
        return fn(a, b, scale_a, scale_b, out_dtype=out_dtype, use_fast_accum=use_fast_accum)

    return mm, ""


def fp8_ops(mm: ScaledMatmul) -> TPOps:
    """The FP8 layers' three GEMMs on NCCL collectives around ``mm`` (``TPOps``' float8 signatures):
    the all-gather moves the float8 rows and their scales (``all_gather_gemm`` returns them in the
    gathered form, ``[M, 1]`` or ``[M, K/128]``); the reduce-scatter sums partials in ``out_dtype``."""

    def all_gather_gemm(a_shard, b, group, *, bias=None, out=None, return_gathered=False, scale_a, scale_b,
                        out_dtype, use_fast_accum=False):
        rows = fp8_comm.all_gather_rows(a_shard, group=group)
        m = a_shard.shape[0]
        kw = dict(scale_b=scale_b, out_dtype=out_dtype, use_fast_accum=use_fast_accum)
        if scale_a.numel() == 1:  # each rank's rows with that rank's tensorwise scale
            per_rank = fp8_comm.all_gather_scales(scale_a.reshape(1, 1).float(), group=group)
            parts = [mm(rows[r * m:(r + 1) * m], b, scale_a=per_rank[r], **kw) for r in range(per_rank.shape[0])]
            y = parts[0] if len(parts) == 1 else torch.cat(parts)
            scales = per_rank.repeat_interleave(m, dim=0)
        else:
            scales = fp8_comm.all_gather_scales(scale_a, group=group)
            y = mm(rows, b, scale_a=scales, **kw)
        y = y + bias if bias is not None else y
        return (y, rows, scales) if return_gathered else y

    def gemm_reduce_scatter(a, b, group, *, bias=None, out=None, scale_a, scale_b, out_dtype, use_fast_accum=False):
        partial = mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype, use_fast_accum=use_fast_accum)
        y = fp8_comm.reduce_scatter_rows(partial, group=group)
        return y + bias if bias is not None else y

    return TPOps(all_gather_gemm=all_gather_gemm, gemm_reduce_scatter=gemm_reduce_scatter, matmul=mm)


def fp8_block(block: TPTransformerBlock, scaling: str) -> TPTransformerBlock:
    """A copy of ``block`` (same config, group, device, dtype and weights) with ``scaling``'s recipe.
    Raises ValueError where the recipe does not fit the block's widths (blockwise: multiples of 128)."""
    param = next(block.parameters())
    twin = TPTransformerBlock(block.config, group=block.group, device=param.device, dtype=param.dtype,
                              fp8=recipe_of(scaling))
    twin.load_state_dict(block.state_dict())
    return twin


@dataclasses.dataclass(frozen=True)
class Fp8Block:
    """One row's block in one scaling: ``inputs`` (a ``block.BlockInputs``: the FP8 copy of the block
    with the row's input and output gradient) and ``check(out)``, the relative error of a step's ``out =
    (y, dx)`` against the float32 run of the same quantized math (``TOLERANCE``), or of a weight gradient
    the step left on ``inputs.block``'s parameters where one exceeds ``WGRAD_TOLERANCE``."""

    inputs: object
    check: Callable[[tuple], float]


def fp8_inputs(x, scaling: str) -> Fp8Block:
    """``x`` (a ``block.BlockInputs``) in ``scaling``: its block copied with the recipe (``fp8_block``),
    and the check, whose reference step this runs once (collective, like any step). Raises ValueError
    where the recipe does not fit the block."""
    fx = dataclasses.replace(x, block=fp8_block(x.block, scaling))
    params = list(fx.block.parameters())
    y, dx = fx.step(fp8_ops(dequantized_matmul))(0)
    reference = [y.float(), dx.float(), *(p.grad.float() for p in params)]
    del y, dx

    def check(out) -> float:
        # The output and input gradient's error, unless a weight gradient (left on the parameters by the
        # step just run) is off by more than its own bound: then that one's error.
        wgrad = max(V.rel_err(p.grad, r) for p, r in zip(params, reference[2:], strict=True))
        return wgrad if not wgrad < WGRAD_TOLERANCE else max(V.rel_err(out[0], reference[0]),
                                                             V.rel_err(out[1], reference[1]))

    return Fp8Block(inputs=fx, check=check)


def fp8_variants(x, scaling: str, names: tuple[str, ...]) -> list[V.Variant]:
    """The FP8 variants among ``names`` (``torch``, ``ours``, in that order) of ``x`` (a
    ``block.BlockInputs``) in ``scaling``, each checked with ``fp8_inputs``' check. A block the recipe does
    not fit gives unavailable variants, with the reason."""
    wanted = [n for n in ("torch", "ours") if n in names]
    if not wanted:
        return []
    try:
        f = fp8_inputs(x, scaling)
    except ValueError as e:
        return [V.Variant(name=n, call=None, note=str(e)[:300]) for n in wanted]
    variants = []
    for name in wanted:
        if name == "torch":
            mm, note = torch_matmul(scaling, x.x.device)
            if mm is None:
                variants.append(V.Variant(name="torch", call=None, note=note))
                continue
            variants.append(V.Variant(name="torch", call=f.inputs.step(fp8_ops(mm)), check=f.check,
                                      tolerance=TOLERANCE))
        else:
            variants.append(V.Variant(name="ours", call=f.inputs.step(None), check=f.check, tolerance=TOLERANCE,
                                      path=ours_paths))
    return variants


def ours_paths() -> str:
    """The paths tileweave's ops took in the last step (``Variant.path`` of the block's ``ours``)."""
    return f"ag {tileweave.last_path('all_gather_gemm')}, rs {tileweave.last_path('gemm_reduce_scatter')}"
