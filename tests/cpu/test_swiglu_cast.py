"""The grouped GEMM's SwiGLU epilogue writing h's float8 cast (``SwiGLU(cast=...)``, MoE layer 0 writing
layer 1's operand) in Triton's interpreter, bit for bit against the cast of a reference SwiGLU written
independently (``support.scenarios.moe_cast``: exact float8 products, the epilogue's float32 steps in
numpy, ``quantize32``); and against ``quantize`` of the plain epilogue's float32 h. Each form, e4m3 and
e5m2, powers of two; rows, F and groups off the tiles, uneven and empty experts, gathered rows, a repeat
call; layer 0's op on two emulated ranks, fused and unfused; empty inputs; the refusals by name."""

import dataclasses

import pytest
import torch

from support.scenarios import moe_cast
from support.scenarios.moe_cast import E4M3, E5M2, dequantized_a, dequantized_b, exact_fp8, gen
from tileweave.ops.compute.grouped_gemm import SwiGLU, grouped_gemm
from tileweave.ops.compute.quantize import quantize
from tileweave.testing.emulated import run_ranks
from tileweave.tune.grouped import INTERPRETER_CONFIG, choose_grouped_config

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # silu of a large negative gate: 0
COUNTS = [9, 0, 31, 12, 0, 3, 40, 1]
"""Rows of G = 8 groups over E = 4 experts (two sources, as layer 0's plan at two ranks): empty experts,
groups off the 32-row tiles."""
EXPERTS = 4


def _offsets(counts) -> torch.Tensor:
    return torch.tensor([0] + counts, dtype=torch.int32).cumsum(0).to(torch.int32)


def _operands(scaling: str, f: int, k: int, seed):
    """Gathered exact float8 rows ``a [30, K]``, ``a_rows [P]``, ``w0 [E, K, 2F]`` (a stack's transpose
    view) and power-of-two scales of ``scaling``."""
    g = gen(seed)
    a = exact_fp8(g, 30, k)
    a_rows = torch.randint(0, 30, (sum(COUNTS),), generator=g)
    b = exact_fp8(g, EXPERTS, 2 * f, k).transpose(1, 2)
    scale_a, scale_b = moe_cast.scales(g, scaling, 30, 2 * f, k, EXPERTS)
    return a, a_rows, b, scale_a, scale_b


@pytest.mark.parametrize("cast,dtype,pow2,f", [
    ("blockwise_1x128", E4M3, False, 136),    # F off the 128-column blocks: a partial last block per row
    ("rowwise", E4M3, True, 72),              # F over three 32-column tiles, the last partial
    ("rowwise", E5M2, False, 40),
    ("tensorwise", E4M3, False, 72),
    ("tensorwise", E5M2, True, 40),
], ids=lambda v: str(v).removeprefix("torch."))
def test_the_cast_equals_the_reference_cast_of_the_swiglu(cast, dtype, pow2, f):
    k = 256
    scaling = cast.removesuffix("_1x128")
    rows = sum(COUNTS)
    for call in range(2):  # the second call takes the cached launch, with fresh inputs
        a, a_rows, b, scale_a, scale_b = _operands(scaling, f, k, (cast, dtype, f, call))
        pre = torch.full((rows, 2 * f), float("nan"))
        got = grouped_gemm(a, b, _offsets(COUNTS), a_rows=a_rows, experts=EXPERTS, scale_a=scale_a, scale_b=scale_b,
                           out_dtype=torch.float32, epilogue=SwiGLU(pre=pre, cast=cast, cast_dtype=dtype,
                                                                    power_of_two=pow2))
        w = dequantized_b(b, scale_b)
        x = dequantized_a(a, scale_a)[a_rows]
        experts = torch.repeat_interleave(torch.arange(len(COUNTS)) % EXPERTS, torch.tensor(COUNTS))
        exact = torch.stack([x[p] @ w[experts[p]] for p in range(rows)])   # gate | up, float64
        h = moe_cast.swiglu_epilogue32(exact)
        assert h.abs().amax() > 0 and (h == 0).float().mean() < 0.5
        assert moe_cast.same_bits(got, *moe_cast.reference_cast(h, cast, dtype, pow2)), (cast, call)
        assert torch.equal(pre.double(), torch.stack([exact[:, :f], exact[:, f:]], dim=2).reshape(rows, 2 * f))


