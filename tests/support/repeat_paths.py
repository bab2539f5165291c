"""Repeated calls of the fused ops, each call's path recorded through ``tileweave.last_path``."""

from __future__ import annotations

import torch
import torch.distributed as dist

import tileweave


def _randn(shape: tuple[int, ...], dtype: torch.dtype, seed: int, device: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen, dtype=torch.float32).to(dtype=dtype, device=device)


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    if not torch.isfinite(got).all():
        return float("inf")
    return ((got.double() - ref).norm() / ref.norm()).item()


def back_to_back_paths_check(rank: int, world: int, m_chunk: int, k: int, n: int, calls: int, dtype: str,
                             transport: str) -> dict:
    """``calls`` AG and RS calls of one signature in a row, fresh inputs each, no host sync or barrier
    between them; the path of each call (``tileweave.last_path``, read right after it) and the worst
    relative error against float64 of the unsharded inputs. ``transport``: "oneshot" (both ops'
    one-shot policy) or the GEMM+ReduceScatter transport of the fused policy."""
    device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
    dt = getattr(torch, dtype)
    oneshot = transport == "oneshot"
    ag = tileweave.AllGatherGemm(policy="oneshot" if oneshot else "fused")
    rs = (tileweave.GemmReduceScatter(policy="oneshot") if oneshot
          else tileweave.GemmReduceScatter(policy="fused", transport=transport))
    inputs = []
    for i in range(calls):
        seed = 7_000 + 100 * i
        shards = [_randn((m_chunk, k), dt, seed + p, device) for p in range(world)]
        b_ag = _randn((n, k), dt, seed + 50 + rank, device).t()
        a_rs = [_randn((m_chunk * world, k), dt, seed + 20 + p, device) for p in range(world)]
        b_rs = [_randn((n, k), dt, seed + 70 + p, device).t() for p in range(world)]
        inputs.append((shards, b_ag, a_rs, b_rs))
    dist.barrier()
    outs, paths = [], {"ag": [], "rs": []}
    for shards, b_ag, a_rs, b_rs in inputs:
        o_ag = ag(shards[rank], b_ag)
        paths["ag"].append(tileweave.last_path("all_gather_gemm"))
        o_rs = rs(a_rs[rank], b_rs[rank])
        paths["rs"].append(tileweave.last_path("gemm_reduce_scatter"))
        outs.append((o_ag, o_rs))
    worst = {"ag": 0.0, "rs": 0.0}
    for (shards, b_ag, a_rs, b_rs), (o_ag, o_rs) in zip(inputs, outs):
        ref_ag = torch.cat(shards).double() @ b_ag.double()
        ref_rs = sum(a.double() @ b.double() for a, b in zip(a_rs, b_rs))[rank * m_chunk:(rank + 1) * m_chunk]
        worst["ag"] = max(worst["ag"], _rel_err(o_ag, ref_ag))
        worst["rs"] = max(worst["rs"], _rel_err(o_rs, ref_rs))
    return {"paths": paths, "worst": worst}
