"""Configurations of the grouped GEMM and the per-shape choice.

The host knows the total row count P, the width N, the depth K and the number of groups G, not how the
rows split between groups (that stays on the device). The choice works from the mean rows per group,
``P / G``, and the column tiles N needs. Measured on an H200 (132 SMs, bf16, TP=2 shards of the MoE
benchmark's shapes, T = 4096 and 16384, against ``torch._grouped_mm``):

* Row tiles: 128 rows. 64-row tiles waste less of a group's last, partial tile, but were slower at
  every measured shape, down to Qwen3-30B-A3B at T = 4096 (128 experts, 256 rows each: 64 x 256 tiles
  0.18 ms, 128 x 256 0.15 ms for layer 0). 64 only where groups average under 128 rows, where a
  128-row tile would be mostly empty.
* Column tiles: 256 columns (8 warps, two warpgroups), which reuse each gathered A load over 256
  columns, unless 256 wastes much more of N than 128 does: N = 384 (Qwen3 layer 0) fills 2 x 256
  columns at 75 % and 3 x 128 fully, and 128 x 128 tiles ran 8 % faster there (0.46 against 0.50 ms at
  T = 16384). Narrow grids (fewer than two waves of 256-column tiles) also take 128.
* BK = 64, 3 stages for 128 x 256 (3 x (16 + 32) KB of shared memory in bf16: 4 stages and an L2
  super-group of 4 instead of 8 measured the same), 4 stages for smaller tiles. fp32 inputs halve
  what fits in shared memory: BK = 32. BK = 128 and 256 x 128 tiles were 5-25 % slower.
* Flattened tile and K loops (``flatten``) for 128 x 256 tiles: the epilogue of one tile then overlaps
  the next tile's loads, which matters where K is short (layer 1 of Qwen3 and DeepSeek-V2-Lite, K =
  384 and 704: 0.48 against 0.54 ms for Qwen3 at T = 16384) and for the gathered layer 0 of Mixtral
  (3.00 against 3.24 ms at T = 16384). With 128 x 128 tiles it was slower, so those stay unflattened.

The SwiGLU epilogue (``swiglu``; ``n`` counts gate and up columns): a tile of 128 output columns
multiplies by 256 columns of B (gate and up side by side), so it takes the 128 x 256 GEMM's config
(3 stages, 8 warps, flattened), and runs as fast as the plain grouped GEMM of the same FLOPs (two
128 x 128 accumulators over separate gate and up loads ran a quarter slower; NOTES.md has the sweep).

Float8 inputs (the FP8 grouped GEMM; compiled for sm_90, not yet timed on a GPU): BK = 128, so that a
step moves what bf16's step of 64 moves while an FP8 MMA does twice bf16's work per cycle, and a step
is the blockwise recipe's scale block (one scale multiply per step). Tiles of 128 x 128 (4 stages x 32
KB, unflattened), or 128 x 64 output columns under the SwiGLU epilogue (128 columns of B): the row
gather's pointer tensor is ``BM x BK`` 64-bit addresses, twice bf16's at BK = 128, and with the wider
tiles ptxas spilled (128 x 256: 255 registers, 1188 bytes of spills under blockwise scaling; the
SwiGLU over 256 columns of B: 956 bytes even tensorwise), where these compile without spills (128 x
64 SwiGLU blockwise: 180 bytes).

The SwiGLU epilogue that casts its output in 1 x 128 blocks (``block_cast``, MoE layer 0 writing layer
1's blockwise operand) needs each block in one tile: 128 output columns, 256 columns of B. In float8
that takes 64-row tiles, 8 warps, 4 stages (4 x 40 KB of shared memory), so that the accumulator and the
blockwise step's product stay 64 registers each per thread (compiled for sm_90: 236 registers, no
spills; not timed). bf16 and
fp32 SwiGLU tiles are 128 columns already.

Worked example: Mixtral-8x7B layer 0 at TP=2, T = 8192, k = 2: P = 16384 rows over G = 8 experts
(2048 rows each), N = F/2 = 7168, K = 4096. 2048 >= 128 rows gives BM = 128; 7168 is 28 x 256 columns
exactly, and 8 * 16 * 28 = 3584 tiles are 27 waves on 132 SMs: 128 x 256 x 64, 3 stages, 8 warps,
flattened.
Qwen3-30B-A3B layer 0 at T = 4096, k = 8: P = 32768 rows over 128 experts (256 each), N = F/2 = 384:
BM = 128; 256-column tiles would cover 512 columns (1.33 x N), 128-column ones 384 (1.0 x): 128 x 128
x 64, 4 stages, 8 warps.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from tileweave.tune.fields import bounded, check_bounds


@dataclasses.dataclass(frozen=True, kw_only=True)
class GroupedConfig:
    """Compile-time shape of one launch of the grouped GEMM."""

    block_m: int = bounded(128, low=16, power_of_two=True)
    """Output rows per tile (rows of one group only: a group's last tile is partly masked)."""
    block_n: int = bounded(256, low=16, power_of_two=True)
    """Output columns per tile."""
    block_k: int = bounded(64, low=16, power_of_two=True)
    """Depth of one pipelined K step."""
    group_m: int = bounded(8, low=1)
    """Row tiles of one group per L2 super-group (consecutive programs share the expert's B tiles)."""
    num_stages: int = bounded(3, low=1)
    """Shared-memory pipeline depth of the K loop."""
    num_warps: int = bounded(8, low=1, power_of_two=True)
    """Warps per program."""
    programs: int = bounded(0, low=0)
    """Persistent programs; 0 means one per SM."""
    flatten: bool = False
    """Pipeline the tile and K loops as one (the tile's epilogue overlaps the next tile's loads). Applies
    where the offsets sit in registers and without a gate; ignored elsewhere."""

    def __post_init__(self) -> None:
        check_bounds(self)


INTERPRETER_CONFIG = GroupedConfig(block_m=32, block_n=32, block_k=32, group_m=2, num_stages=1, num_warps=4,
                                   programs=3)
"""Small tiles and few programs for Triton's interpreter (tests): its cost grows with the number of
program steps, and small tiles exercise partial tiles at small shapes."""


def column_waste(n: int, block_n: int) -> float:
    """Columns computed over columns needed: ``ceil(n / block_n) * block_n / n``."""
    return math.ceil(n / block_n) * block_n / n


def choose_grouped_config(rows: int, n: int, k: int, groups: int, dtype: torch.dtype, *, num_sms: int,
                          interpreter: bool = False, swiglu: bool = False,
                          block_cast: bool = False) -> GroupedConfig:
    """The config for ``rows`` output rows over ``groups`` groups, ``[rows, k] x [k, n]`` per group
    (``swiglu``: with a SwiGLU epilogue; ``block_cast``: which casts its output in 1 x 128 blocks, so a
    tile spans a multiple of 128 output columns); see the module docstring for the rule and a worked
    example."""
    if interpreter:
        return dataclasses.replace(INTERPRETER_CONFIG, block_n=128) if block_cast else INTERPRETER_CONFIG
    per_group = rows / max(groups, 1)
    block_m = 128 if per_group >= 128 else 64
    if dtype.itemsize == 1 and swiglu and block_cast:
        return GroupedConfig(block_m=64, block_n=128, block_k=128, num_stages=4, num_warps=8)
    if dtype.itemsize == 1:  # float8: see the module docstring
        return GroupedConfig(block_m=block_m, block_n=64 if swiglu else 128, block_k=128, num_stages=4,
                             num_warps=8 if block_m == 128 else 4)
    block_k = 32 if dtype == torch.float32 else 64
    if swiglu:
        return GroupedConfig(block_m=block_m, block_n=128, block_k=block_k, num_stages=3 if block_m == 128 else 4,
                             num_warps=8, flatten=block_m == 128)
    row_tiles = max(1, math.ceil(rows / block_m))
    wide = row_tiles * math.ceil(n / 256) >= 2 * num_sms and column_waste(n, 256) <= 1.1 * column_waste(n, 128)
    block_n = 256 if wide else 128
    if block_n == 256:
        return GroupedConfig(block_m=block_m, block_n=256, block_k=block_k, num_stages=3 if block_m == 128 else 4,
                             num_warps=8, flatten=block_m == 128)
    return GroupedConfig(block_m=block_m, block_n=128, block_k=block_k, num_stages=4,
                         num_warps=8 if block_m == 128 else 4)


@dataclasses.dataclass(frozen=True, kw_only=True)
class WgradConfig:
    """Compile-time shape of one launch of the grouped weight gradient
    (``tileweave.ops.compute.grouped_wgrad``)."""

    block_n: int = bounded(128, low=16, power_of_two=True)
    """Rows of the ``[N, K]`` output tile (columns of the left operand)."""
    block_k: int = bounded(128, low=16, power_of_two=True)
    """Columns of the output tile (columns of the right operand)."""
    block_r: int = bounded(64, low=16, power_of_two=True)
    """Plan rows summed per pipelined step."""
    num_stages: int = bounded(3, low=1)
    """Shared-memory pipeline depth of the row loop."""
    num_warps: int = bounded(8, low=1, power_of_two=True)
    """Warps per program."""

    def __post_init__(self) -> None:
        check_bounds(self)


WGRAD_INTERPRETER_CONFIG = WgradConfig(block_n=32, block_k=32, block_r=16, num_stages=1, num_warps=4)
WGRAD_FP8_INTERPRETER_CONFIG = WgradConfig(block_n=64, block_k=64, block_r=16, num_stages=1, num_warps=4)
"""Float8 in the interpreter: a quarter of the programs (its cost is per program), 16 rows a step."""


def choose_wgrad_config(dtype: torch.dtype, *, interpreter: bool = False) -> WgradConfig:
    """The weight gradient's config: 128 x 128 output tiles, 64 rows a step (32 in fp32, whose tiles take
    twice the shared memory), 3 stages, 8 warps. Float8 operands: 128 rows a step (the blockwise block,
    and the FP8 GEMMs' 128-deep K step: a step of one byte per element moves what bf16's 64 rows move)
    in 4 stages (32 KB each). In the interpreter 16 rows a step (which divides the blockwise block), and
    float8 on 64 x 64 output tiles."""
    fp8 = dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    if interpreter:
        return WGRAD_FP8_INTERPRETER_CONFIG if fp8 else WGRAD_INTERPRETER_CONFIG
    if fp8:
        return WgradConfig(block_r=128, num_stages=4)
    return WgradConfig(block_r=32 if dtype == torch.float32 else 64)
