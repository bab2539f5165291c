"""``TPMoE(fp8=...)``'s float8 weight gradients read from one captured ``grouped_wgrad`` call
(``support.fp8_moe_capture``), with plain torch, from the layout that ``tileweave.nn.moe_fp8`` and
``grouped_wgrad`` document (nothing of the library is called):

* an operand is ``[P16, C]`` (the transpose view of a K-major ``[C, P16]``): the plan rows of group g
  (``[offsets[g], offsets[g + 1])`` of the plan's offsets, expert ``g % E``) at rows ``offsets16[g] + i``,
  where ``offsets16`` rounds each group's rows up to a multiple of 16; the rows between are zeros, and
  the rows past ``offsets16[G]`` (P16 is allocated for any split of the P rows) are read by nothing;
* its scales: tensorwise one element (or one per expert, ``[E]``); rowwise one per expert and feature,
  ``[E, C]`` or torch's flat ``[E * C]``; blockwise one per 128 rows of a group and feature, block j of
  group g at table row ``offsets16[g] // 128 + g + j`` of ``P16 // 128 + G`` rows.

``cast_difference`` holds an operand and its scales to torch's cast of the documented values along the
same groups of rows (``fp8_reference.quantize_along_rows32``), bit for bit, the padding rows zeros;
``gemm_reference`` gives float64 of the dequantized operands summed over each expert's rows, the
reference of ``fp8_checks.bounds``; ``check_call`` runs both on a captured call.
"""

from __future__ import annotations

import math

import torch

from support.fp8_checks import FLOAT8, GROUPS, Worst, bounds
from support.fp8_reference import E4M3, FORMS, expand_scale, quantize_along_rows32

ALIGN = 16
"""Each group's rows are padded to a multiple of this many (16 bytes of float8)."""
BLOCK = 128
"""The blockwise scales' rows per block, along the tokens (DeepSeek-V3's 128 x 1 tiles)."""


