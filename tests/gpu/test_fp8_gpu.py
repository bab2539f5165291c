"""The FP8 GEMM and grouped GEMM cores compiled on a GPU, against float64 of the dequantized inputs and
against torch's own scaled matmuls where this torch has them. Skipped without a GPU of compute
capability 8.9 or more (FP8 tensor cores)."""

import pytest
import torch

from gpus import needs_gpu
import tileweave
from tileweave.ops.compute import fp8_sm90, scaling as scaling_mod
from tileweave.ops.compute.grouped_gemm import grouped_gemm

pytestmark = [pytest.mark.gpu, needs_gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9), reason="needs FP8 tensor cores")]
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# Hopper's FP8 MMA keeps fewer bits than fp32 while it accumulates (DeepSeek-V3 technical report,
# section 3.3.2), so a float32 output is exact only to the product of one 128-deep K step, summed in
# fp32 (use_fast_accum=False); with use_fast_accum=True the error grows with K.
TOL = {torch.float32: 3e-4, torch.bfloat16: 1e-2}
FAST_TOL = 3e-3


def _fp8(*shape, dtype=E4M3, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(*shape, generator=g, device="cuda") * 8).to(dtype)


def _positive(*shape, seed=1):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.rand(*shape, generator=g, device="cuda") * 1.5 + 0.25


def _scales(scaling, m, n, k):
    """torch's layouts: rowwise contiguous; blockwise scale_a M-major and scale_b the transpose of a
    contiguous [N/128, K/128]."""
    if scaling == "tensorwise":
        return _positive((), seed=2), _positive((), seed=3)
    if scaling == "rowwise":
        return _positive(m, 1, seed=2), _positive(1, n, seed=3)
    return _positive(k // 128, m, seed=2).t(), _positive(-(-n // 128), k // 128, seed=3).t()


def _expand(scale, rows, cols, block_rows):
    s = scale.double()
    if s.numel() == 1:
        return s.reshape(1, 1).expand(rows, cols)
    if s.shape == (rows, 1) or s.shape == (1, cols):
        return s.expand(rows, cols)
    if block_rows:  # a [K/128, N/128] weight scale
        return s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:rows, :cols]
    return s.repeat_interleave(128, 1)[:rows, :cols]


def _reference(a, b, scale_a, scale_b):
    (m, k), n = a.shape, b.shape[1]
    return (a.double() * _expand(scale_a, m, k, False)) @ (b.double() * _expand(scale_b, k, n, True))


def _rel(got, ref):
    assert torch.isfinite(got).all(), "non-finite output"
    return ((got.double() - ref).norm() / ref.norm()).item()


