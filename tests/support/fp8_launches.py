"""Calls that launch the float8 casts and the FP8 grouped weight gradient, for the sm_90 compile check
(``support.launches`` records them): every group kind of ``quantize``, the RMSNorm and SwiGLU with their
cast fused, the SwiGLU's backward of the FP8 row layer, ``quantize_segments`` (with the H200's tiles
through ``support.launches.h200_variant``), and ``grouped_wgrad`` on float8 operands with the config it
picks on an H200.
"""

from __future__ import annotations

from typing import Callable

import torch

from tileweave.ops.compute.fused_quantize import rms_norm_quantize, swiglu_quantize
from tileweave.ops.compute.grouped_wgrad import grouped_wgrad
from tileweave.ops.compute.quantize import quantize, quantize_segments
from tileweave.ops.compute.scaling import wgrad_blocks
from tileweave.ops.compute.swiglu import swiglu_backward
from tileweave.tune.grouped import choose_wgrad_config

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _randn(*shape, dtype=torch.float16) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape)), dtype=torch.float32).to(dtype)


def _fp8(*shape, dtype=E4M3) -> torch.Tensor:
    return _randn(*shape, dtype=torch.float32).to(dtype)


def cast_calls() -> dict[str, Callable[[], object]]:
    # Every group kind and format, the transposed read (a stride of 1 along the rows), padding, a float8
    # input requantized with its scales, a given scale, power-of-two scales; fp16 inputs, which the H200
    # variants of these launches (h200_variant: the GPU's tiles) compile in bf16.
    x = lambda *shape: _randn(*shape, dtype=torch.float32)
    # A plan's groups (two sources, two experts: one empty, one past 128 rows) for the weight gradient's casts.
    offsets = torch.tensor([0, 5, 5, 150, 170], dtype=torch.int32)
    return {
        "quantize, tensorwise, e5m2, fp16 in": lambda: quantize(_randn(40, 136), "tensorwise", dtype=E5M2),
        "quantize, tensorwise, transposed, given scale": lambda: quantize(
            x(40, 136), "tensorwise", transpose=True, scale=torch.ones(())),
        "quantize, rowwise, power of two": lambda: quantize(x(40, 300), "rowwise", power_of_two=True),
        "quantize, rowwise, transposed": lambda: quantize(x(300, 40), "rowwise", transpose=True),
        "quantize, 1x128, transposed, padded": lambda: quantize(x(200, 64), "blockwise_1x128", transpose=True,
                                                                pad=True),
        "quantize, 128x128, fp16 in": lambda: quantize(_randn(200, 256), "blockwise_128x128"),
        **{f"quantize, requantized float8 {form}": lambda scale=scale: quantize(
            _fp8(128, 256), "blockwise_128x128", transpose=True, x_scale=scale)
           for form, scale in (("[R, 1]", torch.ones(128, 1)), ("[R, C/128]", torch.ones(128, 2)))},
        # The RMSNorm and SwiGLU with their cast fused: each group kind (tensorwise: two launches), with and
        # without the values, a norm without a weight, a values-only norm, gate and up as strided halves.
        "rms_norm_quantize, rowwise, power of two, fp32 weight, values": lambda: rms_norm_quantize(
            _randn(40, 300), x(300), 1e-5, "rowwise", power_of_two=True, return_values=True),
        "rms_norm_quantize, 1x128, no weight": lambda: rms_norm_quantize(_randn(40, 256), None, 1e-5, "blockwise_1x128"),
        "rms_norm_quantize, tensorwise, e5m2, values": lambda: rms_norm_quantize(
            _randn(40, 136), _randn(136), 1e-6, "tensorwise", dtype=E5M2, return_values=True),
        "rms_norm_quantize, values only": lambda: rms_norm_quantize(x(9, 64), x(64), 1e-5, None, return_values=True),
        **{f"swiglu_quantize, {granularity}, strided halves": lambda granularity=granularity: swiglu_quantize(
            *_randn(40, 512).chunk(2, dim=1), granularity, power_of_two=granularity == "rowwise",
            return_values=granularity == "tensorwise") for granularity in ("rowwise", "blockwise_1x128", "tensorwise")},
        # The SwiGLU's backward (RowParallelLinear(gate_up, swiglu=True)): gate | up a column slice of a wider
        # buffer, F off the tiles and odd, one row (fp16: the H200 variant compiles it in bf16).
        "swiglu_backward, strided gate | up, odd F": lambda: swiglu_backward(
            _randn(40, 300)[:, :151], _randn(40, 320)[:, 8:310]),
        "swiglu_backward, one row, fp32": lambda: swiglu_backward(x(1, 64), x(1, 128)),
        # The weight gradient's operands along each expert's tokens: each group kind (tensorwise and rowwise:
        # an amax pass, then the cast and the scales' writers), a given scale, rows gathered from a float8
        # input with scales per row or per 128 columns (the gathered x and dO), one expert in one group.
        "quantize_segments, tensorwise, e5m2, fp16 in": lambda: quantize_segments(
            _randn(170, 136), offsets, 2, "tensorwise", dtype=E5M2),
        "quantize_segments, tensorwise, given scale": lambda: quantize_segments(
            x(170, 40), offsets, 2, "tensorwise", scale=torch.ones(())),
        "quantize_segments, rowwise, gathered float8 [R, C/128], power of two": lambda: quantize_segments(
            _fp8(24, 256), offsets, 2, "rowwise", rows=torch.randint(0, 24, (170,)), x_scale=torch.ones(24, 2),
            power_of_two=True),
        "quantize_segments, 1x128, gathered float8 [R, 1], one group": lambda: quantize_segments(
            _fp8(24, 136, dtype=E5M2), torch.tensor([0, 170], dtype=torch.int32), 1, "blockwise_1x128",
            rows=torch.randint(0, 24, (170,)), dtype=E5M2, x_scale=torch.ones(24, 1)),
    }


def wgrad_h200_calls() -> dict[str, Callable[[], object]]:
    """``grouped_wgrad`` on float8 operands (K-major, groups of 16 rows) with the H200's config: each
    scaling, exact and fast accumulation, an e5m2 gradient (fp16 stands for the bf16 output)."""
    offsets = torch.tensor([0, 16, 16, 160, 176], dtype=torch.int32)
    rows, n, k, experts = 176, 48, 64, 2
    blocks = wgrad_blocks(rows, 4)
    scales = {"tensorwise": (torch.ones(()), torch.ones(())),
              "rowwise": (torch.ones(experts, n), torch.ones(experts, k)),
              "blockwise": (torch.ones(blocks, n), torch.ones(blocks, k))}
    config = choose_wgrad_config(E4M3)
    return {f"grouped_wgrad, fp8 {scaling}{', fast' if fast else ''}, H200 config {config}":
            lambda scaling=scaling, fast=fast: grouped_wgrad(
                _fp8(n, rows, dtype=E5M2).t(), _fp8(k, rows).t(), offsets, experts=experts,
                lhs_scale=scales[scaling][0], rhs_scale=scales[scaling][1], config=config, out_dtype=torch.float16,
                use_fast_accum=fast)
            for scaling in scales for fast in ((False, True) if scaling != "blockwise" else (False,))}
