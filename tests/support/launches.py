"""The kernel launches that tileweave's ops make, recorded in Triton's interpreter as plain data
(``support.recording``), so that another process can compile exactly those launches for a GPU
(``support.gpu_compile``): the calls that make them, and the launches an H200 makes in their place.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Callable

import torch
import torch.distributed as dist
import triton

import tileweave
from tileweave import (AllGatherGemm, GemmAllReduce, GemmConfig, GemmReduceScatter, GroupedConfig, MoEAllGatherGemm,
                       MoEGemmReduceScatter, build_plan, grouped_gemm, moe_plan)
from tileweave.nn import TPMoE
from tileweave.ops.all_reduce import local as local_all_reduce
from tileweave.ops.all_reduce.transports import tiles as all_reduce_tiles
from tileweave.ops.compute.grouped_gemm import G_BLOCK_MAX, SwiGLU
from tileweave.ops.compute.grouped_wgrad import grouped_wgrad
from tileweave.ops.compute.fused_quantize import TILES as FUSED_QUANTIZE_TILES
from tileweave.ops.compute.quantize import TILES as QUANTIZE_TILES, tiles_of as quantize_tiles
from tileweave.ops.compute.rope import ROW_ELEMENTS as ROPE_ROW_ELEMENTS, rope_qkv, rope_qkv_backward
from tileweave.ops.compute import splitk
from tileweave.ops.compute.decode_attention import BLOCK as ATTENTION_BLOCK, decode_attention
from tileweave.ops.compute.rms_norm import REDUCE_TILES as NORM_REDUCE_TILES, choose_tiles as norm_tiles, rms_norm_grad
from tileweave.ops.compute.swiglu import BACKWARD_TILES as SWIGLU_BACKWARD_TILES, TILES as SWIGLU_TILES
from tileweave.ops.compute.topk_reduce import TILES as TOPK_REDUCE_TILES, topk_reduce
from tileweave.tune.autotune import CANDIDATES
from tileweave.tune.configs import choose_fp8_config, choose_gemm_config
from tileweave.tune.grouped import INTERPRETER_CONFIG as GROUPED_INTERPRETER_CONFIG
from tileweave.tune.splitk import choose_splitk_config
from tileweave.tune.grouped import choose_grouped_config, choose_wgrad_config

from support import fp8_launches
from support.recording import (  # noqa: F401 - support.gpu_compile and the tests import them from here
    TRITON_VERSIONS, Launch, Tensor, _value, library_kernels, record, recording)


def h200_variant(launch: Launch) -> Launch | None:
    """The launch an H200 makes in place of ``launch``, for the launchers that pick other tiles in the
    interpreter and take no config (the others take the H200's configs in the calls below, or use the
    same tiles everywhere); None for the rest."""
    kernel = launch.kernel.split(":")[1]
    kwargs = dict(launch.kwargs)
    if kernel == "topk_reduce_kernel":
        kwargs.update(zip(("BT", "BH", "num_warps"), TOPK_REDUCE_TILES))
    elif kernel == "swiglu_grad_kernel":
        kwargs.update(zip(("BR", "BC", "num_warps"), SWIGLU_TILES))
    elif kernel == "swiglu_backward_kernel":
        kwargs.update(zip(("BR", "BC", "num_warps"), SWIGLU_BACKWARD_TILES))
    elif kernel in ("quantize_kernel", "amax_kernel"):
        fn = getattr(importlib.import_module(launch.kernel.split(":")[0]), kernel)
        strides = (launch.args[fn.arg_names.index("stride_xr")], launch.args[fn.arg_names.index("stride_xc")])
        group = kwargs.get("GROUP", "row_amax" if kwargs.get("PER_ROW") else "tensor")
        kwargs.update(zip(("BR", "BC", "num_warps"), quantize_tiles(group, *strides, interpreter=False)))
    elif kernel == "quantize_segments_kernel":
        kwargs.update(zip(("BC", "num_warps"), QUANTIZE_TILES["segments"][1:]))
    elif kernel == "rms_norm_quantize_kernel":
        kwargs.update(zip(("BR", "BC", "num_warps"), FUSED_QUANTIZE_TILES["norm"]))
    elif kernel == "swiglu_quantize_kernel":
        tiles = FUSED_QUANTIZE_TILES["swiglu_row" if kwargs["GROUP"] == "row" else "swiglu"]
        kwargs.update(zip(("BR", "BC", "num_warps"), tiles))
    elif kernel in ("rms_norm_grad_kernel", "rms_norm_grad_rows_kernel"):
        if launch.h200:  # the call passed the H200's tiles
            return None
        # the interpreter and the H200 take the same kernel for a width (up to ROW_COLS, whole rows)
        fn = getattr(importlib.import_module(launch.kernel.split(":")[0]), kernel)
        block = "BC" if kernel == "rms_norm_grad_kernel" else "BH"
        kwargs.update(zip(("BR", block, "num_warps"), norm_tiles(*(launch.args[fn.arg_names.index(n)] for n in "MH"))))
    elif kernel == "rope_heads_kernel":
        kwargs["BR"] = max(1, ROPE_ROW_ELEMENTS // (2 * kwargs["BH"]))
    elif kernel == "decode_attention_kernel":
        kwargs["BLOCK"] = ATTENTION_BLOCK  # the interpreter walks the keys in blocks of 16
    elif kernel == "rms_norm_dweight_kernel":
        kwargs.update(zip(("BP", "BC", "num_warps"), NORM_REDUCE_TILES))
    elif kernel == "oneshot_kernel" and kwargs["WORLD"] == 1:  # GEMM + AllReduce's epilogue in a group of one
        fn = getattr(importlib.import_module(launch.kernel.split(":")[0]), kernel)
        n = launch.args[fn.arg_names.index("n")]
        kwargs["BN"] = min(triton.next_power_of_2(n), local_all_reduce.ROW_ELEMS)
        kwargs["num_warps"] = max(4, min(16, kwargs["BM"] * kwargs["BN"] // 1024))
    elif kernel in ("oneshot_kernel", "twoshot_kernel"):
        fn = getattr(importlib.import_module(launch.kernel.split(":")[0]), kernel)
        rows = launch.args[fn.arg_names.index("rows")]
        path = kernel.removesuffix("_kernel")
        kwargs["P"], kwargs["BM"], kwargs["BN"] = all_reduce_tiles(path, rows, kwargs["WORLD"], H200_SMS,
                                                                   interpreter=False)
    else:
        return None
    return dataclasses.replace(launch, kwargs=tuple(kwargs.items()), origin=f"{launch.origin}, H200 tiles",
                               h200=True)


# -- the calls ---------------------------------------------------------------------------------------
# Small shapes chosen so that the kernels see integer arguments equal to 1 (one row, one row per rank,
# k = 1, one expert, one block of the plan), multiples of 16 and odd values, aligned and unaligned row
# pitches; and calls with the configs that the library picks on an H200 (the interpreter's own configs
# are small tiles).

H200_SMS = 132


def _randn(*shape, dtype=torch.float16) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape)), dtype=torch.float32).to(dtype)


def _index(high: int, size: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, high, (size,), generator=torch.Generator().manual_seed(seed))


def h200_gemm_configs() -> list[tuple[GemmConfig, torch.dtype]]:
    """The persistent GEMM's configs on an H200, with the dtype each is for: the heuristic's choices for
    shapes that reach each of its branches (``tileweave.tune.configs``' examples) and the autotuner's
    candidates (tuned in bf16). ``group_m`` only reorders tiles between programs, so configs that differ
    in nothing else count once."""
    shapes = [(8192, 7168, 4096, torch.bfloat16), (2048, 768, 4096, torch.bfloat16),
              (1024, 768, 4096, torch.bfloat16), (1024, 1280, 8192, torch.bfloat16),
              (1024, 4096, 512, torch.bfloat16), (4096, 1280, 8192, torch.bfloat16),
              (4096, 4096, 4096, torch.float32)]
    chosen = [(choose_gemm_config(m, n, k, dtype, num_sms=H200_SMS), dtype) for m, n, k, dtype in shapes]
    chosen += [(config, torch.bfloat16) for config in CANDIDATES]
    return list({(dataclasses.replace(config, group_m=8), dtype): None for config, dtype in chosen})


def h200_grouped_configs() -> list[tuple[GroupedConfig, bool, torch.dtype]]:
    """``(config, swiglu, dtype)``: the grouped GEMM's configs on an H200 for shapes that reach each
    branch of ``tileweave.tune.grouped`` (its worked examples, small groups, fp32, the SwiGLU epilogue)."""
    shapes = [(16384, 7168, 4096, 8, torch.bfloat16, False), (32768, 384, 2048, 128, torch.bfloat16, False),
              (2048, 7168, 4096, 64, torch.bfloat16, False), (16384, 7168, 4096, 8, torch.float32, False),
              (16384, 14336, 4096, 8, torch.bfloat16, True), (2048, 14336, 4096, 64, torch.bfloat16, True)]
    chosen = [(choose_grouped_config(rows, n, k, groups, dtype, num_sms=H200_SMS, swiglu=swiglu), swiglu, dtype)
              for rows, n, k, groups, dtype, swiglu in shapes]
    return list(dict.fromkeys(chosen))


E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _fp8(*shape, dtype=E4M3) -> torch.Tensor:
    return _randn(*shape, dtype=torch.float32).to(dtype)


def _fp8_scales(scaling: str, m: int, n: int, k: int, experts: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale_a, scale_b)`` of ``scaling`` for ``a [m, k]`` and ``b [k, n]`` (``[experts, k, n]`` if given)."""
    lead = (experts,) if experts else ()
    if scaling == "tensorwise":
        return torch.tensor(0.5), torch.rand(*lead) + 0.5 if experts else torch.tensor(2.0)
    if scaling == "rowwise":
        return torch.rand(m, 1) + 0.5, torch.rand(*lead, 1, n) + 0.5
    return torch.rand(m, k // 128) + 0.5, torch.rand(*lead, k // 128, -(-n // 128)) + 0.5


SCALINGS = ("tensorwise", "rowwise", "blockwise")
CAST_OF = {"tensorwise": "tensorwise", "rowwise": "rowwise", "blockwise": "blockwise_1x128"}
"""Each recipe's form of layer 1's operand, which layer 0's SwiGLU epilogue writes."""


def h200_fp8_configs() -> list[tuple[GemmConfig, torch.dtype, str]]:
    """``(config, out_dtype, scaling)``: the FP8 GEMM's configs on an H200, the picks of
    ``tileweave.tune.configs.choose_fp8_config`` for a large and a small grid and a decode step, each output
    and scaling."""
    shapes = [(8192, 14336, 8192, (torch.bfloat16, torch.float32)), (1024, 1024, 4096, (torch.bfloat16, torch.float32)),
              (16, 8192, 28672, (torch.bfloat16, ))]  # a decode step's output is the model's dtype
    return list(dict.fromkeys((choose_fp8_config(m, n, k, out, num_sms=H200_SMS, scaling=scaling), out, scaling)
                              for m, n, k, outs in shapes for out in outs for scaling in SCALINGS))


def h200_fp8_grouped_configs() -> list[tuple[GroupedConfig, bool, bool]]:
    """``(config, swiglu, block_cast)``: the FP8 grouped GEMM's configs on an H200 (large and small groups;
    the SwiGLU's also casting h in 1 x 128 blocks)."""
    shapes = [(16384, 7168, 4096, 8, False, False), (2048, 7168, 4096, 64, False, False),
              (16384, 14336, 4096, 8, True, False), (2048, 14336, 4096, 64, True, False),
              (16384, 14336, 4096, 8, True, True)]
    return list(dict.fromkeys((choose_grouped_config(rows, n, k, groups, E4M3, num_sms=H200_SMS, swiglu=swiglu,
                                                     block_cast=cast), swiglu, cast)
                              for rows, n, k, groups, swiglu, cast in shapes))


def _on_cpu(dtype: torch.dtype) -> torch.dtype:
    # The interpreter refuses bf16: such calls run in fp16 (``Launch.h200``).
    return torch.float16 if dtype == torch.bfloat16 else dtype


def _dense_calls() -> dict[str, Callable[[], object]]:
    return {
        "matmul, one row, bias": lambda: tileweave.matmul(_randn(1, 64), _randn(48, 64).t(), bias=_randn(48)),
        "matmul, row pitches TMA cannot take": lambda: tileweave.matmul(_randn(17, 20), _randn(20, 33)),
        "matmul, fp32": lambda: tileweave.matmul(_randn(40, 32, dtype=torch.float32),
                                                 _randn(24, 32, dtype=torch.float32).t()),
        **{f"matmul, fp8 {scaling}, fp32 out, bias": lambda scaling=scaling: tileweave.matmul(
            _fp8(40, 256), _fp8(72, 256).t(), *(), **dict(zip(("scale_a", "scale_b"), _fp8_scales(scaling, 40, 72, 256))),
            bias=_randn(72, dtype=torch.float32), out_dtype=torch.float32) for scaling in SCALINGS},
        "matmul, fp8 rowwise, e5m2 b, row-major b, fp16 out": lambda: tileweave.matmul(
            _fp8(40, 128), _fp8(128, 48, dtype=E5M2), **dict(zip(("scale_a", "scale_b"), _fp8_scales("rowwise", 40, 48, 128))),
            out_dtype=torch.float16),
    }


def _dense_h200_calls() -> dict[str, Callable[[], object]]:
    calls = {}
    for config, dtype in h200_gemm_configs():
        dtype = _on_cpu(dtype)
        # 256 x 256: whole tiles of every config (TMA stores), and two tile rows of 128.
        calls[f"matmul, H200 config {config.key()}"] = lambda config=config, dtype=dtype: tileweave.matmul(
            _randn(256, 128, dtype=dtype), _randn(256, 128, dtype=dtype).t(), config=config)
    for config, out, scaling in h200_fp8_configs():
        # fp16 stands for the bf16 output (Launch.h200); 256 x 256 x 256 are whole tiles.
        calls[f"matmul, fp8 {scaling}, H200 config {config.key()}, {out}"] = \
            lambda config=config, out=_on_cpu(out), scaling=scaling: tileweave.matmul(
                _fp8(256, 256), _fp8(256, 256).t(), config=config, out_dtype=out,
                **dict(zip(("scale_a", "scale_b"), _fp8_scales(scaling, 256, 256, 256))))
    # An e5m2 operand and a row-major [K, N] b (not K-major) on an H200 tile.
    config = choose_fp8_config(1024, 1024, 4096, torch.bfloat16, num_sms=H200_SMS)
    calls["matmul, fp8 rowwise, e5m2 a, row-major b, H200 config"] = lambda: tileweave.matmul(
        _fp8(256, 256, dtype=E5M2), _fp8(256, 256), config=config, out_dtype=torch.float16,
        **dict(zip(("scale_a", "scale_b"), _fp8_scales("rowwise", 256, 256, 256))))
    # The split-K decode GEMM with the configs it takes on an H200, one per row tile (16, 32, 64 rows): its
    # spans split (a weight of 256 x 1024) or one span alone (K = 256); TMA reads and pointer reads.
    for m, n, k, tma in ((1, 256, 1024, False), (32, 64, 256, False), (64, 256, 1024, True)):
        decode = dataclasses.replace(choose_splitk_config(m, 8192, 8192, torch.bfloat16, num_sms=H200_SMS), tma=tma)
        calls[f"split-K, H200 config {decode.key()}, {m} x {n} x {k}"] = \
            lambda config=decode, m=m, n=n, k=k: splitk.launch(
                _randn(m, k), _randn(n, k).t(), torch.empty(m, n, dtype=torch.float16), _randn(n), config,
                num_sms=H200_SMS)
    return calls


def _attention_calls() -> dict[str, Callable[[], object]]:
    # Decode attention over a cache of 48 slots, 30 filled: Llama's 4 query heads per key/value head of 128,
    # and 5 per head of 80 (padded tiles), in spans merged by the last program and in one span.
    def attend(bsz, heads, kv, hd, splits):
        valid = torch.ones(bsz, 48, dtype=torch.bool)
        decode_attention(_randn(bsz, heads, hd), _randn(bsz, kv, 48, hd), _randn(bsz, kv, 48, hd), valid,
                         torch.tensor([29]), limit=48, splits=splits)
    return {"decode attention, head_dim 128, grouped 4:1, 3 spans": lambda: attend(2, 8, 2, 128, 3),
            "decode attention, head_dim 80, grouped 5:1, one span": lambda: attend(1, 5, 1, 80, 1)}


def _norm_calls() -> dict[str, Callable[[], object]]:
    # The RMSNorm's backward: one row (M = 1), no weight, strided rows of odd widths, mixed dtypes. GEMM +
    # AllReduce's epilogue in a group of one on a Llama-3-70B row (whole rows on a GPU) and a narrow one.
    def local_epilogue(m, n):
        local_all_reduce.epilogue(_randn(m, n), _randn(n), _randn(m, n), _randn(n), 1e-5, torch.empty(m, n,
                                  dtype=torch.float16), torch.empty(m, n, dtype=torch.float16))
    return {
        "gemm_all_reduce's epilogue alone, 3 rows of 8192": lambda: local_epilogue(3, 8192),
        "gemm_all_reduce's epilogue alone, one row of 200": lambda: local_epilogue(1, 200),
        "rms_norm_grad, one row": lambda: rms_norm_grad(_randn(1, 48), _randn(1, 48), _randn(48), torch.ones(1)),
        "rms_norm_grad, fp32, no weight, strided rows": lambda: rms_norm_grad(
            _randn(21, 136, dtype=torch.float32)[:, :100], _randn(21, 120, dtype=torch.float32)[:, 7:107], None,
            torch.ones(21)),
        "rms_norm_grad, fp16 x, fp32 dy and weight": lambda: rms_norm_grad(
            _randn(40, 80, dtype=torch.float32), _randn(40, 80), _randn(80, dtype=torch.float32), torch.ones(40)),
    }


def _rope_calls() -> dict[str, Callable[[], object]]:
    # The block's rotary embedding both ways: a 128-wide head (Llama) and an 80-wide one (BH = 64, masked).
    def both(m, seq, heads, kv, hd):
        shape = dict(seq=seq, heads=heads, kv_heads=kv, head_dim=hd)
        cos, sin = _randn(seq, hd // 2), _randn(seq, hd // 2)
        rope_qkv(_randn(m, (heads + 2 * kv) * hd), cos, sin, **shape)
        rope_qkv_backward(_randn(m, heads * hd), _randn(m, kv * hd), _randn(m, kv * hd), cos, sin, **shape)
    return {"rope_qkv and its backward, head_dim 128": lambda: both(64, 32, 4, 2, 128),
            "rope_qkv and its backward, head_dim 80": lambda: both(40, 20, 2, 1, 80)}


def _norm_h200_calls() -> dict[str, Callable[[], object]]:
    # The tiles picked on an H200 (choose_tiles' branches), on a few rows: whole rows of 16384, 8192 and
    # 2048 columns (up to ROW_COLS: BH >= H, read once), and rows of 32768 columns walked twice at 8192,
    # 1000 and 100 rows (passed here with H = 256 < BC for the whole rows, H = 4096 > BC for the walks).
    whole = dict.fromkeys(norm_tiles(8192, cols) for cols in (16384, 8192, 2048))
    walked = dict.fromkeys(norm_tiles(rows, 32768) for rows in (8192, 1000, 100))
    return {f"rms_norm_grad, H200 tiles {tiles}": lambda tiles=tiles, cols=cols: rms_norm_grad(
        _randn(32, cols), _randn(32, cols), _randn(cols), torch.ones(32), tiles=tiles)
        for cols, all_tiles in ((256, whole), (4096, walked)) for tiles in all_tiles}


def _moe_local_calls() -> dict[str, Callable[[], object]]:
    return {
        "build_plan, one rank, one expert, k = 1": lambda: build_plan(
            torch.zeros(5, 1, dtype=torch.int64), num_experts=1, world_size=1),
        "topk_reduce, k = 1, no weights": lambda: topk_reduce(
            _randn(6, 40), torch.arange(6, dtype=torch.int32).view(6, 1), out_dtype=torch.float16),
        **{f"grouped_gemm, fp8 {scaling}, gathered rows": lambda scaling=scaling: grouped_gemm(
            _fp8(24, 128), _fp8(2, 48, 128).transpose(1, 2), torch.tensor([0, 5, 5, 17, 40], dtype=torch.int32),
            a_rows=_index(24, 40), experts=2, out_dtype=torch.float32,
            **dict(zip(("scale_a", "scale_b"), _fp8_scales(scaling, 24, 48, 128, experts=2)))) for scaling in SCALINGS},
        "grouped_gemm, signal": lambda: grouped_gemm(
            _randn(40, 64), _randn(2, 64, 48), torch.tensor([0, 5, 5, 17, 40], dtype=torch.int32), experts=2,
            signal=(torch.zeros(2, dtype=torch.int32),)),
        # Over G_BLOCK_MAX groups the kernel walks the offsets in memory (W * E > 1024: 8 ranks x 256 experts);
        # one program, as the interpreter runs that walk once per program.
        "grouped_gemm, more groups than fit in registers": lambda: grouped_gemm(
            _randn(40, 64), _randn(4, 64, 48), torch.arange(G_BLOCK_MAX + 2, dtype=torch.int32).mul(2).clamp(max=40),
            experts=4, config=dataclasses.replace(GROUPED_INTERPRETER_CONFIG, programs=1)),
    }


def _moe_local_h200_calls() -> dict[str, Callable[[], object]]:
    offsets = torch.tensor([0, 5, 5, 17, 40], dtype=torch.int32)
    calls: dict[str, Callable[[], object]] = {}
    for config, swiglu, dtype in h200_grouped_configs():
        dtype = _on_cpu(dtype)
        if swiglu:  # an nn.Linear stack [E, 2N, K] read as its transpose, as the MoE layer passes it; each cast
            for cast in (None, *CAST_OF.values()):
                calls[f"grouped_gemm, H200 config {config}, SwiGLU, cast {cast}"] = \
                    lambda config=config, dtype=dtype, cast=cast: grouped_gemm(
                        _randn(40, 64, dtype=dtype), _randn(4, 96, 64, dtype=dtype).transpose(1, 2), offsets,
                        config=config, epilogue=SwiGLU(pre=torch.empty(40, 96, dtype=dtype), cast=cast))
        else:
            calls[f"grouped_gemm, H200 config {config}"] = lambda config=config, dtype=dtype: grouped_gemm(
                _randn(24, 64, dtype=dtype), _randn(4, 80, 64, dtype=dtype).transpose(1, 2), offsets,
                a_rows=_index(24, 40), config=config)
    for config, swiglu, block_cast in h200_fp8_grouped_configs():
        # Each scaling plain; under the SwiGLU also casting h as its recipe's layer 1 takes it (1 x 128 blocks
        # in their own config).
        for scaling, cast in [(sc, c) for sc in SCALINGS for c in (None, CAST_OF[sc]) if c is None or swiglu]:
            if block_cast != (cast == "blockwise_1x128"):
                continue
            n = 256 if swiglu else 80
            scale_a, scale_b = _fp8_scales(scaling, 24, n, 256, experts=4)
            epilogue = SwiGLU(pre=torch.empty(40, n, dtype=torch.float16), cast=cast) if swiglu else None
            calls[f"grouped_gemm, fp8 {scaling}, H200 config {config}{', SwiGLU' if swiglu else ''}, cast {cast}"] = \
                lambda config=config, scale_a=scale_a, scale_b=scale_b, n=n, epilogue=epilogue: grouped_gemm(
                    _fp8(24, 256), _fp8(4, n, 256).transpose(1, 2), offsets, a_rows=_index(24, 40), config=config,
                    scale_a=scale_a, scale_b=scale_b, out_dtype=torch.float16, epilogue=epilogue)
    for dtype in (torch.bfloat16, torch.float32):
        config = choose_wgrad_config(dtype)
        calls[f"grouped_wgrad, H200 config {config}"] = lambda config=config, dtype=_on_cpu(dtype): grouped_wgrad(
            _randn(40, 48, dtype=dtype), _randn(24, 64, dtype=dtype), offsets, experts=2, rhs_rows=_index(24, 40),
            scale=_randn(40, dtype=torch.float32), config=config)
    return calls


def _collective_calls(rank: int, world: int) -> dict[str, Callable[[], object]]:
    group = dist.group.WORLD
    return {
        "all_gather_gemm, mesh, bias": lambda: AllGatherGemm(group, policy="fused", transport="mesh")(
            _randn(8, 64) + rank, _randn(48, 64).t(), bias=_randn(48)),
        **{f"all_gather_gemm, fp8 {scaling}, {transport}": lambda scaling=scaling, transport=transport: AllGatherGemm(
            group, policy="fused", transport=transport)(
                _fp8(8, 256), _fp8(48, 256).t(), out_dtype=torch.float16,
                **dict(zip(("scale_a", "scale_b"), _fp8_scales(scaling, 8, 48, 256))))
           for scaling, transport in zip(SCALINGS, ("mesh", "ring", "mesh"))},
        "all_gather_gemm, one-shot": lambda: AllGatherGemm(group, policy="oneshot")(
            _randn(3, 64) + rank, _randn(40, 64).t()),
        "gemm_reduce_scatter, one-shot, bias": lambda: GemmReduceScatter(group, policy="oneshot")(
            _randn(8, 32) + rank, _randn(32, 48), bias=_randn(48)),
        "gemm_reduce_scatter, one-shot, one row per rank, fp32": lambda: GemmReduceScatter(group, policy="oneshot")(
            _randn(world, 16, dtype=torch.float32) + rank, _randn(16, 24, dtype=torch.float32)),
        "gemm_all_reduce, one-shot, one row, bias": lambda: GemmAllReduce(group, policy="oneshot")(
            _randn(1, 32) + rank, _randn(32, 48), bias=_randn(48)),
        "gemm_all_reduce, two-shot, graphable, residual and norm": lambda: GemmAllReduce(
            group, policy="twoshot", graphable=True)(_randn(6, 32) + rank, _randn(32, 64), residual=_randn(6, 64),
                                                     norm_weight=_randn(64)),
        "gemm_all_reduce, one-shot, fp32, residual and norm": lambda: GemmAllReduce(group, policy="oneshot")(
            _randn(3, 16, dtype=torch.float32) + rank, _randn(16, 24, dtype=torch.float32),
            residual=_randn(3, 24, dtype=torch.float32), norm_weight=_randn(24, dtype=torch.float32)),
        # 2 x 32 groups make blocks of 256 pairs: 512 pairs are two blocks.
        "moe_plan, several blocks": lambda: moe_plan(_index(32, 256, seed=rank).view(128, 2), num_experts=32,
                                                     group=group),
        "TPMoE forward and backward, fp16": lambda: _moe_step(16, 32, 4, 2, torch.float16, rank),
        "TPMoE forward and backward, one expert, k = 1, fp32": lambda: _moe_step(32, 16, 1, 1, torch.float32, rank),
        # FP8 MoE pair: layer 0's gated grouped GEMM with gathered scales and the SwiGLU, layer 1 chunked.
        **{f"moe pair, fp8 {scaling}": lambda scaling=scaling: _moe_fp8_pair(scaling, rank, world)
           for scaling in SCALINGS},
    }


def _moe_fp8_pair(scaling: str, rank: int, world: int) -> None:
    group = dist.group.WORLD
    tc, hidden, f_loc, experts = 8, 128, 128, 2
    plan = moe_plan(_index(experts, tc * 2, seed=rank).view(tc, 2), num_experts=experts, group=group)
    sa, sb = _fp8_scales(scaling, tc, 2 * f_loc, hidden, experts=experts)
    h = MoEAllGatherGemm(group, policy="fused")(  # h cast in the epilogue, as TPMoE's FP8 forward takes it
        _fp8(tc, hidden), _fp8(experts, 2 * f_loc, hidden).transpose(1, 2), plan, scale_a=sa, scale_b=sb,
        out_dtype=torch.float16, epilogue=SwiGLU(pre=torch.empty(plan.rows, 2 * f_loc, dtype=torch.float16),
                                                 cast=CAST_OF[scaling]))
    sb = _fp8_scales(scaling, plan.rows, hidden, f_loc, experts=experts)[1]
    MoEGemmReduceScatter(group, policy="fused")(
        h.data, _fp8(experts, hidden, f_loc).transpose(1, 2), plan, None, scale_a=h.scale, scale_b=sb,
        out_dtype=torch.float16)


def _collective_h200_calls(rank: int, world: int) -> dict[str, Callable[[], object]]:
    group = dist.group.WORLD
    # The fused kernel's config is the heuristic's without stream-K (FusedOp._decide), or stream-K on the
    # consumer's partial last wave: 128 rows per rank and 384 columns are 6 tiles of 128 x 128 on the
    # emulated ranks' 4 programs, a partial wave of 2 tiles, all in the last chunk.
    big = choose_gemm_config(8192, 7168, 4096, torch.bfloat16, num_sms=H200_SMS, stream_k=False)
    mid = choose_gemm_config(2048, 768, 4096, torch.bfloat16, num_sms=H200_SMS, stream_k=False)
    return {
        "all_gather_gemm, ring, graphable, H200 config": lambda: AllGatherGemm(
            group, policy="fused", transport="ring", graphable=True, config=big)(
                _randn(128, 64) + rank, _randn(256, 64).t()),
        "all_gather_gemm, stream-K tail, H200 config": lambda: AllGatherGemm(
            group, policy="fused", transport="mesh", stream_k=True, config=mid)(
                _randn(128, 64) + rank, _randn(384, 64).t()),
        # FP8 with the configs the op picks on an H200 (fp16 out here, bf16 there).
        **{f"all_gather_gemm, fp8 {scaling}, H200 config": lambda scaling=scaling: AllGatherGemm(
            group, policy="fused", transport="mesh",
            config=choose_fp8_config(8192, 7168, 4096, torch.bfloat16, num_sms=H200_SMS, scaling=scaling))(
                _fp8(128, 256), _fp8(256, 256).t(), out_dtype=torch.float16,
                **dict(zip(("scale_a", "scale_b"), _fp8_scales(scaling, 128, 256, 256))))
           for scaling in SCALINGS},
    }


def _moe_step(hidden: int, ffn: int, experts: int, top_k: int, dtype: torch.dtype, rank: int) -> None:
    torch.manual_seed(0)  # the same weights on every rank
    layer = TPMoE(hidden, ffn, experts, top_k, dtype=dtype)
    x = _randn(4, hidden, dtype=dtype).add(rank).requires_grad_(True)
    layer(x).float().square().sum().backward()


def hopper_fp8_launches() -> list[Launch]:
    """The Hopper FP8 GEMM's launches (``tileweave.ops.compute.fp8_sm90``), which only a GPU runs (the
    interpreter does not run Gluon kernels): its arguments as its launcher derives them on an H200."""
    from tileweave.ops.compute import fp8_sm90, scaling as scaling_mod

    found = []
    # Each SCALING mode, both tile configs (fast accumulation with a bf16 output takes 128 x 256), both
    # outputs, with and without a bias, zero and unit scale strides; each exact and blockwise kernel in
    # both of its modes (the shapes here are small: blockwise takes the two-half kernel).
    halves = {"BM": 128, "BN": 128, "BK": 128, "STAGES": 5, "GROUP_M": 8, "num_warps": 4, "kernel": "halves"}
    plain = {"BM": 128, "BN": 128, "BK": 128, "STAGES": 5, "GROUP_M": 8, "num_warps": 8, "kernel": "plain"}
    staged = dict(halves, STAGES=4, kernel="staged")
    for scaling, fast, out, bias, config in (("tensorwise", False, torch.bfloat16, None, None),
                                             ("rowwise", True, torch.bfloat16, None, None),
                                             ("rowwise", False, torch.float32, torch.zeros(384), None),
                                             ("blockwise", False, torch.float32, torch.zeros(384), None),
                                             ("tensorwise", False, torch.bfloat16, None, halves),
                                             ("blockwise", False, torch.bfloat16, None, plain),
                                             ("blockwise", False, torch.float32, torch.zeros(384), staged)):
        m, n, k = 256, 384, 512
        a, b = _fp8(m, k), _fp8(n, k).t()
        scale_a, scale_b = _fp8_scales(scaling, m, n, k)
        if config is not None and config["kernel"] == "staged":  # the layouts TMA reads: M- and K-major
            scale_a, scale_b = scale_a.t().contiguous().t(), scale_b.t().contiguous().t()
        scales = scaling_mod.dense_scales("matmul", m, n, k, scale_a, scale_b, fast_accum=fast)
        config = config or fp8_sm90.config_for(scales, out, m, n, k)
        _, tensors, ints, constexprs, options = fp8_sm90.arguments(
            a, b, torch.empty(m, n, dtype=out), bias, scales, config=config, programs=H200_SMS)
        kernel = fp8_sm90.kernel_of(config)
        args = (*tensors, *ints)
        kwargs = (*zip(kernel.arg_names[len(args):], constexprs), *options.items())
        found.append(Launch(f"{kernel.fn.__module__}:{kernel.fn.__name__}",
                            tuple(map(_value, args)), tuple((key, _value(v)) for key, v in kwargs),
                            f"matmul on sm_90, fp8 {scaling}{' fast' if fast else ''}, {out}"))
    return found


def op_launches(rank: int, world: int) -> list[Launch]:
    """The launches of the calls above on emulated ranks: the collective ones on every rank, the local
    ones shared out (rank 0 the dense GEMMs, the last rank the MoE compute ops)."""
    launches = record(_collective_calls(rank, world)) + record(_collective_h200_calls(rank, world), h200=True)
    if rank == 0:
        launches += record(_dense_calls()) + record(_dense_h200_calls(), h200=True) + hopper_fp8_launches()
        launches += record(fp8_launches.cast_calls())
        # the H200's tiles first: ptxas reports on each kernel's first form, the widest whole rows here
        launches += record(_norm_h200_calls(), h200=True) + record(_norm_calls())
        launches += record(_rope_calls()) + record(_attention_calls())
    if rank == world - 1:
        launches += record(_moe_local_calls()) + record(_moe_local_h200_calls(), h200=True)
        launches += record(fp8_launches.wgrad_h200_calls(), h200=True)
    return launches
