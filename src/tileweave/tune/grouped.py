"""Configurations of the grouped GEMM and the per-shape choice.

The host knows the total row count P, the width N, the depth K and the number of groups G, not how the
rows split between groups (that stays on the device). The choice works from the mean rows per group,
``P / G``, and the number of tiles it implies:

* Row tiles: a group's last row tile is partly empty, on average half of BM wasted per group. With few
  rows per group (many experts: Qwen3-30B-A3B's 128 experts at T*k = 16384 have 128 rows each, and at
  Zipf skew most have far fewer) 64-row tiles waste half as much as 128-row ones; BM = 128 once groups
  average 512 rows or more (the waste is then under 1/8 of a tile row-block per group).
* Column tiles: 128 x 256 tiles (8 warps, two warpgroups) reuse each A load over 256 columns, which
  matters here because A rows are gathered by pointer loads (no TMA for them); they need enough tiles
  to fill the SMs: at least 2 waves, else 128 x 128.
* BK = 64, 3 stages for 128 x 256 (3 x (16 + 32) KB of shared memory in bf16), 4 stages for smaller
  tiles; 4 warps for 64 x 128 tiles.
* fp32 inputs halve what fits in shared memory: BK = 32.

Worked example (H200, 132 SMs): Mixtral-8x7B layer 0 at TP=2, T = 8192, k = 2: P = 16384 rows over
G = 8 experts (2048 rows each), N = F/2 = 7168, K = 4096. Rows per group 2048 >= 512 gives BM = 128;
tiles with BN = 256: 8 * 16 * 28 = 3584, 27 waves, so 128 x 256 x 64, 3 stages, 8 warps.
Qwen3-30B-A3B layer 1 at T = 4096, k = 8: P = 32768 rows over 128 experts (256 each), N = H = 2048,
K = F/2 = 384: 256 < 512 gives BM = 64; 64 x 256 tiles: 128 * 4 * 8 = 4096 tiles, so 64 x 256 x 64
with 4 stages and 8 warps.
"""

from __future__ import annotations

import dataclasses
import math

import torch


@dataclasses.dataclass(frozen=True, kw_only=True)
class GroupedConfig:
    """Compile-time shape of one launch of the grouped GEMM."""

    block_m: int = 128
    """Output rows per tile (rows of one group only: a group's last tile is partly masked)."""
    block_n: int = 256
    """Output columns per tile."""
    block_k: int = 64
    """Depth of one pipelined K step."""
    group_m: int = 8
    """Row tiles of one group per L2 super-group (consecutive programs share the expert's B tiles)."""
    num_stages: int = 3
    """Shared-memory pipeline depth of the K loop."""
    num_warps: int = 8
    """Warps per program."""
    programs: int = 0
    """Persistent programs; 0 means one per SM."""

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 16 or value & (value - 1):
                raise ValueError(f"GroupedConfig.{name} must be a power of two >= 16, got {value!r}")
        for name, low in (("group_m", 1), ("num_stages", 1), ("num_warps", 1), ("programs", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or value < low:
                raise ValueError(f"GroupedConfig.{name} must be an int >= {low}, got {value!r}")
        if self.num_warps & (self.num_warps - 1):
            raise ValueError(f"GroupedConfig.num_warps must be a power of two, got {self.num_warps}")


INTERPRETER_CONFIG = GroupedConfig(block_m=32, block_n=32, block_k=32, group_m=2, num_stages=1, num_warps=4,
                                   programs=3)
"""Small tiles and few programs for Triton's interpreter (tests): its cost grows with the number of
program steps, and small tiles exercise partial tiles at small shapes."""


def choose_grouped_config(rows: int, n: int, k: int, groups: int, dtype: torch.dtype, *, num_sms: int,
                          interpreter: bool = False) -> GroupedConfig:
    """The config for ``rows`` output rows over ``groups`` groups, ``[rows, k] x [k, n]`` per group; see
    the module docstring for the rule and a worked example."""
    if interpreter:
        return INTERPRETER_CONFIG
    per_group = rows / max(groups, 1)
    block_m = 128 if per_group >= 512 else 64
    block_k = 32 if dtype == torch.float32 else 64
    row_tiles = groups * math.ceil(per_group / block_m) if per_group >= 1 else max(1, math.ceil(rows / block_m))
    if row_tiles * math.ceil(n / 256) >= 2 * num_sms:
        block_n = 256
    else:
        block_n = 128
    if block_m == 128 and block_n == 256:
        return GroupedConfig(block_m=128, block_n=256, block_k=block_k, num_stages=3, num_warps=8)
    if block_m == 64 and block_n == 128:
        return GroupedConfig(block_m=64, block_n=128, block_k=block_k, num_stages=4, num_warps=4)
    return GroupedConfig(block_m=block_m, block_n=block_n, block_k=block_k, num_stages=4, num_warps=8)
