"""The persistent GEMM in Triton's interpreter against a float64 reference, fresh random inputs."""

import zlib

import pytest
import torch

import tileweave
from tileweave.tune.configs import GemmConfig

TOL = {torch.float16: 2e-3, torch.float32: 1e-5}


def _rel(got, ref):
    assert torch.isfinite(got).all(), "NaN or inf in the output"
    return ((got.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("m,n,k", [(64, 64, 64), (70, 45, 37), (33, 96, 130), (1, 40, 16), (129, 17, 64)])
@pytest.mark.parametrize("layout", ["kn", "weight", "column_major_a"])
def test_matmul_matches_reference(dtype, m, n, k, layout):
    # zlib.crc32, not hash(): str hashes are salted per process, so the inputs would differ per run.
    gen = torch.Generator().manual_seed(zlib.crc32(f"{m},{n},{k},{layout}".encode()))
    a = torch.randn(m, k, generator=gen).to(dtype)
    if layout == "column_major_a":
        a = a.t().contiguous().t()
    b = torch.randn(n, k, generator=gen).to(dtype).t() if layout == "weight" else torch.randn(k, n, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    out = torch.full((m, n), float("nan"), dtype=dtype)
    tileweave.matmul(a, b, bias=bias, out=out)
    assert _rel(out, a.double() @ b.double() + bias.double()) < TOL[dtype]


def test_persistent_programs_cover_every_tile_once():
    # Few programs, many tiles: every tile must be computed exactly once by the persistent loop.
    a = torch.randn(160, 64, dtype=torch.float32)
    b = torch.randn(64, 96, dtype=torch.float32)
    config = GemmConfig(block_m=32, block_n=32, block_k=32, group_m=3, num_stages=1, num_warps=4,
                        flatten=False, programs=3)
    out = torch.full((160, 96), float("nan"))
    tileweave.matmul(a, b, out=out, config=config)
    assert _rel(out, a.double() @ b.double()) < 1e-5


@pytest.mark.parametrize("m,n,k,block_n2", [(70, 100, 80, 16), (64, 96, 64, 32), (96, 144, 96, 16),
                                             (40, 200, 48, 32)])
@pytest.mark.parametrize("layout", ["kn", "weight"])
def test_two_part_tiles_match_reference(m, n, k, block_n2, layout):
    # Tiles of block_n + block_n2 columns: the last tile column cut at N, in either part.
    a = torch.randn(m, k, dtype=torch.float16)
    b = torch.randn(n, k, dtype=torch.float16).t() if layout == "weight" else torch.randn(k, n, dtype=torch.float16)
    bias = torch.randn(n, dtype=torch.float16)
    config = GemmConfig(block_m=32, block_n=32, block_n2=block_n2, block_k=32, group_m=2, num_stages=1,
                        num_warps=4, flatten=False, programs=3)
    out = torch.full((m, n), float("nan"), dtype=torch.float16)
    tileweave.matmul(a, b, bias=bias, out=out, config=config)
    assert _rel(out, a.double() @ b.double() + bias.double()) < TOL[torch.float16]


def test_two_part_tiles_are_refused_by_the_fused_kernel():
    from tileweave.ops.compute import gemm_launch

    a = torch.randn(32, 32)
    config = GemmConfig(block_m=32, block_n=32, block_n2=16, block_k=32, num_stages=1, num_warps=4, flatten=False)
    with pytest.raises(ValueError, match="plain GEMM"):
        gemm_launch.launch(a=a, b=a, c=a, bias=None, config=config, m_chunk=16, world=2, programs=2, gathered=a)


def test_linear_matches_functional_linear():
    x = torch.randn(2, 5, 48, dtype=torch.float32)
    w = torch.randn(24, 48, dtype=torch.float32)
    bias = torch.randn(24)
    ref = torch.nn.functional.linear(x.double(), w.double(), bias.double())
    assert _rel(tileweave.linear(x, w, bias), ref) < 1e-5


def test_empty_k_gives_bias_only():
    a, b, bias = torch.randn(4, 0), torch.randn(0, 3), torch.randn(3)
    assert torch.equal(tileweave.matmul(a, b, bias=bias), bias.expand(4, 3))


@pytest.mark.parametrize("bad, message", [
    (lambda: tileweave.matmul(torch.randn(4, 8), torch.randn(7, 3)), "K=8"),
    (lambda: tileweave.matmul(torch.randn(4, 8), torch.randn(8, 3, dtype=torch.float16)), "dtype"),
    (lambda: tileweave.matmul(torch.randn(4, 8, 2), torch.randn(8, 3)), "2-D"),
    (lambda: tileweave.matmul(torch.randn(4, 8).long(), torch.randn(8, 3).long()), "dtype"),
    (lambda: tileweave.matmul(torch.randn(4, 8), torch.randn(8, 3), bias=torch.randn(4)), "bias"),
    (lambda: tileweave.matmul(torch.randn(4, 8), torch.randn(8, 3), out=torch.empty(3, 4)), "out"),
])
def test_bad_inputs_are_named(bad, message):
    with pytest.raises((ValueError, TypeError), match=message):
        bad()


def test_strided_bias_and_output_views():
    a = torch.randn(20, 16)
    b = torch.randn(16, 12)
    bias = torch.randn(24)[::2]              # a non-contiguous view
    big = torch.full((20, 30), float("nan"))
    out = big[:, 4:16]                       # row pitch 30, unit column stride
    tileweave.matmul(a, b, bias=bias, out=out)
    assert _rel(out, a.double() @ b.double() + bias.double()) < 1e-5
    assert torch.isnan(big[:, :4]).all() and torch.isnan(big[:, 16:]).all(), "wrote outside out"


def test_cached_launch_plans_stay_correct_when_tensors_change():
    from tileweave.ops.compute import matmul as matmul_module

    matmul_module._plans.clear()
    w = torch.randn(24, 40, dtype=torch.float16)
    for i in range(3):  # same layout, new data: one plan, reused
        a = torch.randn(33, 40, dtype=torch.float16)
        assert _rel(tileweave.matmul(a, w.t()), a.double() @ w.double().t()) < 2e-3
    assert len(matmul_module._plans) == 1
    # A view that starts 2 bytes into its storage is not 16-byte aligned: a new plan, still correct.
    storage = torch.randn(33 * 40 + 1, dtype=torch.float16)
    a = storage[1:].view(33, 40)
    assert _rel(tileweave.matmul(a, w.t()), a.double() @ w.double().t()) < 2e-3
    assert len(matmul_module._plans) == 2
    # A strided bias is copied on the checked path, so it never takes a cached plan.
    bias = torch.randn(48, dtype=torch.float16)[::2]
    for _ in range(2):
        out = tileweave.matmul(a, w.t(), bias=bias)
        assert _rel(out, a.double() @ w.double().t() + bias.double()) < 2e-3
    assert len(matmul_module._plans) == 2


def _stream_k_config(programs):
    return GemmConfig(block_m=32, block_n=32, block_k=32, group_m=2, num_stages=1, num_warps=4,
                      flatten=False, programs=programs, stream_k=True)


@pytest.mark.parametrize("m,n,k,programs", [
    (70, 45, 200, 5),    # one full wave of whole tiles, then one tile shared by all five programs
    (129, 17, 640, 7),   # fewer tiles than programs: every tile shared, three or more programs a tile
    (33, 96, 130, 16),   # more programs than K steps of a tile
    (64, 64, 96, 3),     # a wave of whole tiles, then a tile of three K steps over three programs
    (40, 40, 300, 1),    # one program: every tile whole, nothing shared
])
@pytest.mark.parametrize("layout", ["kn", "weight"])
def test_stream_k_matches_reference_and_repeats_bitwise(m, n, k, programs, layout):
    from tileweave.ops.compute import gemm_launch as _launch

    a = torch.randn(m, k, dtype=torch.float32)
    b = torch.randn(n, k).t() if layout == "weight" else torch.randn(k, n)
    bias = torch.randn(n)
    config = _stream_k_config(programs)
    outs = []
    for _ in range(3):  # the arrival counts must be back at zero after each call
        out = torch.full((m, n), float("nan"))
        tileweave.matmul(a, b, bias=bias, out=out, config=config)
        outs.append(out)
    assert _rel(outs[0], a.double() @ b.double() + bias.double()) < 1e-5
    assert all(torch.equal(outs[0], o) for o in outs[1:]), "stream-K sums must not depend on the call"
    assert all(int(locks.count_nonzero()) == 0 for _, locks in _launch._stream_k_kept.values())


def test_stream_k_workspace_grows_for_a_larger_grid():
    from tileweave.ops.compute import gemm_launch as _launch

    _launch._stream_k_kept.clear()
    for m, n in [(40, 40), (160, 96), (40, 40)]:
        a, b = torch.randn(m, 128, dtype=torch.float16), torch.randn(128, n, dtype=torch.float16)
        out = tileweave.matmul(a, b, config=_stream_k_config(6))
        assert _rel(out, a.double() @ b.double()) < 2e-3
    (parts, locks), = _launch._stream_k_kept.values()
    assert locks.numel() >= 5 * 3 and parts.numel() >= 2 * 6 * 32 * 32
