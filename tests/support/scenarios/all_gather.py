"""AllGather+GEMM on emulated ranks (or GPUs): every transport, stream-K tails, lent buffers."""

from __future__ import annotations

import dataclasses
import time
import weakref

import torch
import torch.distributed as dist

import tileweave
from tileweave.ops.all_gather import rule
from tileweave.ops.compute import gemm_launch
from tileweave.ops.workspace import ONESHOT_HEADER
from tileweave.runtime.backend import TileweaveError
from tileweave.tune.configs import GemmConfig
from tileweave.runtime.backend import set_producer_delay
from support.scenarios.common import Case, device_name, randn, rel_err, weight_b


def all_gather_call(op, case: Case, it: int, rank: int, world: int, device: str) -> dict:
    """One call of ``op`` on fresh inputs of ``case`` (output and gather buffer poisoned first), checked.
    Odd calls pass a poisoned ``gathered_out``, which the copy stream fills only after each shard's flag
    (a copy that does not wait copies the poisoned gather buffer)."""
    dtype = getattr(torch, case.dtype)
    set_producer_delay(case.delay_s if rank == case.straggler else 0.0)
    m = case.m_chunk * world
    seed = (case.seed, case.m_chunk, case.k, case.n, it)
    shards = [randn((case.m_chunk, case.k), dtype, *seed, "a", p, device=device) for p in range(world)]
    b = weight_b(case, case.k, case.n, dtype, *seed, "b", rank, device=device)
    bias = randn((case.n,), dtype, *seed, "bias", rank, device=device) if case.bias else None
    out = torch.full((m, case.n), float("nan"), dtype=dtype, device=device)
    # Poison the gather buffers too: a consumer that does not wait for a shard reads NaN.
    op.gather_buffer(m, case.k, dtype, torch.device(device)).fill_(float("nan"))
    oneshot = case.ag_transport == "oneshot"
    if oneshot and op.workspace.oneshot is not None:
        op.workspace.oneshot.views[rank][ONESHOT_HEADER:].fill_(255)  # NaN in every float dtype
    gathered_out = torch.full((m, case.k), float("nan"), dtype=dtype, device=device) if it % 2 else None
    dist.barrier()
    if oneshot and rank == case.straggler:
        time.sleep(case.delay_s)  # the others' kernels wait in their flag spin meanwhile
    if gathered_out is None:
        out, gathered = op(shards[rank], b, bias=bias, out=out, return_gathered=True)
    else:
        out, gathered = op(shards[rank], b, bias=bias, out=out, gathered_out=gathered_out)
    full_a = torch.cat(shards).double()
    ref = full_a @ b.double() + (bias.double() if bias is not None else 0)
    exact = torch.equal(gathered.double(), full_a) and (gathered_out is None or gathered is gathered_out)
    result = {"case": dataclasses.asdict(case), "iter": it, "path": tileweave.last_path("all_gather_gemm"),
              "err": rel_err(out, ref), "gathered_exact": bool(exact)}
    if oneshot and device != "cpu":
        torch.cuda.synchronize()  # before the next call poisons a buffer a peer may still be reading
    dist.barrier()
    set_producer_delay(0.0)
    return result


def all_gather_gemm_check(rank: int, world: int, cases: list[Case]) -> list[dict]:
    """Run each case ``iters`` times through one ``AllGatherGemm``; return the errors per call."""
    device = device_name()
    ops = {(t, False): tileweave.AllGatherGemm(policy="fused", transport=t) for t in ("mesh", "ring", "chunked")}
    ops.update({(t, True): tileweave.AllGatherGemm(policy="fused", transport=t, graphable=True)
                for t in ("mesh", "ring", "chunked")})
    ops["oneshot", False] = tileweave.AllGatherGemm(policy="oneshot")
    return [all_gather_call(ops[case.ag_transport, case.graphable], case, it, rank, world, device)
            for case in cases for it in range(case.iters)]


def all_gather_stream_k_check(rank: int, world: int, cases: list[Case], programs: int) -> list[dict]:
    """The fused kernel with its partial last wave shared by K steps (``stream_k=True``) on ``cases`` as
    ``all_gather_gemm_check`` runs them: 32 x 32 tiles over ``programs`` programs, or with ``programs``
    0 the op's own configuration (GPUs); each result also says whether the launch took the stream-K
    tail and whether every tile's arrival count is back at 0."""
    config = GemmConfig(block_m=32, block_n=32, block_k=32, group_m=2, num_stages=1, num_warps=4,
                        flatten=False, programs=programs, stream_k=True) if programs else None
    device = device_name()
    ops = {t: tileweave.AllGatherGemm(policy="fused", transport=t, config=config, stream_k=True)
           for t in ("mesh", "ring")}
    results = []
    gemm_launch._fused_plans.clear()
    for case in cases:
        for it in range(case.iters):  # later calls of a shape relaunch its cached plan
            result = all_gather_call(ops[case.ag_transport], case, it, rank, world, device)
            tails = [plan.stream_k is not None for plan in gemm_launch._fused_plans.values()]
            counts_clear = all(int(locks.count_nonzero()) == 0 for _, locks in gemm_launch._stream_k_kept.values())
            results.append({**result, "stream_k": bool(tails) and all(tails), "counts_clear": counts_clear})
    return results