@pytest.mark.parametrize("cast", ["blockwise_1x128", "rowwise", "tensorwise"])
def test_the_cast_is_quantize_of_the_epilogues_float32_values(cast):
    # Random float8 operands (sums rounded in float32) and float32 ones: the plain epilogue's float32 h
    # of the same launch config, cast by quantize, is the fused cast bit for bit.
    f, k = 136, 128
    g = gen("quantize", cast)
    config = dataclasses.replace(INTERPRETER_CONFIG, block_n=128)
    for fp8 in (True, False):
        a = torch.randn(30, k, generator=g) * 4
        b = torch.randn(EXPERTS, 2 * f, k, generator=g) * 4
        args = dict(scale_a=torch.rand(30, 1, generator=g) + 0.5, scale_b=torch.rand(EXPERTS, 1, 2 * f, generator=g)
                    + 0.5) if fp8 else {}
        a, b = (a.to(E4M3), b.to(E4M3)) if fp8 else (a / 16, b / 16)
        a_rows = torch.randint(0, 30, (sum(COUNTS),), generator=g)
        options = dict(a_rows=a_rows, experts=EXPERTS, config=config,
                       **(dict(args, out_dtype=torch.float32) if fp8 else {}))
        h = grouped_gemm(a, b.transpose(1, 2), _offsets(COUNTS), epilogue=SwiGLU(), **options)
        got = grouped_gemm(a, b.transpose(1, 2), _offsets(COUNTS), epilogue=SwiGLU(cast=cast), **options)
        ref = quantize(h, cast, pad=cast == "blockwise_1x128")
        assert moe_cast.same_bits(got, ref.data[:, :f], ref.scale), (cast, fp8)


def test_layer0_writes_the_cast_on_every_path():
    cases = [("tensorwise", E4M3, False, 5, 64, 40, 3, 2, "fused"),   # per-rank tensorwise input scales
             ("rowwise", E4M3, True, 7, 64, 72, 4, 2, "fused"),
             ("blockwise_1x128", E4M3, False, 3, 128, 136, 2, 2, "fallback")]
    for rank, rows in enumerate(run_ranks(2, moe_cast.layer0_cast_check, cases)):
        for row in rows:
            assert row["same"] and row["pre_exact"] and row["gathered"], (rank, row)
            assert row["path"] == row["case"][-1], row


def test_no_rows_and_no_groups():
    b = exact_fp8(gen("empty"), 2, 256, 128).transpose(1, 2)
    for cast, shape in (("tensorwise", ()), ("rowwise", (0, 1)), ("blockwise_1x128", (0, 1))):
        got = grouped_gemm(exact_fp8(gen("empty"), 4, 128), b, _offsets([0, 0]), a_rows=torch.zeros(0).long(),
                           scale_a=torch.ones(4, 1), scale_b=torch.ones(2, 1, 256), out_dtype=torch.float32,
                           epilogue=SwiGLU(cast=cast))
        assert tuple(got.data.shape) == (0, 128) and tuple(got.scale.shape) == shape, cast
    got = grouped_gemm(exact_fp8(gen("empty"), 4, 128), b, _offsets([0, 0]), a_rows=torch.zeros(0).long(),
                       scale_a=torch.ones(()), scale_b=torch.ones(2), out_dtype=torch.float32,
                       epilogue=SwiGLU(cast="tensorwise"))
    assert float(got.scale) == float(torch.tensor(1e-12) / 448)  # an all-zero tensor's scale, as quantize's


def test_refusals_name_the_argument():
    a, b, offsets = exact_fp8(gen("bad"), 10, 128), exact_fp8(gen("bad"), 2, 128, 80), _offsets([4, 6])
    fp8 = dict(scale_a=torch.ones(10, 1), scale_b=torch.ones(2, 1, 80), out_dtype=torch.float32)
    cases = [
        (dict(epilogue=SwiGLU(cast="rowwise"), out=torch.empty(10, 40)), "pass neither out nor group_range"),
        (dict(epilogue=SwiGLU(cast="rowwise"), group_range=(0, 1)), "pass neither out nor group_range"),
        (dict(epilogue=SwiGLU(cast="blockwise_128x128")), "cast must be None or one of tensorwise"),
        (dict(epilogue=SwiGLU(cast="rowwise", cast_dtype=torch.float16)), "cast_dtype must be torch.float8"),
        (dict(epilogue=SwiGLU(cast="blockwise_1x128"), config=INTERPRETER_CONFIG),
         "block_n to be a multiple of 128"),
    ]
    for kwargs, match in cases:
        with pytest.raises((TypeError, ValueError), match=match):
            grouped_gemm(a, b, offsets, **fp8, **kwargs)
    with pytest.raises(ValueError, match="a given amax applies to tensorwise and rowwise"):
        quantize(torch.ones(2, 128), "blockwise_1x128", amax=torch.ones(1))


def test_a_blockwise_cast_takes_tiles_of_whole_blocks():
    for dtype, interpreter in ((E4M3, False), (torch.bfloat16, False), (E4M3, True)):
        config = choose_grouped_config(16384, 2 * 704, 2048, 64, dtype, num_sms=132, interpreter=interpreter,
                                       swiglu=True, block_cast=True)
        assert config.block_n % 128 == 0, (dtype, interpreter, config)
