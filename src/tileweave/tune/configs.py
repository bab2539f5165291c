"""Typed GEMM configurations and the per-shape choice.

The choices below come from a sweep on an H200 (132 SMs): 128 x 256
x 64 tiles, 3 stages, 8 warps, flattened loops and TMA stores were within 0.92-1.05x of cuBLAS on the
large local GEMMs of the suite; 128 x 128 tiles won on narrow outputs (N = 768: 0.93x against 0.72x).
Worked example: ``choose_gemm_config(8192, 7168, 4096, torch.bfloat16, num_sms=132)`` has 64 x 28 =
1792 tiles of 128 x 256, 13.6 waves over 132 programs, so the large-tile default applies.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch


@dataclasses.dataclass(frozen=True, kw_only=True)
class GemmConfig:
    """Compile-time shape of one launch of the persistent GEMM."""

    block_m: int = 128
    """Rows of C per tile."""
    block_n: int = 256
    """Columns of C per tile."""
    block_n2: int = 0
    """Plain GEMM only: a second block of columns per tile, so that tiles are ``block_n + block_n2``
    wide (96 = 64 + 32, 80 = 64 + 16). Widths that are not powers of two let a small grid come out at
    about one tile per SM, as cuBLAS's tiles do (1024 x 768: 128 tiles of 64 x 96). 0: off."""
    block_k: int = 64
    """Depth of one pipelined K step."""
    group_m: int = 8
    """Tile rows per L2 super-group (consecutive programs reuse the same B tiles)."""
    num_stages: int = 3
    """Shared-memory pipeline depth of the K loop."""
    num_warps: int = 8
    """Warps per program (two warpgroups for 128 x 256 tiles)."""
    flatten: bool = True
    """Flatten the tile and K loops into one pipelined loop (overlaps one tile's epilogue with the next
    tile's loads)."""
    warp_specialize: bool = False
    """Let Triton split producer and consumer warps."""
    c_tma: bool = True
    """Store C with TMA instead of pointer stores where no tile crosses a chunk boundary (the launcher
    falls back to pointer stores elsewhere)."""
    programs: int = 0
    """Persistent programs; 0 means one per SM."""
    stream_k: bool = False
    """Plain GEMM only: whole tiles for the full waves, then the K steps of the remaining tiles dealt out
    evenly over the programs (a tile shared by several is summed by the last to finish, in a fixed
    order). For grids whose last wave would leave SMs idle. Keeps a workspace of two fp32 tiles per
    program on each stream that runs it (17 MB for 128 x 128 tiles on 132 SMs)."""

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"GemmConfig.{name} must be a power of two >= 16, got {value}")
        if self.block_n2 and (self.block_n2 < 16 or self.block_n2 & (self.block_n2 - 1)
                              or self.block_n2 > self.block_n):
            raise ValueError(f"GemmConfig.block_n2 must be 0 or a power of two from 16 to block_n, "
                             f"got {self.block_n2}")
        if self.block_n2 and self.stream_k:
            raise ValueError("GemmConfig.block_n2 does not combine with stream_k")
        if self.block_n2 and self.flatten:
            # Two accumulators in one flattened tile-and-K loop ran 2x slower per tile on an H200
            #: the tile loop stays a loop of its own.
            raise ValueError("GemmConfig.block_n2 needs flatten=False")
        if self.num_stages < 1 or self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"GemmConfig: bad num_stages={self.num_stages} or num_warps={self.num_warps}")
        if self.programs < 0:
            raise ValueError(f"GemmConfig.programs must be >= 0, got {self.programs}")

    def key(self) -> str:
        return (f"{self.block_m}x{self.block_n}{'+' + str(self.block_n2) if self.block_n2 else ''}"
                f"x{self.block_k}_g{self.group_m}_s{self.num_stages}"
                f"_w{self.num_warps}_f{int(self.flatten)}_ws{int(self.warp_specialize)}"
                f"_ct{int(self.c_tma)}_p{self.programs}"
                f"{'_sk' if self.stream_k else ''}")

    @classmethod
    def from_dict(cls, data: dict) -> "GemmConfig":
        """The config of a stored dict; fields this version does not have are ignored."""
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in fields})