def padded_offsets(offsets: torch.Tensor) -> torch.Tensor:
    """int64 ``[G + 1]``: the plan's group offsets with each group's rows rounded up to ``ALIGN``."""
    counts = offsets[1:].long() - offsets[:-1].long()
    return torch.cat([torch.zeros(1, dtype=torch.long), ((counts + ALIGN - 1) // ALIGN * ALIGN).cumsum(0)])


def _groups_of_rows(offsets: torch.Tensor, rows: int) -> torch.Tensor:
    """The group of each of the first ``rows`` rows."""
    return torch.searchsorted(offsets[1:].long(), torch.arange(rows), right=True)


def layout_problem(operand: torch.Tensor, table: torch.Tensor, scaling: str, experts: int, groups: int) -> str:
    """Empty where ``table`` has a documented shape for ``operand [P16, C]`` under ``scaling`` (module
    docstring); else what was found."""
    cols, shape = operand.shape[1], tuple(table.shape)
    forms = {"tensorwise": [(), (1,), (1, 1), (experts,)], "rowwise": [(experts, cols), (experts * cols,)],
             "blockwise": [(operand.shape[0] // BLOCK + groups, cols)]}[scaling]
    return "" if shape in forms else f"{scaling} scales of shape {list(shape)}, documented: {forms}"


def row_scales(table: torch.Tensor, scaling: str, offsets16: torch.Tensor, experts: int, cols: int) -> torch.Tensor:
    """float32 ``[offsets16[-1], cols]``: the scale of each element of an operand's rows up to the last
    group's end, read from ``table`` (module docstring)."""
    rows = int(offsets16[-1])
    group = _groups_of_rows(offsets16, rows)
    expert = group % experts
    if scaling == "tensorwise":
        per_expert = table.reshape(-1).expand(experts) if table.numel() == 1 else table.reshape(experts)
        return per_expert[expert][:, None].expand(rows, cols)
    if scaling == "rowwise":
        return table.reshape(experts, cols)[expert]
    start = offsets16.long()[group]
    return table[start // BLOCK + group + (torch.arange(rows) - start) // BLOCK]


def dequantize32(a: torch.Tensor, scale: torch.Tensor, scaling: str) -> torch.Tensor:
    """float32 ``a [M, K]`` times its scales in a cast's activation layout (one element, ``[M, 1]``,
    ``[M, K/128]``): the values a float8 input of a weight-gradient cast stands for (the recipe
    dequantizes in float32)."""
    groups = GROUPS[scaling][0]
    table = scale.reshape(1, 1) if groups == "tensor" else scale
    return a.float() * expand_scale(table.float(), groups, *a.shape)


def reference_cast(values: torch.Tensor, offsets: torch.Tensor, experts: int, scaling: str, dtype: torch.dtype,
                   pow2: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """torch's cast of ``values [P, C]`` (float32, in plan order) along the plan's rows: one scale over
    all rows (tensorwise), over each expert's rows of every source (rowwise), per 128 rows of each group
    (blockwise). Returns ``(bytes [P16, C]`` uint8 in the operand layout with zero padding rows, ``scales
    [P, C]`` float32 of each plan row, ``at [P]`` the operand row of each plan row)."""
    off, off16 = offsets.long(), padded_offsets(offsets)
    ranges = [torch.arange(int(off[g]), int(off[g + 1])) for g in range(off.numel() - 1)]
    groups = GROUPS[scaling][0]
    pieces = {"tensor": [torch.arange(values.shape[0])],
              "row": [torch.cat(ranges[e::experts]) for e in range(experts)], "1x128": ranges}[groups]
    q, scales = quantize_along_rows32(values, pieces, groups, dtype, pow2)
    at = torch.cat([off16[g] + torch.arange(len(r)) for g, r in enumerate(ranges)])
    data = torch.zeros(int(off16[-1]), values.shape[1], dtype=torch.uint8)
    data[at] = q.view(torch.uint8)
    return data, scales, at


def cast_difference(operand: torch.Tensor, table: torch.Tensor, values: torch.Tensor, offsets: torch.Tensor,
                    experts: int, scaling: str, dtype: torch.dtype, pow2: bool) -> str:
    """Empty where ``operand`` and its scale ``table`` are ``reference_cast`` of ``values`` in ``dtype``
    bit for bit (the padding rows zeros, the scale read for each plan row equal); else how they differ."""
    if operand.dtype != dtype:
        return f"{operand.dtype}, not {dtype}"
    data, scales, at = reference_cast(values, offsets, experts, scaling, dtype, pow2)
    if operand.shape[0] < data.shape[0] or operand.shape[1] != data.shape[1]:
        return f"shape {list(operand.shape)}, not at least {list(data.shape)}"
    elements = int((operand[:data.shape[0]].view(torch.uint8) != data).sum())
    got = row_scales(table, scaling, padded_offsets(offsets), experts, data.shape[1])[at]
    differ = got != scales
    if not elements and not differ.any():
        return ""
    first = f", first {got[differ][0].item():.9g} for {scales[differ][0].item():.9g}" if differ.any() else ""
    return f"{elements} of {data.numel()} elements, {int(differ.sum())} of {scales.numel()} scales{first}"


def gemm_reference(args: dict, scaling: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(ref, magnitude, rows)``: float64 ``[E, N, K]`` of a float8 ``grouped_wgrad`` call's definition,
    ``out[e] = sum over the rows of e's groups of (lhs * lhs_scale)[p].T (rhs * rhs_scale)[p]``, from its
    own arguments (``lhs [P16, N]``, ``rhs [P16, K]``, their scale tables, ``offsets``, ``experts``),
    padding rows included; ``rows [E, 1, 1]``: each expert's rows, the length of its sum."""
    off16, experts = args["offsets"].long(), args["experts"]
    end = int(off16[-1])
    lhs, rhs = (args[s][:end].double() * row_scales(args[f"{s}_scale"], scaling, off16, experts,
                                                      args[s].shape[1]).double() for s in ("lhs", "rhs"))
    expert = _groups_of_rows(off16, end) % experts
    ref = torch.zeros(experts, lhs.shape[1], rhs.shape[1], dtype=torch.float64)
    mag, count = torch.zeros_like(ref), torch.zeros(experts, 1, 1, dtype=torch.float64)
    for e in range(experts):
        mine = expert == e
        ref[e], mag[e], count[e] = lhs[mine].t() @ rhs[mine], lhs[mine].abs().t() @ rhs[mine].abs(), mine.sum()
    return ref, mag, count


OPERANDS = {"w1 grad": (("lhs", "dO @ w1"), ("rhs", "h_scaled")), "w0 grad": (("lhs", "dy"), ("rhs", "x @ w0"))}
"""Per weight gradient, what each operand casts along the tokens (``tileweave.nn.moe_fp8``'s table): the
gathered float8 rows of a layer-0 GEMM's cast (``"<a> @ <b>"``), dequantized, taken by the plan's tokens;
or an output of the SwiGLU's backward, in the model's dtype, in plan order. ``lhs`` is the gradient (the
recipe's ``grad_dtype``), ``rhs`` the activation (e4m3)."""


def check_call(c, every: dict, plan: tuple, swig, scaling: str, world: int, dtype: torch.dtype, out: dict,
               worst: Worst) -> None:
    """One captured float8 weight gradient ``c`` (``fp8_moe_capture.WgradCall``) checked, for
    ``fp8_moe_capture.check``: its arguments and layout, each operand's cast against ``reference_cast`` of
    the documented values, its output against ``gemm_reference`` of its own arguments within
    ``fp8_checks.bounds``. ``every``: each GEMM's operands of every rank by ``(phase, name)``, ``plan``:
    this rank's ``(ids, pair_row, row_token, row_expert, offsets)``, ``swig``: the phase's SwiGLU backward
    call. Labels go to ``out``'s lists, the output's errors to ``worst``."""
    a, label = c.args, c.label()
    grad_dtype, pow2 = FORMS[scaling][2:]
    row_token, offsets = plan[2].long(), plan[4]
    experts = (offsets.numel() - 1) // world
    if a["lhs_rows"] is not None or a["rhs_rows"] is not None or a.get("scale") is not None \
            or a["experts"] != experts or c.out.dtype != dtype or not c.k_major:
        out["operands"].append(f"{label} arguments")
    if not torch.equal(a["offsets"].long(), padded_offsets(offsets)):
        out["operands"].append(f"{label} offsets")
    layout = [f"{side}: {a[side].dtype}" if a[side].dtype not in FLOAT8 else
              layout_problem(a[side], a[f"{side}_scale"], scaling, experts, offsets.numel() - 1)
              for side in ("lhs", "rhs")]
    if any(layout):
        out["operands"].append(f"{label} layout")
        out["details"] += [f"{label} {how}" for how in layout if how]
        worst.gemm = worst.gemm_fp32 = worst.gemm_mma = math.inf  # not checked: fails as well as the label
        worst.worst = f"{label}: operands outside the documented layout"
        return
    for side, source in OPERANDS[c.name]:
        if " @ " in source:
            everyone = every.get((c.phase, source))
            values = None if everyone is None else \
                torch.cat([dequantize32(q, s, scaling) for q, s, *_ in everyone])[row_token]
        else:
            values = getattr(swig, source, None)
        if values is None:
            out["operands"].append(f"{label} {side} source")
            continue
        how = cast_difference(a[side], a[f"{side}_scale"], values.float(), offsets, experts, scaling,
                              grad_dtype if side == "lhs" else E4M3, pow2)
        if how:
            out["casts"].append(f"{label} {side}")
            out["details"].append(f"{label} {side}: {how}")
    ref, mag, count = gemm_reference(a, scaling)
    # each expert's rows in steps added in fp32 (on a GPU the tensor cores' room inside a step); with
    # use_fast_accum the tensor cores accumulate across all of them
    fast = int(count.max()) if a["use_fast_accum"] else 0
    worst.add(label, c.out, ref, (c.out.double() - ref).abs(), *bounds(c.out.dtype, ref, mag, count, fast_k=fast))
