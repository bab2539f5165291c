"""The grouped weight gradient in float8 and the cast of its operands, in Triton's interpreter (an e4m3
dot is exact there): the kernel for each scaling against float64 of the dequantized operands written
here; ``quantize_segments`` against torch's cast of the same groups (``support.fp8_reference``), bit for
bit. Two sources' groups of uneven sizes: empty ones, single rows, past 128 rows and off multiples of 16
and 128; K-major and row-major operands, gathered rows, e5m2 gradients, torch's flat rowwise scales, a
float8 input requantized; bad arguments refused by name."""

import pytest
import torch

from support.fp8_reference import FP8_MAX, quantize_along_rows32
from tileweave.ops.compute.grouped_wgrad import grouped_wgrad
from tileweave.ops.compute.quantize import quantize_segments
from tileweave.tune.grouped import WgradConfig

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
EXPERTS = 3
COUNTS = [130, 0, 5, 1, 0, 257]  # groups s * E + e of two sources: expert 1 has no rows, expert 2 one row from s = 0


def _offsets(counts):
    return torch.tensor([0] + torch.tensor(counts).cumsum(0).tolist(), dtype=torch.int32)


def _padded(counts):
    """The groups' rows padded to multiples of 16 (``grouped_wgrad``'s float8 layout): ``(offsets, the
    padded row of each plan row)``."""
    padded = [-(-c // 16) * 16 for c in counts]
    offsets = _offsets(padded)
    return offsets, torch.cat([offsets[g] + torch.arange(c) for g, c in enumerate(counts)]).long()


def _experts(counts):
    return torch.tensor([g % EXPERTS for g, c in enumerate(counts) for _ in range(c)], dtype=torch.long)


def _blocks(counts):
    """Per plan row, its row of a blockwise scale table: block j of group g is ``offsets[g] // 128 + g + j``
    of the padded offsets."""
    offsets, _ = _padded(counts)
    return torch.tensor([int(offsets[g]) // 128 + g + j // 128 for g, c in enumerate(counts) for j in range(c)])


def _operand(gen, counts, cols, dtype=E4M3, k_major=True):
    """``(operand [P16, cols], its plan rows [P, cols])``: float8 values spread over the format's range in the
    padded rows, zeros in the padding; K-major: stored ``[cols, P16]``."""
    offsets, at = _padded(counts)
    values = (torch.randn(len(at), cols, generator=gen) * 4).to(dtype)
    full = torch.zeros(int(offsets[-1]), cols, dtype=dtype)
    full[at] = values
    return (full.t().contiguous().t() if k_major else full), values


def _scales(gen, scaling, counts, cols):
    """A scale table of ``scaling`` for an operand of ``cols`` columns, and its value at each (plan row, column)."""
    rows = sum(-(-c // 16) * 16 for c in counts)
    experts = _experts(counts)
    if scaling == "tensorwise":
        table = torch.rand((), generator=gen) + 0.5
        return table, table.double().expand(len(experts), cols)
    if scaling == "expertwise":
        table = torch.rand(EXPERTS, generator=gen) + 0.5
        return table, table.double()[experts][:, None].expand(len(experts), cols)
    if scaling in ("rowwise", "rowwise-flat"):
        table = torch.rand(EXPERTS, cols, generator=gen) + 0.5
        return (table.flatten() if scaling == "rowwise-flat" else table), table.double()[experts]
    table = torch.rand(rows // 128 + len(counts), cols, generator=gen) + 0.5
    return table, table.double()[_blocks(counts)]


def _reference(lhs, rhs, lhs_at, rhs_at, counts):
    """float64 ``[E, N, K]``: the sum over each expert's plan rows of the dequantized ``lhs[p].T rhs[p]``."""
    out = torch.zeros(EXPERTS, lhs.shape[1], rhs.shape[1], dtype=torch.float64)
    left, right = lhs.double() * lhs_at, rhs.double() * rhs_at
    for p, e in enumerate(_experts(counts).tolist()):
        out[e] += torch.outer(left[p], right[p])
    return out


def _rel(got, ref):
    got = got.double()
    assert torch.isfinite(got).all(), "non-finite values in the output"
    return ((got - ref).norm() / ref.norm()).item()


# Output tiles of 16 x 32, 32 rows a step: several tiles along N and K, partial last ones.
SMALL_TILES = WgradConfig(block_n=16, block_k=32, block_r=32, num_stages=1, num_warps=4)
# (scaling, out dtype, fast accumulation, lhs format, K-major operands, config: None for the launcher's)
CASES = [("tensorwise", torch.float32, False, E5M2, True, None), ("expertwise", torch.float16, True, E4M3, True, None),
         ("rowwise", torch.float32, False, E4M3, True, SMALL_TILES),
         ("rowwise-flat", torch.bfloat16, False, E5M2, False, None),
         ("blockwise", torch.float32, False, E4M3, True, None), ("blockwise", torch.float16, False, E5M2, False, SMALL_TILES)]


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{str(c[1])[6:]}{'-fast' if c[2] else ''}" for c in CASES])
def test_fp8_grouped_wgrad_matches_float64_of_the_dequantized_operands(case):
    scaling, out_dtype, fast, lhs_dtype, k_major, config = case
    gen = torch.Generator().manual_seed(len(scaling) + int(fast))
    n, k = 24, 40
    (lhs, lv), (rhs, rv) = _operand(gen, COUNTS, n, lhs_dtype, k_major), _operand(gen, COUNTS, k, E4M3, k_major)
    (ls, l_at), (rs, r_at) = _scales(gen, scaling, COUNTS, n), _scales(gen, scaling, COUNTS, k)
    out = torch.full((EXPERTS, n, k), float("nan"), dtype=out_dtype)
    got = grouped_wgrad(lhs, rhs, _padded(COUNTS)[0], experts=EXPERTS, lhs_scale=ls, rhs_scale=rs, out=out,
                        out_dtype=out_dtype, use_fast_accum=fast, config=config)
    assert got is out
    assert _rel(out, _reference(lv, rv, l_at, r_at, COUNTS)) < TOL[out_dtype]
    assert torch.equal(out[1], torch.zeros(n, k, dtype=out_dtype)), "an expert without rows gets zeros"


def test_fp8_grouped_wgrad_gathers_rows_and_defaults_to_bfloat16():
    gen = torch.Generator().manual_seed(3)
    counts, n, k = [3, 140, 0, 9, 0, 2], 16, 24
    offsets, at = _padded(counts)
    src = torch.randint(0, 50, (int(offsets[-1]),), generator=gen)
    (lhs, lv), (rhs, _) = _operand(gen, counts, n), _operand(gen, [50], k, k_major=False)
    (ls, l_at), (rs, r_at) = _scales(gen, "blockwise", counts, n), _scales(gen, "blockwise", counts, k)
    out = grouped_wgrad(lhs, rhs, offsets, experts=EXPERTS, rhs_rows=src, lhs_scale=ls, rhs_scale=rs)
    assert out.dtype == torch.bfloat16
    assert _rel(out, _reference(lv, rhs[src[at]], l_at, r_at, counts)) < TOL[torch.bfloat16]


def test_fp8_grouped_wgrad_refusals(monkeypatch):
    gen = torch.Generator().manual_seed(4)
    offsets = _padded(COUNTS)[0]
    (lhs, _), (rhs, _) = _operand(gen, COUNTS, 8), _operand(gen, COUNTS, 16)
    rows, one = lhs.shape[0], torch.ones(())
    blocks = rows // 128 + len(COUNTS)
    cases = {
        "float8 operands need lhs_scale and rhs_scale": dict(lhs_scale=one),
        "lhs_scale and rhs_scale apply to float8 operands only": dict(lhs=lhs.float(), rhs=rhs.float(), lhs_scale=one,
                                                                       rhs_scale=one),
        "both must be float8": dict(rhs=rhs.float(), lhs_scale=one, rhs_scale=one),
        "rhs_scale must be a float32 tensor": dict(lhs_scale=one, rhs_scale=one.double()),
        rf"match no scaling of lhs \[P, N\] = \[{rows}, 8\]": dict(lhs_scale=torch.ones(EXPERTS, 8),
                                                                  rhs_scale=torch.ones(EXPERTS, 8)),
        rf"blockwise \[P // 128 \+ G, N\] = \[{blocks}, 8\]": dict(lhs_scale=torch.ones(blocks, 8), rhs_scale=one),
        "scale .* does not apply to float8": dict(lhs_scale=one, rhs_scale=one, scale=torch.ones(rows)),
        "out_dtype must be one of": dict(lhs_scale=one, rhs_scale=one, out_dtype=torch.float64),
        "WgradConfig.block_r to divide 128": dict(lhs_scale=torch.ones(blocks, 8), rhs_scale=torch.ones(blocks, 16),
                                                   config=WgradConfig(block_r=256)),
        "unit stride along one of its dimensions": dict(lhs=torch.zeros(rows, 16, dtype=E4M3)[:, ::2],
                                                        lhs_scale=one, rhs_scale=one),
    }
    for text, kwargs in cases.items():
        args = {"lhs": lhs, "rhs": rhs, **kwargs}
        with pytest.raises((ValueError, TypeError), match=text):
            grouped_wgrad(args.pop("lhs"), args.pop("rhs"), offsets, experts=EXPERTS, **args)
    monkeypatch.setenv("TILEWEAVE_DEBUG", "1")  # the offsets are read on the host: unpadded groups are refused
    with pytest.raises(ValueError, match="offsets must .* be multiples of 16 \\(float8\\)"):
        grouped_wgrad(lhs, rhs, _offsets(COUNTS), experts=EXPERTS, lhs_scale=one, rhs_scale=one)


# -- quantize_segments --------------------------------------------------------------------------------

def _pieces(counts, granularity):
    """The rows that share scales: all of them, each expert's, or each group's."""
    starts = _offsets(counts)
    return {"tensorwise": [torch.arange(sum(counts))],
            "rowwise": [torch.nonzero(_experts(counts) == e)[:, 0] for e in range(EXPERTS)],
            "blockwise_1x128": [torch.arange(int(starts[g]), int(starts[g + 1])) for g in range(len(counts))]
            }[granularity]


# granularity: (float8 format, powers of two, input): a float32 input gathered by index, a float8 input with
# scales per 128 columns gathered by index (as the gathered float8 x is), a float32 input in plan order.
SEGMENT_CASES = {"tensorwise": (E5M2, False, "gathered"), "rowwise": (E4M3, True, "float8 gathered"),
                 "blockwise_1x128": (E4M3, False, "plan order")}


@pytest.mark.parametrize("granularity", list(SEGMENT_CASES))
def test_quantize_segments_equals_torchs_cast_of_each_group(granularity):
    dtype, pow2, source = SEGMENT_CASES[granularity]
    gen = torch.Generator().manual_seed(5)
    cols, plan_rows = 256, sum(COUNTS)
    offsets, at = _padded(COUNTS)
    tokens = torch.randn(60, cols, generator=gen) * torch.rand(60, 1, generator=gen) * 50
    rows = torch.randint(0, 60, (plan_rows,), generator=gen)
    if source == "float8 gathered":
        x8, x_scale = (tokens / 4).to(E4M3), torch.rand(60, cols // 128, generator=gen) + 0.5
        values = (x8.float() * x_scale.repeat_interleave(128, 1))[rows]
        seg = quantize_segments(x8, _offsets(COUNTS), EXPERTS, granularity, rows=rows, dtype=dtype, power_of_two=pow2,
                                x_scale=x_scale)
    else:
        x = tokens[rows] if source == "plan order" else tokens
        values = tokens[rows]
        seg = quantize_segments(x, _offsets(COUNTS), EXPERTS, granularity, rows=None if source == "plan order" else rows,
                                dtype=dtype, power_of_two=pow2)
    kind = {"tensorwise": "tensor", "rowwise": "row", "blockwise_1x128": "1x128"}[granularity]
    q, scale_at = quantize_along_rows32(values, _pieces(COUNTS, granularity), kind, dtype, pow2)
    assert torch.equal(seg.offsets, offsets)
    data = seg.data[:, :int(offsets[-1])].t()
    assert torch.equal(data[at].view(torch.uint8), q.view(torch.uint8)), "the float8 values"
    padding = torch.ones(data.shape[0], dtype=torch.bool)
    padding[at] = False
    assert not data[padding].float().any(), "the padding rows are zeros"
    table = {"tensorwise": lambda: seg.scale.expand(plan_rows, cols),
             "rowwise": lambda: seg.scale[_experts(COUNTS)],
             "blockwise_1x128": lambda: seg.scale[_blocks(COUNTS)]}[granularity]()
    assert torch.equal(table, scale_at), "the scales"
    if granularity == "rowwise":  # expert 1 has no rows: the scale of zeros, rounded up to a power of two
        empty = torch.tensor(1e-12, dtype=torch.float32) / FP8_MAX[dtype]
        assert torch.equal(seg.scale[1], torch.exp2(torch.ceil(torch.log2(empty.double()))).float().expand(cols))


def test_quantize_segments_refusals():
    offsets, x = _offsets(COUNTS), torch.randn(sum(COUNTS), 8)
    cases = {
        "granularity must be one of tensorwise, rowwise, blockwise_1x128": dict(granularity="blockwise_128x128"),
        "a given scale applies to tensorwise": dict(granularity="rowwise", scale=torch.ones(())),
        "scale must have one element": dict(scale=torch.ones(2)),
        "pass its scales as x_scale": dict(x=x.to(E4M3)),
        "x_scale applies to a float8 x only": dict(x_scale=torch.ones(())),
        "dtype must be torch.float8_e4m3fn or torch.float8_e5m2": dict(dtype=torch.float16),
        r"offsets must have S\*E \+ 1 entries for E = 4": dict(experts=4),
        "offsets must be a 1-D int32 tensor": dict(offsets=offsets.long()),
        "rows must be a 1-D int32/int64 tensor": dict(rows=torch.zeros(3, 2, dtype=torch.int32)),
        r"x_scale must have one element, \[R, 1\]": dict(x=x.to(E4M3), x_scale=torch.ones(5, 1)),
    }
    for text, kwargs in cases.items():
        args = {"x": x, "offsets": offsets, "experts": EXPERTS, "granularity": "tensorwise", **kwargs}
        with pytest.raises((ValueError, TypeError), match=text):
            quantize_segments(args.pop("x"), args.pop("offsets"), args.pop("experts"), args.pop("granularity"), **args)
