"""The decode-shaped GEMM (split-K, ``tileweave.kernels.splitk``) in Triton's interpreter against a float64
reference: the route ``matmul`` takes for a few rows, its spans' fixed-order sum, and the rule."""

import zlib

import pytest
import torch

import tileweave
from tileweave.ops.compute import splitk
from tileweave.tune.splitk import SPLITK_MAX_ROWS, SplitKConfig, choose_splitk_config, splitk_pays

TOL = {torch.float16: 2e-3, torch.float32: 1e-5}


def _gen(tag: str) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(tag.encode()))


def _rel(got, ref):
    assert torch.isfinite(got).all(), "NaN or inf in the output"
    return ((got.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("m,n,k", [(1, 40, 256), (5, 96, 200), (16, 33, 130), (17, 64, 512), (64, 50, 96)])
@pytest.mark.parametrize("layout", ["weight", "kn"])
def test_matmul_few_rows_takes_splitk_and_matches(dtype, m, n, k, layout):
    # Odd N (cut tiles), K not a multiple of the step (a short last span), M = 1 and M above one tile.
    gen = _gen(f"{m},{n},{k},{layout},{dtype}")
    a = torch.randn(m, k, generator=gen).to(dtype)
    b = (torch.randn(n, k, generator=gen).to(dtype).t() if layout == "weight"
         else torch.randn(k, n, generator=gen).to(dtype))
    bias = torch.randn(n, generator=gen).to(dtype)
    out = torch.full((m, n), float("nan"), dtype=dtype)
    tileweave.matmul(a, b, bias=bias, out=out)
    assert tileweave.last_path("matmul") == "splitk"
    assert _rel(out, a.double() @ b.double() + bias.double()) < TOL[dtype]


@pytest.mark.parametrize("splits", [1, 2, 3, 7])
@pytest.mark.parametrize("tma", [False, True])
def test_spans_sum_in_a_fixed_order_and_leave_the_counts_at_zero(splits, tma):
    # Three calls with fresh inputs on one workspace: a count left above zero by a call would make the
    # next call's tiles finish early (wrong sums); the sum's order fixed, so a repeat is bitwise equal.
    config = SplitKConfig(block_m=16, block_n=32, block_k=32, num_stages=1, splits=splits, tma=tma)
    m, n, k = 3, 70, 7 * 32 + 8  # K a multiple of 8: 16-byte rows of float32, as descriptors need
    for call in range(3):
        gen = _gen(f"spans{splits},{call}")
        a = torch.randn(m, k, generator=gen)
        w = torch.randn(n, k, generator=gen)
        out = torch.full((m, n), float("nan"))
        plan = splitk.launch(a, w.t(), out, None, config, num_sms=4)
        tiles, spans, k_split = config.grid(m, n, k, 4)
        # Spans of whole steps that cover K once, no more of them than asked, none empty.
        assert k_split % 32 == 0 and (spans - 1) * k_split < k <= spans * k_split and 1 <= spans <= splits
        assert plan.programs == tiles * spans and plan.constexprs[-1] == tma
        assert _rel(out, a.double() @ w.double().t()) < 1e-5
        again = torch.full((m, n), float("nan"))
        splitk.relaunch(plan, a, w.t(), again, None)
        assert torch.equal(out, again)


def test_rule_routes_few_rows_only():
    sms = 132
    for m in (1, 8, 16, 17, 32, 33, SPLITK_MAX_ROWS):
        config = choose_splitk_config(m, 4096, 4096, torch.bfloat16, num_sms=sms)
        assert config is not None and config.block_m >= min(m, 64) and config.block_m in (16, 32, 64)
    assert choose_splitk_config(SPLITK_MAX_ROWS + 1, 4096, 4096, torch.bfloat16, num_sms=sms) is None
    assert choose_splitk_config(1, 4096, 4096, torch.float8_e4m3fn, num_sms=sms) is None
    # The worked example of tileweave.tune.splitk: Llama-3-8B o_proj at one token.
    tiles, spans, k_split = choose_splitk_config(1, 4096, 4096, torch.bfloat16, num_sms=sms).grid(1, 4096, 4096, sms)
    assert (tiles, spans, k_split) == (64, 4, 1024)
    # Never a span of fewer than MIN_STEPS steps: a short K is not split.
    assert SplitKConfig().grid(1, 4096, 256, sms)[1] == 1


def test_bfloat16_in_the_interpreter_is_computed_in_float32():
    # The interpreter's bfloat16 dots are wrong: matmul upcasts, the result must still be right.
    gen = _gen("bf16")
    a = torch.randn(4, 160, generator=gen).bfloat16()
    w = torch.randn(48, 160, generator=gen).bfloat16()
    out = tileweave.matmul(a, w.t())
    assert out.dtype == torch.bfloat16
    assert _rel(out.float(), a.double() @ w.double().t()) < 1e-2


def test_decode_gemms_take_cublas_unless_split_k_pays():
    # The rule that keeps GEMM + AllReduce's partial never slower than cuBLAS (tileweave.tune.splitk):
    # Llama-3-70B gate_up at TP 1 and a language-model head at a few tokens on split-K; every
    # Llama-3-8B and -70B shard of the row-parallel layers, and more than a few rows, on cuBLAS.
    assert splitk_pays(1, 57344, 8192, torch.bfloat16) and splitk_pays(8, 128256, 4096, torch.float16)
    for n, k in ((4096, 4096), (4096, 14336), (8192, 8192), (8192, 28672), (28672, 8192), (4096, 1792)):
        assert not splitk_pays(1, n, k, torch.bfloat16), (n, k)
    assert not splitk_pays(9, 57344, 8192, torch.bfloat16)
    assert not splitk_pays(1, 57344, 8192, torch.float32)
