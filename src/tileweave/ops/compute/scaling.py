"""FP8 scales: the checks of ``scale_a`` / ``scale_b`` and the form the GEMM kernels read them in.

The semantics are torch's (``torch._scaled_mm``, ``torch.nn.functional.scaled_mm``,
``torch._scaled_grouped_mm``): ``out = (a * scale_a) @ (b * scale_b)`` with float8 ``a [M, K]`` and
``b [K, N]``, float32 scales, fp32 accumulation. Three scalings, told apart by the scales' shapes:

==========  =======================  ==================================  ==========================================
scaling     ``scale_a``              ``scale_b`` (``matmul``)             ``scale_b`` (``grouped_gemm``, E experts)
==========  =======================  ==================================  ==========================================
tensorwise  one element              one element                         ``[E]`` (one per expert)
rowwise     ``[M, 1]`` (or ``[M]``)  ``[1, N]``                          ``[E, 1, N]`` (or ``[E, N]``)
blockwise   ``[M, K/128]``           ``[K/128, ceil(N/128)]``            ``[E, K/128, ceil(N/128)]``
==========  =======================  ==================================  ==========================================

Blockwise is DeepSeek-V3's recipe: one scale per 1 x 128 block of a row of ``a`` and per 128 x 128
block of ``b`` (of the weight); K must be a multiple of 128. Any strides are read in place (torch
wants the blockwise ``scale_b`` as the transpose of the weight's contiguous ``[N/128, K/128]``).
In ``grouped_gemm`` the rows of ``scale_a`` are the rows of ``a``: with ``a_rows`` an output row p
takes the scales of its source row ``a_rows[p]``, so a token is quantised once, not once per expert.

The grouped weight gradient (``grouped_wgrad``, torch's 2d-2d ``_scaled_grouped_mm``) contracts over each
expert's rows, so its scales vary along those rows, in groups a product can be scaled by
(``wgrad_scales``): per tensor or expert, per expert and column (rowwise), per 128 rows of a group and
column (blockwise).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from tileweave.ops import common

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
"""Inputs of the scaled GEMMs: e4m3 (weights and activations), e5m2 (where a recipe keeps gradients)."""
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
"""Outputs of the scaled GEMMs; bfloat16 by default, as in torch."""
BLOCK = 128
"""The blockwise recipe's block edge along K (and along N for the weight's scales)."""


@dataclasses.dataclass(frozen=True)
class Scales:
    """The scales of one launch as the kernels read them: ``a`` and ``b`` with their element strides,
    zero along a dimension the scaling does not vary in (a tensorwise scale is a broadcast scalar)."""

    scaling: str
    """``"tensorwise"``, ``"rowwise"`` or ``"blockwise"``."""
    a: torch.Tensor
    b: torch.Tensor
    a_strides: tuple[int, int]
    """Per row of ``a``, per K block."""
    b_strides: tuple[int, int, int]
    """Per expert (0 for ``matmul``), per K block, per column (rowwise) or 128-column block (blockwise)."""
    fast_accum: bool = False
    """torch's ``use_fast_accum``: the tensor cores accumulate across K steps (tensorwise and rowwise;
    blockwise always adds each K step's scaled product in fp32)."""

    @property
    def kernel_mode(self) -> str:
        """The kernels' ``SCALING`` switch: ``"block"`` inside the K loop, else ``"outer"`` (or
        ``"outer_fast"``) in the epilogue."""
        if self.scaling == "blockwise":
            return "block"
        return "outer_fast" if self.fast_accum else "outer"


def is_fp8(t: object) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype in FP8_DTYPES


def out_dtype_of(op: str, a: torch.Tensor, out_dtype: torch.dtype | None) -> torch.dtype:
    """The output dtype of a call: ``out_dtype`` (bfloat16 by default) for float8 inputs, ``a``'s dtype
    otherwise (where ``out_dtype`` may only repeat it)."""
    if not is_fp8(a):
        if out_dtype is not None and out_dtype != a.dtype:
            raise TypeError(f"{op}: out_dtype={out_dtype} applies to float8 inputs; {a.dtype} inputs give "
                            f"{a.dtype} (pass out_dtype=None)")
        return a.dtype
    if out_dtype is None:
        return torch.bfloat16
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"{op}: out_dtype must be one of torch.bfloat16, torch.float16, torch.float32, "
                        f"got {out_dtype}")
    return out_dtype


