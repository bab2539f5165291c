"""The RMSNorm's backward (``rms_norm_grad``) compiled on a GPU, against float64 autograd of
``x * rsqrt(mean(x^2) + eps) * w``: bfloat16 and float32, with and without a weight, 8192 rows (the
tiles of a full GPU) and rows and columns off the tiles, strided rows, two calls bit for bit equal;
whole rows read once (widths up to ``ROW_COLS``, powers of two and not) and wider rows walked twice.
Skipped without a CUDA GPU."""

import pytest
import torch

from gpus import needs_gpu
from tileweave.ops.compute.rms_norm import ROW_COLS, choose_tiles, rms_norm_grad

pytestmark = [pytest.mark.gpu, needs_gpu]
EPS = 1e-5


def _reference(dy, x, w):
    x64 = x.double().requires_grad_(True)
    w64 = (torch.ones(x.shape[1], dtype=torch.float64, device=x.device) if w is None else w.double())
    w64.requires_grad_(True)
    (x64 * torch.rsqrt((x64 * x64).mean(1, keepdim=True) + EPS) * w64).backward(dy.double())
    return x64.grad, w64.grad


def _rel(a, b) -> float:
    return float((a.double() - b).norm() / b.norm())


def _inputs(rows, cols, pitch, dtype, weight):
    gen = torch.Generator().manual_seed(rows + cols)
    x = torch.randn(rows, pitch, generator=gen) * torch.exp2(torch.randint(-4, 5, (rows, 1), generator=gen).float())
    x = x.to(dtype).cuda()[:, :cols]  # pitch > cols: strided rows
    dy = torch.randn(rows, cols, generator=gen).to(dtype).cuda()
    w = (1 + 0.5 * torch.randn(cols, generator=gen)).to(dtype).cuda() if weight else None
    return dy, x, w, torch.rsqrt((x.double() ** 2).mean(1) + EPS).float()


def _bound(ref, dtype) -> float:
    # twice the rounding of the exact result to dtype, plus float32's steps: sums of up to 20000 terms
    # (a row's, or the rows' for the weight) in blocks, each a few float32 ulps (2^-24) times the block count
    return 2 * _rel(ref.to(dtype), ref) + 1e-5


def _check(dy, x, w, rstd, **kwargs):
    dtype = x.dtype
    dx, dw = rms_norm_grad(dy, x, w, rstd, **kwargs)
    ref_dx, ref_dw = _reference(dy, x, w)
    assert dx.dtype == dtype and _rel(dx, ref_dx) < _bound(ref_dx, dtype)
    row_err = (dx.double() - ref_dx).norm(dim=1) / ref_dx.norm(dim=1)
    assert float(row_err.max()) < 4 * _bound(ref_dx, dtype)
    if w is not None:
        assert dw.dtype == dtype and _rel(dw, ref_dw) < _bound(ref_dw, dtype)
    else:
        assert dw is None
    again = rms_norm_grad(dy, x, w, rstd, **kwargs)
    assert torch.equal(again[0], dx) and (dw is None or torch.equal(again[1], dw))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("weight", [True, False], ids=["weight", "no_weight"])
@pytest.mark.parametrize("rows,cols,pitch", [(8192, 8192, 8192), (1999, 5000, 5000), (777, 4096, 4160)])
def test_rms_norm_grad_gpu(dtype, weight, rows, cols, pitch):
    _check(*_inputs(rows, cols, pitch, dtype, weight))
    if rows == 8192:
        assert choose_tiles(rows, cols)[1] >= cols  # the full-GPU tiles: whole rows, read once


# (rows, cols, tiles): whole rows of a power of two and of model widths off it (masked), up to ROW_COLS;
# rows walked twice, wider than ROW_COLS or by the tiles given
@pytest.mark.parametrize("rows,cols,tiles,whole", [
    (8192, 8192, None, True), (8192, 5120, None, True), (8192, 7168, None, True), (4096, 16384, None, True),
    (3000, 2048, None, True), (2048, 20000, None, False), (8192, 8192, (16, 128, 4), False),
], ids=str)
def test_rms_norm_grad_gpu_paths(rows, cols, tiles, whole):
    assert ((tiles or choose_tiles(rows, cols))[1] >= cols) == whole and (cols <= ROW_COLS or not whole)
    _check(*_inputs(rows, cols, cols, torch.bfloat16, True), tiles=tiles)
