"""MoE layer 0's SwiGLU epilogue writing h's float8 cast (``SwiGLU(cast=...)``), checked against a
reference written with torch and numpy (here and in ``support.fp8_reference``), independently of the library.

Exact operands: float8 values that are small integers and power-of-two scales, so every product and
every partial sum of the grouped GEMM is exact in float32 whatever the order (at K = 256 and values up
to 4, or K = 2048 and values up to 2, at most 19 significant bits), and the pre-activations equal their
float64 products. The SwiGLU is then the epilogue's formula,
``gate / (1 + exp(-gate)) * up`` step by step in float32 numpy (``fp8_reference.swiglu_epilogue32``: what
Triton's interpreter computes; a GPU's ``exp`` may differ in its last bit), and the cast is
``fp8_reference.quantize32`` of those values.
"""

from __future__ import annotations

import zlib

import torch

import tileweave
from tileweave.ops import common
from tileweave.ops.compute.grouped_gemm import SwiGLU
from support import fp8_reference
from support.fp8_reference import quantize32

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
GROUPS = {"tensorwise": "tensor", "rowwise": "row", "blockwise_1x128": "1x128"}
"""Each cast form and its groups in ``quantize32``'s words."""


def gen(*parts) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(parts).encode()))


def exact_fp8(g: torch.Generator, *shape, high: int = 4) -> torch.Tensor:
    """Float8 integers in [-high, high] (exact in e4m3)."""
    return torch.randint(-high, high + 1, shape, generator=g).float().to(E4M3)


def pow2(g: torch.Generator, *shape) -> torch.Tensor:
    """float32 powers of two from 2**-4 to 2**-1."""
    return torch.exp2(torch.randint(-4, 0, shape, generator=g).float())