def check_operands(op: str, a: torch.Tensor, b: torch.Tensor, scale_a, scale_b, *, names: tuple[str, str] = ("a", "b"),
                   shapes: str = "tileweave.ops.compute.scaling for the shapes of each scaling") -> bool:
    """Whether this is a scaled (float8) call, after refusing mixed operands, missing scales, scales without
    float8 and scales that are not float32 tensors on the operands' device. ``names``: the operands' names
    in the messages (their scales ``<name>_scale``, or ``scale_a`` / ``scale_b`` for ``a`` / ``b``);
    ``shapes``: where the scales' shapes are documented."""
    na, nb = names
    sa_name, sb_name = ("scale_a", "scale_b") if names == ("a", "b") else (f"{na}_scale", f"{nb}_scale")
    fp8_a, fp8_b = is_fp8(a), is_fp8(b)
    if fp8_a != fp8_b:
        raise TypeError(f"{op}: {na} is {a.dtype} and {nb} is {b.dtype}: both must be float8 (e4m3fn or e5m2, "
                        f"with {sa_name} and {sb_name}) or neither; cast the other operand")
    if not fp8_a:
        if scale_a is not None or scale_b is not None:
            raise TypeError(f"{op}: {sa_name} and {sb_name} apply to float8 {'inputs' if na == 'a' else 'operands'} "
                            f"only; {na} and {nb} are {a.dtype}")
        return False
    if scale_a is None or scale_b is None:
        missing = " and ".join(name for name, s in ((sa_name, scale_a), (sb_name, scale_b)) if s is None)
        raise ValueError(f"{op}: float8 {'inputs' if na == 'a' else 'operands'} need {sa_name} and {sb_name} "
                         f"(float32; see {shapes}); {missing} missing")
    if a.device != b.device:
        raise ValueError(f"{op}: {nb} is on {b.device} but {na} is on {a.device}")
    for name, s in ((sa_name, scale_a), (sb_name, scale_b)):
        if not isinstance(s, torch.Tensor) or s.dtype != torch.float32 or s.device != a.device:
            raise TypeError(f"{op}: {name} must be a float32 tensor on {a.device}, got {common.describe(s)}")
    return True


def _strides(t: torch.Tensor, dims: int) -> tuple[int, ...]:
    # The strides of t viewed with `dims` dimensions: dimensions of size 1 never move, so stride 0.
    shape, strides = list(t.shape), list(t.stride())
    while len(shape) < dims:
        shape.insert(0, 1)
        strides.insert(0, 0)
    return tuple(0 if size == 1 else stride for size, stride in zip(shape, strides))


def _blockwise_k(op: str, k: int) -> int:
    if k % BLOCK:
        raise ValueError(f"{op}: blockwise scales need K to be a multiple of {BLOCK}, got K = {k}; pad K "
                         "with zeros or use rowwise scales")
    return k // BLOCK


def dense_scales(op: str, m: int, n: int, k: int, scale_a: torch.Tensor, scale_b: torch.Tensor, *,
                 fast_accum: bool = False) -> Scales:
    """The scaling of ``matmul``'s ``a [m, k] @ b [k, n]`` from its scales' shapes (the module's table)."""
    return dataclasses.replace(_dense_scales(op, m, n, k, scale_a, scale_b), fast_accum=bool(fast_accum))


