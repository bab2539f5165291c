"""The CPU demo: the fused ops on emulated ranks, checked against a float64 reference: the dense pair
(AllGather+GEMM, GEMM+ReduceScatter), the MoE pair (AllGather + grouped GEMM over a routing plan;
grouped GEMM + top-k reduce + ReduceScatter) and the decode GEMM+AllReduce with residual and RMSNorm.

Runs where there is no GPU: W CPU processes share a symmetric heap, and each runs the real Triton
kernels in the interpreter while a producer thread moves the shards and writes the flags, exactly as
the copy engines do on GPUs. It proves the ops and their flag protocol, not their speed.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
import zlib

import torch
import torch.distributed as dist

import tileweave
from tileweave.testing.emulated import RankFailed, run_ranks

MAX_WORLD_SIZE = 16
"""Emulated ranks are CPU processes running the interpreter: beyond this many a demo takes hours."""


@dataclasses.dataclass(frozen=True)
class Case:
    """One problem of the demo: ``m_chunk`` rows per rank, each rank's GEMM ``K x N``."""

    m_chunk: int
    k: int
    n: int
    dtype: str = "float16"
    bias: bool = False
    iters: int = 2
    """Calls with fresh inputs each (the flags' epochs advance)."""


def _randn(shape, dtype: torch.dtype, *seed_parts) -> torch.Tensor:
    """Inputs from seeds, so that every rank can rebuild every rank's (zlib.crc32: the same in every
    process, unlike ``hash``)."""
    g = torch.Generator().manual_seed(zlib.crc32(repr(seed_parts).encode()))
    return torch.randn(*shape, generator=g, dtype=torch.float32).to(dtype)


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    got = got.double()
    if not torch.isfinite(got).all():
        return float("inf")
    return ((got - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def all_gather_gemm_rank(rank: int, world: int, cases: list[Case]) -> list[dict]:
    """One rank of the AllGather + GEMM check: each call's error against the float64 product of the full
    inputs, and whether the gathered input is exactly the ranks' shards. The output and the gather
    buffer start as NaN, so a tile read before its shard's flag, or never written, shows."""
    op = tileweave.AllGatherGemm(policy="fused", transport="mesh")
    rows = []
    for case in cases:
        dtype = getattr(torch, case.dtype)
        m = case.m_chunk * world
        for it in range(case.iters):
            seed = (case.m_chunk, case.k, case.n, it)
            shards = [_randn((case.m_chunk, case.k), dtype, *seed, "a", p) for p in range(world)]
            b = _randn((case.n, case.k), dtype, *seed, "b", rank).t()  # an nn.Linear weight, transposed
            bias = _randn((case.n,), dtype, *seed, "bias", rank) if case.bias else None
            out = torch.full((m, case.n), float("nan"), dtype=dtype)
            op.gather_buffer(m, case.k, dtype, torch.device("cpu")).fill_(float("nan"))
            dist.barrier()
            out, gathered = op(shards[rank], b, bias=bias, out=out, return_gathered=True)
            full_a = torch.cat(shards).double()
            ref = full_a @ b.double() + (bias.double() if bias is not None else 0)
            rows.append({"dtype": case.dtype, "err": _rel_err(out, ref),
                         "gathered_exact": torch.equal(gathered.double(), full_a)})
            dist.barrier()
    return rows


def gemm_reduce_scatter_rank(rank: int, world: int, cases: list[Case]) -> list[dict]:
    """One rank of the GEMM + ReduceScatter check: each call's error against this rank's rows of the
    float64 sum of every rank's product, and whether a second call on the same inputs gives the same
    bits."""
    op = tileweave.GemmReduceScatter(policy="fused", transport="chunked", pull=False)
    rows = []
    for case in cases:
        dtype = getattr(torch, case.dtype)
        m = case.m_chunk * world
        for it in range(case.iters):
            seed = (case.m_chunk, case.k, case.n, it)
            a_all = [_randn((m, case.k), dtype, *seed, "a", p) for p in range(world)]
            b_all = [_randn((case.n, case.k), dtype, *seed, "b", p).t() for p in range(world)]
            bias = _randn((case.n,), dtype, *seed, "bias") if case.bias else None
            out = torch.full((case.m_chunk, case.n), float("nan"), dtype=dtype)
            out = op(a_all[rank], b_all[rank], bias=bias, out=out)
            ref = sum(a.double() @ b.double() for a, b in zip(a_all, b_all))
            if bias is not None:
                ref = ref + bias.double()
            ref = ref[rank * case.m_chunk:(rank + 1) * case.m_chunk]
            again = op(a_all[rank], b_all[rank], bias=bias)
            rows.append({"dtype": case.dtype, "err": _rel_err(out, ref), "deterministic": torch.equal(out, again)})
    return rows


@dataclasses.dataclass(frozen=True)
class MoECase:
    """One MoE problem: ``tokens_per_rank`` tokens of ``hidden`` per rank, ``experts`` experts of
    ``f_loc`` columns per rank, ``topk`` experts per token."""

    tokens_per_rank: int = 12
    hidden: int = 32
    f_loc: int = 16
    experts: int = 4
    topk: int = 2


def moe_rank(rank: int, world: int, case: MoECase) -> list[dict]:
    """One rank of the MoE pair's check: layer 0 (every token's rows for its experts, gathered from
    every rank) and layer 1 (the weighted top-k sum over the experts and over the ranks' F shards) of
    this rank's tokens against float64."""
    tc, h, f, e, k = case.tokens_per_rank, case.hidden, case.f_loc, case.experts, case.topk
    t = tc * world
    mine = slice(rank * tc, (rank + 1) * tc)
    g = torch.Generator().manual_seed(7)
    ids = torch.rand(t, e, generator=g).topk(k, dim=1).indices  # k distinct experts per token
    weights = torch.rand(t, k, generator=g)
    x = _randn((t, h), torch.float32, "moe-x")
    w0 = [_randn((e, h, f), torch.float32, "moe-w0", r) / h ** 0.5 for r in range(world)]
    w1 = [_randn((e, f, h), torch.float32, "moe-w1", r) / f ** 0.5 for r in range(world)]
    plan = tileweave.moe_plan(ids[mine], num_experts=e)
    y = tileweave.MoEAllGatherGemm(policy="fused")(x[mine], w0[rank], plan)
    out = tileweave.MoEGemmReduceScatter(policy="fused")(y, w1[rank], plan, weights[mine])
    # Layer 0's rows, per (token, slot): pair_row says where the plan put each.
    y_pairs = y[plan.pair_row.reshape(-1).long()].view(t, k, f).double()
    y_ref = torch.einsum("th,tjhf->tjf", x.double(), w0[rank].double()[ids])
    out_ref = sum(torch.einsum("tjf,tjfh,tj->th", torch.einsum("th,tjhf->tjf", x.double(), w0[r].double()[ids]),
                               w1[r].double()[ids], weights.double()) for r in range(world))
    return [{"dtype": "float32", "err": max(_rel_err(y_pairs, y_ref), _rel_err(out, out_ref[mine])),
             "plan_exact": bool((plan.row_expert.long()[plan.pair_row.reshape(-1).long()] == ids.reshape(-1)).all())}]


def gemm_all_reduce_rank(rank: int, world: int, m: int, k_loc: int, n: int) -> list[dict]:
    """One rank of the decode GEMM+AllReduce's check with the residual add and RMSNorm fused: both
    outputs against float64, and whether every rank got the same bits."""
    a = _randn((m, k_loc), torch.float32, "ar-a", rank)
    b = _randn((k_loc, n), torch.float32, "ar-b", rank)
    residual, norm = _randn((m, n), torch.float32, "ar-r"), _randn((n,), torch.float32, "ar-g")
    normed, resid = tileweave.GemmAllReduce(policy="oneshot")(a, b, residual=residual, norm_weight=norm)
    total = sum(_randn((m, k_loc), torch.float32, "ar-a", r).double() @ _randn((k_loc, n), torch.float32, "ar-b", r)
                .double() for r in range(world)) + residual.double()
    normed_ref = total * torch.rsqrt(total.square().mean(-1, keepdim=True) + 1e-6) * norm.double()
    everyone = [torch.empty_like(normed) for _ in range(world)]
    dist.all_gather(everyone, normed)
    return [{"dtype": "float32", "err": max(_rel_err(normed, normed_ref), _rel_err(resid, total)),
             "same_on_every_rank": all(torch.equal(other, normed) for other in everyone)}]


def _world_size(text: str) -> int:
    """``--world-size``: an int in [1, MAX_WORLD_SIZE], or an argparse error that says so."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number of ranks, got {text!r}") from None
    if not 1 <= value <= MAX_WORLD_SIZE:
        raise argparse.ArgumentTypeError(f"expected between 1 and {MAX_WORLD_SIZE} ranks, got {value}")
    return value


def main(argv=None) -> int:
    """``tileweave demo [--world-size W]``; returns the exit code (0: every check passed; 1: a check
    failed or a rank failed; 2: bad options, reported by argparse)."""
    parser = argparse.ArgumentParser(prog="tileweave demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=_world_size, default=2,
                        help=f"emulated ranks, 1 to {MAX_WORLD_SIZE} (default 2)")
    args = parser.parse_args(argv)
    w = args.world_size
    cases = [Case(m_chunk=48, k=64, n=80, bias=True), Case(m_chunk=17, k=40, n=24, dtype="float32")]
    tol = {"float16": 2e-3, "float32": 1e-5}
    print(f"tileweave demo: {w} emulated ranks on the CPU, Triton kernels in the interpreter")
    failures = 0
    checks = (("all_gather_gemm", all_gather_gemm_rank, (cases,), "gathered_exact"),
              ("gemm_reduce_scatter", gemm_reduce_scatter_rank, (cases,), "deterministic"),
              ("moe pair", moe_rank, (MoECase(),), "plan_exact"),
              ("gemm_all_reduce+norm", gemm_all_reduce_rank, (4, 16, 24), "same_on_every_rank"))
    for title, fn, args, key in checks:
        start = time.monotonic()
        try:
            rows = [row for per_rank in run_ranks(w, fn, *args) for row in per_rank]
        except RankFailed as exc:
            print(f"  {title:20s} FAILED: {exc}")
            failures += 1
            continue
        worst = max(row["err"] / tol[row["dtype"]] for row in rows)
        ok = worst < 1 and all(row[key] for row in rows)
        failures += not ok
        print(f"  {title:20s} {len(rows):2d} calls  worst error {worst:.2f} of tolerance  "
              f"{key}={all(row[key] for row in rows)}  {'OK' if ok else 'FAILED'}  ({time.monotonic() - start:.1f} s)")
    print("Speed figures need two or more NVIDIA GPUs with peer access: there, `tileweave bench` (or this "
          "same command) runs the benchmark against NCCL+cuBLAS and PyTorch async-TP.")
    return 1 if failures else 0
