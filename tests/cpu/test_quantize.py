"""Dynamic float8 quantization (``tileweave.ops.compute.quantize``) in Triton's interpreter, against
torch written here: amax per group with plain reductions, ``scale = max(amax, 1e-12) / fp8_max``,
``(x / scale).clamp(-fp8_max, fp8_max).to(float8)``, bit for bit (float8 values and float32 scales)."""

import zlib

import pytest
import torch

import tileweave
from tileweave.ops.compute.quantize import quantize

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
MAX = {E4M3: 448.0, E5M2: 57344.0}


def _gen(*parts) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(",".join(map(str, parts)).encode()))


def _data(gen, rows, cols) -> torch.Tensor:
    # rows of very different magnitudes (so that per-row and per-block scales differ), one all-zero row
    x = torch.randn(rows, cols, generator=gen) * torch.exp2(torch.randint(-8, 9, (rows, 1), generator=gen).float())
    x[rows // 3] = 0
    return x


def reference(x: torch.Tensor, granularity: str, dtype, *, pad=False, power_of_two=False):
    """``(q, scale)`` of float32 ``x [R, C]``, written with torch reductions and torch's cast."""
    fp8_max = MAX[dtype]
    rows, cols = x.shape
    if pad:
        x = torch.nn.functional.pad(x, (0, -(-cols // 128) * 128 - cols))
        cols = x.shape[1]
    if granularity == "tensorwise":
        amax = x.abs().amax()
    elif granularity == "rowwise":
        amax = x.abs().amax(1, keepdim=True)
    elif granularity == "blockwise_1x128":
        amax = x.view(rows, cols // 128, 128).abs().amax(2)
    else:
        r128 = -(-rows // 128) * 128
        amax = torch.nn.functional.pad(x, (0, 0, 0, r128 - rows)).view(r128 // 128, 128, cols // 128, 128).abs().amax((1, 3))
    scale = amax.clamp(min=1e-12) / fp8_max
    if power_of_two:
        scale = torch.exp2(torch.ceil(torch.log2(scale.double()))).float()
    if granularity == "blockwise_1x128":
        each = scale.repeat_interleave(128, 1)
    elif granularity == "blockwise_128x128":
        each = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:rows]
    else:
        each = scale
    return (x / each).clamp(-fp8_max, fp8_max).to(dtype), scale


def _same(got, ref) -> bool:
    q, s = got
    rq, rs = ref
    return q.dtype == rq.dtype and torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and \
        tuple(s.shape) == tuple(rs.shape) and torch.equal(s, rs)


@pytest.mark.parametrize("granularity,dtype,transpose,pad,power_of_two,rows,cols", [
    ("tensorwise", E4M3, False, False, False, 70, 200),
    ("tensorwise", E5M2, True, False, True, 70, 200),       # the transpose, read in place
    ("rowwise", E4M3, False, False, True, 70, 300),          # several column steps per row
    ("rowwise", E4M3, True, False, False, 300, 70),          # per column of x
    ("rowwise", E5M2, False, False, False, 33, 64),
    ("blockwise_1x128", E4M3, False, False, False, 70, 256),
    ("blockwise_1x128", E4M3, True, True, False, 200, 70),   # the tokens padded to 256
    ("blockwise_128x128", E4M3, False, False, False, 200, 256),  # a partial block of rows
    ("blockwise_128x128", E4M3, True, True, True, 70, 136),
])
def test_quantize_matches_torch(granularity, dtype, transpose, pad, power_of_two, rows, cols):
    for it in range(2):  # fresh inputs each call (the second reuses the compiled launch)
        x = _data(_gen(granularity, transpose, rows, it), rows, cols)
        got = quantize(x, granularity, dtype=dtype, transpose=transpose, pad=pad, power_of_two=power_of_two)
        assert got.data.is_contiguous()
        assert _same(got, reference(x.t() if transpose else x, granularity, dtype, pad=pad,
                                    power_of_two=power_of_two)), (granularity, it)


@pytest.mark.parametrize("granularity,transpose,rows,cols,pad", [
    ("tensorwise", True, 70, 200, False),          # one scale over the whole stack
    ("rowwise", False, 33, 300, False),
    ("rowwise", True, 70, 96, False),              # each matrix's columns: an amax pass, then the cast
    ("blockwise_128x128", True, 200, 256, False),  # each matrix's partial block of rows on its own
    ("blockwise_1x128", False, 40, 256, False),
    ("blockwise_1x128", True, 40, 200, True),      # each matrix padded with zero columns to 256
])
def test_a_stack_is_each_matrix_quantized(granularity, transpose, rows, cols, pad):
    # x [B, R, C] (transpose: [B, C, R], each matrix's transpose quantized, as an MoE layer's experts'
    # weights for an input gradient): every matrix as the reference casts it alone; tensorwise's one
    # scale is the whole stack's.
    experts = 3
    gen = _gen("stack", granularity, transpose)
    mats = [_data(gen, rows, cols) for _ in range(experts)]
    x = torch.stack([m.t() for m in mats]).transpose(1, 2) if transpose else torch.stack(mats)
    assert x.shape == (experts, rows, cols) and x.is_contiguous() != transpose
    got = quantize(x.transpose(1, 2) if transpose else x, granularity, transpose=transpose, pad=pad)
    assert got.data.shape == (experts, rows, -(-cols // 128) * 128 if pad else cols) and got.data.is_contiguous()
    if granularity == "tensorwise":
        q, scale = reference(torch.cat(mats), granularity, E4M3)
        assert torch.equal(got.scale, scale)
        assert torch.equal(got.data.reshape(-1, cols).view(torch.uint8), q.view(torch.uint8))
        return
    for e, m in enumerate(mats):
        assert _same((got.data[e], got.scale[e]), reference(m, granularity, E4M3, pad=pad)), (granularity, e)


def test_given_row_amaxes():
    # rowwise with each row's amax found elsewhere (as a GEMM's epilogue raises it): the cast alone, the
    # same bits as the reference; powers of two too.
    gen = _gen("row amax")
    x = _data(gen, 50, 300)
    amax = x.abs().amax(1)
    assert _same(quantize(x, "rowwise", amax=amax), reference(x, "rowwise", E4M3))
    assert _same(quantize(x, "rowwise", amax=amax, power_of_two=True, dtype=E5M2),
                 reference(x, "rowwise", E5M2, power_of_two=True))


def test_casts_round_to_nearest_even_with_subnormals():
    # Every finite float8 value, the midpoints between neighbours (ties) and their float32 neighbours,
    # cast with a given scale of 1: what torch's cast gives, for both formats.
    for dtype in (E4M3, E5M2):
        values = torch.arange(256, dtype=torch.uint8).view(dtype).float()
        values = values[torch.isfinite(values)].sort().values
        mids = (values[1:] + values[:-1]) / 2
        x = torch.cat([values, mids, torch.nextafter(mids, torch.tensor(1e30)),
                       torch.nextafter(mids, torch.tensor(-1e30)), values * 3]).view(-1, 1)
        got = quantize(x, "tensorwise", dtype=dtype, scale=torch.ones(()))
        ref = x.clamp(-MAX[dtype], MAX[dtype]).to(dtype)
        assert torch.equal(got.data.view(torch.uint8), ref.view(torch.uint8)), dtype


def test_bfloat16_input_and_a_given_scale():
    gen = _gen("bf16")
    x = _data(gen, 40, 128).bfloat16()
    assert _same(quantize(x, "rowwise"), reference(x.float(), "rowwise", E4M3))
    first = quantize(x, "tensorwise", dtype=E5M2)
    again = quantize(x, "tensorwise", dtype=E5M2, transpose=True, scale=first.scale)
    assert again.scale is first.scale
    assert torch.equal(again.data.view(torch.uint8), first.data.t().contiguous().view(torch.uint8))


@pytest.mark.parametrize("scaling,transpose,granularity,rows,cols", [
    ("tensorwise", True, "tensorwise", 128, 256),
    ("rowwise", True, "rowwise", 128, 256),
    ("rowwise", False, "blockwise_1x128", 200, 384),
    ("blockwise", True, "blockwise_128x128", 128, 256),
    ("blockwise", True, "blockwise_128x128", 320, 256),
    ("blockwise", True, "blockwise_1x128", 200, 512),
    ("blockwise", False, "blockwise_1x128", 128, 256),
    ("blockwise", False, "rowwise", 136, 384),
])
def test_requantize_a_float8_operand(scaling, transpose, granularity, rows, cols):
    # A gathered float8 operand with its row scales (one element, [R, 1] or [R, C/128]) quantized again:
    # x8 * x_scale in float32, then the reference. The input's scales are one per tile, per row or per
    # column of a tile (read once per row or column), or vary within a row of a tile (the rowwise cast
    # walks a row 256 columns at a time in the interpreter: two 1 x 128 scales), over several tiles and
    # off their edges.
    gen = _gen("requant", scaling, transpose, rows)
    x = _data(gen, rows, cols)
    first = quantize(x, {"tensorwise": "tensorwise", "rowwise": "rowwise", "blockwise": "blockwise_1x128"}[scaling])
    pad = granularity.startswith("blockwise")
    got = quantize(first.data, granularity, transpose=transpose, x_scale=first.scale, pad=pad)
    s = first.scale if scaling != "blockwise" else first.scale.repeat_interleave(128, 1)
    dequantized = first.data.float() * s
    assert _same(got, reference(dequantized.t() if transpose else dequantized, granularity, E4M3, pad=pad))


@pytest.mark.parametrize("transpose,requantize,rows,cols", [
    (False, False, 256, 384),   # several blocks each way
    (True, False, 384, 128),    # x read transposed: the twin is x itself
    (False, True, 128, 256),    # a float8 x with 1 x 128 scales, quantized again
])
def test_twin_is_the_other_orientation(transpose, requantize, rows, cols):
    # twin=True: the second result is the reference cast of the other orientation, bit for bit, and the
    # first is what a call without twin gives.
    gen = _gen("twin", transpose, requantize)
    x = _data(gen, cols, rows) if transpose else _data(gen, rows, cols)
    kw = {}
    if requantize:
        first = quantize(x, "blockwise_1x128")
        x, kw = first.data, {"x_scale": first.scale}
        plain = first.data.float() * first.scale.repeat_interleave(128, 1)
    else:
        plain = x
    q, t = quantize(x, "blockwise_128x128", transpose=transpose, twin=True, **kw)
    oriented = plain.t() if transpose else plain
    assert _same(q, reference(oriented, "blockwise_128x128", E4M3))
    assert t.data.is_contiguous() and t.scale.is_contiguous()
    assert _same(t, reference(oriented.t().contiguous(), "blockwise_128x128", E4M3))


@pytest.mark.parametrize("dtype,rows,cols", [(E4M3, 200, 256), (E5M2, 384, 128), (E4M3, 40, 384)])
def test_twin_of_row_blocks_is_the_padded_transpose(dtype, rows, cols):
    # blockwise_1x128 with twin: the first result as without it, the second the reference cast of x.T
    # with its columns (x's rows) padded with zeros to a multiple of 128, bit for bit.
    x = _data(_gen("twin-1x128", rows, cols), rows, cols)
    q, t = quantize(x, "blockwise_1x128", dtype=dtype, twin=True)
    assert _same(q, reference(x, "blockwise_1x128", dtype))
    assert t.data.shape == (cols, -(-rows // 128) * 128) and t.data.is_contiguous()
    assert _same(t, reference(x.t().contiguous(), "blockwise_1x128", dtype, pad=True))


def test_quantized_operands_feed_matmul():
    # quantize's scales are matmul's: a [M, K] as it is, b as the transpose of a quantized [N, K].
    gen = _gen("matmul")
    x, w = torch.randn(40, 256, generator=gen), torch.randn(72, 256, generator=gen)
    for ga, gb in (("rowwise", "rowwise"), ("blockwise_1x128", "blockwise_128x128"), ("tensorwise", "tensorwise")):
        a, b = quantize(x, ga), quantize(w, gb)
        got = tileweave.matmul(a.data, b.data.t(), scale_a=a.scale, scale_b=b.scale.t(), out_dtype=torch.float32)
        ea = a.scale.double() if ga != "blockwise_1x128" else a.scale.double().repeat_interleave(128, 1)
        eb = b.scale.double() if gb != "blockwise_128x128" else \
            b.scale.double().repeat_interleave(128, 0).repeat_interleave(128, 1)[:72]
        ref = (a.data.double() * ea) @ (b.data.double() * eb).t()
        assert ((got.double() - ref).norm() / ref.norm()).item() < 1e-5, ga
        assert ((ref - x.double() @ w.double().t()).norm() / ref.norm()).item() < 0.1, ga  # near the unquantized


def test_bad_arguments_are_refused_by_name():
    x = torch.randn(8, 96)
    x8 = x.to(E4M3)
    cases = {
        "granularity": (lambda: quantize(x, "columnwise"), "granularity must be one of"),
        "dtype": (lambda: quantize(x, "rowwise", dtype=torch.float16), "dtype must be torch.float8_e4m3fn"),
        "blockwise columns": (lambda: quantize(x, "blockwise_1x128"), "multiple of 128"),
        "blockwise transposed": (lambda: quantize(torch.randn(96, 128), "blockwise_128x128", transpose=True),
                                 "rows of x (the columns of x.T)"),
        "pad": (lambda: quantize(x, "rowwise", pad=True), "pad applies to blockwise"),
        "scale": (lambda: quantize(x, "rowwise", scale=torch.ones(())), "a given scale applies to tensorwise"),
        "scale shape": (lambda: quantize(x, "tensorwise", scale=torch.ones(2)), "scale must have one element"),
        "float8 without scales": (lambda: quantize(x8, "rowwise"), "pass its scales as x_scale"),
        "x_scale on float32": (lambda: quantize(x, "rowwise", x_scale=torch.ones(8, 1)), "x_scale applies to a float8"),
        "x_scale shape": (lambda: quantize(x8, "rowwise", x_scale=torch.ones(8, 2)), "x_scale must have one element"),
        "x_scale dtype": (lambda: quantize(x8, "rowwise", x_scale=torch.ones(8, 1).double()),
                          "x_scale must be a float32 tensor"),
        "x dtype": (lambda: quantize(x.int(), "rowwise"), "x has dtype torch.int32"),
        "x dims": (lambda: quantize(x.view(2, 2, 2, 96), "rowwise"), "x must be 2-D, or 3-D"),
        "amax granularity": (lambda: quantize(x, "blockwise_1x128", amax=torch.ones(8)),
                             "a given amax applies to tensorwise and rowwise"),
        "row amax count": (lambda: quantize(x, "rowwise", amax=torch.ones(7)), "amax must have 8 contiguous"),
        "x_scale on a stack": (lambda: quantize(x8.view(2, 4, 96), "rowwise", x_scale=torch.ones(())),
                               "x_scale applies to a 2-D x"),
        "twin granularity": (lambda: quantize(torch.randn(128, 128), "rowwise", twin=True),
                             "twin applies to blockwise granularities"),
        "twin rows": (lambda: quantize(torch.randn(96, 128), "blockwise_128x128", twin=True),
                      "rows that are a multiple of 128"),
        "twin pad": (lambda: quantize(torch.randn(128, 100), "blockwise_1x128", pad=True, twin=True),
                     "twin applies to blockwise granularities"),
        "twin stack": (lambda: quantize(torch.randn(2, 128, 128), "blockwise_1x128", twin=True),
                       "twin applies to blockwise granularities"),
    }
    for name, (call, text) in cases.items():
        with pytest.raises((TypeError, ValueError)) as info:
            call()
        assert text in str(info.value), (name, str(info.value))
