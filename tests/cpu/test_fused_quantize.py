"""RMSNorm and SwiGLU fused with their float8 cast (``tileweave.ops.compute.fused_quantize``) in Triton's
interpreter: the float8 data and scales equal, bit for bit, ``quantize`` (tested on its own in
``test_quantize.py``) of the norm's and the SwiGLU's values computed here with torch by the documented
formula (``support.fp8_reference``), so the fusion changes nothing; those values against float64 of
the norm and the SwiGLU; each granularity and format, rows off the tiles, an all-zero row, strided
gate and up, bfloat16 inputs, empty inputs, and the refusals by name."""

import zlib

import pytest
import torch

from support.fp8_reference import rms_norm32, swiglu32
from tileweave.ops.compute.fused_quantize import rms_norm_quantize, swiglu_quantize
from tileweave.ops.compute.quantize import quantize

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
EPS = 1e-5
# (granularity, float8 format, powers of two): each recipe's forward operand, and e5m2 for its range
FORMS = [("rowwise", E4M3, True), ("blockwise_1x128", E4M3, False), ("tensorwise", E4M3, False),
         ("tensorwise", E5M2, False), ("rowwise", E4M3, False)]


def _gen(*parts) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(",".join(map(str, parts)).encode()))


def _rows(gen, rows, cols, spread=8) -> torch.Tensor:
    # rows of very different magnitudes (per-row and per-block scales differ), one all-zero row
    x = torch.randn(rows, cols, generator=gen) * torch.exp2(torch.randint(-spread, spread + 1, (rows, 1),
                                                                          generator=gen).float())
    x[rows // 3] = 0
    return x


def _same(got, ref) -> bool:
    return got.data.dtype == ref.data.dtype and torch.equal(got.data.view(torch.uint8), ref.data.view(torch.uint8)) \
        and tuple(got.scale.shape) == tuple(ref.scale.shape) and torch.equal(got.scale, ref.scale)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b).norm() / b.norm().clamp(min=1e-300))


@pytest.mark.parametrize("granularity,dtype,pow2", FORMS, ids=lambda v: str(v).removeprefix("torch."))
@pytest.mark.parametrize("rows,cols,weight", [(37, 384, True), (1, 128, False), (70, 200, True)])
def test_rms_norm_quantize_is_quantize_of_the_norm(granularity, dtype, pow2, rows, cols, weight):
    if granularity == "blockwise_1x128" and cols % 128:
        pytest.skip("1x128 blocks need the columns to be a multiple of 128 (refusal tested below)")
    gen = _gen("norm", granularity, rows, cols)
    x = _rows(gen, rows, cols)
    w = 1 + 0.5 * torch.randn(cols, generator=gen) if weight else None
    got = rms_norm_quantize(x, w, EPS, granularity, dtype=dtype, power_of_two=pow2, return_values=True)
    values = rms_norm32(x, w, EPS)
    assert torch.equal(got.values, values)
    assert _same(got.q, quantize(values, granularity, dtype=dtype, power_of_two=pow2))
    mean_sq = (x.double() ** 2).mean(1)
    assert torch.equal(got.rstd, torch.rsqrt(((x.double() ** 2).sum(1) / cols).float() + EPS))
    exact = x.double() / torch.sqrt(mean_sq + EPS)[:, None] * (w.double() if weight else 1)
    assert _rel(got.values, exact) < 1e-6
    # without the values: the same cast
    assert _same(rms_norm_quantize(x, w, EPS, granularity, dtype=dtype, power_of_two=pow2).q, got.q)


@pytest.mark.parametrize("granularity,dtype,pow2", FORMS, ids=lambda v: str(v).removeprefix("torch."))
@pytest.mark.parametrize("rows,cols", [(37, 384), (1, 128), (70, 200)])
def test_swiglu_quantize_is_quantize_of_the_swiglu(granularity, dtype, pow2, rows, cols):
    if granularity == "blockwise_1x128" and cols % 128:
        pytest.skip("1x128 blocks need the columns to be a multiple of 128 (refusal tested below)")
    gen = _gen("swiglu", granularity, rows, cols)
    gate_up = torch.cat([4 * torch.randn(rows, cols, generator=gen), _rows(gen, rows, cols, spread=4)], dim=1)
    gate, up = gate_up.chunk(2, dim=1)  # strided halves of one projection, as the down projection reads them
    q, values = swiglu_quantize(gate, up, granularity, dtype=dtype, power_of_two=pow2, return_values=True)
    h = swiglu32(gate, up)
    assert torch.equal(values, h)
    assert _same(q, quantize(h, granularity, dtype=dtype, power_of_two=pow2))
    exact = gate.double() * torch.sigmoid(gate.double()) * up.double()
    assert _rel(values, exact) < 1e-6
    assert _same(swiglu_quantize(gate, up, granularity, dtype=dtype, power_of_two=pow2)[0], q)


