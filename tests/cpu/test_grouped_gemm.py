"""The grouped GEMM core in Triton's interpreter against a float64 reference written here."""

import json
import threading
import time

import pytest
import torch

from tileweave.bench import grouped as bench
from tileweave.ops.compute import grouped_gemm as gg_module
from tileweave.ops.compute.grouped_gemm import expected_tiles, grouped_config, grouped_gemm
from tileweave.tune.grouped import GroupedConfig, choose_grouped_config

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def _offsets(counts):
    ends = [0]
    for c in counts:
        ends.append(ends[-1] + c)
    return torch.tensor(ends, dtype=torch.int32)


def _reference(a, b, counts, a_rows=None, row_scale=None, experts=None, groups=None):
    """float64 ``[P, N]``: row p of group g is ``a[a_rows[p]] @ b[g % E] * row_scale[p]``; rows of the
    groups not in ``groups`` are NaN."""
    experts = experts or b.shape[0]
    rows = sum(counts)
    a64, b64 = a.double(), b.double()
    out = torch.full((rows, b.shape[2]), float("nan"), dtype=torch.float64)
    start = 0
    for g, count in enumerate(counts):
        if groups is None or g in groups:
            for p in range(start, start + count):
                src = int(a_rows[p]) if a_rows is not None else p
                row = a64[src] @ b64[g % experts]
                out[p] = row * (float(row_scale[p]) if row_scale is not None else 1.0)
        start += count
    return out


def _rel(out, ref):
    assert not torch.isnan(out).any(), "NaN in the output"
    return ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _weights(gen, experts, k, n, dtype, nk):
    """b [E, K, N]: the transpose view of a stacked nn.Linear weight [E, N, K] (nk) or row-major."""
    if nk:
        return torch.randn(experts, n, k, generator=gen).to(dtype).transpose(1, 2)
    return torch.randn(experts, k, n, generator=gen).to(dtype)


