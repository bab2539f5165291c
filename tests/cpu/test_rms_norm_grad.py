"""The RMSNorm's backward (``tileweave.ops.compute.rms_norm.rms_norm_grad``) in Triton's interpreter,
against float64 autograd of ``x * rsqrt(mean(x^2) + eps) * w`` written here: float32, float16 and
bfloat16, with and without a weight, rows and columns off the tiles, rows of very different
magnitudes, strided rows, empty inputs, two calls bit for bit equal, the layer's entry
(``nn.fused_inputs.rms_norm_backward``), the GPU tile rule, and the refusals by name."""

import zlib

import pytest
import torch

from tileweave.nn.fused_inputs import rms_norm_backward
from tileweave.ops.compute import rms_norm
from tileweave.ops.compute.rms_norm import rms_norm_grad

EPS = 1e-5
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _gen(*parts) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(",".join(map(str, parts)).encode()))


def _inputs(gen, rows, cols, dtype, weight=True):
    """``x`` (rows scaled by powers of two from 2^-4 to 2^4), ``dy``, a weight around 1 (or None), all in
    ``dtype``, and ``rstd`` in float32 as the forward writes it."""
    x = torch.randn(rows, cols, generator=gen) * torch.exp2(torch.randint(-4, 5, (rows, 1), generator=gen).float())
    x = x.to(dtype)
    dy = torch.randn(rows, cols, generator=gen).to(dtype)
    w = (1 + 0.5 * torch.randn(cols, generator=gen)).to(dtype) if weight else None
    return dy, x, w, _rstd(x)


def _rstd(x: torch.Tensor) -> torch.Tensor:
    return torch.rsqrt((x.double() ** 2).mean(1) + EPS).float()


def _reference(dy, x, w):
    """``(dx, dw)`` in float64 by autograd through the norm, ``rstd`` included."""
    x64 = x.double().requires_grad_(True)
    w64 = (torch.ones(x.shape[1], dtype=torch.float64) if w is None else w.double()).requires_grad_(True)
    y = x64 * torch.rsqrt((x64 * x64).mean(1, keepdim=True) + EPS) * w64
    y.backward(dy.double())
    return x64.grad, w64.grad


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b).norm() / b.norm().clamp(min=1e-300))


def _bound(ref: torch.Tensor, dtype: torch.dtype) -> float:
    """What a result in ``dtype`` may be off ``ref`` (relative, in norm): twice the rounding of ``ref``
    itself to ``dtype``, plus float32's steps (the float32 ``rstd``, sums over a row or the rows)."""
    return 2 * _rel(ref.to(dtype), ref) + 2e-6


def _check(dy, x, w, rstd, **kwargs):
    dx, dw = rms_norm_grad(dy, x, w, rstd, **kwargs)
    ref_dx, ref_dw = _reference(dy, x, w)
    assert dx.dtype == x.dtype and dx.shape == x.shape and dx.is_contiguous()
    assert _rel(dx, ref_dx) < _bound(ref_dx, x.dtype)
    # every row right, not only the big ones: each row's error against its own norm
    row_err = (dx.double() - ref_dx).norm(dim=1) / ref_dx.norm(dim=1)
    assert float(row_err.max()) < 4 * _bound(ref_dx, x.dtype)
    if w is None:
        assert dw is None
    else:
        assert dw.dtype == w.dtype and dw.shape == w.shape
        assert _rel(dw, ref_dw) < _bound(ref_dw, w.dtype)
    return dx, dw


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("weight", [True, False], ids=["weight", "no_weight"])
@pytest.mark.parametrize("rows,cols", [(37, 200), (1, 64), (16, 3), (300, 70)])
def test_matches_float64(dtype, weight, rows, cols):
    _check(*_inputs(_gen("match", dtype, weight, rows, cols), rows, cols, dtype, weight))


