"""The dense pair in FP8 on emulated ranks (or GPUs): AllGather+GEMM and GEMM+ReduceScatter with float8
inputs and tensorwise, rowwise or blockwise scales, on every path, against float64 of the dequantized
inputs of every rank; and bad FP8 arguments, on every rank or on one only.

Quantisation is written here, independently of the library: each rank's float32 operand is divided by
its scales (amax / 448, the e4m3 maximum, per tensor, per row of ``a`` / column of ``b``, or per 1 x 128
block of ``a`` and 128 x 128 block of ``b``) and cast to e4m3; the reference dequantises the float8
values with the same scales in float64.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

import tileweave
from tileweave.ops import common
from tileweave.runtime.backend import set_producer_delay
from support.scenarios.common import device_name, randn, rel_err

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0


def quantize_a(x: torch.Tensor, scaling: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(a8, scale_a)`` of float32 ``x [m, k]``: tensorwise a 0-d scale, rowwise ``[m, 1]``, blockwise
    ``[m, k/128]``."""
    m, k = x.shape
    if scaling == "tensorwise":
        s = (x.abs().amax() / E4M3_MAX).reshape(())
        return (x / s).to(E4M3), s
    if scaling == "rowwise":
        s = x.abs().amax(1, keepdim=True) / E4M3_MAX
        return (x / s).to(E4M3), s
    s = x.view(m, k // 128, 128).abs().amax(2) / E4M3_MAX
    return (x.view(m, k // 128, 128) / s[:, :, None]).view(m, k).to(E4M3), s


def quantize_b(x: torch.Tensor, scaling: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(b8, scale_b)`` of float32 ``x [k, n]``: tensorwise a ``[1]`` scale, rowwise ``[1, n]``,
    blockwise ``[k/128, ceil(n/128)]``."""
    k, n = x.shape
    if scaling == "tensorwise":
        s = (x.abs().amax() / E4M3_MAX).reshape(1)
        return (x / s).to(E4M3), s
    if scaling == "rowwise":
        s = x.abs().amax(0, keepdim=True) / E4M3_MAX
        return (x / s).to(E4M3), s
    nb = -(-n // 128)
    padded = torch.nn.functional.pad(x, (0, nb * 128 - n)).view(k // 128, 128, nb, 128)
    s = padded.abs().amax((1, 3)) / E4M3_MAX
    return (padded / s[:, None, :, None]).view(k, nb * 128)[:, :n].to(E4M3), s


def dequantize_a(a8: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """float64 ``a8 * scale_a``, each element times its scale (one, its row's, or its 1 x 128 block's)."""
    s = s.double()
    if s.numel() == 1:
        return a8.double() * s.reshape(())
    return a8.double() * s.repeat_interleave(a8.shape[1] // s.shape[1], 1)


def dequantize_b(b8: torch.Tensor, s: torch.Tensor, scaling: str) -> torch.Tensor:
    k, n = b8.shape
    s = s.double()
    if scaling == "blockwise":
        return b8.double() * s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:k, :n]
    return b8.double() * (s.reshape(()) if s.numel() == 1 else s)


def _operands(op: str, scaling: str, mc: int, k: int, n: int, world: int, seed: tuple, device) -> list[tuple]:
    """Every rank's ``(a8, scale_a, b8, scale_b)``: AllGather+GEMM's shard ``[mc, k]`` and ``b [k, n]``,
    GEMM+ReduceScatter's ``a [mc * world, k]`` and ``b [k, n]`` (K being each rank's slice)."""
    rows = mc if op == "ag" else mc * world
    out = []
    for p in range(world):
        # Ranks' magnitudes differ, so that a tensorwise scale differs per rank.
        a8, sa = quantize_a(randn((rows, k), torch.float32, *seed, "a", p) * (1 + p), scaling)
        b8, sb = quantize_b(randn((k, n), torch.float32, *seed, "b", p), scaling)
        out.append((a8.to(device), sa.to(device), b8.to(device), sb.to(device)))
    return out


def _op(kind: str, variant: str):
    """The op of a case's variant: AllGather+GEMM "mesh", "ring", "chunked", "fallback", "auto";
    GEMM+ReduceScatter "chunked" (pushes), "pull", "oneshot", "fallback", "auto"."""
    if kind == "ag":
        if variant in ("fallback", "auto", "oneshot"):
            return tileweave.AllGatherGemm(policy=variant)
        return tileweave.AllGatherGemm(policy="fused", transport=variant)
    if variant in ("fallback", "auto", "oneshot"):
        return tileweave.GemmReduceScatter(policy=variant)
    return tileweave.GemmReduceScatter(policy="fused", transport="chunked", pull=variant == "pull")


def fp8_dense_check(rank: int, world: int, cases: list[tuple]) -> list[dict]:
    """Per case ``(op, variant, scaling, mc, k, n, out_dtype, bias, weight_layout, straggler, delay_s)``
    (op "ag" or "rs"; ``mc`` rows per rank; ``weight_layout``: b is ``weight.t()`` of a float8 ``[n, k]``
    weight): two calls with fresh inputs each (the second takes the signature's plan) into a NaN-poisoned
    ``out``, each against float64 of the dequantized inputs of every rank; the path; the dtype; for
    AllGather+GEMM, whether the second call's ``return_gathered`` gave every rank's float8 rows and
    scales."""
    device = device_name()
    rows = []
    for case in cases:
        kind, variant, scaling, mc, k, n, out_dtype, with_bias, weight_layout, straggler, delay_s = case
        dtype = getattr(torch, out_dtype)
        op = _op(kind, variant)
        set_producer_delay(delay_s if rank == straggler else 0.0)
        errs = []
        for it in range(2):
            seed = (kind, variant, scaling, mc, k, n, it)
            everyone = _operands(kind, scaling, mc, k, n, world, seed, device)
            a8, sa, b8, sb = everyone[rank]
            if weight_layout:
                b8 = b8.t().contiguous().t()
            bias = randn((n,), dtype, *seed, "bias", device=device) if with_bias else None
            out_rows = mc * world if kind == "ag" else mc
            out = torch.full((out_rows, n), float("nan"), dtype=dtype, device=device)
            if variant == "oneshot" and rank == straggler:
                time.sleep(delay_s)  # the others' one-shot kernels wait in their flag spin meanwhile
            gather = kind == "ag" and it == 1  # the second call also returns the gathered rows and scales
            got = op(a8, b8, bias=bias, out=out, scale_a=sa, scale_b=sb, out_dtype=dtype, return_gathered=gather) \
                if kind == "ag" else op(a8, b8, bias=bias, out=out, scale_a=sa, scale_b=sb, out_dtype=dtype)
            if gather:
                got, rows_back, scales_back = got
                gathered_ok = torch.equal(rows_back.cpu().view(torch.uint8),
                                          torch.cat([e[0].cpu() for e in everyone]).view(torch.uint8)) and \
                    torch.equal(scales_back.cpu(), torch.cat([_scale_rows(e[1].cpu(), mc) for e in everyone]))
            if kind == "ag":
                gathered = torch.cat([dequantize_a(e[0].cpu(), e[1].cpu()) for e in everyone])
                ref = gathered @ dequantize_b(everyone[rank][2].cpu(), everyone[rank][3].cpu(), scaling)
            else:
                ref = sum(dequantize_a(e[0].cpu(), e[1].cpu()) @ dequantize_b(e[2].cpu(), e[3].cpu(), scaling)
                          for e in everyone)[rank * mc:(rank + 1) * mc]
            if bias is not None:
                ref = ref + bias.double().cpu()
            errs.append(rel_err(got.cpu(), ref))
            assert got.data_ptr() == out.data_ptr()
        name = "all_gather_gemm" if kind == "ag" else "gemm_reduce_scatter"
        rows.append({"case": case, "err": max(errs), "dtype": str(got.dtype).removeprefix("torch."),
                     "path": common.last_path(name), "gathered": gathered_ok if kind == "ag" else None})
    set_producer_delay(0.0)
    return rows


def _scale_rows(s: torch.Tensor, rows: int) -> torch.Tensor:
    """A shard's a-scales as ``return_gathered`` gives them: a float32 row per row of the shard (its
    scale, or its 1 x 128 blocks' scales)."""
    return s.reshape(1, 1).expand(rows, 1) if s.numel() == 1 else s.reshape(rows, -1)


def _outcome(fn) -> str:
    try:
        fn()
    except (TypeError, ValueError, tileweave.TileweaveError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def fp8_dense_errors_check(rank: int, world: int) -> dict[str, str]:
    """Bad FP8 calls of each op, a fresh op per call (each a signature's first call): the error's type
    and message. Names ending in "one rank" are bad on rank 1 only, the others on every rank."""
    device = device_name()
    mc, k, n = 4, 128, 16
    a8, sa = quantize_a(randn((mc, k), torch.float32, "err", rank), "rowwise")
    b8, sb = quantize_b(randn((k, n), torch.float32, "err-b", rank), "rowwise")
    a8, sa, b8, sb = (t.to(device) for t in (a8, sa, b8, sb))
    ra8, rsa = (t.to(device) for t in quantize_a(randn((mc * world, k), torch.float32, "err-rs", rank), "rowwise"))
    bad = rank == 1
    f16 = torch.float16
    outcomes = {}
    for kind, x8, xs in (("ag", a8, sa), ("rs", ra8, rsa)):
        def call(variant="auto", **kw):
            args = {"scale_a": xs, "scale_b": sb, "out_dtype": f16, **kw}
            return _op(kind, variant)(args.pop("a", x8), args.pop("b", b8), **args)

        cases = {
            "no scales": lambda: call(scale_a=None, scale_b=None),
            "scale_a shape": lambda: call(scale_a=xs[:-1]),
            "scale_b dtype": lambda: call(scale_b=sb.double()),
            "mixed operands": lambda: call(b=b8.half()),
            "scales on fp16": lambda: call(a=x8.half(), b=b8.half(), out_dtype=None),
            "out_dtype": lambda: call(out_dtype=torch.int32),
            "bias dtype": lambda: call(bias=torch.zeros(n, dtype=torch.float32, device=device)),
            "blockwise K": lambda: call(a=x8[:, :96], b=b8[:96], scale_a=xs.new_ones(x8.shape[0], 1),
                                        scale_b=sb.new_ones(1, 1)),
            "scale_a shape, one rank": lambda: call(scale_a=xs[:-1] if bad else xs),
            "scale_b device or dtype, one rank": lambda: call(scale_b=sb.half() if bad else sb),
            "no scales, one rank": lambda: call(scale_a=None if bad else xs),
        }
        if common.interpreting():
            cases["bf16 out on the CPU"] = lambda: call(out_dtype=torch.bfloat16)
        if kind == "ag":
            cases["oneshot"] = lambda: call("oneshot")
            cases["gathered_out"] = lambda: call("mesh", gathered_out=torch.empty(mc * world, k, device=device).to(E4M3))
        for name, fn in cases.items():
            outcomes[f"{kind}: {name}"] = _outcome(fn)
            dist.barrier()
    return outcomes
