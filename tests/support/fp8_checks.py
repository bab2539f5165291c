"""What the captured FP8 checks share (``support.fp8_decoder_capture``, ``support.fp8_moe_capture``): the
GEMMs' float8 operands dequantized in float64, the elementwise error bound of a float8 GEMM against
float64 of its own operands, the worst ratio to that bound over many calls, the ranks' operands
exchanged, and a run's results against the float64 references end to end.

A product of an e4m3 or e5m2 value (at most 4 significant bits) and a float32 scale (24) is exact in
float64, so a dequantized operand is exactly what the GEMM was given."""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist

from support.fp8_reference import expand_scale

GROUPS = {"tensorwise": ("tensor", "tensor"), "rowwise": ("row", "row"), "blockwise": ("1x128", "128x128")}
"""Per scaling: the activations' groups and the weights' groups (``support.fp8_reference.quantize32``)."""
FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)
U32 = 2.0 ** -24
"""The unit roundoff of float32."""
MMA_UNIT = 2.0 ** -10
"""Room for Hopper's FP8 MMA, which aligns the products of one instruction to the largest and keeps
about 14 bits of them (DeepSeek-V3, section 3.3.2) before a K step's sum reaches the fp32 accumulator:
at most 2^-13 of the magnitudes per instruction, up to four instructions (K = 32 each) of a 128-wide K
step, and a factor 2 to spare. One e4m3 step is 2^-4 to 2^-3, 64 times more. With ``use_fast_accum``
the sum stays inside the MMA over the whole K (no fp32 add per K step): the same room per 128 of K."""
OUT_UNIT = {torch.float32: U32, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}
"""Per output dtype: its rounding (bfloat16 and float16 with a factor 2 for the reduced sums)."""


def snapshot(t):
    """A detached copy of a tensor (anything else as it is): what a capture keeps of a call."""
    return t.detach().clone() if isinstance(t, torch.Tensor) else t


def to_cpu(obj):
    """A dataclass with every tensor field moved to the CPU."""
    return dataclasses.replace(obj, **{f.name: getattr(obj, f.name).cpu() for f in dataclasses.fields(obj)
                                       if isinstance(getattr(obj, f.name), torch.Tensor)})


def rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    """The relative Frobenius error of ``got`` against ``ref`` (inf where ``got`` is not finite)."""
    got, ref = got.detach().double().cpu(), ref.detach().double().cpu()
    if not torch.isfinite(got).all():
        return math.inf
    return ((got - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def dequantize_a(a: torch.Tensor, scale: torch.Tensor, scaling: str) -> torch.Tensor:
    """float64 ``a [M, K] * scale_a`` (one element tensorwise, ``[M, 1]`` rowwise, ``[M, K/128]``
    blockwise: the GEMMs' layouts)."""
    groups = GROUPS[scaling][0]
    if groups == "tensor":
        return a.double() * scale.double().reshape(())
    return a.double() * expand_scale(scale, groups, *a.shape).double()


def dequantize_b(b: torch.Tensor, scale: torch.Tensor, scaling: str) -> torch.Tensor:
    """float64 ``b [K, N] * scale_b`` (one element tensorwise, ``[1, N]`` rowwise, ``[K/128, ceil(N/128)]``
    blockwise)."""
    groups = GROUPS[scaling][1]
    if groups == "tensor":
        return b.double() * scale.double().reshape(())
    return (b.t().double() * expand_scale(scale.t(), groups, b.shape[1], b.shape[0]).double()).t()


def same_scale(got: torch.Tensor, ref: torch.Tensor) -> bool:
    """Whether a cast's scales equal ``quantize32``'s bit for bit (a tensorwise scale in any shape of
    one element, the others in their exact shape)."""
    if ref.numel() == 1:
        return got.numel() == 1 and torch.equal(got.reshape(ref.shape), ref)
    return torch.equal(got, ref)


def bounds(out_dtype: torch.dtype, ref: torch.Tensor, mag: torch.Tensor, k: int, *, reduced: bool = False,
           fast_k: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The elementwise error bounds ``(fp32, mma)`` of a GEMM of float8 operands with an fp32 accumulator,
    from the float64 result ``ref`` of its operands and the sum ``mag`` of the magnitudes of its terms:
    every product is exact in fp32; ``k`` additions (a number, or a tensor broadcast over ``ref``), the
    scales (two products per term or per tile) and a bias or residual add at most ``(k + 8) u`` of the
    magnitudes (``u``: float32's unit roundoff), the output's rounding its unit of ``|ref|``, and where
    partial sums may be rounded to the output dtype before they are added (``reduced``), that unit of the
    magnitudes too. ``mma`` adds ``MMA_UNIT`` of the magnitudes for tensor cores that keep fewer bits
    inside one K step; ``fast_k``: the length of a contraction summed inside the MMA with
    ``use_fast_accum``, which takes that room per 128 of it."""
    out = OUT_UNIT[out_dtype]
    fp32 = (k + 8) * U32 * mag + out * (ref.abs() + (mag if reduced else 0))
    steps = max(1, math.ceil(fast_k / 128))
    return fp32 + 1e-300, fp32 + steps * MMA_UNIT * mag + 1e-300


def ratio(err: torch.Tensor, bound: torch.Tensor) -> float:
    """The largest ``err / bound`` (inf where an error is not finite): at most 1 when every element is
    within its bound."""
    if not torch.isfinite(err).all():
        return math.inf
    return (err / bound).max().item() if err.numel() else 0.0


class Worst:
    """The worst GEMM over the calls ``add``-ed: ``gemm`` (the largest relative Frobenius error),
    ``gemm_fp32`` and ``gemm_mma`` (the largest ratio to ``bounds``), ``worst`` (the call with the
    largest ``gemm_fp32``); ``keys()`` gives them as a dict."""

    def __init__(self) -> None:
        self.gemm, self.gemm_fp32, self.gemm_mma, self.worst = 0.0, 0.0, 0.0, ""

    def add(self, label: str, got: torch.Tensor, ref: torch.Tensor, err: torch.Tensor, fp32: torch.Tensor,
            mma: torch.Tensor) -> None:
        r = ratio(err, fp32)
        if r >= self.gemm_fp32:
            self.worst = f"{label}: {rel(got, ref):.2e} relative"
        self.gemm_fp32 = max(self.gemm_fp32, r)
        self.gemm_mma = max(self.gemm_mma, ratio(err, mma))
        self.gemm = max(self.gemm, rel(got, ref))

    def keys(self) -> dict:
        return {"gemm": self.gemm, "gemm_fp32": self.gemm_fp32, "gemm_mma": self.gemm_mma, "worst": self.worst}


def exchange(items: list) -> list[list]:
    """Every rank's ``items`` (a list of tuples of CPU tensors or None), in rank order. Collective. float8
    tensors travel as their bytes (torch's pickling of tensors has no float8)."""

    def pack(t):
        return ("float8", str(t.dtype).removeprefix("torch."), t.view(torch.uint8)) \
            if isinstance(t, torch.Tensor) and t.dtype in FLOAT8 else t

    def unpack(t):
        return t[2].view(getattr(torch, t[1])) if isinstance(t, tuple) and t[:1] == ("float8",) else t

    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, [tuple(pack(t) for t in item) for item in items])
    return [[tuple(unpack(t) for t in item) for item in theirs] for theirs in gathered]


def end_to_end(got: list, ref: list, exact: list) -> dict:
    """A run's results against the float64 references, each over all of the run's results at once:
    ``quantized`` (against the same quantized math), ``exact`` (against the exact model) and ``effect``
    (the quantized reference against the exact one: the quantization's own effect)."""
    g, r, e = (torch.cat([t.detach().double().cpu().reshape(-1) for t in ts]) for ts in (got, ref, exact))
    return {"quantized": rel(g, r), "exact": rel(g, e), "effect": rel(r, e)}
