"""Per-rank checks of the fused ops, run on emulated ranks by the tests and the CPU demo, and on GPUs by
the GPU tests. Each returns plain data (errors, flags) so that the caller asserts.

Inputs are regenerated from seeds: every rank can rebuild every other rank's inputs, so the reference
(float64 ``torch`` on the full, unsharded problem) needs no collective and shares no code with the ops.
"""

from __future__ import annotations

import dataclasses
import os
import time
import zlib

import torch
import torch.distributed as dist

import tileweave
from tileweave.ops.workspace import ONESHOT_HEADER
from tileweave.runtime.backend import set_producer_delay
from tileweave.testing import references


@dataclasses.dataclass(frozen=True)
class Case:
    m_chunk: int
    """Rows per rank (M / W)."""
    k: int
    n: int
    dtype: str = "float16"
    weight_layout: bool = True
    """Pass b as ``weight.t()`` of an ``[N, K]`` weight (else a row-major ``[K, N]``)."""
    bias: bool = False
    iters: int = 2
    """Calls with fresh inputs each (epochs advance)."""
    straggler: int = -1
    """Rank whose producer is delayed by ``delay_s`` (-1: none)."""
    delay_s: float = 0.0
    seed: int = 0
    transport: str = "store"
    """Reduce-scatter transport: "store", "copy_engine" or "chunked"; "oneshot": the one-shot path
    (``policy="oneshot"``), whose straggler sleeps before each call instead (it has no producer)."""
    ag_transport: str = "mesh"
    """All-gather transport: "mesh", "ring" or "chunked"; "oneshot": the one-shot path
    (``policy="oneshot"``), whose straggler sleeps before each call instead (it has no producer)."""
    ce_release: str = "tile"
    """Copy-engine reduce-scatter: ``GemmConfig.ce_release`` (a case with another value gets its own op)."""
    chunk_rows: int = 0
    """Chunked reduce-scatter: rows per block (0: the op's default)."""
    graphable: bool = False
    """The op with constant-valued (CUDA-graph replayable) flags (all-gather: every transport;
    reduce-scatter: chunked)."""
    pull: bool = False
    """Chunked reduce-scatter: the owner pulls the peer's blocks into its output (``GemmReduceScatter.pull``;
    False: the push variant, though pulling is the default at two ranks)."""


def _randn(shape, dtype, *seed_parts, device="cpu"):
    # zlib.crc32, not hash(): string hashing is salted per process and every rank must agree.
    g = torch.Generator().manual_seed(zlib.crc32(repr(seed_parts).encode()))
    return torch.randn(*shape, generator=g, dtype=torch.float32).to(dtype=dtype, device=device)