def _torch_scaled_mm(scaling, a, b, scale_a, scale_b):
    """torch's result, or None where this torch does not take the call."""
    try:
        if scaling != "blockwise":
            return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16)
        kinds = torch.nn.functional.ScalingType
        return torch.nn.functional.scaled_mm(a, b, scale_a, kinds.BlockWise1x128, scale_b, kinds.BlockWise128x128,
                                             output_dtype=torch.bfloat16)
    except (AttributeError, RuntimeError, ValueError, NotImplementedError):
        return None


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise", "blockwise"])
@pytest.mark.parametrize("m,n,k", [(4096, 4096, 1024), (1000, 1000, 1024), (129, 200, 512)])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_matmul_fp8(scaling, m, n, k, out_dtype):
    # 4096 x 4096 takes the 128 x 256 tiles (tensorwise, rowwise, bf16 out), the others 128 x 128.
    a, w = _fp8(m, k, seed=m + n), _fp8(n, k, seed=k)
    scale_a, scale_b = _scales(scaling, m, n, k)
    bias = _positive(n, seed=4).to(out_dtype)
    out = torch.full((m, n), float("nan"), dtype=out_dtype, device="cuda")
    tileweave.matmul(a, w.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype, bias=bias, out=out)
    ref = _reference(a, w.t(), scale_a, scale_b)
    assert _rel(out, ref + bias.double()) < TOL[out_dtype]
    theirs = _torch_scaled_mm(scaling, a, w.t(), scale_a, scale_b)
    if theirs is not None:
        ours = tileweave.matmul(a, w.t(), scale_a=scale_a, scale_b=scale_b)
        assert _rel(ours, theirs.double()) < TOL[torch.bfloat16]


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_matmul_fp8_fast_accum(scaling):
    m, n, k = 1024, 768, 8192  # a long K, where the tensor cores' own accumulation shows
    a, w = _fp8(m, k, seed=11), _fp8(n, k, seed=12)
    scale_a, scale_b = _scales(scaling, m, n, k)
    ref = _reference(a, w.t(), scale_a, scale_b)
    exact = tileweave.matmul(a, w.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=torch.float32)
    fast = tileweave.matmul(a, w.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=torch.float32,
                            use_fast_accum=True)
    assert _rel(exact, ref) < TOL[torch.float32]
    assert _rel(fast, ref) < FAST_TOL


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="the Gluon kernel is for sm_90")
@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise", "blockwise"])
@pytest.mark.parametrize("k", [128, 256, 384, 1152, 400])
@pytest.mark.parametrize("fast", [False, True])
def test_matmul_fp8_hopper_kernel_k_steps(scaling, k, fast):
    # One, two, three and nine K steps (the exact mode retires products two at a time: odd and even
    # counts), a K off the 128-deep step (zero-filled by TMA), an e5m2 operand; more tiles than SMs.
    if scaling == "blockwise" and (k % 128 or fast):
        pytest.skip("blockwise needs K in whole 128-blocks and always sums each step in fp32")
    m, n = 2000, 2048
    a, w = _fp8(m, k, seed=k, dtype=E5M2 if k == 384 else E4M3), _fp8(n, k, seed=k + 1)
    scale_a, scale_b = _scales(scaling, m, n, k)
    out = torch.full((m, n), float("nan"), dtype=torch.float32, device="cuda")
    assert fp8_sm90.suits(a, w.t(), out, scaling_mod.dense_scales("matmul", m, n, k, scale_a, scale_b))
    for _ in range(2):  # the first launch compiles, the second replays the kept kernel
        tileweave.matmul(a, w.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=torch.float32, out=out,
                         use_fast_accum=fast)
        assert _rel(out, _reference(a, w.t(), scale_a, scale_b)) < (FAST_TOL if fast else TOL[torch.float32])


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="the Gluon kernels are for sm_90")
@pytest.mark.parametrize("kernel", ["plain", "loader", "halves"])
@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise", "blockwise"])
@pytest.mark.parametrize("k", [128, 384, 512, 1152])
def test_hopper_kernels_each_config(kernel, scaling, k):
    # Each exact/blockwise kernel launched with its own config, whichever a default route takes: one,
    # three, four and nine K steps (the two-half kernel takes two a turn: odd and even counts), M and N
    # off the tile, a float32 output and a bias, more tiles than SMs.
    m, n = 2000, 2000
    a, w = _fp8(m, k, seed=k), _fp8(n, k, seed=k + 1)
    scale_a, scale_b = _scales(scaling, m, n, k)
    bias = torch.randn(n, device="cuda")
    scales = scaling_mod.dense_scales("matmul", m, n, k, scale_a, scale_b)
    config = {"BM": 128, "BN": 128, "BK": 128, "GROUP_M": 8, "STAGES": 5, "num_warps": 8, "kernel": kernel,
              **({"maxnreg": 168} if kernel == "loader" else {}), **({"num_warps": 4} if kernel == "halves" else {})}
    out = torch.full((m, n), float("nan"), dtype=torch.float32, device="cuda")
    fp8_sm90.launch(a, w.t(), out, bias, scales, config=config)
    ref = _reference(a, w.t(), scale_a, scale_b) + bias.double()
    assert _rel(out, ref) < TOL[torch.float32]


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="the Gluon kernels are for sm_90")
@pytest.mark.parametrize("k", [384, 512, 1536, 1664, 1792, 2048])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_staged_blockwise_kernel(k, out_dtype):
    # Blockwise with each step's scales brought into shared memory by the loader warp, the warp groups
    # taking turns two steps at a time: 3 to 16 K steps (3 and 13: an odd last step), M and N off the
    # tile, a bias; 13 and 14 K blocks give a weight-scale pitch TMA could not step over (read as one row
    # of their storage); the buffers config_for gives.
    m, n = 2000, 2000
    a, w = _fp8(m, k, seed=k), _fp8(n, k, seed=k + 1)
    scale_a, scale_b = _scales("blockwise", m, n, k)
    bias = torch.randn(n, device="cuda")
    scales = scaling_mod.dense_scales("matmul", m, n, k, scale_a, scale_b)
    assert fp8_sm90.staged_suits(scales)
    config = {"BM": 128, "BN": 128, "BK": 128, "GROUP_M": 8, "STAGES": 4 if out_dtype == torch.float32 else 5,
              "num_warps": 4, "kernel": "staged"}
    out = torch.full((m, n), float("nan"), dtype=out_dtype, device="cuda")
    fp8_sm90.launch(a, w.t(), out, bias, scales, config=config)
    ref = _reference(a, w.t(), scale_a, scale_b) + bias.double()
    assert _rel(out, ref) < TOL[out_dtype]


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise", "blockwise"])
@pytest.mark.parametrize("m", [1, 7, 64])
def test_matmul_fp8_decode_rows_share_k_over_the_sms(scaling, m):
    # Decode sizes take the stream-K tiles (every tile's K steps shared out over the SMs, each shared
    # tile summed in a fixed order): right, and the same bits on a second call. N off the tiles.
    n, k = 1000, 4096
    a, w = _fp8(m, k, seed=m), _fp8(n, k, seed=m + 1)
    scale_a, scale_b = _scales(scaling, m, n, k)
    outs = [tileweave.matmul(a, w.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=torch.float32)
            for _ in range(2)]
    assert _rel(outs[0], _reference(a, w.t(), scale_a, scale_b)) < TOL[torch.float32]
    assert torch.equal(outs[0], outs[1])