def _dense_scales(op: str, m: int, n: int, k: int, scale_a: torch.Tensor, scale_b: torch.Tensor) -> Scales:
    sa, sb = tuple(scale_a.shape), tuple(scale_b.shape)
    if scale_a.numel() == 1 and scale_b.numel() == 1 and scale_a.dim() <= 2 and scale_b.dim() <= 2:
        return Scales("tensorwise", scale_a, scale_b, (0, 0), (0, 0, 0))
    if sa == (m, 1) and sb == (1, n):
        return Scales("rowwise", scale_a, scale_b, _strides(scale_a, 2), (0, 0, _strides(scale_b, 2)[1]))
    nb = math.ceil(n / BLOCK)
    if scale_a.dim() == 2 and scale_b.dim() == 2 and sa[0] == m and sb[1] == nb:
        kb = _blockwise_k(op, k)
        if sa != (m, kb) or sb != (kb, nb):
            raise ValueError(f"{op}: blockwise scales for K = {k} must be scale_a [M, K/128] = {[m, kb]} and "
                             f"scale_b [K/128, ceil(N/128)] = {[kb, nb]}; got {list(sa)} and {list(sb)}")
        return Scales("blockwise", scale_a, scale_b, _strides(scale_a, 2), (0, *_strides(scale_b, 2)))
    raise ValueError(f"{op}: scale_a {list(sa)} and scale_b {list(sb)} match no scaling of a [{m}, {k}] @ "
                     f"b [{k}, {n}]: tensorwise takes one element each, rowwise [M, 1] = {[m, 1]} and [1, N] = "
                     f"{[1, n]}, blockwise [M, K/128] and [K/128, ceil(N/128)] = {[k // BLOCK, nb]}")


def grouped_scales(op: str, rows_a: int, experts: int, n: int, k: int, scale_a: torch.Tensor,
                   scale_b: torch.Tensor, *, fast_accum: bool = False) -> Scales:
    """The scaling of ``grouped_gemm`` with ``a [rows_a, k]`` and ``b [experts, k, n]``."""
    return dataclasses.replace(_grouped_scales(op, rows_a, experts, n, k, scale_a, scale_b),
                               fast_accum=bool(fast_accum))


def _grouped_scales(op: str, rows_a: int, experts: int, n: int, k: int, scale_a: torch.Tensor,
                    scale_b: torch.Tensor) -> Scales:
    sa, sb = tuple(scale_a.shape), tuple(scale_b.shape)
    nb = math.ceil(n / BLOCK)
    if scale_a.numel() == 1 and scale_a.dim() <= 2 and sb in ((experts,), (experts, 1, 1)):
        return Scales("tensorwise", scale_a, scale_b, (0, 0), (scale_b.stride(0) if experts > 1 else 0, 0, 0))
    if sa in ((rows_a,), (rows_a, 1)) and sb in ((experts, n), (experts, 1, n)):
        per_expert, per_col = scale_b.stride(0), scale_b.stride(-1)
        return Scales("rowwise", scale_a, scale_b, (scale_a.stride(0), 0),
                      (per_expert if experts > 1 else 0, 0, per_col if n > 1 else 0))
    if scale_a.dim() == 2 and scale_b.dim() == 3 and sa[0] == rows_a and sb[0] == experts and sb[2] == nb:
        kb = _blockwise_k(op, k)
        if sa != (rows_a, kb) or sb != (experts, kb, nb):
            raise ValueError(f"{op}: blockwise scales for K = {k} must be scale_a [Ma, K/128] = {[rows_a, kb]} "
                             f"and scale_b [E, K/128, ceil(N/128)] = {[experts, kb, nb]}; got {list(sa)} and "
                             f"{list(sb)}")
        return Scales("blockwise", scale_a, scale_b, _strides(scale_a, 2), _strides(scale_b, 3))
    raise ValueError(f"{op}: scale_a {list(sa)} and scale_b {list(sb)} match no scaling of a [{rows_a}, {k}] "
                     f"and b [{experts}, {k}, {n}]: tensorwise takes one element and [E] = {[experts]}, rowwise "
                     f"[Ma, 1] = {[rows_a, 1]} and [E, 1, N] = {[experts, 1, n]}, blockwise [Ma, K/128] and "
                     f"[E, K/128, ceil(N/128)] = {[experts, k // BLOCK, nb]}")


