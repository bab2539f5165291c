"""How the chunked GEMM+ReduceScatter transports cut an owner's rows into blocks: the same on every
rank, from the agreed shape alone."""

from __future__ import annotations

from typing import Callable

from tileweave.ops.skeleton import Call
from tileweave.ops.workspace import Workspace

BLOCK_FLAGS = 256
"""Arrival words per (source) in the workspace's block flags: row blocks per owner at most."""

CHUNK_ROWS = 1024
CHUNK_GFLOP = 48.0
"""The pushing transport's blocks: at least ``CHUNK_ROWS`` rows, doubled until a block's GEMM has
``CHUNK_GFLOP`` (about 75 us on an H200), so that the host's cost per block (a GEMM, an event, a copy
and a flag: tens of microseconds) stays hidden behind the GPU's work."""

PULL_MAX_BLOCKS = 2
"""The pulling transport's blocks per owner at most. Its caller's stream runs the peer's blocks, then the
own blocks added in place onto the pulled ones, so a pull hides behind the own blocks before it
whenever a block's pull is no slower than its GEMM (K_loc above ~1800 at ~650 TFLOP/s and ~365 GB/s),
and more blocks only cut the GEMMs smaller. (The pushing transport keeps smaller blocks: its last
block's copy is exposed.)"""


def chunk_rows_for(mc: int, k: int, n: int) -> int:
    """Rows per block of the pushing transport for ``mc`` rows per owner of a ``[., k] x [k, n]`` GEMM."""
    rows = CHUNK_ROWS
    while rows < mc and 2.0 * rows * k * n < CHUNK_GFLOP * 1e9:
        rows *= 2
    return rows


def blocks_for(mc: int, k: int, n: int, *, pull: bool = False, chunk_rows: int = 0) -> int:
    """Row blocks per owner of a chunked call: blocks of ``chunk_rows`` rows, or of
    :func:`chunk_rows_for`'s, at most ``BLOCK_FLAGS``; a pulling call (two ranks) takes at most
    ``PULL_MAX_BLOCKS`` of the latter."""
    blocks = max(1, min(BLOCK_FLAGS, mc // (chunk_rows or chunk_rows_for(mc, k, n))))
    return min(blocks, PULL_MAX_BLOCKS) if pull and not chunk_rows else blocks


def block_rows(mc: int, blocks: int) -> tuple[slice, ...]:
    """The rows of each of ``blocks`` blocks of ``mc`` rows, as even as integers allow."""
    bounds = [mc * j // blocks for j in range(blocks + 1)]
    return tuple(slice(bounds[j], bounds[j + 1]) for j in range(blocks))


def block_plan(call: Call, a, m: int, n: int, nbytes: int, kind: str, build: Callable, *, send_bytes: int = 0,
               blocks: int = 0, dtype=None) -> tuple[Workspace, tuple]:
    """The workspace (``nbytes`` of symmetric data, the block flags and ``send_bytes`` of private send
    buffer) and the plan of a chunked call of ``kind`` for this shape, built once by
    ``build(ws, backend, rows per owner, n, dtype, blocks per owner)``. ``blocks``: 0 for
    :func:`blocks_for`'s, with the op's ``chunk_rows`` (``call.options``). ``dtype``: the partials'
    (``a``'s when None)."""
    dtype = dtype or a.dtype
    backend = call.backend
    ws = call.memory.workspace(backend, nbytes)
    ws.ensure_block_flags(BLOCK_FLAGS)
    if send_bytes:
        ws.ensure_local(send_bytes)  # before the plans: growing it drops them
    mc = m // backend.world_size
    blocks = blocks or blocks_for(mc, a.shape[1], n, chunk_rows=call.options.get("chunk_rows", 0))
    key = (kind, m, n, dtype, blocks)
    entry = ws.plans.get(key)
    if entry is None:
        entry = ws.plans[key] = build(ws, backend, mc, n, dtype, blocks)
    return ws, entry
