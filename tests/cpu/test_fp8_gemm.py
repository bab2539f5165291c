"""The FP8 GEMM core (``matmul``/``linear``) and FP8 grouped GEMM core in Triton's interpreter, against
float64 of the dequantized float8 inputs, written here: ``(a * scale_a) @ (b * scale_b)`` with the
scales expanded to every element (tensorwise, rowwise, blockwise 1 x 128 / 128 x 128)."""

import dataclasses
import zlib

import pytest
import torch

import tileweave
from tileweave.ops.compute.grouped_gemm import SwiGLU, grouped_gemm
from tileweave.tune.configs import INTERPRETER_CONFIG
from tileweave.tune.grouped import INTERPRETER_CONFIG as GROUPED_INTERPRETER_CONFIG

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def _gen(*parts) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(",".join(map(str, parts)).encode()))


def _fp8(gen, *shape, dtype=E4M3) -> torch.Tensor:
    # Values spread over the format's range (a recipe scales into it), never all zero.
    return (torch.randn(*shape, generator=gen) * 8).to(dtype)


def _positive(gen, *shape) -> torch.Tensor:
    return torch.rand(*shape, generator=gen) * 1.5 + 0.25


def _scales(gen, scaling, m, n, k, experts=0):
    """``(scale_a, scale_b)`` of ``a [m, k]`` and ``b [k, n]`` (``[experts, k, n]`` when given)."""
    lead = (experts,) if experts else ()
    if scaling == "tensorwise":
        return _positive(gen, ()), _positive(gen, *lead) if experts else _positive(gen, 1)
    if scaling == "rowwise":
        return _positive(gen, m, 1), _positive(gen, *lead, 1, n)
    return _positive(gen, m, k // 128), _positive(gen, *lead, k // 128, -(-n // 128))


def _expand_a(scale_a, m, k):
    """float64 ``[m, k]``: the scale of each element of ``a``."""
    s = scale_a.double()
    if s.numel() == 1:
        return s.reshape(1, 1).expand(m, k)
    if s.dim() == 1 or s.shape[1] == 1:
        return s.reshape(m, 1).expand(m, k)
    return s.repeat_interleave(128, dim=1)[:, :k]


def _expand_b(scale_b, k, n):
    """float64 ``[k, n]``: the scale of each element of one ``b [k, n]`` (one expert's)."""
    s = scale_b.double()
    if s.numel() == 1:
        return s.reshape(1, 1).expand(k, n)
    if s.dim() == 1 or s.shape[0] == 1 and s.shape[1] == n:
        return s.reshape(1, n).expand(k, n)
    return s.repeat_interleave(128, dim=0).repeat_interleave(128, dim=1)[:k, :n]


def _dense_ref(a, b, scale_a, scale_b, bias=None):
    m, k = a.shape
    n = b.shape[1]
    out = (a.double() * _expand_a(scale_a, m, k)) @ (b.double() * _expand_b(scale_b, k, n))
    return out if bias is None else out + bias.double()


def _rel(got, ref):
    assert torch.isfinite(got).all(), "NaN or inf in the output"
    return ((got.double() - ref).norm() / ref.norm()).item()


# -- matmul ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("scaling,m,n,k,out_dtype,layout", [
    ("tensorwise", 70, 45, 96, torch.float32, "weight"),
    ("tensorwise", 33, 40, 64, torch.bfloat16, "kn"),
    ("rowwise", 70, 45, 96, torch.float32, "kn"),
    ("rowwise", 1, 40, 48, torch.float16, "weight"),
    ("blockwise", 70, 150, 256, torch.float32, "weight"),   # N off the 128-column scale blocks
    ("blockwise", 33, 40, 128, torch.bfloat16, "kn"),
])
def test_matmul_fp8_matches_dequantized_reference(scaling, m, n, k, out_dtype, layout):
    gen = _gen(scaling, m, n, k, out_dtype, layout)
    a = _fp8(gen, m, k)
    b = _fp8(gen, n, k).t() if layout == "weight" else _fp8(gen, k, n)
    scale_a, scale_b = _scales(gen, scaling, m, n, k)
    bias = torch.randn(n, generator=gen).to(out_dtype)
    out = torch.full((m, n), float("nan"), dtype=out_dtype)
    got = tileweave.matmul(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype, bias=bias, out=out)
    assert got is out
    assert _rel(out, _dense_ref(a, b, scale_a, scale_b, bias)) < TOL[out_dtype]


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise", "blockwise"])
def test_fp8_use_fast_accum_matches_the_reference_in_matmul_and_grouped_gemm(scaling):
    # The interpreter's FP8 dot is exact in both modes; on a GPU the fast mode keeps fewer bits over a
    # long K (tests/gpu/test_fp8_gpu.py). Fast first, then the default on the same shapes: the two
    # must not share a cached launch.
    m, n, k, experts, counts = 37, 150, 256, 2, [20, 0, 17]
    gen = _gen("fast", scaling)
    a, w = _fp8(gen, m, k), _fp8(gen, n, k)
    scale_a, scale_b = _scales(gen, scaling, m, n, k)
    for fast in (True, False):
        out = tileweave.matmul(a, w.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=torch.float32,
                               use_fast_accum=fast)
        assert _rel(out, _dense_ref(a, w.t(), scale_a, scale_b)) < TOL[torch.float32]
    b = _fp8(gen, experts, n, k).transpose(1, 2)
    gscale_a, gscale_b = _scales(gen, scaling, m, n, k, experts=experts)
    for fast in (True, False):
        out = grouped_gemm(a, b, _offsets(counts), experts=experts, scale_a=gscale_a, scale_b=gscale_b,
                           out_dtype=torch.float32, use_fast_accum=fast)
        assert _rel(out, _grouped_ref(a, b, counts, gscale_a, gscale_b, None)) < TOL[torch.float32]