def scales(g: torch.Generator, scaling: str, rows: int, n: int, k: int, experts: int):
    """``(scale_a, scale_b)`` of ``scaling`` for ``a [rows, K]`` and ``b [E, K, N]``, powers of two."""
    if scaling == "tensorwise":
        return pow2(g), pow2(g, experts)
    if scaling == "rowwise":
        return pow2(g, rows, 1), pow2(g, experts, 1, n)
    return pow2(g, rows, k // 128), pow2(g, experts, k // 128, -(-n // 128))


def dequantized_a(a8: torch.Tensor, scale_a: torch.Tensor) -> torch.Tensor:
    """float64 ``a8 * scale_a`` (one element, ``[rows, 1]`` or ``[rows, K/128]``)."""
    s = scale_a.double()
    s = s.reshape(1, 1) if s.numel() == 1 else s.repeat_interleave(128, 1) if s.shape[1] > 1 else s
    return a8.double() * s


def dequantized_b(b8: torch.Tensor, scale_b: torch.Tensor) -> torch.Tensor:
    """float64 ``[E, K, N]`` of ``b8 * scale_b`` (``[E]``, ``[E, 1, N]`` or ``[E, K/128, ceil(N/128)]``)."""
    e, k, n = b8.shape
    s = scale_b.double()
    if s.dim() == 1:
        s = s.view(e, 1, 1)
    elif s.shape[1] > 1 or s.shape[2] < n:
        s = s.repeat_interleave(128, 1).repeat_interleave(128, 2)[:, :k, :n]
    return b8.double() * s


def swiglu_epilogue32(pre: torch.Tensor) -> torch.Tensor:
    """``h [R, F]`` of exact pre-activations ``pre [R, 2F]`` (gate, then up; float64 holding float32
    values), by the epilogue's float32 steps."""
    f = pre.shape[1] // 2
    as32 = pre.float()
    assert torch.equal(as32.double(), pre), "the pre-activations must be exact in float32"
    return fp8_reference.swiglu_epilogue32(as32[:, :f], as32[:, f:])


def reference_cast(h: torch.Tensor, cast: str, dtype, power_of_two: bool):
    """``(data, scale)`` of float32 ``h`` in the form of ``cast`` (``quantize32``), scale shapes as the
    epilogue's: one element, ``[R, 1]``, ``[R, ceil(F/128)]``."""
    data, scale = quantize32(h, GROUPS[cast], dtype, power_of_two)
    return data, scale.reshape(()) if cast == "tensorwise" else scale


def same_bits(got, data: torch.Tensor, scale: torch.Tensor) -> bool:
    return (got.data.dtype == data.dtype and torch.equal(got.data.view(torch.uint8), data.view(torch.uint8))
            and tuple(got.scale.shape) == tuple(scale.shape) and torch.equal(got.scale, scale))


# (cast form, cast dtype, powers of two, tokens per rank, hidden, F_loc, experts, top-k, policy)
FIELDS = ("cast", "dtype", "pow2", "tc", "hidden", "f_loc", "experts", "topk", "policy")


def layer0_cast_check(rank: int, world: int, cases: list[tuple]) -> list[dict]:
    """Per case (``FIELDS``): ``MoEAllGatherGemm`` with ``SwiGLU(cast=...)``, its input scaled as the
    cast's recipe scales it (tensorwise, rowwise, blockwise), against the reference cast of every (token,
    slot) pair's SwiGLU; whether the pre-activations are exact; the path; what ``return_gathered`` gave."""
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    rows = []
    for case in cases:
        c = dict(zip(FIELDS, case))
        cast, tc, hid, f, e, k = (c[name] for name in ("cast", "tc", "hidden", "f_loc", "experts", "topk"))
        scaling = cast.removesuffix("_1x128")
        tokens = tc * world
        g = gen("ids", case, world)
        ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(tokens)])
        shards = []
        for p in range(world):  # every rank's float8 shard and its scales
            gp = gen("x", case, p)
            x8 = exact_fp8(gp, tc, hid)
            shards.append((x8, scales(gp, scaling, tc, 2 * f, hid, e)[0]))
        gw = gen("w0", case, rank)
        w8 = exact_fp8(gw, e, 2 * f, hid).transpose(1, 2)  # the nn.Linear stack's transpose view
        scale_b = scales(gw, scaling, tc, 2 * f, hid, e)[1]
        x_deq = torch.cat([dequantized_a(x8, s) for x8, s in shards])
        w_deq = dequantized_b(w8, scale_b)
        pairs = torch.stack([x_deq[t] @ w_deq[ids[t, j]] for t in range(tokens) for j in range(k)])
        h_ref = swiglu_epilogue32(pairs)
        data_ref, scale_ref = reference_cast(h_ref, cast, c["dtype"], c["pow2"])

        plan = tileweave.moe_plan(ids[rank * tc:(rank + 1) * tc].to(device), num_experts=e)
        pre = torch.full((plan.rows, 2 * f), float("nan"), device=device)
        x8, scale_a = shards[rank]
        got, gathered, gathered_scales = tileweave.MoEAllGatherGemm(policy=c["policy"])(
            x8.to(device), w8.to(device), plan, return_gathered=True, scale_a=scale_a.to(device),
            scale_b=scale_b.to(device), out_dtype=torch.float32,
            epilogue=SwiGLU(pre=pre, cast=cast, cast_dtype=c["dtype"], power_of_two=c["pow2"]))
        path = common.last_path("moe_all_gather_gemm")
        order = plan.pair_row.reshape(-1).long().cpu()  # the plan row of pair (t, j), pairs in (t, j) order
        data, scale = got.data.cpu()[order], got.scale.cpu()
        if cast != "tensorwise":
            scale = scale[order]
        pre_exact = torch.stack([pairs[:, :f], pairs[:, f:]], dim=2).reshape(-1, 2 * f)
        rows.append({"case": case, "path": path, "same": same_bits(type(got)(data, scale), data_ref, scale_ref),
                     "pre_exact": torch.equal(pre.cpu()[order].double(), pre_exact),
                     "gathered": torch.equal(gathered.cpu().view(torch.uint8),
                                             torch.cat([x8 for x8, _ in shards]).view(torch.uint8))
                     and gathered_scales.shape[0] == tokens})
    return rows
