"""The autotune cache: keys, the on-disk round trip, tolerance of bad files, and a tuning pass in the
interpreter (CPU timer) whose winner ``select_config`` then returns."""

import json

import torch

from tileweave.bench import tune
from tileweave.tune import autotune
from tileweave.tune.configs import FP8_DECODE_ROWS, FP8_DECODE_TILE, GemmConfig, choose_gemm_config


def test_m_is_bucketed_to_the_next_power_of_two():
    assert [autotune.m_bucket(m) for m in (1, 64, 65, 1000, 1024, 1025)] == [64, 64, 128, 1024, 1024, 2048]
    assert autotune.shape_key(3000, 768, 4096, torch.bfloat16) == "bfloat16:4096:768:4096"


def test_cache_round_trip_and_bad_files(tmp_path):
    path = tmp_path / "gemm-test.json"
    cache = autotune.ConfigCache(path)
    config = GemmConfig(block_n=128, num_stages=4, warp_specialize=True)
    cache.put("bfloat16:4096:768:4096", config, 0.05)
    cache.save()
    assert autotune.ConfigCache(path).get("bfloat16:4096:768:4096") == config
    assert autotune.ConfigCache(path).get("bfloat16:8192:768:4096") is None
    path.write_text("{not json")
    assert autotune.ConfigCache(path).entries == {}
    path.write_text(json.dumps({"entries": {"k": {"config": {"block_m": 7}}}}))
    assert autotune.ConfigCache(path).get("k") is None, "an invalid stored config must be ignored"