def lent_gathered_check(rank: int, world: int, transport: str, graphable: bool, calls: int = 3,
                        hold_s: float = 0.5) -> list[bool]:
    """Whether the gathered input a call returns (``return_gathered`` without ``gathered_out``) is still
    intact after rank 0 has held it for ``hold_s``, call after call, while the other ranks ran ahead
    into their next call, whose shards would land in that buffer were it already released."""
    device = device_name()
    op = tileweave.AllGatherGemm(policy="fused", transport=transport, graphable=graphable)
    case = Case(m_chunk=16, k=32, n=24)
    b = weight_b(case, case.k, case.n, torch.float16, "lent", "b", rank, device=device)
    intact = []
    for it in range(calls):
        shards = [randn((case.m_chunk, case.k), torch.float16, "lent", it, p, device=device) for p in range(world)]
        _, gathered = op(shards[rank], b, return_gathered=True)
        if rank == 0:
            time.sleep(hold_s)
        intact.append(bool(torch.equal(gathered, torch.cat(shards))))
    dist.barrier()
    return intact


def all_gather_auto_transport_check(rank: int, world: int, cases: list[Case], rounds: int,
                                    chunked_below_n: int, graphable: bool = False) -> list[dict]:
    """One ``AllGatherGemm(transport="auto")`` called on the cases in turn, ``rounds`` times, with the
    per-shape choice replaced by "chunked below ``chunked_below_n`` output columns, else the kernel", so
    that consecutive calls switch transport and must share the workspace's epochs and release flags."""
    def by_width(m, n_local, k, world, dtype, *, interpreter=False):
        return "chunked" if n_local < chunked_below_n else "mesh"

    rule.all_gather_transport = by_width
    device = device_name()
    op = tileweave.AllGatherGemm(policy="fused", graphable=graphable)
    return [all_gather_call(op, case, it, rank, world, device) for it in range(rounds) for case in cases]


def all_gather_only_check(rank: int, world: int, transport: str, iters: int, straggler: int,
                          graphable: bool = False, fp8: bool = False, policy: str = "fused") -> dict:
    """``AllGatherGemm.all_gather`` alone and interleaved with fused calls on the same op: every
    gathered tensor equals the concatenated shards, bitwise, call after call with fresh inputs; ``fp8``:
    float8 rows with two block scales per row, the gathered scales equal to the concatenated ones too,
    and ``"refusals"``: the errors of float8 rows without scales and of scales with float16 rows."""
    device = device_name()
    op = tileweave.AllGatherGemm(policy=policy, transport=transport, graphable=graphable)
    refusals = []
    if fp8:  # refused before any communication, on every rank alike
        row8, row16 = torch.zeros(7, 256, device=device).to(torch.float8_e4m3fn), torch.zeros(7, 24, device=device)
        ones = torch.ones(7, 1, device=device)
        # the last: only rank 0's scales are wrong (float64), and every rank must fail
        for args in ((row8, None), (row16, ones), (row8, ones.double() if rank == 0 else ones)):
            try:
                op.all_gather(args[0], scales=args[1])
                refusals.append("no error")
            except (TypeError, TileweaveError) as exc:
                refusals.append(str(exc))
    set_producer_delay(0.2 if rank == straggler else 0.0)
    exact, fused_err = True, 0.0
    for it in range(iters):
        shards = [randn((7, 24), torch.float16, "gather", it, p, device=device) for p in range(world)]
        if fp8:
            exact &= _float8_gather_exact(op, rank, world, it, device)
        else:
            pending = op.all_gather(shards[rank])
            gathered = pending.wait().clone()
            pending.release()
            exact &= bool(torch.equal(gathered, torch.cat(shards)))
        b = randn((24, 16), torch.float16, "gather-b", it, device=device)
        out = op(shards[rank], b)  # the next epoch on the same buffer and flags
        ref = torch.cat(shards).double() @ b.double()
        fused_err = max(fused_err, rel_err(out, ref))
    set_producer_delay(0.0)
    return {"exact": exact, "fused_err": fused_err, "refusals": refusals}