# Small tiles keep the interpreter fast on the CPU; they are never used on a GPU.
INTERPRETER_CONFIG = GemmConfig(block_m=32, block_n=32, block_k=32, group_m=2, num_stages=1,
                                num_warps=4, flatten=False)


STREAM_K_CONFIG = GemmConfig(block_m=128, block_n=128, block_k=64, num_stages=4, num_warps=8, stream_k=True)
"""A stream-K configuration for tests and probes."""
STREAM_K_BELOW = 0.9
"""Stream-K when whole tiles would keep the programs busy for less than this share of their waves."""
STREAM_K_MIN_K = 8192
"""...and K is at least this long: the shared segments pay a pipeline fill, an fp32 partial and its
sum, which K = 4096 tiles did not earn back on an H200."""


def wave_use(tiles: int, programs: int) -> float:
    """Share of the program-slots of all waves that whole tiles fill: 1.0 for full waves."""
    return tiles / (math.ceil(tiles / programs) * programs)


BIG_TILE_COST = 1.8
"""Time of a 128 x 256 tile over a 128 x 128 one at the same K on an H200: 0.67 against 0.375 us a K
step of 64, i.e. large tiles do 2 / 1.8 = 1.1x more work per SM-second."""

BIG_TILE = GemmConfig(group_m=16)
"""128 x 256 x 64 tiles for large problems, in L2 groups of 16 tile rows. The 132 programs running at
once then cover about 16 rows x 8 columns of tiles: per K step of 64 they read 16 A slices of 16 KB
and 9 B slices of 32 KB (544 KB of distinct data) where groups of 8 rows read 8 and 17 (672 KB), and
the GEMM loses less to a transfer running next to it. On one H200, against groups
of 8, AllGather+GEMM's kernel next to a copy of a shard: 1.006x and 1.018x on two machine starts (alone
1.008x and 1.001x); the plain GEMM's suite shapes of 0.5 ms or more then ran 1.006-1.008x cuBLAS."""

SMALL_TILE = GemmConfig(block_m=64, block_n=128, block_k=64, num_stages=5, num_warps=4, flatten=False)
"""Plain GEMM on a grid of 128 x 128 tiles that would leave over half the SMs idle."""
SMALL_TILE_COST = 0.69
"""Time of a 64 x 128 tile over a 128 x 128 one at the same K, each program one tile, on an H200:
16.9 against 24.3 us on 1024 x 768 x 4096 in graph replay."""
WIDE_TILE = GemmConfig(block_m=64, block_n=128, block_n2=32, block_k=64, num_stages=5, num_warps=4,
                       flatten=False)
"""Plain GEMM: tiles of 64 x 160 (128 + 32 columns), for N = 1280 and its like, where 160 divides N and
128 x 128 tiles come out at well under one per SM."""
WIDE_TILE_COST = 0.86
"""Time of a 64 x 160 tile over a 128 x 128 one at the same K on an H200: 40.8 against 47.5 us on
1024 x 1280 x 8192 in graph replay, one wave each."""


