"""FP8 training recipes for the TP linears: which tensor each GEMM casts to which float8 format, with
which scaling.

A linear ``y = x @ w.T`` runs three GEMMs per step: the forward, the input gradient ``dx = dy @ w``
(dgrad) and the weight gradient ``dw = dy.T @ x`` (wgrad). Every operand is cast to float8 just before
its GEMM, with scales computed on the device from the tensor itself (dynamic scaling, no history),
K-major: along the GEMM's contraction. Master weights, their gradients and the optimizer state stay
in the parameters' dtype; activations and gradients between layers stay in the model's dtype; only the
GEMMs' operands are float8, and each GEMM writes its result in the dtype its consumer wants (the output
and ``dx`` in the input's, ``dw`` in the weight's).

===========  ======================================  ======================================  =======================================
recipe       forward ``x @ w.T``                     dgrad ``dy @ w``                        wgrad ``dy.T @ x``
===========  ======================================  ======================================  =======================================
tensorwise   x e4m3, w e4m3: one scale each          dy e5m2, w e4m3: one scale each         dy e5m2, x e4m3: one scale each
rowwise      x e4m3 per row (along K), w e4m3 per    dy e4m3 per row (along N), w e4m3 per   dy e4m3 per column (along M), x e4m3
             row (along K)                           column (along N)                        per column (along M)
blockwise    x e4m3 per 1 x 128 (along K), w e4m3    dy e4m3 per 1 x 128 (along N), w e4m3   dy e4m3 per 128 x 1 (along M), x e4m3
             per 128 x 128                           per 128 x 128 (the forward's blocks)    per 128 x 128 (M x K blocks)
===========  ======================================  ======================================  =======================================

* **tensorwise** is torchao's float8 tensorwise recipe (gradients in e5m2, for their range); the
  backward GEMMs reuse the forward's weight scale and the dgrad's gradient scale, transposed.
* **rowwise** is torchao's rowwise recipe: every scale along the dimension the GEMM contracts (a
  transposed operand is quantized again along its own rows, not reused), scales rounded up to powers
  of two, e4m3 everywhere.
* **blockwise** is DeepSeek-V3's: 1 x 128 blocks for activations and gradients, 128 x 128 for weights,
  e4m3 everywhere. The weight gradient contracts over the tokens: its gradient operand is 1 x 128
  along the tokens (DeepSeek-V3's 128 x 1 tiles), its activation operand 128 x 128 blocks (the form the
  GEMM takes for its second operand; DeepSeek-V3 uses 128 x 1 tiles there too), the tokens padded with
  zeros to a multiple of 128. Both local feature dimensions (in and out) must be multiples of 128.

Which values each activation cast reads (``x`` of the forward and of the weight gradient; ``q(.)``: a
cast of the table above, ``deq(.)``: float8 times its scales, in float32):

===========================  ===========================================  ==========================================
layer, input                 forward ``q(x)``                             wgrad ``q(x)``, along the tokens
===========================  ===========================================  ==========================================
column                       ``x_shard`` in its dtype                     ``deq`` of the forward's gathered float8
                                                                          rows; ``save_gathered=False``: ``x``
                                                                          gathered again in its dtype
column, ``norm=``            the norm's float32 values, in its kernel     ``deq`` of the forward's float8 rows, kept
                                                                          gathered or (``save_gathered=False``)
                                                                          cast again and gathered
row                          ``x`` in its dtype                           ``deq`` of the forward's float8 ``x``
row, ``swiglu=True``         the SwiGLU's float32 values, in its kernel   ``deq`` of the forward's float8 ``x``
===========================  ===========================================  ==========================================

A fused producer's float32 values are never rounded to the model's dtype, and never stored: the weight
gradient takes the forward's float8 rows, dequantized and quantized again along the tokens
(DeepSeek-V3's requantization; ``[M, K]`` bytes kept, half of a bf16 copy). A column layer with
``norm=`` and ``save_gathered=False`` keeps no copy of the rows: its backward runs the norm's kernel
again on the norm's input (kept anyway for the norm's backward), which gives the forward's rows and
scales bit for bit, and gathers them with their scales (half the bytes of bf16); ``save_gathered`` then
trades ``[M, K]`` bytes of memory for that gather and one pass over ``[M/W, K]``, and changes no bit of
the gradients. Without a producer, ``save_gathered=False`` gathers the input itself and quantizes it
once. The gradient ``dy`` is quantized from the output gradient where the layer has it whole (the
dgrad's, and the column layer's wgrad), and requantized from the gathered float8 ``dy`` where only that
crossed the ranks (the row layer's wgrad: its dgrad AllGather+GEMM gathers ``dy`` in float8, half the
bytes). Bias gradients are sums of ``dy`` in float32: the output gradient itself (column layer), the
gathered float8 ``dy`` dequantized (row layer).

Which casts are fused into the kernel that produces the tensor. The forward GEMM's activation operand
of a column-parallel linear called with ``norm=`` (the RMSNorm before it, as ``TPTransformerBlock`` calls
its QKV and gate/up projections) is written by the RMSNorm's own kernel, and that of a row-parallel
linear called with ``swiglu=True`` (the down projection) by the SwiGLU's: every recipe, rowwise and
blockwise in one launch, tensorwise in two (the norm or SwiGLU with an atomic amax, then again with the
cast). The MoE layer's down projection (``TPMoE(fp8=...)``) gets its operand from layer 0's grouped
GEMM, whose SwiGLU epilogue casts it (``swiglu_epilogue``; tensorwise writes its float32 values and an
atomic amax, then a launch casts them). The normalized or gated activation is never written in the
model's dtype: its values are cast from float32; the norm's backward runs in one kernel, from the norm's input
and each row's ``rstd`` (``tileweave.ops.compute.rms_norm``), and the SwiGLU's in one kernel from ``gate | up``
(``tileweave.ops.compute.swiglu``; the MoE layer's from its pre-activations). Every other cast is a pass
of its own (``tileweave.ops.compute.quantize``): the forward's input of a linear called without a
producer, the weights (twice per step; once with blockwise, whose forward cast also writes the
transposed operand of the input gradient and keeps it: ``keep_weight_transpose``), the output
gradients (blockwise, where a layer holds ``dy`` whole, both its casts in one pass: ``grads``) and the
weight gradient's requantized operands.

``TPMoE(fp8=...)`` takes the same recipes for its experts' six grouped GEMMs: the forward pair and the
input gradients as above, per expert, and both weight gradients with their operands quantized along
each expert's tokens (``expert_tokens``): one scale per operand, one per expert and feature (torchao's
MoE recipe), or one per 128 tokens of a group and feature (DeepSeek-V3's 128 x 1 tiles);
``tileweave.nn.moe_fp8`` has its table.

The GEMMs take ``use_fast_accum`` from the recipe: the presets let the tensor cores accumulate across
K steps in the forward GEMM (torchao's choice) and add each K step in fp32 in the backward ones;
blockwise scaling always adds each K step in fp32.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TypeVar

import torch

from tileweave.ops.compute.fused_quantize import NormQuantized, rms_norm_quantize, swiglu_quantize
from tileweave.ops.compute.grouped_gemm import SwiGLU
from tileweave.ops.compute.quantize import Quantized, Segments, quantize, quantize_segments

SCALINGS = ("tensorwise", "rowwise", "blockwise")
T = TypeVar("T")
_A = {"tensorwise": "tensorwise", "rowwise": "rowwise", "blockwise": "blockwise_1x128"}
_B = {"tensorwise": "tensorwise", "rowwise": "rowwise", "blockwise": "blockwise_128x128"}


_CASTS = "_tileweave_float8_casts"
"""The attribute of a weight tensor that holds its float8 casts: ``(stamp, {key: cast})``."""


def cached_weight_cast(recipe: "Float8Recipe", weight: torch.Tensor, key: object, cast: Callable[[], T]) -> T:
    """``cast()``, a float8 cast of ``weight`` named ``key``: made at every call, or with
    ``recipe.cache_weights`` once per state of ``weight`` and kept on it. The state is the weight's
    version counter (bumped by every in-place change through the tensor: the optimizer's step,
    ``copy_``), its storage, shape, strides and dtype: any change makes every kept cast of it stale. Never
    kept under CUDA-graph capture (a replay would not see the weight change)."""
    if not recipe.cache_weights or (weight.is_cuda and torch.cuda.is_current_stream_capturing()):
        return cast()
    stamp = (weight._version, weight.data_ptr(), tuple(weight.shape), weight.stride(), weight.dtype, weight.device)
    entry = weight.__dict__.get(_CASTS)
    if entry is None or entry[0] != stamp:
        entry = weight.__dict__[_CASTS] = (stamp, {})
    casts = entry[1]
    full = (recipe, key)
    if full not in casts:
        casts[full] = cast()
    return casts[full]


def refresh_weight_casts(module: torch.nn.Module) -> None:
    """Drop the float8 casts kept on ``module``'s parameters (``Float8Recipe.cache_weights``): the next
    forward casts them again. Needed only after a change the version counter does not see (through
    ``weight.data``)."""
    for param in module.parameters():
        param.__dict__.pop(_CASTS, None)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Float8Recipe:
    """How a TP linear runs its forward, input-gradient and weight-gradient GEMMs in float8 (the module
    docstring's table). ``Float8Recipe.tensorwise()``, ``.rowwise()`` and ``.blockwise()`` are torchao's
    and DeepSeek-V3's choices; the fields let one differ."""

    scaling: str
    """``"tensorwise"``, ``"rowwise"`` or ``"blockwise"``: which elements share a scale."""
    grad_dtype: torch.dtype = torch.float8_e4m3fn
    """The format of the output gradient ``dy`` in both backward GEMMs (``torch.float8_e5m2``: more
    range, fewer bits). Activations and weights are always ``torch.float8_e4m3fn``."""
    power_of_two_scales: bool = False
    """Round every scale up to a power of two (scaling then loses no mantissa bits)."""
    forward_fast_accum: bool = False
    """``use_fast_accum`` of the forward GEMM (tensorwise and rowwise): the tensor cores accumulate
    across K steps, faster, fewer bits kept over a long K."""
    backward_fast_accum: bool = False
    """The same for the two backward GEMMs (torchao keeps them exact: each K step summed in fp32)."""
    keep_weight_transpose: bool = True
    """Blockwise: the forward's weight cast also writes the transposed float8 weight that the input
    gradient's GEMM takes (the same 128 x 128 blocks: bit for bit what a cast in the backward gives),
    kept for the backward: one byte per weight element held from forward to backward, one read of
    the weight and one cast less per step. False: the backward casts the weight again."""

    cache_weights: bool = False
    """Cast each weight once per state of it, not at every forward and backward: the float8 weights (each
    orientation a GEMM takes) are kept on the weight tensor and reused until it changes, across the
    micro-batches of a step and from the forward to the backward (``cached_weight_cast``). Costs, per
    weight, one byte per element and orientation held (plus scales) for as long as the weight lives. A
    change through the parameter (the optimizer's step, ``copy_``, a new tensor) is seen by its version
    counter and storage; one through ``weight.data`` is not: call ``refresh_weight_casts(module)`` after
    such a change."""

    def __post_init__(self) -> None:
        if self.scaling not in SCALINGS:
            raise ValueError(f"Float8Recipe.scaling must be one of {', '.join(SCALINGS)}, got {self.scaling!r}")
        if self.grad_dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise TypeError("Float8Recipe.grad_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got "
                            f"{self.grad_dtype}")
        for name in ("power_of_two_scales", "forward_fast_accum", "backward_fast_accum", "keep_weight_transpose",
                     "cache_weights"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"Float8Recipe.{name} must be a bool, got {getattr(self, name)!r}")

    @classmethod
    def tensorwise(cls) -> "Float8Recipe":
        """torchao's float8 tensorwise recipe: e4m3 activations and weights, e5m2 gradients, one scale
        per tensor, a fast-accumulating forward GEMM."""
        return cls(scaling="tensorwise", grad_dtype=torch.float8_e5m2, forward_fast_accum=True)

    @classmethod
    def rowwise(cls) -> "Float8Recipe":
        """torchao's rowwise recipe: e4m3 everywhere, a scale per row along each GEMM's contraction,
        powers of two, a fast-accumulating forward GEMM."""
        return cls(scaling="rowwise", power_of_two_scales=True, forward_fast_accum=True)

    @classmethod
    def blockwise(cls) -> "Float8Recipe":
        """DeepSeek-V3's recipe: e4m3 everywhere, 1 x 128 blocks of activations and gradients, 128 x 128
        blocks of weights."""
        return cls(scaling="blockwise")

    # -- the operands, each quantized K-major (``tileweave.ops.compute.quantize``) --------------------

    def lhs(self, x: torch.Tensor, *, grad: bool = False, transpose: bool = False, tokens: bool = False,
            scale=None, x_scale=None):
        """The first operand of a GEMM: ``x [M, K]`` (or ``x.T`` with ``transpose``) quantized along K,
        in e4m3 (``grad``: in ``grad_dtype``); ``tokens``: K is the tokens (a weight gradient), which
        blockwise pads with zeros to a multiple of 128. ``scale``, ``x_scale``: ``quantize``'s."""
        return quantize(x, _A[self.scaling], dtype=self.grad_dtype if grad else torch.float8_e4m3fn,
                        transpose=transpose, pad=tokens and self.scaling == "blockwise",
                        power_of_two=self.power_of_two_scales, scale=scale, x_scale=x_scale)

    def rhs(self, x: torch.Tensor, *, transpose: bool = False, tokens: bool = False, scale=None, x_scale=None):
        """The second operand of a GEMM as ``[N, K]`` (``x``, or ``x.T`` with ``transpose``) quantized
        along K, e4m3; ``matmul`` takes ``(data.t(), scale.t())``. ``tokens``, ``scale``, ``x_scale``:
        as ``lhs``'s."""
        return quantize(x, _B[self.scaling], transpose=transpose, pad=tokens and self.scaling == "blockwise",
                        power_of_two=self.power_of_two_scales, scale=scale, x_scale=x_scale)

    def weights(self, weight: torch.Tensor) -> tuple[Quantized, Quantized | None]:
        """The forward GEMM's weight operand ``rhs(weight)`` and, where the recipe keeps it
        (``keep_weight_transpose``, blockwise), the input gradient's ``rhs(weight, transpose=True)``
        from the same pass; else None (the backward casts it)."""
        def cast():
            if self.scaling == "blockwise" and self.keep_weight_transpose:
                return quantize(weight, _B[self.scaling], power_of_two=self.power_of_two_scales, twin=True)
            return self.rhs(weight), None

        return cached_weight_cast(self, weight, "weights", cast)

    def grads(self, dy: torch.Tensor) -> tuple[Quantized, Quantized]:
        """Both backward GEMMs' operands of an output gradient ``dy [M, N]`` held whole: ``lhs(dy,
        grad=True)`` for the input gradient and ``lhs(dy, grad=True, transpose=True, tokens=True)`` for the
        weight gradient (tensorwise: with the first's scale); blockwise in one pass over ``dy``."""
        if self.scaling == "blockwise":
            return quantize(dy, _A[self.scaling], dtype=self.grad_dtype, power_of_two=self.power_of_two_scales,
                            twin=True)
        first = self.lhs(dy, grad=True)
        scale = first.scale if self.scaling == "tensorwise" else None
        return first, self.lhs(dy, grad=True, transpose=True, tokens=True, scale=scale)

    def expert_tokens(self, x: torch.Tensor, offsets: torch.Tensor, experts: int, *, grad: bool = False,
                      rows: torch.Tensor | None = None, scale=None, x_scale=None) -> Segments:
        """An operand of an MoE layer's weight gradient (``grouped_wgrad``), whose sum runs over each
        expert's tokens: the plan rows of ``x`` (``x[rows[p]]`` with ``rows``) quantized along the tokens
        (``quantize_segments``): tensorwise one scale, rowwise one per expert and feature, blockwise one per
        128 tokens of a group and feature (DeepSeek-V3's 128 x 1 tiles); e4m3 (``grad``: in ``grad_dtype``).
        ``scale``, ``x_scale``: ``quantize``'s."""
        return quantize_segments(x, offsets, experts, _A[self.scaling],
                                 rows=rows, dtype=self.grad_dtype if grad else torch.float8_e4m3fn,
                                 power_of_two=self.power_of_two_scales, scale=scale, x_scale=x_scale)

    def normed_lhs(self, x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> NormQuantized:
        """The forward GEMM's first operand ``q(rms_norm(x))`` of ``x [M, K]``, as ``lhs`` casts it, from the
        kernel that computes the norm (``rms_norm_quantize``: also each row's ``rstd``). A second call on
        the same tensors returns the same rows and scales, bit for bit."""
        return rms_norm_quantize(x, weight, eps, _A[self.scaling], power_of_two=self.power_of_two_scales)

    def swiglu_lhs(self, gate: torch.Tensor, up: torch.Tensor) -> Quantized:
        """The forward GEMM's first operand ``q(silu(gate) * up)`` (``[M, K]`` each), as ``lhs`` casts it,
        from the kernel that computes the SwiGLU (``swiglu_quantize``)."""
        return swiglu_quantize(gate, up, _A[self.scaling], power_of_two=self.power_of_two_scales)[0]

    def swiglu_epilogue(self, pre: torch.Tensor | None = None) -> SwiGLU:
        """The SwiGLU epilogue of a grouped GEMM (MoE layer 0) that writes the next GEMM's first operand
        ``q(h)`` as ``lhs`` casts it, from the epilogue's float32 values; ``pre``: ``SwiGLU``'s."""
        return SwiGLU(pre=pre, cast=_A[self.scaling], power_of_two=self.power_of_two_scales)

    def check_features(self, owner: str, contractions: dict[str, int]) -> None:
        """Refuse blockwise scaling where a GEMM's contraction over features is not a multiple of 128
        (``contractions``: each dimension's name and this rank's size)."""
        if self.scaling != "blockwise":
            return
        bad = {name: size for name, size in contractions.items() if size % 128}
        if bad:
            got = ", ".join(f"{name} = {size}" for name, size in contractions.items())
            raise ValueError(f"{owner}: fp8 blockwise scaling needs {' and '.join(contractions)} to be multiples "
                             f"of 128 (the contraction dimensions of the forward and input-gradient GEMMs), got "
                             f"{got}; use the rowwise or tensorwise recipe")


def resolve(fp8) -> Float8Recipe | None:
    """A layer's ``fp8`` argument as a recipe: None, a ``Float8Recipe``, or the name of one of the three."""
    if fp8 is None or isinstance(fp8, Float8Recipe):
        return fp8
    if isinstance(fp8, str) and fp8 in SCALINGS:
        return getattr(Float8Recipe, fp8)()
    raise ValueError(f"fp8 must be None, a Float8Recipe or one of {', '.join(repr(s) for s in SCALINGS)}, "
                     f"got {fp8!r}")
