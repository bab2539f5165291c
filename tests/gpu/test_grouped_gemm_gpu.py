"""The grouped GEMM core compiled on a GPU, against a float64 reference. Skipped without CUDA."""

import time

import pytest
import torch

from gpus import needs_gpu
from tileweave.bench import grouped as bench
from tileweave.ops.compute import grouped_gemm as gg_module
from tileweave.ops.compute.grouped_gemm import expected_tiles, grouped_config, grouped_gemm
from tileweave.tune.grouped import GroupedConfig

pytestmark = pytest.mark.gpu
TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 5e-3}


def _offsets(counts):
    ends = torch.tensor([0] + list(counts)).cumsum(0)
    return ends.to(torch.int32).cuda()


def _reference(a, b, counts, a_rows=None, row_scale=None, experts=None):
    experts = experts or b.shape[0]
    a64 = a.double()[a_rows.long()] if a_rows is not None else a.double()
    out = torch.zeros(a64.shape[0], b.shape[2], dtype=torch.float64, device=a.device)
    start = 0
    for g, count in enumerate(counts):
        out[start:start + count] = a64[start:start + count] @ b[g % experts].double()
        start += count
    if row_scale is not None:
        out *= row_scale.double()[:, None]
    return out


def _rel(got, ref):
    assert torch.isfinite(got).all(), "non-finite output"
    return ((got.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _counts(rows, experts, gen, empty=1):
    weights = torch.rand(experts, generator=gen)
    weights[:empty] = 0
    ids = torch.multinomial(weights, rows, replacement=True, generator=gen)
    return torch.bincount(ids, minlength=experts).tolist()


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows,k,n,experts", [(4099, 1024, 1536, 8), (2000, 384, 2048, 128), (777, 1000, 520, 3),
                                              (300, 64, 96, 1)])