def test_swiglu_sigmoid_in_its_tails():
    # Gates across the sigmoid's whole range, the clamp's edges at -87 and 87 and past them: the values
    # bit for bit the documented float32 steps, and within a few float32 units of the exact SwiGLU (0
    # below g = -87, where the exact one is under 2e-36).
    edges = torch.tensor([-87.0, 87.0, -86.99, 86.99, -87.01, 87.01, -88.7, -104.0, 89.0, 0.0, -0.0, 1e-30])
    gate = torch.cat([torch.linspace(-120, 120, 256 * 2 - edges.numel()), edges]).reshape(2, 256)
    up = 1 + torch.rand(2, 256, generator=_gen("tails"))
    _, values = swiglu_quantize(gate, up, "rowwise", return_values=True)
    assert torch.equal(values, swiglu32(gate, up))
    exact = gate.double() * torch.sigmoid(gate.double()) * up.double()
    assert bool(((values.double() - exact).abs() <= 4 * 2.0**-23 * exact.abs() + 1e-35).all())


def test_bfloat16_inputs_and_values():
    gen = _gen("bf16")
    x = _rows(gen, 20, 256).bfloat16()
    w = (1 + 0.5 * torch.randn(256, generator=gen)).bfloat16()
    got = rms_norm_quantize(x, w, EPS, "blockwise_1x128", return_values=True)
    values = rms_norm32(x, w, EPS)  # the bfloat16 inputs read exactly, the values computed in float32
    assert _same(got.q, quantize(values, "blockwise_1x128")) and got.values.dtype == torch.bfloat16
    assert torch.equal(got.values, values.bfloat16())
    gate, up = torch.randn(20, 256, generator=gen).bfloat16(), torch.randn(20, 256, generator=gen).bfloat16()
    q, h = swiglu_quantize(gate, up, "rowwise", power_of_two=True, return_values=True)
    assert _same(q, quantize(swiglu32(gate, up), "rowwise", power_of_two=True))
    assert torch.equal(h, swiglu32(gate, up).bfloat16())


def test_norm_values_only_and_empty_inputs():
    x = _rows(_gen("values"), 9, 96)
    got = rms_norm_quantize(x, None, EPS, None, return_values=True)
    assert got.q is None and torch.equal(got.values, rms_norm32(x, None, EPS))
    for granularity in ("tensorwise", "rowwise", "blockwise_1x128"):
        empty = rms_norm_quantize(torch.empty(0, 256), torch.ones(256), EPS, granularity)
        ref = quantize(torch.empty(0, 256), granularity)
        assert _same(empty.q, ref) and empty.rstd.shape == (0,)
        assert _same(swiglu_quantize(torch.empty(0, 128), torch.empty(0, 128), granularity)[0],
                     quantize(torch.empty(0, 128), granularity))


def test_refusals_name_the_argument():
    x, w = torch.randn(4, 200), torch.ones(200)
    cases = {
        "granularity": (lambda: rms_norm_quantize(x, w, EPS, "blockwise_128x128"), ValueError, "granularity must be"),
        "blockwise columns": (lambda: rms_norm_quantize(x, w, EPS, "blockwise_1x128"), ValueError, "multiple of 128"),
        "weight shape": (lambda: rms_norm_quantize(x, torch.ones(100), EPS, "rowwise"), ValueError, "weight must be"),
        "dtype": (lambda: rms_norm_quantize(x, w, EPS, "rowwise", dtype=torch.float16), TypeError, "dtype must be"),
        "no cast, no values": (lambda: rms_norm_quantize(x, w, EPS, None), ValueError, "return_values=True"),
        "x strides": (lambda: rms_norm_quantize(x.t(), None, EPS, "rowwise"), ValueError, "unit stride"),
        "x dtype": (lambda: rms_norm_quantize(x.double(), None, EPS, "rowwise"), TypeError, "float64"),
        "gate and up": (lambda: swiglu_quantize(x, torch.randn(4, 100), "rowwise"), ValueError, "gate and up"),
        "swiglu blockwise": (lambda: swiglu_quantize(x, x, "blockwise_1x128"), ValueError, "multiple of 128"),
    }
    for name, (call, kind, words) in cases.items():
        with pytest.raises(kind, match=words):
            call()