def _float8_gather_exact(op, rank: int, world: int, it: int, device) -> bool:
    """One ``op.all_gather`` of float8 rows with ``[7, 2]`` scales: whether the gathered bytes and scales
    are every rank's, in rank order."""
    shards = [(30 * randn((7, 256), torch.float32, "gather8", it, p, device=device)).clamp(-448, 448)
              .to(torch.float8_e4m3fn) for p in range(world)]
    scales = [randn((7, 2), torch.float32, "gather8-s", it, p, device=device).abs() for p in range(world)]
    pending = op.all_gather(shards[rank], scales=scales[rank])
    gathered = pending.wait().clone()
    same_scales = bool(torch.equal(pending.gathered_scales, torch.cat(scales)))
    pending.release()
    return same_scales and bool(torch.equal(gathered.view(torch.uint8), torch.cat(shards).view(torch.uint8)))


def dropped_sources_check(rank: int, world: int, fp8: bool, iters: int = 4) -> list[bool]:
    """``AllGatherGemm.all_gather`` of a shard (and, ``fp8``, its scales) that the caller drops as soon as
    the call returns, while the copy into rank 1's buffer waits for rank 1, whose stream releases the
    previous call late (no barrier between the calls: the host of each rank runs on). Meanwhile the
    caller makes tensors of the sources' sizes until the allocator hands out a dropped source's memory
    (or gives up), and writes them. Per call, whether every gathered row (and scale) is its source's,
    bitwise."""
    device = device_name()
    op = tileweave.AllGatherGemm(policy="fused")
    rows, k = 2000, 1024

    def shard(it: int, p: int) -> torch.Tensor:
        x = randn((rows, k), torch.float32, "dropped", it, p, device=device)
        return (30 * x).clamp(-448, 448).to(torch.float8_e4m3fn) if fp8 else x.to(torch.bfloat16)

    def scales(it: int, p: int) -> torch.Tensor:
        return randn((rows, 1), torch.float32, "dropped-s", it, p, device=device).abs() + 0.5

    def land_on(address: int, shape: tuple, dtype: torch.dtype, value) -> list[torch.Tensor]:
        # Tensors of a dropped source's size, each written, until one sits where the source was.
        made = []
        for _ in range(64):
            made.append(torch.full(shape, value, dtype=dtype, device=device))
            if made[-1].data_ptr() == address:
                break
        return made

    exact = []
    dist.barrier()
    for it in range(iters):
        src = shard(it, rank)
        src_scales = scales(it, rank) if fp8 else None
        addresses = (src.data_ptr(), None if src_scales is None else src_scales.data_ptr())
        pending = op.all_gather(src, **({"scales": src_scales} if fp8 else {}))
        del src, src_scales
        junk = land_on(addresses[0], (rows, k), torch.uint8 if fp8 else torch.bfloat16, 0x7E if fp8 else 7)
        if fp8:
            junk += land_on(addresses[1], (rows, 1), torch.float32, -1.0)
        gathered = pending.wait().clone()
        got_scales = pending.gathered_scales.clone() if fp8 else None
        if rank == 1:  # the release's flags wait behind 0.2-0.4 s of this stream; the host runs on
            torch.cuda._sleep(400_000_000)
        pending.release()
        del junk
        want = torch.cat([shard(it, p) for p in range(world)])
        ok = torch.equal(gathered.view(torch.uint8), want.view(torch.uint8)) if fp8 else torch.equal(gathered, want)
        if fp8:
            ok = ok and torch.equal(got_scales, torch.cat([scales(it, p) for p in range(world)]))
        exact.append(bool(ok))
    torch.cuda.synchronize()
    dist.barrier()
    return exact


def gather_holds_sources_check(rank: int, world: int) -> dict:
    """Whether ``AllGatherGemm.all_gather`` keeps the shard and the scales it was given alive after the
    caller dropped them, until ``release()``, and lets them go then (float8 rows with scales, then
    float16 rows)."""
    device = device_name()
    op = tileweave.AllGatherGemm(policy="fused")
    out = {}
    for kind in ("float8", "float16"):
        rows = randn((7, 256), torch.float32, "hold", kind, rank, device=device)
        src = (30 * rows).clamp(-448, 448).to(torch.float8_e4m3fn) if kind == "float8" else rows.half()
        src_scales = torch.ones((7, 2), device=device) if kind == "float8" else None
        refs = [weakref.ref(t) for t in (src, src_scales) if t is not None]
        pending = op.all_gather(src, scales=src_scales)
        del src, src_scales
        pending.wait()  # every copy issued so far has run: only the call itself can still hold them
        held = all(r() is not None for r in refs)
        pending.release()
        out[kind] = (held, all(r() is None for r in refs))
    return out