def is_fp8(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` is a one-byte float (float8 e4m3fn, e5m2)."""
    return dtype.is_floating_point and dtype.itemsize == 1


FP8_BIG_TILE = GemmConfig(block_m=128, block_n=256, block_k=128, group_m=16, num_stages=3, num_warps=8)
"""FP8: 128 x 256 tiles, 128 deep. An FP8 MMA does twice bf16's work per cycle on half the bytes per
element, so a K step of 128 one-byte elements moves what bf16's step of 64 moves (16 KB of A and 32 KB
of B a stage) and keeps the tensor cores twice as busy per byte: the bf16 tile's pipeline in the same
shared memory, 3 stages x 48 KB + the TMA store's 64 KB bf16 tile = 208 KB of the 227 KB a program may
have on sm_90 (ptxas: 162 registers, no spills). Not yet tuned on a GPU."""
FP8_MID_TILE = GemmConfig(block_m=128, block_n=128, block_k=128, num_stages=4, num_warps=8)
"""FP8 128 x 128 tiles: 4 stages x 32 KB + the store tile (32 KB bf16, 64 KB fp32) = 160 or 192 KB."""
FP8_DECODE_ROWS = 64
"""FP8 GEMMs of this many rows or fewer (decode steps) take ``FP8_DECODE_TILE``, not the Hopper kernel."""
FP8_DECODE_TILE = GemmConfig(block_m=64, block_n=128, block_k=128, num_stages=4, num_warps=4, flatten=False,
                             stream_k=True)
"""FP8 at decode sizes, where reading the weight sets the time: 64 x 128 tiles with every tile's K steps
dealt out over all SMs (stream-K), so that every SM streams its share of the weight. On the 128 x 128 tiles
of the Hopper kernel a 1-64 row GEMM has one program per 128 output columns (64 programs for N = 8192),
each reading all of K."""


def choose_fp8_config(m: int, n: int, k: int, out_dtype: torch.dtype | None, *, num_sms: int,
                      scaling: str | None = None, stream_k: bool = True) -> GemmConfig:
    """The FP8 GEMM's config: up to ``FP8_DECODE_ROWS`` rows ``FP8_DECODE_TILE`` (unless ``stream_k`` is
    False: whole tiles only, as the fused kernels take); otherwise whole tiles, ``FP8_BIG_TILE`` or
    ``FP8_MID_TILE`` by the wave rule of
    ``choose_gemm_config`` (``BIG_TILE_COST``), except where 128 x 256 tiles do not fit an sm_90 program:
    blockwise ``scaling`` (each K step's product is a second 128 x 256 fp32 tile beside the
    accumulator: 255 registers and spills, against 190 registers for 128 x 128) and a float32 output
    (converting the 128 KB fp32 tile for its store needs shared memory beside the 3 stages: 272 KB).
    A K step of 128 is also the blockwise recipe's scale block: one scale multiply per step.
    Worked example: 8192 x 14336 x 8192, tensorwise, bf16 out, is 64 x 56 = 3584 tiles of 128 x 256
    (27 waves on 132 SMs): ``FP8_BIG_TILE``; 1024 x 1024 x 4096 is 32 such tiles (one wave, cost 1.8)
    or 64 of 128 x 128 (one wave, 1.0): ``FP8_MID_TILE``."""
    if stream_k and m <= FP8_DECODE_ROWS:
        return FP8_DECODE_TILE
    if scaling == "blockwise" or out_dtype == torch.float32:
        return FP8_MID_TILE
    big_tiles = math.ceil(m / 128) * math.ceil(n / 256)
    mid_tiles = math.ceil(m / 128) * math.ceil(n / 128)
    big = big_tiles >= 2 * num_sms or math.ceil(big_tiles / num_sms) * BIG_TILE_COST <= math.ceil(mid_tiles / num_sms)
    return FP8_BIG_TILE if big else FP8_MID_TILE


@functools.lru_cache(maxsize=4096)
def choose_gemm_config(m: int, n: int, k: int, dtype: torch.dtype, *, num_sms: int,
                       interpreter: bool = False, stream_k: bool = True,
                       out_dtype: torch.dtype | None = None, scaling: str | None = None) -> GemmConfig:
    """The default configuration for a local GEMM of ``[m, k] x [k, n]``.

    Large problems take 128 x 256 x 64 tiles (``BIG_TILE``, the shape cuBLAS also favours on Hopper).
    Under two waves of them, the tile size whose waves take less time: ``waves(128 x 256) *
    BIG_TILE_COST`` against ``waves(128 x 128)``. Worked example: 4096 x 768 is 96 large tiles (one
    wave, 1.8) or 192 mid tiles (two waves, 2.0): large tiles; 2048 x 768 is 48 or 96 tiles (1.8 against
    1.0): 128 x 128. When the chosen tiles still fill their last wave badly and K is long, the last
    wave's K steps are dealt out over all programs (stream-K). The plain GEMM also weighs two narrower
    tiles the same way, for grids that 128 x 128 tiles leave mostly idle: 64 x 128 (``SMALL_TILE``; 1024
    x 768 is 96 of them, one wave at 0.69, against 48 mid tiles at 1.0) and 64 x 160 (``WIDE_TILE``;
    1024 x 1280 is 128, 0.86 against 80 mid tiles at 1.0). ``stream_k=False``: whole tiles of 128 rows
    only (the fused kernels). Float8 inputs (output ``out_dtype``, ``scaling`` tensorwise, rowwise or
    blockwise) take ``choose_fp8_config``.
    """
    if interpreter:
        return INTERPRETER_CONFIG
    if is_fp8(dtype):
        return choose_fp8_config(m, n, k, out_dtype, num_sms=num_sms, scaling=scaling, stream_k=stream_k)
    if dtype == torch.float32:
        return GemmConfig(block_m=128, block_n=128, block_k=32, num_stages=3, num_warps=8)
    big_tiles = math.ceil(m / 128) * math.ceil(n / 256)
    mid_tiles = math.ceil(m / 128) * math.ceil(n / 128)
    # Measured on an H200 in graph replay, the wave count picks the faster tile on
    # all ten shapes probed: 128 x 256 on 4096 x 768 x 4096 (44.6 against 49.8 us), 1024 x 3072 x 4096,
    # 2048 x 4096 x 2048 and 2048 x 1280 x 8192; 128 x 128 on 1024 x 768 x 4096 (24.3 against 42.8 us),
    # 2048 x 768 x 4096, 1024 x 1280 x 8192 and 4096 x 1280 x 8192. (64 x 128 tiles of 8 warps, the
    # earlier choice for small grids, were slower than 128 x 128 wherever tried; with 4 warps and a
    # loop of their own they win where 128 x 128 tiles would leave over half the SMs idle.)
    mid = GemmConfig(block_m=128, block_n=128, block_k=64, num_stages=4, num_warps=8)
    if big_tiles >= 2 * num_sms or math.ceil(big_tiles / num_sms) * BIG_TILE_COST <= math.ceil(mid_tiles / num_sms):
        config, tiles = BIG_TILE, big_tiles
        cost = math.ceil(big_tiles / num_sms) * BIG_TILE_COST
    else:
        config, tiles = mid, mid_tiles
        cost = math.ceil(mid_tiles / num_sms)
    if stream_k and big_tiles < 2 * num_sms:
        # The plain GEMM's narrower tiles, weighed the same way.
        for narrow, unit in ((SMALL_TILE, SMALL_TILE_COST), (WIDE_TILE, WIDE_TILE_COST)):
            narrow_tiles = math.ceil(m / narrow.block_m) * math.ceil(n / (narrow.block_n + narrow.block_n2))
            narrow_cost = math.ceil(narrow_tiles / num_sms) * unit
            if narrow_cost < cost:
                config, cost = narrow, narrow_cost
        if config.block_m == 64:
            return config
    if stream_k and config is not mid and big_tiles <= num_sms:
        # Plain GEMM, one tile per program: a TMA store has nothing left to overlap, and pointer
        # stores were as fast or faster on 7 of 8 such shapes (1024 x 4096 x 512: 11.1 against 11.8
        # us).
        return dataclasses.replace(config, c_tma=False)
    # Only behind at least one full wave: with fewer tiles than programs every tile would be shared out
    # (1024 x 1280 x 8192: 0.70x cuBLAS against 0.79x with whole tiles).
    if stream_k and k >= STREAM_K_MIN_K and tiles >= num_sms and wave_use(tiles, num_sms) < STREAM_K_BELOW:
        if config is not mid and big_tiles < 2 * num_sms:
            # Under two waves a shared tail of large tiles is most of the work, and each shared tile
            # stores and sums 128 KB of fp32 partials: stream-K on 128 x 256 tiles was never the faster
            # in graph replay (10 shapes), and 1024 x 7168 x 8192 ran at 0.76x
            # cuBLAS with it against 0.93x on 128 x 128 tiles.
            config, tiles = mid, mid_tiles
            if not (tiles >= num_sms and wave_use(tiles, num_sms) < STREAM_K_BELOW):
                return config
        return dataclasses.replace(config, stream_k=True)
    return config