def test_one_column():
    # dx = rstd * g * eps / (x^2 + eps): nearly all of g * rstd cancels, so bound the error by that scale
    dy, x, w, rstd = _inputs(_gen("one column"), 16, 1, torch.float32)
    dx, dw = rms_norm_grad(dy, x, w, rstd)
    ref_dx, ref_dw = _reference(dy, x, w)
    scale = (rstd[:, None] * dy * w).abs().double()
    assert bool(((dx.double() - ref_dx).abs() <= 2**-20 * scale).all())
    assert _rel(dw, ref_dw) < 1e-6


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_strided_rows_and_mixed_dtypes(dtype):
    gen = _gen("strided", dtype)
    rows, cols = 29, 96
    # x and dy: column slices of wider tensors (row strides 160 and 131), the weight in another dtype
    x = _inputs(gen, rows, 160, dtype)[1][:, 40:40 + cols]
    dy = torch.randn(rows, 131, generator=gen).to(torch.float16 if dtype != torch.float16 else torch.float32)[:, :cols]
    w = (1 + 0.5 * torch.randn(cols, generator=gen)).to(torch.bfloat16 if dtype != torch.bfloat16 else torch.float32)
    assert not x.is_contiguous() and not dy.is_contiguous()
    dx, dw = _check(dy, x, w, _rstd(x))
    assert torch.equal(dx, rms_norm_grad(dy.contiguous(), x.contiguous(), w, _rstd(x))[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_two_calls_are_equal_bit_for_bit(dtype):
    dy, x, w, rstd = _inputs(_gen("repeat", dtype), 70, 150, dtype)
    dx1, dw1 = rms_norm_grad(dy, x, w, rstd)
    dx2, dw2 = rms_norm_grad(dy, x, w, rstd)
    assert torch.equal(dx1, dx2) and torch.equal(dw1, dw2)


@pytest.mark.parametrize("tiles", [(1, 64, 1), (4, 32, 2), (16, 128, 4)])
def test_given_tiles(tiles):
    # the GPU's tiles (choose_tiles) run here too: one row per program, a column block past H, H = 16 x 16
    for dtype in (torch.float32, torch.float16):
        _check(*_inputs(_gen("tiles", tiles, dtype), 21, 100, dtype), tiles=tiles)


def test_empty_inputs():
    dx, dw = rms_norm_grad(torch.empty(0, 48), torch.empty(0, 48), torch.ones(48, dtype=torch.float16),
                           torch.empty(0))
    assert dx.shape == (0, 48) and dw.dtype == torch.float16 and torch.equal(dw, torch.zeros(48, dtype=torch.float16))
    dx, dw = rms_norm_grad(torch.empty(5, 0), torch.empty(5, 0), torch.empty(0), torch.ones(5))
    assert dx.shape == (5, 0) and dw.shape == (0,)
    dx, dw = rms_norm_grad(torch.empty(0, 8), torch.empty(0, 8), None, torch.empty(0))
    assert dx.shape == (0, 8) and dw is None


def test_layer_entry_is_the_kernel():
    dy, x, w, rstd = _inputs(_gen("layer"), 33, 80, torch.float16)
    dx, dw = rms_norm_backward(dy, x, w, rstd)
    ref = rms_norm_grad(dy, x, w, rstd)
    assert torch.equal(dx, ref[0]) and torch.equal(dw, ref[1]) and dx.dtype == dw.dtype == torch.float16
    assert rms_norm_backward(dy, x, None, rstd)[1] is None


@pytest.mark.parametrize("rows,cols", [(8192, 16384), (8192, 8192), (1000, 16384), (37, 200), (10**6, 4096)])
def test_gpu_tiles_fill_the_gpu_with_modest_tiles(rows, cols):
    br, bc, warps = rms_norm.choose_tiles(rows, cols)
    assert br & (br - 1) == 0 and bc & (bc - 1) == 0 and br <= rms_norm.MAX_ROWS
    assert br * bc <= rms_norm.TILE and br * bc <= 32 * warps * 16  # at most 16 elements per thread
    programs = -(-rows // br)
    assert programs >= min(rows, rms_norm.PROGRAMS)  # enough programs, unless rows are that few
    assert bc >= min(cols, 128)  # whole rows of narrow inputs, else 128 contiguous columns at least
    if rows == 8192:
        assert (br, programs) == (16, 512)


def _bad(**change):
    dy, x, w, rstd = _inputs(_gen("bad"), 6, 8, torch.float32)
    args = dict(dy=dy, x=x, weight=w, rstd=rstd)
    args.update(change)
    return args


@pytest.mark.parametrize("args,error,match", [
    (_bad(x=torch.ones(6, 8, 1)), ValueError, "x must be 2-D"),
    (_bad(x=torch.ones(6, 8, dtype=torch.float64)), TypeError, "x has dtype torch.float64"),
    (_bad(dy=torch.ones(6, 8, dtype=torch.int32)), TypeError, "dy has dtype torch.int32"),
    (_bad(dy=torch.ones(6, 9)), ValueError, r"dy must have x's shape \[6, 8\]"),
    (_bad(dy=torch.ones(6, 8, device="meta")), ValueError, "dy is on meta"),
    (_bad(x=torch.ones(8, 6).t()), ValueError, "x must have unit stride along its last dimension"),
    (_bad(dy=torch.ones(8, 6).t()), ValueError, "dy must have unit stride along its last dimension"),
    (_bad(weight=torch.ones(7)), ValueError, r"weight must be None or .* shape \(8,\)"),
    (_bad(weight=torch.ones(16)[::2]), ValueError, "weight must be None or a contiguous"),
    (_bad(weight=torch.ones(8, dtype=torch.float64)), ValueError, "weight must be None or .*float64"),
    (_bad(weight=[1.0] * 8), ValueError, "weight must be None or .*got list"),
    (_bad(rstd=torch.ones(6, dtype=torch.float64)), ValueError, "rstd must be a contiguous float32"),
    (_bad(rstd=torch.ones(6, dtype=torch.bfloat16)), ValueError, "rstd must be a contiguous float32"),
    (_bad(rstd=torch.ones(5)), ValueError, r"rstd must .* shape \(6,\)"),
    (_bad(rstd=torch.ones(6, 1)), ValueError, r"rstd must .* got torch.float32 \(6, 1\)"),
    (_bad(rstd=torch.ones(12)[::2]), ValueError, "rstd must be a contiguous"),
    (_bad(rstd=torch.ones(6, device="meta")), ValueError, "rstd must .* on cpu"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_refusals_name_the_argument(args, error, match):
    with pytest.raises(error, match=match):
        rms_norm_grad(**args)


@pytest.mark.parametrize("tiles", [(16, 96, 4), (16, 64), [16, 64, 4], (0, 64, 4)], ids=str)
def test_refusals_of_tiles(tiles):
    with pytest.raises(ValueError, match="tiles must be"):
        rms_norm_grad(**_bad(), tiles=tiles)