def test_matmul_fp8_default_output_is_bfloat16_and_e5m2_operands_work():
    gen = _gen("e5m2")
    a, b = _fp8(gen, 40, 64, dtype=E5M2), _fp8(gen, 24, 64).t()
    scale_a, scale_b = _scales(gen, "rowwise", 40, 24, 64)
    out = tileweave.matmul(a, b, scale_a=scale_a, scale_b=scale_b)
    assert out.dtype == torch.bfloat16 and out.shape == (40, 24)
    assert _rel(out, _dense_ref(a, b, scale_a, scale_b)) < TOL[torch.bfloat16]
    both = tileweave.matmul(a, _fp8(gen, 64, 24, dtype=E5M2), scale_a=scale_a, scale_b=scale_b,
                            out_dtype=torch.float32)
    assert torch.isfinite(both).all()


@pytest.mark.parametrize("scaling", ["tensorwise", "blockwise"])
def test_matmul_fp8_scales_once_under_stream_k_and_per_step_in_every_share(scaling):
    # 3 programs over 6 tiles of 8 K steps: a tail of tiles shared by K steps, summed by the last sharer.
    config = dataclasses.replace(INTERPRETER_CONFIG, programs=4, stream_k=True)
    gen = _gen("stream-k", scaling)
    a, b = _fp8(gen, 64, 256), _fp8(gen, 80, 256).t()
    scale_a, scale_b = _scales(gen, scaling, 64, 80, 256)
    out = tileweave.matmul(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=torch.float32, config=config)
    assert _rel(out, _dense_ref(a, b, scale_a, scale_b)) < TOL[torch.float32]


def test_matmul_fp8_two_part_tiles_scale_both_parts():
    config = dataclasses.replace(INTERPRETER_CONFIG, block_n2=16, programs=3)
    gen = _gen("bn2")
    a, b = _fp8(gen, 40, 64), _fp8(gen, 100, 64).t()
    scale_a, scale_b = _scales(gen, "rowwise", 40, 100, 64)
    out = tileweave.matmul(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=torch.float32, config=config)
    assert _rel(out, _dense_ref(a, b, scale_a, scale_b)) < TOL[torch.float32]


def test_matmul_fp8_repeat_call_reads_the_new_scales():
    # The second call replays the first call's launch plan: it must take this call's scales and data.
    gen = _gen("repeat")
    for _ in range(2):
        a, b = _fp8(gen, 24, 128), _fp8(gen, 40, 128).t()
        scale_a, scale_b = _scales(gen, "blockwise", 24, 40, 128)
        out = tileweave.matmul(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=torch.float32)
        assert _rel(out, _dense_ref(a, b, scale_a, scale_b)) < TOL[torch.float32]