CASES = [
    # (counts, experts of b, K, N, gather, scale, nk)
    ([5, 0, 37], 3, 40, 50, True, True, True),      # odd K and N, an empty expert, rows not a tile multiple
    ([23], 1, 33, 17, False, False, False),         # E = 1
    ([0, 0, 70, 0], 4, 32, 64, True, False, False),  # every row in one group
    ([9, 31, 0, 12, 40, 1], 3, 24, 40, True, True, True),  # G = 2 * E groups, expert g % E
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_matches_reference(case, dtype):
    counts, experts, k, n, gather, scale, nk = CASES[case]
    gen = torch.Generator().manual_seed(100 + case)
    rows = sum(counts)
    a = torch.randn(max(rows, 1) + 3, k, generator=gen).to(dtype)
    a_rows = torch.randint(0, a.shape[0], (rows,), generator=gen, dtype=torch.int32) if gather else None
    if not gather:
        a = a[:rows]
    b = _weights(gen, experts, k, n, dtype, nk)
    row_scale = torch.rand(rows, generator=gen) + 0.5 if scale else None
    out = grouped_gemm(a, b, _offsets(counts), a_rows=a_rows, row_scale=row_scale, experts=experts)
    assert out.shape == (rows, n) and out.dtype == dtype
    ref = _reference(a, b, counts, a_rows, row_scale, experts)
    assert _rel(out, ref) < TOL[dtype]


def test_out_group_range_and_repeats():
    """``out`` with a row pitch, NaN-poisoned: group_range writes exactly its groups' rows; repeated
    calls with fresh inputs (int64 row indices, a with a row pitch) stay right."""
    counts = [7, 0, 19, 4, 11]
    experts, k, n = 5, 20, 24
    offsets = _offsets(counts)
    for call in range(2):
        gen = torch.Generator().manual_seed(200 + call)
        a = torch.randn(30, k + 8, generator=gen)[:, :k]
        a_rows = torch.randint(0, 30, (sum(counts),), generator=gen, dtype=torch.int64)
        b = _weights(gen, experts, k, n, torch.float32, nk=bool(call))
        wide = torch.full((sum(counts), n + 5), float("nan"))
        out = wide[:, :n]
        grouped_gemm(a, b, offsets, a_rows=a_rows, out=out, group_range=(1, 4))
        ref = _reference(a, b, counts, a_rows, groups={1, 2, 3})
        computed = slice(counts[0], sum(counts[:4]))
        assert torch.isnan(out[:counts[0]]).all() and torch.isnan(out[sum(counts[:4]):]).all()
        assert torch.isnan(wide[:, n:]).all()
        assert _rel(out[computed], ref[computed]) < TOL[torch.float32]


def test_walking_the_groups(monkeypatch):
    """Above G_BLOCK_MAX groups each program walks the offsets in memory: same results."""
    monkeypatch.setattr(gg_module, "G_BLOCK_MAX", 2)
    counts = [3, 0, 40, 0, 0, 9, 17]
    gen = torch.Generator().manual_seed(300)
    a = torch.randn(50, 24, generator=gen, dtype=torch.float32)
    a_rows = torch.randint(0, 50, (sum(counts),), generator=gen, dtype=torch.int32)
    b = _weights(gen, 7, 24, 36, torch.float32, nk=True)
    out = grouped_gemm(a, b, _offsets(counts), a_rows=a_rows)
    assert _rel(out, _reference(a, b, counts, a_rows)) < TOL[torch.float32]


def test_bfloat16_is_computed_correctly():
    counts = [10, 0, 21]
    gen = torch.Generator().manual_seed(400)
    a = torch.randn(31, 40, generator=gen).to(torch.bfloat16)
    b = _weights(gen, 3, 40, 24, torch.bfloat16, nk=True)
    out = grouped_gemm(a, b, _offsets(counts))
    assert out.dtype == torch.bfloat16
    assert _rel(out, _reference(a, b, counts)) < TOL[torch.bfloat16]


def test_empty_and_degenerate():
    a = torch.randn(4, 8)
    b = torch.randn(2, 8, 16)
    assert grouped_gemm(a[:0], b, _offsets([0, 0])).shape == (0, 16)
    out = torch.full((4, 16), float("nan"))
    grouped_gemm(a, b, _offsets([4, 0]), out=out, group_range=(1, 1))
    assert torch.isnan(out).all()


@pytest.mark.parametrize("bad, match", [
    (dict(offsets=torch.tensor([0, 4], dtype=torch.int64)), "offsets must be a 1-D int32"),
    (dict(b=torch.randn(2, 9, 16)), "K=8"),
    (dict(b=torch.randn(2, 8, 16, dtype=torch.float64)), "dtype"),
    (dict(experts=3), "experts must be an int from 1 to b.shape"),
    (dict(row_scale=torch.ones(3)), "row_scale must be a float32 tensor of shape \\(4,\\)"),
    (dict(a_rows=torch.zeros(4, dtype=torch.float32)), "a_rows must be a 1-D int32/int64"),
    (dict(out=torch.empty(4, 15)), "out must be"),
    (dict(group_range=(0, 3)), "group_range must satisfy"),
    (dict(config=dict(block_m=64)), "config must be a GroupedConfig"),
    (dict(gate=(torch.zeros(1, dtype=torch.int32), 1, 0, torch.zeros(1, dtype=torch.int32), 0)), "max_spin"),
    (dict(signal=(torch.zeros(1, dtype=torch.int64),)), "signal counters"),
])
def test_bad_arguments_are_named(bad, match):
    args = dict(a=torch.randn(4, 8), b=torch.randn(2, 8, 16), offsets=_offsets([4, 0]))
    args.update(bad)
    with pytest.raises((ValueError, TypeError), match=match):
        grouped_gemm(args.pop("a"), args.pop("b"), args.pop("offsets"), **args)


def test_config_rule():
    assert GroupedConfig().block_m == 128
    with pytest.raises(ValueError, match="block_n"):
        GroupedConfig(block_n=96)
    # The module docstring's worked examples.
    mixtral = choose_grouped_config(16384, 7168, 4096, 8, torch.bfloat16, num_sms=132)
    assert (mixtral.block_m, mixtral.block_n, mixtral.block_k, mixtral.num_stages, mixtral.flatten) == \
        (128, 256, 64, 3, True)
    qwen = choose_grouped_config(32768, 384, 2048, 128, torch.bfloat16, num_sms=132)
    assert (qwen.block_m, qwen.block_n, qwen.block_k, qwen.num_stages, qwen.num_warps, qwen.flatten) == \
        (128, 128, 64, 4, 8, False)
    # Few rows per group: 64-row tiles; 704 columns: 3 x 256 waste no more than 6 x 128.
    sparse = choose_grouped_config(64 * 100, 704, 2048, 100, torch.bfloat16, num_sms=132)
    assert (sparse.block_m, sparse.block_n) == (64, 256)
    assert grouped_config(10, 10, 10, 2, torch.float32, torch.device("cpu")).programs > 0


# Gate and signal: two source ranks' groups (G = 2 * E) as layer 0 of a fused all-gather sees them.

def _two_sources(seed):
    experts, k, n = 3, 24, 20
    counts = [6, 0, 13, 9, 17, 0]        # source 0: groups 0-2, source 1: groups 3-5
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(16, k, generator=gen)   # gathered tokens: rows 0-7 from source 0, 8-15 from source 1
    rows0, rows1 = sum(counts[:3]), sum(counts[3:])
    a_rows = torch.cat([torch.randint(0, 8, (rows0,), generator=gen),
                        torch.randint(8, 16, (rows1,), generator=gen)]).to(torch.int32)
    b = _weights(gen, experts, k, n, torch.float32, nk=True)
    return counts, experts, x, a_rows, b, rows0


def test_gate_waits_for_a_late_source():
    """Rank 0's tiles of source 1 wait for its flag: source 1's rows are NaN until a thread writes them
    and then raises the flag, well after the launch. A tile that did not wait would read NaN."""
    counts, experts, x, a_rows, b, _ = _two_sources(500)
    gathered = x.clone()
    gathered[8:] = float("nan")
    flags = torch.tensor([7, 6], dtype=torch.int32)   # source 1 still at the previous epoch
    err = torch.zeros(1, dtype=torch.int32)

    def producer():
        time.sleep(0.5)
        gathered[8:] = x[8:]
        flags[1] = 7

    thread = threading.Thread(target=producer)
    thread.start()
    start = time.monotonic()
    out = grouped_gemm(gathered, b, _offsets(counts), a_rows=a_rows, experts=experts,
                       gate=(flags, 7, 0, err, 1 << 30))
    thread.join()
    assert time.monotonic() - start >= 0.5
    assert int(err) == 0
    assert _rel(out, _reference(x, b, counts, a_rows, experts=experts)) < TOL[torch.float32]


def test_expired_gate_records_the_source_and_skips_its_tiles():
    """Rank 1 waits for source 0, which never comes: the call returns, ``err`` names source 0, source
    1's own rows are right and source 0's rows are left as they were (never read nor written)."""
    counts, experts, x, a_rows, b, rows0 = _two_sources(600)
    flags = torch.tensor([3, 5], dtype=torch.int32)
    err = torch.zeros(1, dtype=torch.int32)
    out = torch.full((sum(counts), b.shape[2]), float("nan"))
    grouped_gemm(x, b, _offsets(counts), a_rows=a_rows, experts=experts, out=out,
                 gate=(flags, 5, 1, err, 50))
    assert int(err) == 1 + 0
    assert torch.isnan(out[:rows0]).all()
    ref = _reference(x, b, counts, a_rows, experts=experts)
    assert _rel(out[rows0:], ref[rows0:]) < TOL[torch.float32]


def test_signal_counts_every_tile_of_each_source():
    counts, experts, x, a_rows, b, _ = _two_sources(700)
    offsets = _offsets(counts)
    counters = torch.tensor([40, -3], dtype=torch.int32)   # cumulative across calls: never reset
    config = GroupedConfig(block_m=16, block_n=16, block_k=16, num_stages=1, num_warps=4, programs=3)
    expected = expected_tiles(offsets, experts=experts, n=b.shape[2], config=config)
    # By hand: source 0 has 6 and 13 rows -> 1 + 1 row tiles; source 1: 9 and 17 -> 1 + 2; N = 20: 2 column tiles.
    assert expected.tolist() == [4, 6]
    for call in range(1, 3):
        out = grouped_gemm(x, b, offsets, a_rows=a_rows, experts=experts, config=config, signal=(counters,))
        assert counters.tolist() == [40 + 4 * call, -3 + 6 * call]
    assert _rel(out, _reference(x, b, counts, a_rows, experts=experts)) < TOL[torch.float32]


def test_benchmark_smoke(tmp_path):
    """``python -m tileweave.bench.grouped --smoke`` checks every variant's output on tiny shapes."""
    assert bench.main(["--smoke", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "grouped.json").read_text())
    assert len(report["rows"]) == 8
    for row in report["rows"]:
        assert set(row["results"]) == ({"ours", "torch", "torch+gather"} if row["layer"] == 0 else {"ours", "torch"})
        assert all(r["rel_err"] < 1e-5 and "error" not in r for r in row["results"].values())
    assert "| tiny-a |" in (tmp_path / "grouped.md").read_text()