@pytest.mark.parametrize("nk", [True, False])
def test_matches_reference(dtype, rows, k, n, experts, nk):
    gen = torch.Generator().manual_seed(rows + k + n)
    counts = _counts(rows, experts, gen, empty=1 if experts > 1 else 0)
    a = torch.randn(rows // 2 + 1, k, generator=gen).to(dtype).cuda()
    a_rows = torch.randint(0, a.shape[0], (rows,), generator=gen, dtype=torch.int32).cuda()
    w = torch.randn(experts, n, k, generator=gen) / k ** 0.5
    b = w.to(dtype).cuda().transpose(1, 2) if nk else w.transpose(1, 2).contiguous().to(dtype).cuda()
    scale = (torch.rand(rows, generator=gen) + 0.5).cuda()
    out = torch.full((rows, n), float("nan"), dtype=dtype, device="cuda")
    for _ in range(2):
        grouped_gemm(a, b, _offsets(counts), a_rows=a_rows, row_scale=scale, out=out)
        assert _rel(out, _reference(a, b, counts, a_rows, scale)) < TOL[dtype]


@needs_gpu
@pytest.mark.parametrize("config", [GroupedConfig(block_m=64, block_n=128, num_stages=4, num_warps=4),
                                    GroupedConfig(block_m=128, block_n=256, num_stages=3, num_warps=8),
                                    GroupedConfig(block_m=128, block_n=256, num_stages=3, num_warps=8, flatten=True),
                                    GroupedConfig(block_m=64, block_n=256, num_stages=4, num_warps=8),
                                    GroupedConfig(block_m=128, block_n=128, num_stages=4, num_warps=8)])
def test_configs_and_walk(config, monkeypatch):
    gen = torch.Generator().manual_seed(7)
    counts = [0, 513, 1, 0, 1000, 64, 0, 255]
    a = torch.randn(sum(counts), 512, generator=gen).to(torch.bfloat16).cuda()
    b = (torch.randn(8, 768, 512, generator=gen) / 512 ** 0.5).to(torch.bfloat16).cuda().transpose(1, 2)
    out = grouped_gemm(a, b, _offsets(counts), config=config)
    ref = _reference(a, b, counts)
    assert _rel(out, ref) < TOL[torch.bfloat16]
    monkeypatch.setattr(gg_module, "G_BLOCK_MAX", 4)
    assert _rel(grouped_gemm(a, b, _offsets(counts), config=config), ref) < TOL[torch.bfloat16]


@needs_gpu
def test_unaligned_weights_take_pointer_loads():
    """K = 1001 (rows of the weight not 16-byte aligned): no TMA for B, same result."""
    gen = torch.Generator().manual_seed(8)
    counts = [100, 0, 157]
    a = torch.randn(257, 1001, generator=gen).to(torch.float16).cuda()
    b = torch.randn(3, 333, 1001, generator=gen).to(torch.float16).cuda().transpose(1, 2)
    out = grouped_gemm(a, b, _offsets(counts))
    assert _rel(out, _reference(a, b, counts)) < TOL[torch.float16]


@needs_gpu
def test_group_range_gate_and_signal():
    """Two sources: rank 0's tiles of source 1 wait until another stream raises its flag after its data
    is written; signal counts every tile; a range computes only its groups."""
    gen = torch.Generator().manual_seed(9)
    experts, k, n = 4, 256, 384
    counts = [300, 0, 77, 129, 50, 400, 0, 3]
    x = torch.randn(64, k, generator=gen).to(torch.bfloat16).cuda()
    rows0 = sum(counts[:4])
    a_rows = torch.cat([torch.randint(0, 32, (rows0,), generator=gen),
                        torch.randint(32, 64, (sum(counts) - rows0,), generator=gen)]).to(torch.int32).cuda()
    b = (torch.randn(experts, k, n, generator=gen) / 16).to(torch.bfloat16).cuda()
    ref = _reference(x, b, counts, a_rows, experts=experts)
    gathered = x.clone()
    gathered[32:] = float("nan")
    flags = torch.tensor([5, 4], dtype=torch.int32, device="cuda")
    err = torch.zeros(1, dtype=torch.int32, device="cuda")
    counters = torch.zeros(2, dtype=torch.int32, device="cuda")
    config = grouped_config(sum(counts), n, k, len(counts), torch.bfloat16, x.device)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)   # well after the kernel has started
        gathered[32:].copy_(x[32:])
        flags[1:].fill_(5)
    out = grouped_gemm(gathered, b, _offsets(counts), a_rows=a_rows, experts=experts, config=config,
                       gate=(flags, 5, 0, err, 1 << 22), signal=(counters,))
    torch.cuda.synchronize()
    assert int(err) == 0
    assert _rel(out, ref) < TOL[torch.bfloat16]
    assert counters.tolist() == expected_tiles(_offsets(counts), experts=experts, n=n, config=config).tolist()
    part = torch.full_like(out, float("nan"))
    grouped_gemm(x, b, _offsets(counts), a_rows=a_rows, experts=experts, out=part, group_range=(4, 8))
    assert torch.isnan(part[:rows0]).all()
    assert _rel(part[rows0:], ref[rows0:]) < TOL[torch.bfloat16]


@needs_gpu
def test_expired_gate_returns():
    experts, k, n = 2, 128, 128
    counts = [100, 20, 50, 70]
    x = torch.randn(240, k, device="cuda", dtype=torch.float16)
    b = torch.randn(experts, k, n, device="cuda", dtype=torch.float16)
    flags = torch.zeros(2, dtype=torch.int32, device="cuda")
    err = torch.zeros(1, dtype=torch.int32, device="cuda")
    out = torch.full((240, n), float("nan"), dtype=torch.float16, device="cuda")
    t0 = time.monotonic()
    grouped_gemm(x, b, _offsets(counts), experts=experts, out=out, gate=(flags, 1, 1, err, 1000))
    torch.cuda.synchronize()
    assert time.monotonic() - t0 < 30
    assert int(err) == 1
    assert torch.isnan(out[:120]).all()
    assert _rel(out[120:], _reference(x, b, counts, experts=experts)[120:]) < TOL[torch.float16]


@needs_gpu
def test_bench_smoke(tmp_path):
    assert bench.main(["--smoke", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "grouped.json").exists()