def test_matmul_fp8_takes_torch_blockwise_scale_strides():
    # torch wants the weight's block scales as the transpose of a contiguous [N/128, K/128].
    gen = _gen("strides")
    a, w = _fp8(gen, 20, 256), _fp8(gen, 130, 256)
    scale_a = _positive(gen, 256 // 128, 20).t()          # [M, K/128], M-major like torch's
    scale_b = _positive(gen, 2, 256 // 128).t()           # [K/128, N/128] with strides (1, K/128)
    out = tileweave.matmul(a, w.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=torch.float32)
    assert _rel(out, _dense_ref(a, w.t(), scale_a, scale_b)) < TOL[torch.float32]


def test_linear_fp8_matches_reference():
    gen = _gen("linear")
    x, w = _fp8(gen, 2, 5, 128), _fp8(gen, 24, 128)
    scale_a, scale_b = _scales(gen, "rowwise", 10, 24, 128)
    bias = torch.randn(24, generator=gen)
    y = tileweave.linear(x, w, bias, scale_a=scale_a, scale_b=scale_b, out_dtype=torch.float32)
    assert y.shape == (2, 5, 24)
    assert _rel(y.reshape(10, 24), _dense_ref(x.reshape(10, 128), w.t(), scale_a, scale_b, bias)) < 1e-5


def _refused(match, **kwargs):
    gen = _gen("refused")
    args = dict(a=_fp8(gen, 8, 256), b=_fp8(gen, 16, 256).t(), scale_a=torch.ones(8, 1), scale_b=torch.ones(1, 16))
    args.update(kwargs)
    a, b = args.pop("a"), args.pop("b")
    with pytest.raises((TypeError, ValueError), match=match):
        tileweave.matmul(a, b, **args)


def test_matmul_fp8_refuses_bad_inputs_by_name():
    _refused("scale_b missing", scale_b=None)
    _refused("scale_a and scale_b apply to float8", a=torch.randn(8, 256), b=torch.randn(256, 16))
    _refused("both must be float8", b=torch.randn(256, 16, dtype=torch.float16))
    _refused("scale_a must be a float32", scale_a=torch.ones(8, 1, dtype=torch.float16))
    _refused("scale_b must be a float32 tensor on cpu", scale_b=torch.ones(1, 16, device="meta"))
    _refused(r"match no scaling.*rowwise \[M, 1\] = \[8, 1\]", scale_a=torch.ones(7, 1))
    _refused(r"blockwise scales for K = 256 must be scale_a \[M, K/128\] = \[8, 2\]",
             scale_a=torch.ones(8, 3), scale_b=torch.ones(2, 1))
    _refused("K to be a multiple of 128, got K = 200", a=_fp8(_gen(0), 8, 200), b=_fp8(_gen(1), 200, 16),
             scale_a=torch.ones(8, 2), scale_b=torch.ones(2, 1))
    _refused("out_dtype must be one of", out_dtype=torch.float8_e4m3fn)
    _refused("out_dtype=torch.float32 applies to float8", a=torch.randn(8, 256, dtype=torch.float16),
             b=torch.randn(256, 16, dtype=torch.float16), scale_a=None, scale_b=None, out_dtype=torch.float32)


# -- grouped_gemm ----------------------------------------------------------------------------------

def _offsets(counts):
    return torch.tensor([0] + counts, dtype=torch.int32).cumsum(0).to(torch.int32)


def _grouped_ref(a, b, counts, scale_a, scale_b, a_rows=None, experts=None):
    """float64 ``[P, N]``: row p of group g is ``(a * sa)[a_rows[p]] @ (b[e] * sb[e])``, ``e = g % E``."""
    experts = experts or b.shape[0]
    ma, k = a.shape
    n = b.shape[2]
    a64 = a.double() * _expand_a(scale_a, ma, k)
    src = a_rows.long() if a_rows is not None else torch.arange(sum(counts))
    out = torch.empty(sum(counts), n, dtype=torch.float64)
    start = 0
    for g, count in enumerate(counts):
        e = g % experts
        sb = scale_b[e] if scale_b.dim() > 1 or scale_b.numel() > 1 else scale_b
        out[start:start + count] = a64[src[start:start + count]] @ (b[e].double() * _expand_b(sb, k, n))
        start += count
    return out


@pytest.mark.parametrize("scaling,k,out_dtype,gather", [
    ("tensorwise", 96, torch.float32, True),
    ("rowwise", 96, torch.bfloat16, True),
    ("rowwise", 64, torch.float32, False),
    ("blockwise", 256, torch.float32, True),
    ("blockwise", 128, torch.float16, False),
])
def test_grouped_gemm_fp8_matches_dequantized_reference(scaling, k, out_dtype, gather):
    # Uneven and empty experts, G = 2 * E groups (expert g % E), rows and N off the tiles.
    counts, experts, n, ma = [9, 0, 31, 12, 0, 3], 3, 150 if scaling == "blockwise" else 40, 30
    gen = _gen(scaling, k, out_dtype, gather)
    rows = sum(counts)
    a = _fp8(gen, ma if gather else rows, k)
    a_rows = torch.randint(0, ma, (rows,), generator=gen) if gather else None
    b = _fp8(gen, experts, n, k).transpose(1, 2)
    scale_a, scale_b = _scales(gen, scaling, a.shape[0], n, k, experts=experts)
    out = torch.full((rows, n), float("nan"), dtype=out_dtype)
    grouped_gemm(a, b, _offsets(counts), a_rows=a_rows, experts=experts, scale_a=scale_a, scale_b=scale_b,
                 out_dtype=out_dtype, out=out)
    assert _rel(out, _grouped_ref(a, b, counts, scale_a, scale_b, a_rows)) < TOL[out_dtype]


def test_grouped_gemm_fp8_takes_torch_rowwise_shapes_and_a_row_scale():
    # torch._scaled_grouped_mm's rowwise scales: scale_a [Ma], scale_b [E, N]; row_scale after them.
    counts, experts, k, n = [5, 0, 20], 3, 64, 24
    gen = _gen("torch-shapes")
    a, b = _fp8(gen, 25, k), _fp8(gen, experts, k, n)
    scale_a, scale_b = _positive(gen, 25), _positive(gen, experts, n)
    row_scale = torch.rand(25, generator=gen)
    out = grouped_gemm(a, b, _offsets(counts), scale_a=scale_a, scale_b=scale_b, row_scale=row_scale)
    assert out.dtype == torch.bfloat16
    ref = _grouped_ref(a, b, counts, scale_a, scale_b.unsqueeze(1)) * row_scale.double()[:, None]
    assert _rel(out, ref) < TOL[torch.bfloat16]


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # silu of a large negative gate: exactly 0
@pytest.mark.parametrize("scaling", ["rowwise", "blockwise"])
def test_grouped_gemm_fp8_swiglu_scales_gate_and_up_before_the_activation(scaling):
    counts, experts, k, f = [7, 0, 14], 2, 128, 136   # b holds 2F = 272 columns: gate | up
    gen = _gen("swiglu", scaling)
    a = _fp8(gen, 12, k)
    a_rows = torch.randint(0, 12, (21,), generator=gen)
    b = _fp8(gen, experts, 2 * f, k).transpose(1, 2)
    scale_a, scale_b = _scales(gen, scaling, 12, 2 * f, k, experts=experts)
    pre = torch.full((21, 2 * f), float("nan"), dtype=torch.float32)
    out = grouped_gemm(a, b, _offsets(counts), a_rows=a_rows, experts=experts, scale_a=scale_a, scale_b=scale_b,
                       out_dtype=torch.float32, epilogue=SwiGLU(pre=pre))
    ref = _grouped_ref(a, b, counts, scale_a, scale_b, a_rows)
    gate, up = ref[:, :f], ref[:, f:]
    assert _rel(out, torch.nn.functional.silu(gate) * up) < 1e-5
    assert _rel(pre, torch.stack([gate, up], dim=2).reshape(21, 2 * f)) < 1e-5


def test_grouped_gemm_fp8_refuses_bad_scales_by_name():
    gen = _gen("grouped-refused")
    a, b, offsets = _fp8(gen, 10, 256), _fp8(gen, 2, 256, 16), _offsets([4, 6])
    cases = [
        (dict(scale_a=torch.ones(()), scale_b=None), "scale_b missing"),
        (dict(scale_a=torch.ones(()), scale_b=torch.ones(3)), r"tensorwise takes one element and \[E\] = \[2\]"),
        (dict(scale_a=torch.ones(10, 1), scale_b=torch.ones(2, 1, 15)), r"rowwise \[Ma, 1\] = \[10, 1\] and "
                                                                       r"\[E, 1, N\] = \[2, 1, 16\]"),
        (dict(scale_a=torch.ones(10, 2), scale_b=torch.ones(2, 2, 1, dtype=torch.float64)), "float32"),
        (dict(scale_a=torch.ones(10, 2), scale_b=torch.ones(2, 2, 1), out_dtype=torch.int32), "out_dtype"),
    ]
    for kwargs, match in cases:
        with pytest.raises((TypeError, ValueError), match=match):
            grouped_gemm(a, b, offsets, **kwargs)
    with pytest.raises(ValueError, match="K to be a multiple of 128, got K = 160"):
        grouped_gemm(_fp8(gen, 10, 160), _fp8(gen, 2, 160, 16), offsets, scale_a=torch.ones(10, 2),
                     scale_b=torch.ones(2, 2, 1))
    with pytest.raises(TypeError, match="both must be float8"):
        grouped_gemm(a, b.to(torch.float16), offsets, scale_a=torch.ones(()), scale_b=torch.ones(2))
    with pytest.raises(ValueError, match="block_k to divide 128"):
        grouped_gemm(a, b, offsets, scale_a=torch.ones(10, 2), scale_b=torch.ones(2, 2, 1),
                     config=dataclasses.replace(GROUPED_INTERPRETER_CONFIG, block_k=256))


# -- the benchmark's FP8 rows ----------------------------------------------------------------------

@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise", "blockwise", "rowwise-fast"])
def test_gemm_section_fp8_variants_verify(scaling):
    # The gemm section's FP8 rows on CPU tensors: ours must pass the check every row gets before timing;
    # torch's scaled matmul where this torch runs it on the CPU.
    from tileweave.bench import variants as V

    gen = _gen("bench", scaling)
    a = [torch.randn(48, 256, generator=gen).to(torch.bfloat16) for _ in range(2)]
    w = [(torch.randn(128, 256, generator=gen) / 16).to(torch.bfloat16) for _ in range(2)]
    theirs, ours = V.gemm_fp8_variants(a, w, scaling)
    assert (theirs.name, ours.name) == ("torch", "ours")
    out = ours.call(1)
    assert out.dtype == torch.bfloat16 and out.shape == (48, 128)
    assert ours.check(ours.call(0)) < V.TOLERANCE
    if theirs.call is not None:
        try:
            result = theirs.call(0)
        except (RuntimeError, NotImplementedError, ValueError):
            assert scaling == "blockwise", "torch._scaled_mm runs on the CPU"  # CPU torch has no blockwise
        else:
            assert theirs.check(result) < V.TOLERANCE


def test_grouped_benchmark_fp8_smoke(tmp_path):
    """``python -m tileweave.bench.grouped --smoke --dtype fp8``: every FP8 row's output checked, named by
    its scaling, beside the bf16-path row of the same shape and routing."""
    import json

    from tileweave.bench import grouped as bench

    assert bench.main(["--smoke", "--dtype", "fp8", "--scaling", "rowwise,blockwise,rowwise-fast",
                       "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "grouped.json").read_text())["rows"]
    assert {r["dtype"] for r in rows} == {"float32", "fp8-rowwise", "fp8-blockwise", "fp8-rowwise-fast"}
    for r in rows:
        assert r["results"]["ours"]["rel_err"] < 1e-5, r
    per_shape = {}
    for r in rows:
        per_shape.setdefault((r["routing"], r["layer"]), set()).add((r["dtype"], r["max_rows_per_expert"]))
    assert all(len({m for _, m in found}) == 1 and len(found) == 4 for found in per_shape.values())


def test_gemm_report_compares_fp8_rows_with_torch_per_scaling():
    from tileweave.bench.report import Measurement, markdown, summarize

    def row(variant, ms, dtype):
        return Measurement(op="gemm", layer="l", world_size=1, m=4096, k=4096, n=6144, variant=variant,
                           status="ok", ms=ms, dtype=dtype)

    rows = [row("cublas", 0.30, "bf16"), row("ours", 0.31, "bf16"),
            row("torch", 0.20, "fp8-rowwise"), row("ours", 0.16, "fp8-rowwise")]
    bf16, fp8 = summarize(rows)
    assert (bf16.dtype, fp8.dtype) == ("bf16", "fp8-rowwise")
    assert fp8.x_cublas == pytest.approx(0.20 / 0.16)
    text = markdown("gemm", rows, {})
    assert "| l | fp8-rowwise | 4096 |" in text and "(fp8-rowwise)" in text


def test_bench_cli_takes_fp8_for_the_gemm_ag_rs_and_block_sections():
    from tileweave.bench.cli import parse_args

    opts = parse_args(["--op", "gemm", "--dtype", "fp8", "--scaling", "rowwise,blockwise"])
    assert opts.bench.dtype == "fp8" and opts.bench.scalings == ("rowwise", "blockwise")
    opts = parse_args(["--op", "ag,rs", "--dtype", "fp8", "--scaling", "tensorwise-fast"])
    assert opts.bench.ops == ("ag", "rs") and opts.bench.scalings == ("tensorwise-fast",)
    assert parse_args(["--op", "block", "--dtype", "fp8"]).bench.scalings == ("tensorwise", "rowwise", "blockwise")
    for argv in (["--op", "gemm", "--scaling", "rowwise"], ["--op", "gemm", "--dtype", "fp8", "--scaling", "columnwise"]):
        with pytest.raises(SystemExit):
            parse_args(argv)
