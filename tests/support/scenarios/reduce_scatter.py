"""GEMM+ReduceScatter on emulated ranks (or GPUs): every transport, padded outputs."""

from __future__ import annotations

import dataclasses
import time

import torch

import tileweave
from tileweave.runtime.backend import set_producer_delay
from support.scenarios.common import Case, device_name, randn, rel_err, weight_b


def gemm_reduce_scatter_check(rank: int, world: int, cases: list[Case]) -> list[dict]:
    """Run each case ``iters`` times through one ``GemmReduceScatter``; also re-run the last inputs to
    check that the output is bitwise the same."""
    device = device_name()
    # "chunked" cases push (pull=False); pulling is the default at two ranks, and cases with pull=True take it.
    ops = {"chunked": tileweave.GemmReduceScatter(policy="fused", transport="chunked", pull=False)}
    ops["oneshot"] = tileweave.GemmReduceScatter(policy="oneshot")
    graphable = tileweave.GemmReduceScatter(policy="fused", transport="chunked", graphable=True)
    pulling = tileweave.GemmReduceScatter(policy="fused", transport="chunked", pull=True)
    results = []
    for case in cases:
        dtype = getattr(torch, case.dtype)
        op = graphable if case.graphable else pulling if case.pull else ops[case.transport or "chunked"]
        if case.chunk_rows:
            op.chunk_rows = case.chunk_rows
        set_producer_delay(case.delay_s if rank == case.straggler else 0.0)
        m = case.m_chunk * world
        for it in range(case.iters):
            seed = (case.seed, case.m_chunk, case.k, case.n, it)
            a_all = [randn((m, case.k), dtype, *seed, "a", p, device=device) for p in range(world)]
            b_all = [weight_b(case, case.k, case.n, dtype, *seed, "b", p, device=device) for p in range(world)]
            bias = randn((case.n,), dtype, *seed, "bias", device=device) if case.bias else None
            out = torch.full((case.m_chunk, case.n), float("nan"), dtype=dtype, device=device)
            if case.transport == "oneshot" and rank == case.straggler:
                time.sleep(case.delay_s)  # the others' kernels wait in their flag spin meanwhile
            out = op(a_all[rank], b_all[rank], bias=bias, out=out)
            ref = sum(a.double() @ b.double() for a, b in zip(a_all, b_all))
            if bias is not None:
                ref = ref + bias.double()
            ref = ref[rank * case.m_chunk:(rank + 1) * case.m_chunk]
            # Without an out (and a bias), a repeat of a decided call takes its plan at once: no checks.
            again = op(a_all[rank], b_all[rank], bias=bias)
            local = op.workspace.local if op.workspace is not None else None
            plan = op.plans[op.signature(a_all[rank], b_all[rank], bias)]
            results.append({"case": dataclasses.asdict(case), "iter": it, "path": tileweave.last_path("gemm_reduce_scatter"),
                            "err": rel_err(out, ref), "deterministic": bool(torch.equal(out, again)),
                            "local_bytes": 0 if local is None else local.numel(),
                            "route": f"{plan.path}:{plan.run.__module__.rsplit('.', 1)[-1]}"})
    set_producer_delay(0.0)
    return results


def rs_padded_out_check(rank: int, world: int, m_chunk: int = 24, k: int = 32, n: int = 40) -> dict[str, float]:
    """Errors of ``GemmReduceScatter`` calls into an ``out`` whose rows are padded (a column slice of a
    wider tensor), per policy: a pulling op ("fused"; the pulls need contiguous rows, so such a call
    pushes) and the one-shot path ("oneshot", whose kernel writes the rows by their stride)."""
    device = device_name()
    a_all = [randn((m_chunk * world, k), torch.float16, "padded", "a", p, device=device) for p in range(world)]
    b_all = [randn((k, n), torch.float16, "padded", "b", p, device=device) for p in range(world)]
    ref = sum(a.double() @ b.double() for a, b in zip(a_all, b_all))[rank * m_chunk:(rank + 1) * m_chunk]
    errors = {}
    for policy in ("fused", "oneshot"):
        op = tileweave.GemmReduceScatter(policy=policy, transport="chunked", pull=True)
        wide = torch.full((m_chunk, n + 8), float("nan"), dtype=torch.float16, device=device)
        errors[policy] = rel_err(op(a_all[rank], b_all[rank], out=wide[:, :n]), ref)
    return errors