def test_tuning_pass_stores_a_verified_winner(tmp_path, monkeypatch):
    monkeypatch.setenv(autotune.CACHE_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(autotune, "_caches", {})
    small = (GemmConfig(block_m=32, block_n=32, block_k=32, num_stages=1, num_warps=4, flatten=False),
             GemmConfig(block_m=16, block_n=32, block_k=16, num_stages=1, num_warps=4, flatten=False))
    config, ms = tune.autotune_gemm(40, 48, 32, torch.float32, device="cpu", candidates=small,
                                        warmup=0, iters=1, reps=1)
    assert config in small and ms > 0
    stored = json.loads(autotune.cache_path("cpu-interpreter").read_text())["entries"]
    assert GemmConfig.from_dict(stored[autotune.shape_key(40, 48, 32, torch.float32)]["config"]) == config


def test_default_tile_sizes_follow_the_measured_winners():
    # Large tiles from two waves of them; under that, the tile whose waves take least time at the
    # measured cost per tile (H200, graph replay: NOTES.md entries 27 and 71).
    from tileweave.tune.configs import SMALL_TILE, WIDE_TILE, choose_gemm_config

    def tile(m, n, k, **kw):
        c = choose_gemm_config(m, n, k, torch.bfloat16, num_sms=132, **kw)
        return c.block_m, c.block_n + c.block_n2

    for m, n, k in [(16384, 768, 4096), (8192, 4096, 7168), (8192, 1280, 8192), (4096, 4096, 4096)]:
        assert tile(m, n, k) == (128, 256), (m, n, k)
    for m, n, k in [(4096, 768, 4096), (1024, 3072, 4096), (2048, 4096, 2048)]:
        assert tile(m, n, k) == (128, 256), (m, n, k)
    for m, n, k in [(2048, 768, 4096), (4096, 1280, 8192), (8192, 768, 4096)]:
        assert tile(m, n, k) == (128, 128), (m, n, k)
    # 1024 x 768: 48 tiles of 128 x 128 (one wave, 1.0) against 96 of 64 x 128 (one wave, 0.69).
    assert choose_gemm_config(1024, 768, 4096, torch.bfloat16, num_sms=132) == SMALL_TILE
    # 1024 x 1280: 80 tiles of 128 x 128 against 128 of 64 x 160 (one wave, 0.86); 2048 x 1280: 80 large
    # tiles (1.8) against 256 of 64 x 160 (two waves, 1.72).
    assert choose_gemm_config(1024, 1280, 8192, torch.bfloat16, num_sms=132) == WIDE_TILE
    assert choose_gemm_config(2048, 1280, 8192, torch.bfloat16, num_sms=132) == WIDE_TILE
    # The fused kernels keep tiles of 128 rows, one accumulator each.
    for m, n, k in [(1024, 768, 4096), (1024, 1280, 8192), (2048, 1280, 8192), (64, 4096, 4096)]:
        config = choose_gemm_config(m, n, k, torch.bfloat16, num_sms=132, stream_k=False)
        assert config.block_m == 128 and config.block_n2 == 0 and config.c_tma, (m, n, k)
    # Large tiles, one per program: stored with pointer stores, not TMA.
    assert not choose_gemm_config(1024, 4096, 512, torch.bfloat16, num_sms=132).c_tma
    assert choose_gemm_config(8192, 4096, 4096, torch.bfloat16, num_sms=132).c_tma
    # Large tiles run in L2 groups of 16 tile rows (entry 76), the mid tiles in groups of 8.
    for m, n, k in [(8192, 28672, 8192), (16384, 5120, 8192)]:
        for stream_k in (True, False):
            assert choose_gemm_config(m, n, k, torch.bfloat16, num_sms=132, stream_k=stream_k).group_m == 16
    assert choose_gemm_config(2048, 768, 4096, torch.bfloat16, num_sms=132).group_m == 8


def test_two_part_tiles_are_checked():
    import pytest

    assert GemmConfig(block_n=128, block_n2=32, flatten=False).key() != GemmConfig(block_n=128, flatten=False).key()
    for bad in (dict(block_n2=48, flatten=False), dict(block_n=64, block_n2=128, flatten=False),
                dict(block_n2=8, flatten=False), dict(block_n2=32, flatten=False, stream_k=True),
                dict(block_n2=32)):
        with pytest.raises(ValueError, match="block_n2"):
            GemmConfig(**bad)


def test_grids_that_fill_their_waves_badly_share_out_k():
    from tileweave.tune.configs import STREAM_K_BELOW, STREAM_K_MIN_K, choose_gemm_config, wave_use

    assert wave_use(132, 132) == 1.0 and wave_use(133, 132) == 133 / 264
    # 4096 x 1280: 320 tiles of 128 x 128 for 132 SMs, 2.4 waves.
    assert choose_gemm_config(4096, 1280, 8192, torch.bfloat16, num_sms=132).stream_k
    # Under two waves of large tiles, stream-K runs on 128 x 128 tiles (1024 x 7168: 224 large tiles, 1.7
    # waves; 448 mid tiles, 3.4 waves).
    config = choose_gemm_config(1024, 7168, 8192, torch.bfloat16, num_sms=132)
    assert config.stream_k and (config.block_m, config.block_n) == (128, 128)
    # The fused kernels take whole tiles; their tile size is the one chosen without stream-K.
    config = choose_gemm_config(1024, 7168, 8192, torch.bfloat16, num_sms=132, stream_k=False)
    assert not config.stream_k and (config.block_m, config.block_n) == (128, 256)
    # Two waves or more of large tiles keep them, stream-K included (2048 x 7168: 448 large tiles).
    config = choose_gemm_config(2048, 7168, 8192, torch.bfloat16, num_sms=132)
    assert config.stream_k and (config.block_m, config.block_n) == (128, 256)
    # Full waves, fewer tiles than SMs, a short K, fp32 and the interpreter keep whole tiles.
    assert not choose_gemm_config(8192, 4096, 8192, torch.bfloat16, num_sms=132).stream_k
    assert not choose_gemm_config(1024, 768, 8192, torch.bfloat16, num_sms=132).stream_k
    assert not choose_gemm_config(4096, 1280, STREAM_K_MIN_K // 2, torch.bfloat16, num_sms=132).stream_k
    assert not choose_gemm_config(4096, 1280, 8192, torch.float32, num_sms=132).stream_k
    assert not choose_gemm_config(4096, 1280, 8192, torch.bfloat16, num_sms=132, interpreter=True).stream_k
    for m, n, k in [(1024, 768, 4096), (2048, 1280, 8192), (8192, 4096, 4096), (333, 517, 2048), (4096, 1280, 8192),
                    (1024, 7168, 8192), (1536, 5120, 8192)]:
        config = choose_gemm_config(m, n, k, torch.bfloat16, num_sms=132)
        tiles = -(-m // config.block_m) * -(-n // (config.block_n + config.block_n2))
        if config.stream_k:
            assert k >= STREAM_K_MIN_K and tiles >= 132 and wave_use(tiles, 132) < STREAM_K_BELOW
            assert config.block_n == 128 or -(-m // 128) * -(-n // 256) >= 2 * 132, (m, n, k, config)
        elif config.block_m == 128 and k >= STREAM_K_MIN_K and tiles >= 132:
            # (Tiles of 64 rows are whole tiles by choice: their waves already took least time.)
            assert wave_use(tiles, 132) >= STREAM_K_BELOW, (m, n, k, config)


def test_fp8_decode_rows_take_stream_k_tiles_and_fused_kernels_whole_tiles():
    for m in (1, 8, FP8_DECODE_ROWS):
        for scaling in ("tensorwise", "rowwise", "blockwise"):
            config = choose_gemm_config(m, 8192, 28672, torch.float8_e4m3fn, num_sms=132, out_dtype=torch.bfloat16,
                                        scaling=scaling)
            assert config == FP8_DECODE_TILE and config.stream_k
            whole = choose_gemm_config(m, 8192, 28672, torch.float8_e4m3fn, num_sms=132, out_dtype=torch.bfloat16,
                                       scaling=scaling, stream_k=False)
            assert not whole.stream_k and whole.block_m == 128
    assert not choose_gemm_config(FP8_DECODE_ROWS + 1, 8192, 28672, torch.float8_e4m3fn, num_sms=132,
                                  out_dtype=torch.bfloat16, scaling="rowwise").stream_k