def test_matmul_fp8_e5m2_and_row_major_b():
    a, b = _fp8(512, 384, dtype=E5M2), _fp8(384, 300, seed=5)
    scale_a, scale_b = _scales("rowwise", 512, 300, 384)
    out = tileweave.matmul(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=torch.float32)
    assert _rel(out, _reference(a, b, scale_a, scale_b)) < TOL[torch.float32]


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise", "blockwise"])
def test_grouped_gemm_fp8(scaling):
    counts, experts, k, n, tokens = [300, 0, 1129, 47], 4, 1024, 768, 900  # an empty expert, rows off the tiles
    offsets = torch.tensor([0] + counts, device="cuda").cumsum(0).to(torch.int32)
    rows = sum(counts)
    a = _fp8(tokens, k, seed=6)
    a_rows = torch.randint(0, tokens, (rows,), device="cuda", generator=torch.Generator("cuda").manual_seed(7))
    w = _fp8(experts, n, k, seed=8)
    if scaling == "tensorwise":
        scale_a, scale_b = _positive((), seed=9), _positive(experts, seed=10)
    elif scaling == "rowwise":
        scale_a, scale_b = _positive(tokens, 1, seed=9), _positive(experts, 1, n, seed=10)
    else:
        scale_a, scale_b = _positive(tokens, k // 128, seed=9), _positive(experts, k // 128, n // 128, seed=10)
    out = grouped_gemm(a, w.transpose(1, 2), offsets, a_rows=a_rows, scale_a=scale_a, scale_b=scale_b)
    ref = torch.empty(rows, n, dtype=torch.float64, device="cuda")
    start = 0
    for g, count in enumerate(counts):
        e = g % experts
        src = a_rows[start:start + count]
        sb = scale_b[e] if scaling != "tensorwise" else scale_b[e].reshape(1, 1)
        a64 = a.double()[src] * _expand(scale_a[src] if scale_a.dim() else scale_a, count, k, False)
        ref[start:start + count] = a64 @ (w[e].t().double() * _expand(sb, k, n, True))
        start += count
    assert _rel(out, ref) < TOL[torch.bfloat16]
    if scaling == "rowwise" and hasattr(torch, "_scaled_grouped_mm"):
        ends = offsets[1:].contiguous()
        try:
            theirs = torch._scaled_grouped_mm(a[a_rows.long()], w.transpose(1, 2), scale_a[a_rows.long()].reshape(-1),
                                              scale_b.reshape(experts, n), offs=ends, out_dtype=torch.bfloat16)
        except RuntimeError:
            return
        assert _rel(out, theirs.double()) < TOL[torch.bfloat16]


@pytest.mark.parametrize("m,n,k", [(1024, 768, 512), (384, 1280, 8192)])
def test_weight_grad_matmul_blockwise_gpu(m, n, k):
    # The FP8 layers' weight-gradient GEMM with blockwise operands (torch's blockwise scaled matmul where
    # this torch has it): against float64 of the dequantized operands, as tileweave.matmul is.
    from tileweave.nn.tp_ops import weight_grad_matmul
    a, b = _fp8(m, k, seed=5), _fp8(n, k, seed=6).t()
    scale_a = _positive(m, k // 128, seed=7)  # K-major, as the layers' casts write them
    scale_b = _positive(n // 128, k // 128, seed=8).t()
    ref = _reference(a, b, scale_a, scale_b)
    for out_dtype in (torch.bfloat16, torch.float32):
        got = weight_grad_matmul(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)
        assert got.dtype == out_dtype and got.shape == (m, n)
        assert _rel(got, ref) < TOL[out_dtype], (out_dtype, _rel(got, ref))
