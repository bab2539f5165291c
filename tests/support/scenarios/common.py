"""The cases, seeded inputs and error measure every scenario shares.

Inputs are regenerated from seeds: every rank can rebuild every other rank's inputs, so the reference
(float64 ``torch`` on the full, unsharded problem) needs no collective and shares no code with the ops.
"""

from __future__ import annotations

import dataclasses
import zlib

import torch

import tileweave


@dataclasses.dataclass(frozen=True)
class GemmCase:
    """What every op's case says: the GEMM each rank runs and how the op is called. Keyword-only fields,
    after those of the op's case."""

    _: dataclasses.KW_ONLY
    k: int
    """K of each rank's GEMM: all of K for AllGather + GEMM; the rank's K_loc for the ops that sum over
    ranks (GEMM + AllReduce: rank 0's, rank p has ``k + p``)."""
    n: int
    dtype: str = "float16"
    bias: bool = False
    graphable: bool = False
    """The op with constant-valued (CUDA-graph replayable) flags (all-gather: every transport;
    reduce-scatter: chunked; all-reduce: both fused transports)."""
    weight_layout: bool = True
    """Pass b as ``weight.t()`` of an ``[N, K]`` weight (else a row-major ``[K, N]``), K as in ``k``."""
    iters: int = 2
    """Calls with fresh inputs each (epochs advance)."""
    straggler: int = -1
    """Rank that is late by ``delay_s`` in each call (-1: none): its producer is delayed, or on a path
    without one (the one-shot paths, GEMM + AllReduce) it sleeps before each call."""
    delay_s: float = 0.0
    seed: int = 0


@dataclasses.dataclass(frozen=True)
class Case(GemmCase):
    """A case of AllGather + GEMM or GEMM + ReduceScatter: M per rank and the transport."""

    m_chunk: int
    """Rows per rank (M / W)."""
    transport: str = ""
    """Reduce-scatter transport: "chunked" (also for ""); "oneshot": the one-shot path
    (``policy="oneshot"``)."""
    ag_transport: str = "mesh"
    """All-gather transport: "mesh", "ring" or "chunked"; "oneshot": the one-shot path
    (``policy="oneshot"``)."""
    chunk_rows: int = 0
    """Chunked reduce-scatter: rows per block (0: the op's default)."""
    pull: bool = False
    """Chunked reduce-scatter: the owner pulls the peer's blocks into its output (``GemmReduceScatter.pull``;
    False: the push variant, though pulling is the default at two ranks)."""


def randn(shape, dtype, *seed_parts, device="cpu"):
    # zlib.crc32, not hash(): string hashing is salted per process and every rank must agree.
    g = torch.Generator().manual_seed(zlib.crc32(repr(seed_parts).encode()))
    return torch.randn(*shape, generator=g, dtype=torch.float32).to(dtype=dtype, device=device)


def weight_b(case: Case, rows: int, cols: int, dtype, *seed, device):
    if case.weight_layout:
        return randn((cols, rows), dtype, *seed, device=device).t()
    return randn((rows, cols), dtype, *seed, device=device)


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    got = got.double()
    if not torch.isfinite(got).all():
        return float("inf")
    return ((got - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def device_name() -> str:
    return f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"


def shared_ops_graphable() -> bool:
    """Whether the ops that the functional API and the TP layers share were made graphable (and exist)."""
    ops = [op for cls in (tileweave.AllGatherGemm, tileweave.GemmReduceScatter) for op in cls._shared.values()]
    return bool(ops) and all(op.graphable for op in ops)


def compiled(fn, *args):
    """``(result, graphs, ops)``: ``fn(*args)`` under ``torch.compile(fullgraph=True)`` with a backend that
    records the graphs it is given and runs them as traced; ``ops``: the sorted ``torch.ops.tileweave``
    targets in them."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    result = torch.compile(fn, backend=backend, fullgraph=True)(*args)
    nodes = [str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"]
    return result, len(graphs), sorted(n for n in nodes if "tileweave" in n)
