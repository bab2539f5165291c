"""The RMSNorm's backward (``tileweave.ops.compute.rms_norm.rms_norm_grad``) in Triton's interpreter,
against float64 autograd of ``x * rsqrt(mean(x^2) + eps) * w`` written here: float32, float16 and
bfloat16, with and without a weight, rows and columns off the tiles, rows of very different
magnitudes, strided rows, empty inputs, both kernels (whole rows read once by persistent programs that
each take several row blocks, and rows walked twice), two calls bit for bit equal on each, the layer's
entry (``nn.fused_inputs.rms_norm_backward``), the GPU tile rule, and the refusals by name, before any
launch."""

import re
import zlib

import pytest
import torch

from support.recording import recording
from tileweave.nn.fused_inputs import rms_norm_backward
from tileweave.ops.compute import rms_norm
from tileweave.ops.compute.rms_norm import rms_norm_grad

ROWS_KERNEL = "tileweave.kernels.rms_norm:rms_norm_grad_rows_kernel"
WALK_KERNEL = "tileweave.kernels.rms_norm:rms_norm_grad_kernel"
DWEIGHT_KERNEL = "tileweave.kernels.rms_norm:rms_norm_dweight_kernel"

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


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _kernels(dy, x, w, rstd, **kwargs):
    """``_check``'s result and the norm kernel the call launched (the reduction aside)."""
    with recording() as launched:
        out = _check(dy, x, w, rstd, **kwargs)
    norms = [launch.kernel for launch in launched if launch.kernel != DWEIGHT_KERNEL]
    assert len(norms) == 1 and len(launched) == 1 + (w is not None)
    return out, norms[0]


# (rows, cols, tiles, row blocks per program at most): rows off BR, columns off powers of two, and the
# persistent loop, each of the interpreter's INTERPRETER_ROW_PROGRAMS programs taking several row blocks
@pytest.mark.parametrize("rows,cols,tiles,blocks", [
    (37, 200, None, 2),  # BR = 8: five blocks over four programs, the last one short
    (300, 70, None, 10),
    (45, 96, (1, 128, 4), 12),  # one row per block
    (29, 130, (4, 256, 2), 2),  # BC past next_power_of_2(H)
    (50, 33, (2, 64, 1), 7),  # 25 blocks over four programs, one warp
])
@pytest.mark.parametrize("dtype,weight", [(torch.float32, True), (torch.bfloat16, True), (torch.float16, False)],
                         ids=["float32", "bfloat16", "float16-no_weight"])
def test_whole_rows_are_read_once(rows, cols, tiles, blocks, dtype, weight):
    gen = _gen("whole rows", rows, cols, tiles, dtype, weight)
    _, kernel = _kernels(*_inputs(gen, rows, cols, dtype, weight), tiles=tiles)
    assert kernel == ROWS_KERNEL
    br = rms_norm.INTERPRETER_ROWS if tiles is None else tiles[0]
    assert _cdiv(_cdiv(rows, br), rms_norm.INTERPRETER_ROW_PROGRAMS) == blocks  # the loop this case runs


@pytest.mark.parametrize("rows,cols,tiles", [
    (37, 200, (4, 64, 4)),  # four column blocks, the last one short
    (21, 100, (1, 32, 2)),
    (3, rms_norm.ROW_COLS + 17, None),  # rows wider than ROW_COLS are walked twice by default
])
@pytest.mark.parametrize("dtype,weight", [(torch.bfloat16, True), (torch.float32, False)],
                         ids=["bfloat16", "float32-no_weight"])
def test_wide_rows_are_walked_twice(rows, cols, tiles, dtype, weight):
    gen = _gen("two walks", rows, cols, tiles, dtype, weight)
    _, kernel = _kernels(*_inputs(gen, rows, cols, dtype, weight), tiles=tiles)
    assert kernel == WALK_KERNEL


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("tiles", [None, (2, 256, 4), (8, 64, 4)], ids=["whole rows", "whole rows, BR 2", "two walks"])
def test_two_calls_are_equal_bit_for_bit(dtype, tiles):
    dy, x, w, rstd = _inputs(_gen("repeat", dtype, tiles), 70, 150, dtype)
    dx1, dw1 = _check(dy, x, w, rstd, tiles=tiles)
    dx2, dw2 = rms_norm_grad(dy, x, w, rstd, tiles=tiles)
    assert torch.equal(dx1, dx2) and torch.equal(dw1, dw2)


@pytest.mark.parametrize("tiles", [(1, 64, 1), (4, 32, 2), (16, 128, 4)])
def test_given_tiles(tiles):
    # tiles the GPU may run: one row per program, walked twice; a column block past H, walked twice;
    # whole rows, rounded up to 128 columns (the interpreter's programs, each taking two blocks)
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


@pytest.mark.parametrize("rows,cols", [(8192, 32768), (1000, 32768), (8192, rms_norm.ROW_COLS + 1), (10**6, 65536)])
def test_gpu_tiles_of_wide_rows_fill_the_gpu_with_modest_tiles(rows, cols):
    br, bc, warps = rms_norm.choose_tiles(rows, cols)
    assert br & (br - 1) == 0 and bc & (bc - 1) == 0 and br <= rms_norm.MAX_ROWS
    assert bc < cols  # walked twice
    assert br * bc <= rms_norm.TILE and br * bc <= 32 * warps * 16  # at most 16 elements per thread
    programs = -(-rows // br)
    assert programs >= min(rows, rms_norm.PROGRAMS)  # enough programs, unless rows are that few
    assert bc >= 128  # 128 contiguous columns at least
    if rows == 8192:
        assert (br, programs) == (16, 512)


@pytest.mark.parametrize("rows,cols", [(8192, 8192), (8192, 5120), (8192, 7168), (8192, 16384), (8192, 2048),
                                       (1000, 1024), (37, 200), (10**6, 4096), (1, 1), (300, 48)])
def test_gpu_tiles_of_rows_that_fit_read_them_once(rows, cols):
    br, bc, warps = rms_norm.choose_tiles(rows, cols)
    assert br & (br - 1) == 0 and bc & (bc - 1) == 0 and warps & (warps - 1) == 0 and br <= rms_norm.ROW_MAX_ROWS
    assert cols <= bc < 2 * cols  # whole rows, rounded up to a power of two
    assert br * bc <= 32 * 32 * warps and warps <= 16  # at most 32 float32 per thread per tensor, 16 warps
    programs = rms_norm.row_programs(rows, br, bc)
    blocks = _cdiv(rows, br)
    assert programs <= min(blocks, rms_norm.ROW_PROGRAMS)
    assert programs >= min(blocks, rms_norm.ROW_PROGRAMS // 2)  # one program per SM at least, unless too few rows
    if rows == 8192 and cols <= 8192:
        assert (br * bc, warps, programs) == (rms_norm.ROW_TILE, 8, 264)
    if cols == 16384:
        assert (br, warps, programs) == (1, 16, 132)


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


@pytest.mark.parametrize("tiles,match", [
    ((16, 96, 4), "three powers of two"), ((16, 64), "three powers of two"), ([16, 64, 4], "three powers of two"),
    ((0, 64, 4), "three powers of two"), ((1, 64, 64), "num_warps <= 32"), ((2, 2**20, 4), r"BR \* BC <= 2\*\*20"),
], ids=str)
def test_refusals_of_tiles(tiles, match):
    with recording() as launched, \
            pytest.raises(ValueError, match=f"tiles must .*{match}.*got {re.escape(repr(tiles))}"):
        rms_norm_grad(**_bad(), tiles=tiles)
    assert launched == []  # refused before any launch