@dataclasses.dataclass(frozen=True)
class WgradScales:
    """The scales of a grouped weight gradient (``grouped_wgrad``) as its kernel reads them: for each
    operand, its stride per row of its table (an expert, or a block of 128 plan rows) and per column,
    zero along a dimension the scaling does not vary in."""

    scaling: str
    """``"tensorwise"``, ``"rowwise"`` or ``"blockwise"``."""
    lhs: torch.Tensor
    rhs: torch.Tensor
    lhs_strides: tuple[int, int]
    rhs_strides: tuple[int, int]
    fast_accum: bool = False

    @property
    def kernel_mode(self) -> str:
        """The kernel's ``SCALING`` switch, as ``Scales.kernel_mode``."""
        if self.scaling == "blockwise":
            return "block"
        return "outer_fast" if self.fast_accum else "outer"


def wgrad_blocks(rows: int, groups: int) -> int:
    """Rows of a blockwise weight-gradient scale table for ``rows`` plan rows in ``groups`` groups: block j
    of group g is row ``offsets[g] // 128 + g + j`` (``tileweave.kernels.grouped_wgrad``), so at most
    ``rows // 128 + groups`` rows, whatever the split of the rows between the groups."""
    return rows // BLOCK + groups


def _wgrad_forms(scale: torch.Tensor, experts: int, blocks: int, cols: int) -> dict[str, tuple[int, int]]:
    """The scalings whose shape ``scale`` has, each with its strides (per table row, per column)."""
    shape, forms = tuple(scale.shape), {}
    if scale.numel() == 1 and scale.dim() <= 2:
        forms["tensorwise"] = (0, 0)
    elif shape == (experts,):
        forms["tensorwise"] = (scale.stride(0), 0)
    if shape == (experts, cols):
        forms["rowwise"] = _strides(scale, 2)
    elif shape == (experts * cols,):  # torch._scaled_grouped_mm's 2d-2d form: [E * N], expert-major
        forms["rowwise"] = (cols * scale.stride(0), scale.stride(0))
    if shape == (blocks, cols):
        forms["blockwise"] = _strides(scale, 2)
    return forms


def wgrad_scales(op: str, rows: int, groups: int, experts: int, n: int, k: int, lhs_scale: torch.Tensor,
                 rhs_scale: torch.Tensor, *, fast_accum: bool = False) -> WgradScales:
    """The scaling of ``grouped_wgrad``'s float8 ``lhs [P, n]`` and ``rhs [P, k]`` (P = ``rows`` plan rows in
    ``groups`` groups of ``experts`` experts) from its scales' shapes: tensorwise one element (or ``[E]``,
    one per expert) each; rowwise ``[E, n]`` and ``[E, k]`` (or torch's flat ``[E * n]`` and ``[E * k]``);
    blockwise ``[P // 128 + G, n]`` and ``[P // 128 + G, k]``. Where one shape fits two scalings (a single
    expert, group or column), they scale every element alike."""
    blocks = wgrad_blocks(rows, groups)
    lhs_forms = _wgrad_forms(lhs_scale, experts, blocks, n)
    rhs_forms = _wgrad_forms(rhs_scale, experts, blocks, k)
    for scaling in ("tensorwise", "rowwise", "blockwise"):
        if scaling in lhs_forms and scaling in rhs_forms:
            return WgradScales(scaling, lhs_scale, rhs_scale, lhs_forms[scaling], rhs_forms[scaling],
                               fast_accum=bool(fast_accum))
    raise ValueError(f"{op}: lhs_scale {list(lhs_scale.shape)} and rhs_scale {list(rhs_scale.shape)} match no "
                     f"scaling of lhs [P, N] = [{rows}, {n}] and rhs [P, K] = [{rows}, {k}] over {experts} experts in "
                     f"{groups} groups: tensorwise takes one element or [E] = {[experts]} each, rowwise [E, N] = "
                     f"{[experts, n]} and [E, K] = {[experts, k]} (or [E * N] and [E * K]), blockwise "
                     f"[P // 128 + G, N] = {[blocks, n]} and [P // 128 + G, K] = {[blocks, k]}")
