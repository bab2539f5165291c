"""The per-shape choices that every rank must make alike: properties over random shapes."""

import random

import torch

from tileweave.ops.reduce_scatter.blocks import (BLOCK_FLAGS, CHUNK_GFLOP, CHUNK_ROWS, PULL_MAX_BLOCKS, blocks_for,
                                               chunk_rows_for)
from tileweave.ops.all_gather import rule as all_gather
from tileweave.ops.reduce_scatter import rule as reduce_scatter


def _random_shapes(max_rows_per_rank, count=200):
    """``(world, m, n, k)`` with m a multiple of the world size, fresh each run."""
    rng = random.Random()
    for _ in range(count):
        w = rng.choice([2, 4, 8])
        yield w, w * rng.randrange(1, max_rows_per_rank), rng.randrange(1, 30000), rng.randrange(1, 30000)


def test_chunk_rows_reach_the_block_work_or_the_owner_rows():
    rng = random.Random()
    for _ in range(200):
        mc, k, n = rng.randrange(1, 20000), rng.randrange(1, 30000), rng.randrange(1, 60000)
        rows = chunk_rows_for(mc, k, n)
        assert rows >= CHUNK_ROWS and rows & (rows - 1) == 0
        block_gflop = 2.0 * rows * k * n / 1e9
        # Either a block has the work that hides the host's per-block cost, or it already spans the
        # owner's rows; and it never doubled past the first size that had enough work.
        assert block_gflop >= CHUNK_GFLOP or rows >= mc
        if rows > CHUNK_ROWS:
            assert 2.0 * (rows // 2) * k * n < CHUNK_GFLOP * 1e9 and rows // 2 < mc


def test_pulls_take_the_push_blocks_up_to_two():
    rng = random.Random()
    for _ in range(200):
        mc, k, n = rng.randrange(1, 20000), rng.randrange(1, 30000), rng.randrange(1, 60000)
        push = max(1, min(BLOCK_FLAGS, mc // chunk_rows_for(mc, k, n)))
        assert blocks_for(mc, k, n) == push
        assert blocks_for(mc, k, n, pull=True) == min(push, PULL_MAX_BLOCKS)
        # Rows per block given by the caller are kept, pulling or not.
        assert blocks_for(mc, k, n, pull=True, chunk_rows=16) == max(1, min(BLOCK_FLAGS, mc // 16))
    # llama3-70b down M=16384 at two ranks (8192 rows per owner, K_loc 14336): 8 pushed blocks, 2 pulled;
    # llama3-8b o M=8192 (4096 rows, K_loc 2048): one block either way.
    assert (max(1, 8192 // chunk_rows_for(8192, 14336, 8192)), blocks_for(8192, 14336, 8192, pull=True)) == (8, 2)
    assert blocks_for(4096, 2048, 4096, pull=True) == 1


def test_reduce_scatter_transports_by_default():
    for w, m, n, k in _random_shapes(8192):
        chunked = reduce_scatter.prefer_fused_reduce_scatter(m, n, k, w, torch.bfloat16)
        # The chunked transport needs enough GEMM work per owner to hide the copies behind.
        rows = m // w
        assert chunked == (k >= reduce_scatter.MIN_CHUNKED_K_LOCAL and rows >= reduce_scatter.MIN_CHUNKED_ROWS_PER_RANK
                           and rows * k >= reduce_scatter.MIN_CHUNKED_ROWS_X_K_LOCAL)
        if chunked:  # more rows or a longer K never turns it off
            assert reduce_scatter.prefer_fused_reduce_scatter(2 * m, n, k, w, torch.bfloat16)
            assert reduce_scatter.prefer_fused_reduce_scatter(m, n, 2 * k, w, torch.bfloat16)
        assert reduce_scatter.prefer_fused_reduce_scatter(m, n, k, w, torch.bfloat16, interpreter=True)


def test_pulling_reduce_scatter_takes_the_chunked_path_on_fewer_rows():
    for w, m, n, k in _random_shapes(8192):
        pushing = reduce_scatter.prefer_fused_reduce_scatter(m, n, k, w, torch.bfloat16)
        pulling = reduce_scatter.prefer_fused_reduce_scatter(m, n, k, w, torch.bfloat16, pull=True)
        rows = m // w
        if w != 2:  # only two ranks pull
            assert pulling == pushing
            continue
        assert pulling == (k >= reduce_scatter.MIN_CHUNKED_K_LOCAL and rows >= reduce_scatter.MIN_PULL_ROWS_PER_RANK
                           and rows * k >= reduce_scatter.MIN_PULL_ROWS_X_K_LOCAL)
        assert pulling or not pushing  # wherever pushing pays, pulling does
        if pulling:
            assert reduce_scatter.prefer_fused_reduce_scatter(2 * m, n, k, w, torch.bfloat16, pull=True)
            assert reduce_scatter.prefer_fused_reduce_scatter(m, n, 2 * k, w, torch.bfloat16, pull=True)


def test_all_gather_fuses_from_its_work_threshold():
    for w, m, n, k in _random_shapes(4096):
        fused = all_gather.prefer_fused_all_gather(m, n, k, w, torch.bfloat16)
        assert fused == (2.0 * m * n * k >= all_gather.MIN_FUSED_GFLOP_AG * 1e9)
        if fused:  # more rows or more work never turns fusion off
            assert all_gather.prefer_fused_all_gather(2 * m, n, k, w, torch.bfloat16)
            assert all_gather.prefer_fused_all_gather(m, 2 * n, k, w, torch.bfloat16)


def test_all_gather_transport_is_chunked_below_its_work_threshold():
    for w, m, n, k in _random_shapes(8192):
        chosen = all_gather.all_gather_transport(m, n, k, w, torch.bfloat16)
        assert chosen == ("chunked" if 2.0 * m * n * k < all_gather.CHUNKED_BELOW_GFLOP_AG * 1e9 else "mesh")
        assert all_gather.all_gather_transport(m, n, k, w, torch.bfloat16, interpreter=True) == "mesh"
        if chosen == "mesh":  # more work never turns the kernel off
            assert all_gather.all_gather_transport(2 * m, n, k, w, torch.bfloat16) == "mesh"


def test_all_gather_stream_k_where_whole_tiles_leave_programs_idle():
    rng = random.Random()
    for w, m, n, k in _random_shapes(8192, count=400):
        programs = rng.choice([4, 66, 132])
        mc = m // w
        chosen = all_gather.all_gather_stream_k(mc, n, k, w, 128, 256, programs)
        # Independently: deal the tiles out one by one and see how full the busiest program's waves are.
        tiles = w * -(-mc // 128) * -(-n // 256)
        busiest = max(len(range(p, tiles, programs)) for p in range(min(programs, tiles)))
        fill = tiles / (busiest * programs)
        full_waves = tiles // programs
        assert chosen == (k >= all_gather.AG_STREAM_K_MIN_K and full_waves >= all_gather.AG_STREAM_K_MIN_WAVES
                          and fill < all_gather.AG_STREAM_K_BELOW), (w, m, n, k, programs)
    # gpt3-175b fc1 at TP=2: 768 tiles (5.8 waves of 132) at M=1024, 3072 (23.3) at M=4096, 6144 (46.5,
    # 0.99 full) at M=8192.
    assert not all_gather.all_gather_stream_k(512, 24576, 12288, 2, 128, 256, 132)
    assert all_gather.all_gather_stream_k(2048, 24576, 12288, 2, 128, 256, 132)
    assert not all_gather.all_gather_stream_k(4096, 24576, 12288, 2, 128, 256, 132)


def test_all_gather_stream_k_tail_lies_in_the_last_chunk():
    from tileweave.ops.compute.gemm_launch import ag_stream_k_tail
    from tileweave.tune.configs import GemmConfig

    rng = random.Random()
    config = GemmConfig(block_m=32, block_n=32)
    for _ in range(500):
        w, programs = rng.choice([2, 3, 4, 8]), rng.randrange(1, 140)
        mc, n = rng.randrange(1, 400), rng.randrange(1, 400)
        per_chunk = -(-mc // 32) * -(-n // 32)
        total = w * per_chunk
        whole = total // programs * programs  # tiles of the full waves, in global order
        tail = range(whole, total)
        expected = whole > 0 and len(tail) > 0 and all(t >= (w - 1) * per_chunk for t in tail)
        assert ag_stream_k_tail(mc, n, config, w, programs) == expected, (w, programs, mc, n)