def _b(case: Case, rows: int, cols: int, dtype, *seed, device):
    if case.weight_layout:
        return _randn((cols, rows), dtype, *seed, device=device).t()
    return _randn((rows, cols), dtype, *seed, device=device)


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    got = got.double()
    if not torch.isfinite(got).all():
        return float("inf")
    return ((got - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _device() -> str:
    return f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"


def _all_gather_call(op, case: Case, it: int, rank: int, world: int, device: str) -> dict:
    """One call of ``op`` on fresh inputs of ``case`` (output and gather buffer poisoned first), checked.
    Odd calls pass a poisoned ``gathered_out``, which the copy stream fills only after each shard's flag
    (a copy that does not wait copies the poisoned gather buffer)."""
    dtype = getattr(torch, case.dtype)
    set_producer_delay(case.delay_s if rank == case.straggler else 0.0)
    m = case.m_chunk * world
    seed = (case.seed, case.m_chunk, case.k, case.n, it)
    shards = [_randn((case.m_chunk, case.k), dtype, *seed, "a", p, device=device) for p in range(world)]
    b = _b(case, case.k, case.n, dtype, *seed, "b", rank, device=device)
    bias = _randn((case.n,), dtype, *seed, "bias", rank, device=device) if case.bias else None
    out = torch.full((m, case.n), float("nan"), dtype=dtype, device=device)
    # Poison the gather buffers too: a consumer that does not wait for a shard reads NaN.
    op.gather_buffer(m, case.k, dtype, torch.device(device)).fill_(float("nan"))
    oneshot = case.ag_transport == "oneshot"
    if oneshot and op._ws.oneshot is not None:
        op._ws.oneshot.views[rank][ONESHOT_HEADER:].fill_(255)  # NaN in every float dtype
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
              "err": _rel_err(out, ref), "gathered_exact": bool(exact)}
    if oneshot and device != "cpu":
        torch.cuda.synchronize()  # before the next call poisons a buffer a peer may still be reading
    dist.barrier()
    set_producer_delay(0.0)
    return result


def all_gather_gemm_check(rank: int, world: int, cases: list[Case]) -> list[dict]:
    """Run each case ``iters`` times through one ``AllGatherGemm``; return the errors per call."""
    device = _device()
    ops = {(t, False): tileweave.AllGatherGemm(policy="fused", transport=t) for t in ("mesh", "ring", "chunked")}
    ops.update({(t, True): tileweave.AllGatherGemm(policy="fused", transport=t, graphable=True)
                for t in ("mesh", "ring", "chunked")})
    ops["oneshot", False] = tileweave.AllGatherGemm(policy="oneshot")
    return [_all_gather_call(ops[case.ag_transport, case.graphable], case, it, rank, world, device)
            for case in cases for it in range(case.iters)]


def all_gather_stream_k_check(rank: int, world: int, cases: list[Case], programs: int) -> list[dict]:
    """The fused kernel with its partial last wave shared by K steps (``stream_k=True``) on ``cases`` as
    ``all_gather_gemm_check`` runs them: 32 x 32 tiles over ``programs`` programs, or with ``programs``
    0 the op's own configuration (GPUs); each result also says whether the launch took the stream-K
    tail and whether every tile's arrival count is back at 0."""
    from tileweave.ops import _launch
    from tileweave.tune.configs import GemmConfig

    config = GemmConfig(block_m=32, block_n=32, block_k=32, group_m=2, num_stages=1, num_warps=4,
                        flatten=False, programs=programs, stream_k=True) if programs else None
    device = _device()
    ops = {t: tileweave.AllGatherGemm(policy="fused", transport=t, config=config, stream_k=True)
           for t in ("mesh", "ring")}
    results = []
    _launch._fused_plans.clear()
    for case in cases:
        for it in range(case.iters):  # later calls of a shape relaunch its cached plan
            result = _all_gather_call(ops[case.ag_transport], case, it, rank, world, device)
            tails = [plan.stream_k is not None for plan in _launch._fused_plans.values()]
            counts_clear = all(int(locks.count_nonzero()) == 0 for _, locks in _launch._stream_k_kept.values())
            results.append({**result, "stream_k": bool(tails) and all(tails), "counts_clear": counts_clear})
    return results


def all_gather_head_split_check(rank: int, world: int, cases: list[Case], head: int) -> list[dict]:
    """The chunked transport with ``head_split`` on ``cases`` (fresh inputs, poisoned outputs and
    buffers, a ``gathered_out`` on odd calls, stragglers), the head's size fixed to ``head`` rows; each
    result also says whether the call took the head-split GEMMs."""
    from tileweave.ops.all_gather_gemm import AllGatherGemm
    from tileweave.tune import heuristics

    heuristics.all_gather_head_rows = lambda m_chunk, n_local, k, itemsize, *, local_copies: head
    taken = []
    split = AllGatherGemm._head_split_gemms

    def counted(*args, **kwargs):
        taken.append(True)
        return split(*args, **kwargs)

    AllGatherGemm._head_split_gemms = staticmethod(counted)
    device = _device()
    op = tileweave.AllGatherGemm(policy="fused", transport="chunked", head_split=True)
    results = []
    for case in cases:
        for it in range(case.iters):
            before = len(taken)
            result = _all_gather_call(op, case, it, rank, world, device)
            results.append({**result, "head_split": len(taken) > before})
    return results


def lent_gathered_check(rank: int, world: int, transport: str, graphable: bool, calls: int = 3,
                        hold_s: float = 0.5) -> list[bool]:
    """Whether the gathered input a call returns (``return_gathered`` without ``gathered_out``) is still
    intact after rank 0 has held it for ``hold_s``, call after call, while the other ranks ran ahead
    into their next call, whose shards would land in that buffer were it already released."""
    device = _device()
    op = tileweave.AllGatherGemm(policy="fused", transport=transport, graphable=graphable)
    case = Case(m_chunk=16, k=32, n=24)
    b = _b(case, case.k, case.n, torch.float16, "lent", "b", rank, device=device)
    intact = []
    for it in range(calls):
        shards = [_randn((case.m_chunk, case.k), torch.float16, "lent", it, p, device=device) for p in range(world)]
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
    from tileweave.tune import heuristics

    def by_width(m, n_local, k, world, dtype, *, interpreter=False):
        return "chunked" if n_local < chunked_below_n else "mesh"

    heuristics.all_gather_transport = by_width
    device = _device()
    op = tileweave.AllGatherGemm(policy="fused", graphable=graphable)
    return [_all_gather_call(op, case, it, rank, world, device) for it in range(rounds) for case in cases]


def gemm_reduce_scatter_check(rank: int, world: int, cases: list[Case]) -> list[dict]:
    """Run each case ``iters`` times through one ``GemmReduceScatter``; also re-run the last inputs to
    check that the output is bitwise the same."""
    device = _device()
    # "chunked" cases push (pull=False); pulling is the default at two ranks, and cases with pull=True take it.
    ops = {t: tileweave.GemmReduceScatter(policy="fused", transport=t, pull=False)
           for t in ("store", "copy_engine", "chunked")}
    ops["oneshot"] = tileweave.GemmReduceScatter(policy="oneshot")
    graphable = tileweave.GemmReduceScatter(policy="fused", transport="chunked", graphable=True)
    pulling = tileweave.GemmReduceScatter(policy="fused", transport="chunked", pull=True)
    results = []
    for case in cases:
        dtype = getattr(torch, case.dtype)
        op = graphable if case.graphable else pulling if case.pull else ops[case.transport]
        if case.chunk_rows:
            op.chunk_rows = case.chunk_rows
        if case.ce_release != "tile":
            from tileweave.tune.autotune import select_config

            config = select_config(case.m_chunk * world, case.n, case.k, dtype, torch.device(device),
                                   num_sms=torch.cuda.get_device_properties(device).multi_processor_count
                                   if device.startswith("cuda") else 4,
                                   interpreter=not device.startswith("cuda"))
            op = tileweave.GemmReduceScatter(policy="fused", transport="copy_engine",
                                             config=dataclasses.replace(config, ce_release=case.ce_release))
        set_producer_delay(case.delay_s if rank == case.straggler else 0.0)
        m = case.m_chunk * world
        for it in range(case.iters):
            seed = (case.seed, case.m_chunk, case.k, case.n, it)
            a_all = [_randn((m, case.k), dtype, *seed, "a", p, device=device) for p in range(world)]
            b_all = [_b(case, case.k, case.n, dtype, *seed, "b", p, device=device) for p in range(world)]
            bias = _randn((case.n,), dtype, *seed, "bias", device=device) if case.bias else None
            out = torch.full((case.m_chunk, case.n), float("nan"), dtype=dtype, device=device)
            if case.transport == "oneshot" and rank == case.straggler:
                time.sleep(case.delay_s)  # the others' kernels wait in their flag spin meanwhile
            out = op(a_all[rank], b_all[rank], bias=bias, out=out)
            ref = sum(a.double() @ b.double() for a, b in zip(a_all, b_all))
            if bias is not None:
                ref = ref + bias.double()
            ref = ref[rank * case.m_chunk:(rank + 1) * case.m_chunk]
            # Without an out (and a bias), a repeat of a decided call takes its route: no checks.
            again = op(a_all[rank], b_all[rank], bias=bias)
            local = op._ws.local if op._ws is not None else None
            signature, _ = op._unfused_route(a_all[rank], b_all[rank], None, None)
            results.append({"case": dataclasses.asdict(case), "iter": it, "path": tileweave.last_path("gemm_reduce_scatter"),
                            "err": _rel_err(out, ref), "deterministic": bool(torch.equal(out, again)),
                            "local_bytes": 0 if local is None else local.numel(),
                            "route": op._routes.get(signature, ("",))[0]})
    set_producer_delay(0.0)
    return results


def replay_check(rank: int, world: int, op_name: str, seed: int, m_chunk: int = 20, k: int = 24,
                 n: int = 32) -> dict:
    """An op with ``replay=True`` (on emulated ranks the graphs are stand-ins that rerun the captured
    call) on calls of one shape with fresh inputs: each shape's first call eager, then captures and
    replays; three weights, a bias, an ``out``; rank 1 moves a weight to a new address mid-way, so that
    it captures where rank 0 replays; more weights than the graphs kept (3 here). Returns per call the
    error against float64 and the path taken."""
    from tileweave.ops import _fused

    _fused.REPLAY_GRAPHS = 3
    device = _device()
    dtype = torch.float16
    cls = tileweave.AllGatherGemm if op_name == "ag" else tileweave.GemmReduceScatter
    op = cls(policy="auto", replay=True)
    rows = m_chunk if op_name == "ag" else m_chunk * world
    weights = [[_randn((n, k), dtype, seed, "w", j, p, device=device) / k ** 0.5 for j in range(3)]
               for p in range(world)]
    bias = _randn((n,), dtype, seed, "bias", device=device)
    # (weight, bias, out): see the docstring; rank 1 moves weight 1 before call 4.
    plan = [(0, False, False), (0, True, False), (1, True, False), (1, True, True), (1, True, False),
            (0, False, False), (2, True, False), (0, False, False)]
    errors, paths = [], []
    for it, (j, with_bias, with_out) in enumerate(plan):
        if it == 4 and rank == 1:
            weights[1][1] = weights[1][1].clone()
        parts = [_randn((rows, k), dtype, seed, "x", it, p, device=device) for p in range(world)]
        out = torch.full((rows * world if op_name == "ag" else m_chunk, n), float("nan"), dtype=dtype,
                         device=device) if with_out else None
        y = op(parts[rank], weights[rank][j].t(), bias=bias if with_bias else None, out=out)
        if with_out and y is not out:
            raise AssertionError("the call did not return the out it was given")
        if op_name == "ag":
            ref = torch.cat(parts).double() @ weights[rank][j].double().t()
        else:
            ref = sum(x.double() @ wp[j].double().t() for x, wp in zip(parts, weights))[rank * m_chunk:
                                                                                        (rank + 1) * m_chunk]
        if with_bias:
            ref = ref + bias.double()
        errors.append(_rel_err(y, ref))
        paths.append(tileweave.last_path(op.op_name))
    graphs_before = len(op._graphs)
    # A shape four times as tall: its first call (eager) grows the inner op's buffers, which drops every
    # graph; the first shape's next call captures again.
    for it, tall in ((len(plan), 4), (len(plan) + 1, 1)):
        parts = [_randn((rows * tall, k), dtype, seed, "x", it, p, device=device) for p in range(world)]
        y = op(parts[rank], weights[rank][0].t())
        if op_name == "ag":
            ref = torch.cat(parts).double() @ weights[rank][0].double().t()
        else:
            mc = m_chunk * tall
            ref = sum(x.double() @ wp[0].double().t() for x, wp in zip(parts, weights))[rank * mc:(rank + 1) * mc]
        errors.append(_rel_err(y, ref))
        paths.append(tileweave.last_path(op.op_name))
    return {"errors": errors, "paths": paths, "graphs": (graphs_before, len(op._graphs))}


def rs_padded_out_check(rank: int, world: int, m_chunk: int = 24, k: int = 32, n: int = 40) -> dict[str, float]:
    """Errors of ``GemmReduceScatter`` calls into an ``out`` whose rows are padded (a column slice of a
    wider tensor), per policy: a pulling op ("fused"; the pulls need contiguous rows, so such a call
    pushes) and the one-shot path ("oneshot", whose kernel writes the rows by their stride)."""
    device = _device()
    a_all = [_randn((m_chunk * world, k), torch.float16, "padded", "a", p, device=device) for p in range(world)]
    b_all = [_randn((k, n), torch.float16, "padded", "b", p, device=device) for p in range(world)]
    ref = sum(a.double() @ b.double() for a, b in zip(a_all, b_all))[rank * m_chunk:(rank + 1) * m_chunk]
    errors = {}
    for policy in ("fused", "oneshot"):
        op = tileweave.GemmReduceScatter(policy=policy, transport="chunked", pull=True)
        wide = torch.full((m_chunk, n + 8), float("nan"), dtype=torch.float16, device=device)
        errors[policy] = _rel_err(op(a_all[rank], b_all[rank], out=wide[:, :n]), ref)
    return errors


def shared_gpu_refused_check(rank: int, world: int) -> str:
    """The message a plain ``CudaBackend`` gives ranks that share a GPU (run where they do)."""
    from tileweave.runtime.backend import CudaBackend, TileweaveError

    try:
        CudaBackend(dist.group.WORLD, torch.device("cuda", torch.cuda.current_device()))
    except TileweaveError as exc:
        return str(exc)
    return "no error"


def missing_peer_check(rank: int, world: int, max_spin: int, op_kind: str = "ag") -> dict:
    """Rank 0 calls the fused all-gather GEMM (``op_kind="ag"``; "ag_oneshot", "rs_oneshot": the
    one-shot paths), the others never do: rank 0 must get a clear error.

    On the CPU (and in debug mode) the call that misses its data raises. On GPUs a call does not wait
    for its kernel: the kernel's bounded wait expires, and the next call raises, once the GPU is done
    (here after a synchronize), from the error word mirrored to the host."""
    device = _device()

    def make(spin):
        if op_kind == "rs_oneshot":
            return tileweave.GemmReduceScatter(policy="oneshot", max_spin=spin)
        return tileweave.AllGatherGemm(policy="oneshot" if op_kind == "ag_oneshot" else "fused", transport="mesh",
                                       max_spin=spin)

    op = make(max_spin)
    a = _randn((8 * (world if op_kind == "rs_oneshot" else 1), 32), torch.float16, "missing", rank, device=device)
    b = _randn((32, 16), torch.float16, "missing-b", rank, device=device)
    outcome = {"raised": False, "message": "", "calls": 0}
    if device != "cpu":
        # Compile the kernels on every rank first, with the default bound: a rank still compiling would
        # look missing to the short bound of the call below.
        make(None)(a, b)
        torch.cuda.synchronize()
        dist.barrier()
    # Agree on shapes first (the op's first call does this collectively), so that only the data of
    # the second call is missing.
    op(a, b)
    if rank == 0:
        try:
            for _ in range(2):
                op(a, b)
                outcome["calls"] += 1
                if device != "cpu":
                    torch.cuda.synchronize()
        except tileweave.CollectiveTimeout as exc:
            outcome.update(raised=True, message=str(exc))
    if device != "cpu":
        # The peers stay until rank 0 is done: its copies write into their memory.
        torch.cuda.synchronize()
        dist.barrier()
    return outcome


def back_to_back_check(rank: int, world: int, m_chunk: int, k: int, n: int, calls: int, dtype: str,
                       transport: str = "store") -> dict:
    """``calls`` fused AG and RS calls in a row with fresh inputs and no host sync or barrier between
    them; every output is checked afterwards."""
    device = _device()
    dt = getattr(torch, dtype)
    ag = tileweave.AllGatherGemm(policy="oneshot" if transport == "oneshot" else "fused")
    rs = (tileweave.GemmReduceScatter(policy="oneshot") if transport == "oneshot" else
          tileweave.GemmReduceScatter(policy="fused", transport=transport))
    inputs = []
    for i in range(calls):
        shards = [_randn((m_chunk, k), dt, "b2b", i, "a", p, device=device) for p in range(world)]
        b_ag = _randn((n, k), dt, "b2b", i, "bag", rank, device=device).t()
        a_rs = [_randn((m_chunk * world, k), dt, "b2b", i, "ars", p, device=device) for p in range(world)]
        b_rs = [_randn((n, k), dt, "b2b", i, "brs", p, device=device).t() for p in range(world)]
        inputs.append((shards, b_ag, a_rs, b_rs))
    dist.barrier()
    outs = [(ag(s[rank], bag), rs(ars[rank], brs[rank])) for s, bag, ars, brs in inputs]
    errs = []
    for (shards, b_ag, a_rs, b_rs), (o_ag, o_rs) in zip(inputs, outs):
        ref_ag = torch.cat(shards).double() @ b_ag.double()
        ref_rs = sum(a.double() @ b.double() for a, b in zip(a_rs, b_rs))[rank * m_chunk:(rank + 1) * m_chunk]
        errs.append((_rel_err(o_ag, ref_ag), _rel_err(o_rs, ref_rs)))
    # Every call after the first repeated a decided signature: the routes that skip the checks.
    return {"max_ag": max(e[0] for e in errs), "max_rs": max(e[1] for e in errs),
            "routes": [sorted(route[0] for route in op._routes.values()) for op in (ag, rs)]}


def oneshot_slots_check(rank: int, world: int, shapes: list[tuple[int, int, int]]) -> dict:
    """One-shot AG and RS calls on a sequence of ``(m_chunk, k, n)`` shapes, each checked against float64.
    Returns, per op, each call's slot as ``(buffer base, first byte, end)`` of this rank's one-shot
    buffer: a call must never write where the previous call's slot lies, which a peer may still be
    reading, whatever the two calls' shapes."""
    device = _device()
    ops = {"ag": tileweave.AllGatherGemm(policy="oneshot"), "rs": tileweave.GemmReduceScatter(policy="oneshot")}
    slots = {name: [] for name in ops}
    worst = 0.0
    for i, (m_chunk, k, n) in enumerate(shapes):
        m = m_chunk * world
        shards = [_randn((m_chunk, k), torch.float16, "slots", i, "a", p, device=device) for p in range(world)]
        b_ag = _randn((k, n), torch.float16, "slots", i, "bag", device=device)
        a_rs = [_randn((m, k), torch.float16, "slots", i, "ars", p, device=device) for p in range(world)]
        b_rs = [_randn((k, n), torch.float16, "slots", i, "brs", p, device=device) for p in range(world)]
        out_ag = ops["ag"](shards[rank], b_ag)
        out_rs = ops["rs"](a_rs[rank], b_rs[rank])
        ref_ag = torch.cat(shards).double() @ b_ag.double()
        ref_rs = sum(a.double() @ b.double() for a, b in zip(a_rs, b_rs))[rank * m_chunk:(rank + 1) * m_chunk]
        worst = max(worst, _rel_err(out_ag, ref_ag), _rel_err(out_rs, ref_rs))
        for name, op, cols in (("ag", ops["ag"], k), ("rs", ops["rs"], n)):
            ws = op._ws
            slot = ws.plans[("oneshot", m, cols, torch.float16)][0][ws.oneshot_epoch & 1]
            base = ws.oneshot.address(rank)
            start = slot.data_ptr() - base
            slots[name].append((base, start, start + slot.numel() * slot.element_size()))
    return {"err": worst, "slots": slots}


def settings_change_check(rank: int, world: int) -> list[dict]:
    """Calls of one signature (a repeat takes the route its first call decided) with the ops' settings
    changed in between, on every rank alike: each call must take the path of the settings it was made
    under and be right. Returns per call the setting then in force, both ops' paths and errors."""
    device = _device()
    m_chunk, k, n = 20, 32, 24
    ag = tileweave.AllGatherGemm(policy="oneshot")
    rs = tileweave.GemmReduceScatter(policy="oneshot")
    from tileweave.tune.autotune import select_config

    config = dataclasses.replace(select_config(m_chunk * world, n, k, torch.float16, torch.device(device), num_sms=4,
                                               interpreter=not device.startswith("cuda")), group_m=3)
    steps = [{}, {"policy": "fallback"}, {"policy": "fused", "transport": "chunked"},
             {"transport": "store", "config": config}, {"policy": "oneshot", "max_spin": 123_457},
             {"max_spin": 99_991}]
    results = []
    for step, settings in enumerate(steps):
        for op in (ag, rs):
            for name, value in settings.items():
                if name == "transport" and op is ag:
                    value = {"chunked": "chunked", "store": "mesh"}[value]
                setattr(op, name, value)
        routes_kept = [sorted(route[0] for route in op._routes.values()) for op in (ag, rs)]
        for i in range(2):
            seed = ("settings", step, i)
            shards = [_randn((m_chunk, k), torch.float16, *seed, "a", p, device=device) for p in range(world)]
            b_ag = _randn((k, n), torch.float16, *seed, "bag", device=device)
            a_rs = [_randn((m_chunk * world, k), torch.float16, *seed, "ars", p, device=device) for p in range(world)]
            b_rs = [_randn((k, n), torch.float16, *seed, "brs", p, device=device) for p in range(world)]
            out_ag = ag(shards[rank], b_ag)
            path_ag = tileweave.last_path("all_gather_gemm")
            out_rs = rs(a_rs[rank], b_rs[rank])
            path_rs = tileweave.last_path("gemm_reduce_scatter")
            ref_ag = torch.cat(shards).double() @ b_ag.double()
            ref_rs = sum(a.double() @ b.double() for a, b in zip(a_rs, b_rs))[rank * m_chunk:(rank + 1) * m_chunk]
            results.append({"settings": {name: str(value) for name, value in settings.items()}, "call": i,
                            "paths": (path_ag, path_rs), "err": max(_rel_err(out_ag, ref_ag), _rel_err(out_rs, ref_rs)),
                            "configs": [str(c) for op in (ag, rs) for _, c in op._decisions.values()],
                            "routes_kept": routes_kept,
                            "spins": [plan[1].max_spin for op in (ag, rs) for key, plan in op._ws.plans.items()
                                      if key[0] == "oneshot"]})
    return results


def input_errors_check(rank: int, world: int) -> dict[str, str]:
    """Bad inputs must raise a clear error on every rank before any flag wait (so no rank hangs)."""
    caught: dict[str, str] = {}

    def attempt(name, fn):
        try:
            fn()
            caught[name] = "no error"
        except (ValueError, TypeError, tileweave.TileweaveError) as exc:
            caught[name] = f"{type(exc).__name__}: {exc}"

    a = _randn((8, 32), torch.float16, "e", rank)
    rs = tileweave.GemmReduceScatter(policy="fused")
    attempt("rs_indivisible_m", lambda: rs(_randn((world * 8 + 1, 32), torch.float16, "e"),
                                           _randn((32, 16), torch.float16, "e")))
    ag = tileweave.AllGatherGemm(policy="fused")
    attempt("ag_k_mismatch", lambda: ag(a, _randn((31, 16), torch.float16, "e")))
    attempt("ag_dtype_mismatch", lambda: ag(a, _randn((32, 16), torch.float32, "e")))
    b16 = _randn((32, 16), torch.float16, "e")
    attempt("ag_gathered_out_shape", lambda: ag(a, b16, gathered_out=a.new_empty((8, 32))))
    attempt("ag_gathered_out_strided", lambda: ag(a, b16, gathered_out=a.new_empty((8 * world, 64))[:, :32]))
    # Shapes that differ between ranks are caught collectively, on every rank.
    k = 32 if rank == 0 else 40
    attempt("ag_ranks_disagree", lambda: ag(_randn((8, k), torch.float16, "e", rank),
                                            _randn((k, 16), torch.float16, "e")))
    return caught


def bf16_cpu_check(rank: int, world: int) -> dict[str, str]:
    """bfloat16 through every fused path and the TP layers on emulated ranks: each call either raises
    a ``TypeError`` that names bfloat16, or its relative error against float64 is reported."""
    from tileweave.nn import ColumnParallelLinear, RowParallelLinear

    results: dict[str, str] = {}

    def attempt(name, fn, ref):
        try:
            got = fn()
        except TypeError as exc:
            results[name] = f"refused: {exc}"
            return
        results[name] = f"err {_rel_err(got, ref):.3g}"

    x = _randn((8 * world, 32), torch.float32, "bf16-x")
    b = _randn((32, 16), torch.float32, "bf16-b")
    rows = slice(rank * 8, (rank + 1) * 8)
    for policy in ("fused", "oneshot", "fallback"):
        ag = tileweave.AllGatherGemm(policy=policy)
        attempt(f"ag_{policy}", lambda: ag(x[rows].bfloat16(), b.bfloat16()), x.double() @ b.double())
    k_rows = slice(rank * 32 // world, (rank + 1) * 32 // world)
    partial_sum = (x.double() @ b.double())[rows]
    for policy in ("fused", "oneshot", "fallback"):
        rs = tileweave.GemmReduceScatter(policy=policy)
        attempt(f"rs_{policy}", lambda: rs(x[:, k_rows].bfloat16(), b[k_rows].bfloat16()), partial_sum)
    w_col = _randn((16 * world, 32), torch.float32, "bf16-wc")
    col = ColumnParallelLinear(32, 16 * world, bias=False, dtype=torch.bfloat16)
    col.load_full_state_dict({"weight": w_col})
    cols = slice(rank * 16, (rank + 1) * 16)
    attempt("column_layer", lambda: col(x[rows].bfloat16()), (x.double() @ w_col.double().t())[:, cols])
    w_row = _randn((16, 32), torch.float32, "bf16-wr")
    row = RowParallelLinear(32, 16, bias=False, dtype=torch.bfloat16)
    row.load_full_state_dict({"weight": w_row})
    attempt("row_layer", lambda: row(x[:, k_rows].bfloat16()), (x.double() @ w_row.double().t())[rows])
    return results


def fallback_check(rank: int, world: int, m_chunk: int, k: int, n: int) -> dict[str, float]:
    """The unfused paths (collective, then GEMM / GEMM, then collective) against the same references."""
    shards = [_randn((m_chunk, k), torch.float32, "fb", p) for p in range(world)]
    b = _randn((k, n), torch.float32, "fb-b", rank)
    ag = tileweave.AllGatherGemm(policy="fallback")
    out, gathered = ag(shards[rank], b, return_gathered=True)
    a_all = [_randn((m_chunk * world, k), torch.float32, "fb-a", p) for p in range(world)]
    b_all = [_randn((k, n), torch.float32, "fb-bb", p) for p in range(world)]
    bias = _randn((n,), torch.float32, "fb-bias")
    rs_out = tileweave.GemmReduceScatter(policy="fallback")(a_all[rank], b_all[rank], bias=bias)
    ref_rs = sum(x.double() @ y.double() for x, y in zip(a_all, b_all)) + bias.double()
    result = {"ag": _rel_err(out, torch.cat(shards).double() @ b.double()),
              "gathered": float(torch.equal(gathered, torch.cat(shards))),
              "rs": _rel_err(rs_out, ref_rs[rank * m_chunk:(rank + 1) * m_chunk]),
              "ag_path": tileweave.last_path("all_gather_gemm"), "rs_path": tileweave.last_path("gemm_reduce_scatter")}
    # Repeat calls of a signature already decided for the unfused path skip the checks and the
    # decision: fresh inputs each time still give the right answers, and a changed signature is
    # checked again (a wrong K or dtype still raises).
    rs = tileweave.GemmReduceScatter(policy="fallback")
    for it in range(3):
        shards = [_randn((m_chunk, k), torch.float32, f"fb{it}", p) for p in range(world)]
        # The second repeat gathers into a caller's tensor (the decided route checks it too).
        given = torch.full((m_chunk * world, k), float("nan")) if it == 1 else None
        got, gathered = ag(shards[rank], b, return_gathered=True, gathered_out=given)
        result[f"ag_repeat{it}"] = max(_rel_err(got, torch.cat(shards).double() @ b.double()),
                                       float(not torch.equal(gathered, torch.cat(shards))),
                                       float(given is not None and gathered is not given))
        a_all = [_randn((m_chunk * world, k), torch.float32, f"fb-a{it}", p) for p in range(world)]
        ref = sum(x.double() @ y.double() for x, y in zip(a_all, b_all))
        result[f"rs_repeat{it}"] = _rel_err(rs(a_all[rank], b_all[rank]), ref[rank * m_chunk:(rank + 1) * m_chunk])
    for name, call in (("ag_bad_k", lambda: ag(shards[rank][:, 1:], b)),
                       ("ag_bad_gathered_out", lambda: ag(shards[rank], b, gathered_out=torch.empty(m_chunk, k))),
                       ("ag_bad_dtype", lambda: ag(shards[rank], b.double())),
                       ("rs_bad_k", lambda: rs(a_all[rank], b_all[rank][1:])),
                       ("rs_bad_dtype", lambda: rs(a_all[rank].half(), b_all[rank]))):
        try:
            call()
            result[name] = "no error"
        except (TypeError, ValueError) as exc:
            result[name] = str(exc)
    return result


def compile_check(rank: int, world: int) -> dict:
    """``torch.compile(fullgraph=True)`` of a function using both fused ops: no graph break, each op
    one custom-op node, same result as eager."""
    import torch._dynamo

    group = dist.group.WORLD
    shards = [_randn((16, 32), torch.float32, "cc-a", p) for p in range(world)]
    w_col = _randn((24, 32), torch.float32, "cc-w1", rank)
    w_row = _randn((40, 24), torch.float32, "cc-w2", rank)

    def block(x):
        h = tileweave.all_gather_gemm(x, w_col.t(), group)
        return tileweave.gemm_reduce_scatter(torch.relu(h), w_row.t(), group)

    eager = block(shards[rank])
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(block, backend=backend, fullgraph=True)(shards[rank])
    nodes = [str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"]
    return {"graphs": len(graphs), "match": bool(torch.allclose(compiled, eager, rtol=1e-5, atol=1e-5)),
            "ops": sorted(n for n in nodes if "tileweave" in n)}


def tp_mlp_check(rank: int, world: int, tokens: int, hidden: int, ffn: int, save_gathered: bool,
                 autocast: bool = False) -> dict:
    """A sequence-parallel MLP (column-parallel up, SiLU, row-parallel down) against the same MLP
    unsharded in float64: output, input gradient and every parameter gradient. (A smooth activation,
    so that low-precision runs are not compared across ReLU's kink.)"""
    from tileweave.nn import ColumnParallelLinear, RowParallelLinear

    device = _device()
    full_up = {"weight": _randn((ffn, hidden), torch.float32, "mlp-up", device=device) / hidden ** 0.5,
               "bias": _randn((ffn,), torch.float32, "mlp-ub", device=device)}
    full_down = {"weight": _randn((hidden, ffn), torch.float32, "mlp-dn", device=device) / ffn ** 0.5,
                 "bias": _randn((hidden,), torch.float32, "mlp-db", device=device)}
    x_full = _randn((tokens, hidden), torch.float32, "mlp-x", device=device)
    grad_full = _randn((tokens, hidden), torch.float32, "mlp-g", device=device)
    rows = slice(rank * tokens // world, (rank + 1) * tokens // world)

    up = ColumnParallelLinear(hidden, ffn, save_gathered=save_gathered, device=device)
    down = RowParallelLinear(ffn, hidden, device=device)
    up.load_full_state_dict(full_up)
    down.load_full_state_dict(full_down)
    x = x_full[rows].clone().requires_grad_(True)
    # Interpreter runs use fp16 (its bf16 is unreliable); GPUs use bf16, as training does.
    low = torch.bfloat16 if x.is_cuda else torch.float16
    with torch.autocast(x.device.type, dtype=low, enabled=autocast):
        y = down(torch.nn.functional.silu(up(x)))
    (y.float() * grad_full[rows]).sum().backward()

    xr = x_full.double().requires_grad_(True)
    wu, bu = full_up["weight"].double().requires_grad_(True), full_up["bias"].double().requires_grad_(True)
    wd, bd = full_down["weight"].double().requires_grad_(True), full_down["bias"].double().requires_grad_(True)
    yr = torch.nn.functional.silu(xr @ wu.t() + bu) @ wd.t() + bd
    (yr * grad_full.double()).sum().backward()

    local = slice(rank * ffn // world, (rank + 1) * ffn // world)
    saved = {"up": up.full_state_dict(), "down": down.full_state_dict()}
    return {
        "y": _rel_err(y, yr.detach()[rows]),
        "dx": _rel_err(x.grad, xr.grad[rows]),
        "d_up_w": _rel_err(up.weight.grad, wu.grad[local]),
        "d_up_b": _rel_err(up.bias.grad, bu.grad[local]),
        "d_down_w": _rel_err(down.weight.grad, wd.grad[:, local]),
        "d_down_b": _rel_err(down.bias.grad, bd.grad),
        "grad_dtypes": str(up.weight.grad.dtype) + "," + str(down.weight.grad.dtype),
        "round_trip": bool(torch.equal(saved["up"]["weight"], full_up["weight"])
                           and torch.equal(saved["down"]["weight"], full_down["weight"])),
        "graphable": _shared_ops_graphable(),
        "paths": f"{tileweave.last_path('all_gather_gemm')} {tileweave.last_path('gemm_reduce_scatter')}",
        "shared_options": sorted({f"{name}={getattr(op, name)}" for cls in (tileweave.AllGatherGemm,
                                                                             tileweave.GemmReduceScatter)
                                  for op in cls._shared.values() for name in cls.option_envs}),
    }


def _small_block_data(c, m: int, tag: str, device) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """An unsharded fp32 block state (as ``TPTransformerBlock.load_full_state_dict`` takes it), and
    the full input and output gradient of ``m`` tokens; the same on every rank."""
    hd = c.head_dim
    shapes = {"q": (c.heads * hd, c.hidden), "k": (c.kv_heads * hd, c.hidden), "v": (c.kv_heads * hd, c.hidden),
              "o": (c.hidden, c.hidden), "gate": (c.ffn, c.hidden), "up": (c.ffn, c.hidden), "down": (c.hidden, c.ffn)}
    state = {name: _randn(shape, torch.float32, tag, name, device=device) / shape[1] ** 0.5
             for name, shape in shapes.items()}
    state["attn_norm"] = 1 + 0.1 * _randn((c.hidden,), torch.float32, f"{tag}-n1", device=device)
    state["mlp_norm"] = 1 + 0.1 * _randn((c.hidden,), torch.float32, f"{tag}-n2", device=device)
    x_full = _randn((m, c.hidden), torch.float32, f"{tag}-x", device=device)
    g_full = _randn((m, c.hidden), torch.float32, f"{tag}-g", device=device)
    return state, x_full, g_full


def tp_block_check(rank: int, world: int, batch: int, seq: int, policy: str = "auto", heads: int = 4,
                   kv_heads: int = 2) -> dict:
    """The TP transformer block against the unsharded reference in float64: output, input gradient,
    and the gradient of every parameter (each rank's slice)."""
    from tileweave.nn.block import BlockConfig, TPTransformerBlock

    device = _device()
    c = BlockConfig(hidden=32, heads=heads, kv_heads=kv_heads, ffn=64, rope_theta=10000.0)
    state, x_full, g_full = _small_block_data(c, batch * seq, "blk", device)
    m = batch * seq
    rows = slice(rank * m // world, (rank + 1) * m // world)

    os.environ["TILEWEAVE_POLICY"] = policy  # read by the ops the block's layers create
    block = TPTransformerBlock(c, device=device)
    block.load_full_state_dict(state)
    x = x_full[rows].clone().requires_grad_(True)
    y = block(x, batch)
    (y * g_full[rows]).sum().backward()

    ref_state = {k: v.double().requires_grad_(True) for k, v in state.items()}
    xr = x_full.double().requires_grad_(True)
    yr = references.transformer_block(xr, ref_state, heads=c.heads, kv_heads=c.kv_heads,
                                      rope_theta=c.rope_theta, norm_eps=c.norm_eps, batch=batch)
    (yr * g_full.double()).sum().backward()

    def local_rows(t):
        n = t.shape[0] // world
        return t[rank * n:(rank + 1) * n]

    d = {k: v.grad for k, v in ref_state.items()}
    expect = {
        "qkv": torch.cat([local_rows(d["q"]), local_rows(d["k"]), local_rows(d["v"])]),
        "gate_up": torch.cat([local_rows(d["gate"]), local_rows(d["up"])]),
        "o": d["o"][:, rank * c.hidden // world:(rank + 1) * c.hidden // world],
        "down": d["down"][:, rank * c.ffn // world:(rank + 1) * c.ffn // world],
    }
    errors = {"y": _rel_err(y, yr.detach()[rows]), "dx": _rel_err(x.grad, xr.grad[rows])}
    for name, ref in expect.items():
        errors[f"d_{name}"] = _rel_err(getattr(block, name).weight.grad, ref)
    # Norm weights are replicated: each rank's gradient covers its tokens only; summed over ranks they
    # must give the full gradient.
    for name in ("attn_norm", "mlp_norm"):
        grad = getattr(block, name).weight.grad.clone()
        dist.all_reduce(grad)
        errors[f"d_{name}"] = _rel_err(grad, d[name])
    errors["paths"] = tileweave.last_path("all_gather_gemm") + "," + tileweave.last_path("gemm_reduce_scatter")
    return errors


def foreign_group_check(rank: int, world: int) -> str:
    """An op given a group this rank is not in must say so."""
    group = dist.new_group([0])  # collective: every rank creates it, only rank 0 is a member
    if rank == 0:
        return "member"
    try:
        tileweave.AllGatherGemm(group)(_randn((4, 8), torch.float32, "fg"), _randn((8, 4), torch.float32, "fg"))
    except tileweave.TileweaveError as exc:
        return str(exc)
    return "no error"


def block_bench_variants_check(rank: int, world: int, batch: int, seq: int) -> dict:
    """The block section's step under each of its variants (tileweave's ops, NCCL-style ops, the
    compute floor) on one small fp32 block: output and input gradient of ours and of the NCCL-style
    ops against the float64 unsharded reference, the variant check's own error, and that the layers'
    ops are restored afterwards."""
    import tileweave.nn.linear as linear
    from tileweave.bench import block as B
    from tileweave.nn.block import BlockConfig, TPTransformerBlock

    device = _device()
    c = BlockConfig(hidden=32, heads=4, kv_heads=2, ffn=64, rope_theta=10000.0)
    m = batch * seq
    state, x_full, g_full = _small_block_data(c, m, "bb", device)
    rows = slice(rank * m // world, (rank + 1) * m // world)

    os.environ["TILEWEAVE_POLICY"] = "fused"
    block = TPTransformerBlock(c, device=device)
    block.load_full_state_dict(state)
    row = B.BlockRow("llama3-8b", m)  # only its batch (M tokens as one sequence here) is used
    assert row.batch == batch
    inputs = B.BlockInputs(row=row, block=block, x=x_full[rows].clone().requires_grad_(True), dy=g_full[rows])
    originals = (linear.all_gather_gemm, linear.gemm_reduce_scatter)
    base = [t.clone() for t in inputs.step(B.base_ops(world))(0)]
    ours = B.block_variant("ours", inputs, rank=rank, world_size=world, reference=tuple(base))
    y_ours, dx_ours = ours.call(0)
    floor_y, _ = inputs.step(B.floor_ops(rank, world))(0)

    xr = x_full.double().requires_grad_(True)
    ref_state = {k: v.double() for k, v in state.items()}
    yr = references.transformer_block(xr, ref_state, heads=c.heads, kv_heads=c.kv_heads,
                                      rope_theta=c.rope_theta, norm_eps=c.norm_eps, batch=batch)
    yr.backward(g_full.double())

    def err(got, ref):
        return ((got.double() - ref).norm() / ref.norm()).item()

    return {"base_y": err(base[0], yr[rows]), "base_dx": err(base[1], xr.grad[rows]),
            "ours_y": err(y_ours, yr[rows]), "ours_dx": err(dx_ours, xr.grad[rows]),
            "ours_check": ours.check((y_ours, dx_ours)), "ours_path": ours.path(),
            "floor_shape": tuple(floor_y.shape) == tuple(y_ours.shape),
            "restored": (linear.all_gather_gemm, linear.gemm_reduce_scatter) == originals}


def block_bench_gpu_check(rank: int, world: int, m: int) -> dict:
    """On GPUs: the block section's PyTorch async-TP and tileweave variants of the llama3-8b block at
    M tokens, each checked against its NCCL reference (bf16; the benchmark's own check)."""
    from tileweave.bench import block as B
    from tileweave.bench.runner import _enable_torch_symm_mem

    _enable_torch_symm_mem(dist.group.WORLD)
    row = B.BlockRow("llama3-8b", m)
    x = B.make_block_inputs(row, rank=rank, world_size=world, group=dist.group.WORLD)
    reference = tuple(t.clone() for t in x.step(B.base_ops(world))(0))
    out = {}
    for name in ("torch", "ours"):
        v = B.block_variant(name, x, rank=rank, world_size=world, reference=reference)
        out[name] = v.check(v.call(0)) if v.call is not None else v.note
    return out


def all_gather_only_check(rank: int, world: int, transport: str, iters: int, straggler: int,
                          graphable: bool = False) -> dict:
    """``AllGatherGemm.all_gather`` alone and interleaved with fused calls on the same op: every
    gathered tensor equals the concatenated shards, bitwise, call after call with fresh inputs."""
    device = _device()
    op = tileweave.AllGatherGemm(policy="fused", transport=transport, graphable=graphable)
    set_producer_delay(0.2 if rank == straggler else 0.0)
    exact, fused_err = True, 0.0
    for it in range(iters):
        shards = [_randn((7, 24), torch.float16, "gather", it, p, device=device) for p in range(world)]
        pending = op.all_gather(shards[rank])
        gathered = pending.wait().clone()
        pending.release()
        exact &= bool(torch.equal(gathered, torch.cat(shards)))
        b = _randn((24, 16), torch.float16, "gather-b", it, device=device)
        out = op(shards[rank], b)  # the next epoch on the same buffer and flags
        ref = torch.cat(shards).double() @ b.double()
        fused_err = max(fused_err, _rel_err(out, ref))
    set_producer_delay(0.0)
    return {"exact": exact, "fused_err": fused_err}


def capture_rules_check(rank: int, world: int) -> dict[str, str]:
    """What each op does when called under CUDA-graph capture, with capture simulated (the emulated
    ranks have no CUDA): the unfused path runs for a signature an eager call has agreed on; a first
    call, or one that would take a fused path, raises. Returns each outcome: an error or the result's
    error against float64."""
    from tileweave.ops import _launch

    real = _launch.capturing
    shards = [_randn((8, 16), torch.float32, "cap-a", p) for p in range(world)]
    a_all = [_randn((8 * world, 16), torch.float32, "cap-ra", p) for p in range(world)]
    b = _randn((16, 12), torch.float32, "cap-b", rank)
    b_all = [_randn((16, 12), torch.float32, "cap-rb", p) for p in range(world)]
    bias = _randn((12,), torch.float32, "cap-bias")
    ag_ref = torch.cat(shards).double() @ b.double()
    rs_ref = sum(x.double() @ y.double() for x, y in zip(a_all, b_all))[rank * 8:(rank + 1) * 8]
    calls = {
        "ag": lambda op: _rel_err(op(shards[rank], b), ag_ref),
        "ag_bias": lambda op: _rel_err(op(shards[rank], b, bias=bias), ag_ref + bias.double()),
        "rs": lambda op: _rel_err(op(a_all[rank], b_all[rank]), rs_ref),
        "rs_bias": lambda op: _rel_err(op(a_all[rank], b_all[rank], bias=bias), rs_ref + bias.double()),
    }
    outcomes = {}

    def attempt(name, call, op):
        _launch.capturing = lambda t: True
        try:
            outcomes[name] = f"ok {call(op):.1e}"
        except tileweave.TileweaveError as exc:
            outcomes[name] = f"error: {exc}"
        finally:
            _launch.capturing = real

    for policy in ("fallback", "fused"):
        ops = {"ag": tileweave.AllGatherGemm(policy=policy), "rs": tileweave.GemmReduceScatter(policy=policy)}
        for name, call in calls.items():
            op = ops[name.split("_")[0]]
            attempt(f"{policy} {name} before eager", call, op)
            call(op)  # the eager call that agrees on the signature
            attempt(f"{policy} {name} after eager", call, op)
    for transport in ("mesh", "chunked"):  # the fused paths of a graphable op
        op = tileweave.AllGatherGemm(policy="fused", transport=transport, graphable=True)
        attempt(f"graphable ag-{transport} before eager", calls["ag"], op)
        calls["ag"](op)
        attempt(f"graphable ag-{transport} after eager", calls["ag"], op)
    # The one-shot path's epochs would not advance on replay: under capture it runs NCCL + cuBLAS, and
    # the next eager call of the signature takes the one-shot path again.
    ops = {"ag": tileweave.AllGatherGemm(policy="oneshot"), "rs": tileweave.GemmReduceScatter(policy="oneshot")}
    for name in calls:
        kind = name.split("_")[0]
        op = ops[kind]
        attempt(f"oneshot {name} before eager", calls[name], op)
        calls[name](op)
        attempt(f"oneshot {name} after eager", calls[name], op)
        op_name = "all_gather_gemm" if kind == "ag" else "gemm_reduce_scatter"
        captured = tileweave.last_path(op_name)
        calls[name](op)
        outcomes[f"oneshot-paths {name} capture-then-eager"] = f"{captured} {tileweave.last_path(op_name)}"
    return outcomes


def _captured(call, refill):
    """``(graph, what call returned)``: two eager calls on a side stream first, each after ``refill()``
    of its inputs (a shape's first call agrees on it with the other ranks, compiles kernels and sizes
    workspaces, none of which a graph can hold), then ``call`` captured in a CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            refill()
            call()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = call()
    return graph, result


def _shared_ops_graphable() -> bool:
    """Whether the ops that the functional API and the TP layers share were made graphable (and exist)."""
    ops = [op for cls in (tileweave.AllGatherGemm, tileweave.GemmReduceScatter) for op in cls._shared.values()]
    return bool(ops) and all(op.graphable for op in ops)


def cuda_graph_unfused_gpu_check(rank: int, world: int, m_chunk: int = 512, k: int = 1024, n: int = 768) -> dict:
    """Both ops on the unfused path captured in one CUDA graph after an eager warm-up, replayed on
    fresh inputs copied into the captured buffers; each replay against float64."""
    device = _device()
    ag, rs = tileweave.AllGatherGemm(policy="fallback"), tileweave.GemmReduceScatter(policy="fallback")
    x_ag = torch.empty((m_chunk, k), dtype=torch.bfloat16, device=device)
    x_rs = torch.empty((m_chunk * world, k), dtype=torch.bfloat16, device=device)
    w_ag = _randn((n, k), torch.bfloat16, "cg-w1", rank, device=device) / k ** 0.5
    w_rs = _randn((n, k), torch.bfloat16, "cg-w2", rank, device=device) / k ** 0.5
    graph, (y, z) = _captured(lambda: (ag(x_ag, w_ag.t()), rs(x_rs, w_rs.t())),
                              lambda: (x_ag.normal_(), x_rs.normal_()))
    errors = []
    for it in range(3):
        shards = [_randn((m_chunk, k), torch.bfloat16, "cg-xa", it, p, device=device) for p in range(world)]
        rows = [_randn((m_chunk * world, k), torch.bfloat16, "cg-xr", it, p, device=device) for p in range(world)]
        weights = [_randn((n, k), torch.bfloat16, "cg-w2", p, device=device) / k ** 0.5 for p in range(world)]
        x_ag.copy_(shards[rank])
        x_rs.copy_(rows[rank])
        graph.replay()
        torch.cuda.synchronize()
        ref_ag = torch.cat(shards).double() @ w_ag.double().t()
        ref_rs = sum(x.double() @ w.double().t() for x, w in zip(rows, weights))
        errors.append(max(_rel_err(y, ref_ag), _rel_err(z, ref_rs[rank * m_chunk:(rank + 1) * m_chunk])))
    return {"err": max(errors), "paths": tileweave.last_path("all_gather_gemm") + "," + tileweave.last_path("gemm_reduce_scatter")}


def cuda_graph_fused_gpu_check(rank: int, world: int, kind: str, m_chunk: int = 1024, k: int = 2048,
                               n: int = 1536, stream_k: bool | None = None) -> dict:
    """A graphable op on its fused path (``kind``: "ag-mesh", "ag-ring", "ag-chunked" or "rs-chunked")
    captured in a CUDA graph after eager warm-up calls, replayed on fresh inputs copied into the captured
    buffer: checked after each replay, after replays back to back without a host sync, and in an eager
    call on the same op after them (the 0/1 flags must be back where every call starts). ``stream_k``:
    AllGather+GEMM's option; the result says whether a launch took the stream-K tail."""
    from tileweave.ops import _launch

    device = _device()
    dtype = torch.bfloat16
    op_name, transport = kind.split("-")
    rows = m_chunk if op_name == "ag" else m_chunk * world
    if op_name == "ag":
        op = tileweave.AllGatherGemm(policy="fused", transport=transport, graphable=True, stream_k=stream_k)
    else:
        op = tileweave.GemmReduceScatter(policy="fused", transport=transport, graphable=True)
    _launch._fused_plans.clear()
    weights = [_randn((n, k), dtype, "gf-w", p, device=device) / k ** 0.5 for p in range(world)]
    w = weights[rank]
    x = torch.empty((rows, k), dtype=dtype, device=device)
    graph, y = _captured(lambda: op(x, w.t()), x.normal_)
    path = tileweave.last_path(op.op_name)

    def inputs(it):
        return [_randn((rows, k), dtype, "gf-x", it, p, device=device) for p in range(world)]

    def ref(parts):
        if op_name == "ag":
            return torch.cat(parts).double() @ w.double().t()
        total = sum(part.double() @ wp.double().t() for part, wp in zip(parts, weights))
        return total[rank * m_chunk:(rank + 1) * m_chunk]

    errors = []
    for it in range(3):
        parts = inputs(it)
        x.copy_(parts[rank])
        y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        errors.append(_rel_err(y, ref(parts)))
    parts = inputs(99)
    x.copy_(parts[rank])
    for _ in range(6):  # back to back: each replay waits on the flags the previous one left
        graph.replay()
    torch.cuda.synchronize()
    errors.append(_rel_err(y, ref(parts)))
    parts = inputs(100)
    eager = op(parts[rank], w.t())
    torch.cuda.synchronize()
    errors.append(_rel_err(eager, ref(parts)))
    dist.barrier()
    tail = any(plan.stream_k is not None for plan in _launch._fused_plans.values())
    return {"err": max(errors), "errors": errors, "path": path, "stream_k": tail}


def tp_mlp_graph_gpu_check(rank: int, world: int, tokens: int = 4096, hidden: int = 2048, ffn: int = 8192) -> dict:
    """Run with ``TILEWEAVE_GRAPHABLE=1``: a sequence-parallel MLP's forward (inference, bf16) captured
    in a CUDA graph on the ops the TP layers share, replayed on fresh inputs, against float64. At these
    sizes ``auto`` takes both chunked transports (AllGather+GEMM at 69 GFLOP, GEMM+RS with K_loc 4096)."""
    from tileweave.nn import ColumnParallelLinear, RowParallelLinear

    device = _device()
    dtype = torch.bfloat16
    full_up = {"weight": _randn((ffn, hidden), torch.float32, "gm-up", device=device) / hidden ** 0.5,
               "bias": _randn((ffn,), torch.float32, "gm-ub", device=device)}
    full_down = {"weight": _randn((hidden, ffn), torch.float32, "gm-dn", device=device) / ffn ** 0.5,
                 "bias": _randn((hidden,), torch.float32, "gm-db", device=device)}
    up = ColumnParallelLinear(hidden, ffn, device=device, dtype=dtype)
    down = RowParallelLinear(ffn, hidden, device=device, dtype=dtype)
    with torch.no_grad():
        up.load_full_state_dict(full_up)
        down.load_full_state_dict(full_down)
    rows = slice(rank * tokens // world, (rank + 1) * tokens // world)
    x = torch.empty((tokens // world, hidden), dtype=dtype, device=device)

    def forward():
        return down(torch.nn.functional.silu(up(x)))

    def reference(x_full):
        # The bf16 weights the layers hold, in float64.
        wu, bu = full_up["weight"].to(dtype).double(), full_up["bias"].to(dtype).double()
        wd, bd = full_down["weight"].to(dtype).double(), full_down["bias"].to(dtype).double()
        return (torch.nn.functional.silu(x_full.double() @ wu.t() + bu) @ wd.t() + bd)[rows]

    with torch.no_grad():
        graph, y = _captured(forward, x.normal_)
        paths = tileweave.last_path("all_gather_gemm") + "," + tileweave.last_path("gemm_reduce_scatter")
        errors = []
        for it in range(3):
            x_full = _randn((tokens, hidden), dtype, "gm-x", it, device=device)
            x.copy_(x_full[rows])
            graph.replay()
            torch.cuda.synchronize()
            errors.append(_rel_err(y, reference(x_full)))
    dist.barrier()
    return {"err": max(errors), "paths": paths, "graphable": _shared_ops_graphable()}
