"""What both fused ops share: lost peers, back-to-back calls, one-shot slots, settings, input errors,
the unfused paths, torch.compile and the rules under CUDA-graph capture."""

from __future__ import annotations

import dataclasses

import torch
import torch._dynamo
import torch.distributed as dist

import tileweave
from tileweave.ops import common
from tileweave.tune.autotune import select_config
from tileweave.runtime.backend import CudaBackend, TileweaveError
from tileweave.nn import ColumnParallelLinear, RowParallelLinear
from support.scenarios.common import compiled, device_name, randn, rel_err


def shared_gpu_refused_check(rank: int, world: int) -> str:
    """The message a plain ``CudaBackend`` gives ranks that share a GPU (run where they do)."""
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
    device = device_name()

    def make(spin):
        if op_kind == "rs_oneshot":
            return tileweave.GemmReduceScatter(policy="oneshot", max_spin=spin)
        return tileweave.AllGatherGemm(policy="oneshot" if op_kind == "ag_oneshot" else "fused", transport="mesh",
                                       max_spin=spin)

    op = make(max_spin)
    a = randn((8 * (world if op_kind == "rs_oneshot" else 1), 32), torch.float16, "missing", rank, device=device)
    b = randn((32, 16), torch.float16, "missing-b", rank, device=device)
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
                       transport: str = "chunked") -> dict:
    """``calls`` fused AG and RS calls in a row with fresh inputs and no host sync or barrier between
    them; every output is checked afterwards."""
    device = device_name()
    dt = getattr(torch, dtype)
    ag = tileweave.AllGatherGemm(policy="oneshot" if transport == "oneshot" else "fused")
    rs = (tileweave.GemmReduceScatter(policy="oneshot") if transport == "oneshot" else
          tileweave.GemmReduceScatter(policy="fused", transport=transport))
    inputs = []
    for i in range(calls):
        shards = [randn((m_chunk, k), dt, "b2b", i, "a", p, device=device) for p in range(world)]
        b_ag = randn((n, k), dt, "b2b", i, "bag", rank, device=device).t()
        a_rs = [randn((m_chunk * world, k), dt, "b2b", i, "ars", p, device=device) for p in range(world)]
        b_rs = [randn((n, k), dt, "b2b", i, "brs", p, device=device).t() for p in range(world)]
        inputs.append((shards, b_ag, a_rs, b_rs))
    dist.barrier()
    outs = [(ag(s[rank], bag), rs(ars[rank], brs[rank])) for s, bag, ars, brs in inputs]
    errs = []
    for (shards, b_ag, a_rs, b_rs), (o_ag, o_rs) in zip(inputs, outs):
        ref_ag = torch.cat(shards).double() @ b_ag.double()
        ref_rs = sum(a.double() @ b.double() for a, b in zip(a_rs, b_rs))[rank * m_chunk:(rank + 1) * m_chunk]
        errs.append((rel_err(o_ag, ref_ag), rel_err(o_rs, ref_rs)))
    # Every call after the first repeated a decided signature: its plan, without the checks.
    return {"max_ag": max(e[0] for e in errs), "max_rs": max(e[1] for e in errs),
            "plans": [sorted(plan.path for plan in op.plans.values()) for op in (ag, rs)]}


def oneshot_slots_check(rank: int, world: int, shapes: list[tuple[int, int, int]]) -> dict:
    """One-shot AG and RS calls on a sequence of ``(m_chunk, k, n)`` shapes, each checked against float64.
    Returns, per op, each call's slot as ``(buffer base, first byte, end)`` of this rank's one-shot
    buffer: a call must never write where the previous call's slot lies, which a peer may still be
    reading, whatever the two calls' shapes."""
    device = device_name()
    ops = {"ag": tileweave.AllGatherGemm(policy="oneshot"), "rs": tileweave.GemmReduceScatter(policy="oneshot")}
    slots = {name: [] for name in ops}
    worst = 0.0
    for i, (m_chunk, k, n) in enumerate(shapes):
        m = m_chunk * world
        shards = [randn((m_chunk, k), torch.float16, "slots", i, "a", p, device=device) for p in range(world)]
        b_ag = randn((k, n), torch.float16, "slots", i, "bag", device=device)
        a_rs = [randn((m, k), torch.float16, "slots", i, "ars", p, device=device) for p in range(world)]
        b_rs = [randn((k, n), torch.float16, "slots", i, "brs", p, device=device) for p in range(world)]
        out_ag = ops["ag"](shards[rank], b_ag)
        out_rs = ops["rs"](a_rs[rank], b_rs[rank])
        ref_ag = torch.cat(shards).double() @ b_ag.double()
        ref_rs = sum(a.double() @ b.double() for a, b in zip(a_rs, b_rs))[rank * m_chunk:(rank + 1) * m_chunk]
        worst = max(worst, rel_err(out_ag, ref_ag), rel_err(out_rs, ref_rs))
        for name, op, cols in (("ag", ops["ag"], k), ("rs", ops["rs"], n)):
            ws = op.workspace
            slot = ws.plans[("oneshot", m, cols, torch.float16)][0][ws.oneshot_epoch & 1]
            base = ws.oneshot.address(rank)
            start = slot.data_ptr() - base
            slots[name].append((base, start, start + slot.numel() * slot.element_size()))
    return {"err": worst, "slots": slots}


def settings_change_check(rank: int, world: int) -> list[dict]:
    """Calls of one signature (a repeat takes the route its first call decided) with the ops' settings
    changed in between, on every rank alike: each call must take the path of the settings it was made
    under and be right. Returns per call the setting then in force, both ops' paths and errors."""
    device = device_name()
    m_chunk, k, n = 20, 32, 24
    ag = tileweave.AllGatherGemm(policy="oneshot")
    rs = tileweave.GemmReduceScatter(policy="oneshot")
    config = dataclasses.replace(select_config(m_chunk * world, n, k, torch.float16, torch.device(device), num_sms=4,
                                               interpreter=not device.startswith("cuda")), group_m=3)
    steps = [{}, {"policy": "fallback"}, {"policy": "fused", "transport": "chunked"},
             {"transport": "mesh", "config": config}, {"policy": "oneshot", "max_spin": 123_457},
             {"max_spin": 99_991}]
    results = []
    for step, settings in enumerate(steps):
        for op in (ag, rs):
            for name, value in settings.items():
                if name == "transport" and op is rs:
                    value = "chunked"  # its one transport
                setattr(op, name, value)
        plans_kept = [sorted(plan.path for plan in op.plans.values()) for op in (ag, rs)]
        for i in range(2):
            seed = ("settings", step, i)
            shards = [randn((m_chunk, k), torch.float16, *seed, "a", p, device=device) for p in range(world)]
            b_ag = randn((k, n), torch.float16, *seed, "bag", device=device)
            a_rs = [randn((m_chunk * world, k), torch.float16, *seed, "ars", p, device=device) for p in range(world)]
            b_rs = [randn((k, n), torch.float16, *seed, "brs", p, device=device) for p in range(world)]
            out_ag = ag(shards[rank], b_ag)
            path_ag = tileweave.last_path("all_gather_gemm")
            out_rs = rs(a_rs[rank], b_rs[rank])
            path_rs = tileweave.last_path("gemm_reduce_scatter")
            ref_ag = torch.cat(shards).double() @ b_ag.double()
            ref_rs = sum(a.double() @ b.double() for a, b in zip(a_rs, b_rs))[rank * m_chunk:(rank + 1) * m_chunk]
            results.append({"settings": {name: str(value) for name, value in settings.items()}, "call": i,
                            "paths": (path_ag, path_rs), "err": max(rel_err(out_ag, ref_ag), rel_err(out_rs, ref_rs)),
                            "configs": [str(plan.config) for op in (ag, rs) for plan in op.plans.values()
                                        if plan.config is not None and plan.path != "oneshot"],
                            "plans_kept": plans_kept,
                            "spins": [entry[1].max_spin for op in (ag, rs)
                                      for key, entry in op.workspace.plans.items() if key[0] == "oneshot"]})
    return results


def grad_refused_check(rank: int, world: int) -> dict:
    """Every fused op called in grad mode on an input that requires grad: the error each raises (before
    any communication, so every rank raises it), then whether the same call under ``torch.no_grad()``
    completes on every rank with a finite result (no rank was left waiting by the refused call; the
    ops' arithmetic is checked elsewhere)."""
    device = device_name()
    x = randn((4, 8), torch.float32, "gr-x", rank, device=device)
    w = randn((8, 6), torch.float32, "gr-w", rank, device=device).requires_grad_()
    ids = torch.randint(0, 4, (4, 2), generator=torch.Generator().manual_seed(7 + rank)).to(device)
    w0 = randn((4, 8, 6), torch.float32, "gr-w0", rank, device=device).requires_grad_()
    w1 = randn((4, 6, 8), torch.float32, "gr-w1", rank, device=device).requires_grad_()
    plan = tileweave.moe_plan(ids, num_experts=4)
    h = randn((plan.rows, 6), torch.float32, "gr-h", rank, device=device)
    weights = torch.full((4, 2), 0.5, device=device)
    calls = {
        "all_gather_gemm": lambda: tileweave.all_gather_gemm(x, w),
        "gemm_reduce_scatter": lambda: tileweave.gemm_reduce_scatter(x.repeat(world, 1), w),
        "gemm_all_reduce": lambda: tileweave.gemm_all_reduce(x, w),
        "moe_all_gather_gemm": lambda: tileweave.moe_all_gather_gemm(x, w0, plan),
        "moe_gemm_reduce_scatter": lambda: tileweave.moe_gemm_reduce_scatter(h, w1, plan, weights),
    }
    out = {}
    for name, call in calls.items():
        try:
            call()
            error = None
        except TypeError as exc:
            error = str(exc)
        with torch.no_grad():
            finite = bool(torch.isfinite(call()).all())
        out[name] = (error, finite)
    return out


def input_errors_check(rank: int, world: int) -> dict[str, str]:
    """Bad inputs must raise a clear error on every rank before any flag wait (so no rank hangs)."""
    caught: dict[str, str] = {}

    def attempt(name, fn):
        try:
            fn()
            caught[name] = "no error"
        except (ValueError, TypeError, tileweave.TileweaveError) as exc:
            caught[name] = f"{type(exc).__name__}: {exc}"

    a = randn((8, 32), torch.float16, "e", rank)
    rs = tileweave.GemmReduceScatter(policy="fused")
    attempt("rs_indivisible_m", lambda: rs(randn((world * 8 + 1, 32), torch.float16, "e"),
                                           randn((32, 16), torch.float16, "e")))
    ag = tileweave.AllGatherGemm(policy="fused")
    attempt("ag_k_mismatch", lambda: ag(a, randn((31, 16), torch.float16, "e")))
    attempt("ag_dtype_mismatch", lambda: ag(a, randn((32, 16), torch.float32, "e")))
    b16 = randn((32, 16), torch.float16, "e")
    attempt("ag_gathered_out_shape", lambda: ag(a, b16, gathered_out=a.new_empty((8, 32))))
    attempt("ag_gathered_out_strided", lambda: ag(a, b16, gathered_out=a.new_empty((8 * world, 64))[:, :32]))
    # Shapes that differ between ranks are caught collectively, on every rank.
    k = 32 if rank == 0 else 40
    attempt("ag_ranks_disagree", lambda: ag(randn((8, k), torch.float16, "e", rank),
                                            randn((k, 16), torch.float16, "e")))
    return caught


def bf16_cpu_check(rank: int, world: int) -> dict[str, str]:
    """bfloat16 through every fused path and the TP layers on emulated ranks: each call either raises
    a ``TypeError`` that names bfloat16, or its relative error against float64 is reported."""
    results: dict[str, str] = {}

    def attempt(name, fn, ref):
        try:
            got = fn()
        except TypeError as exc:
            results[name] = f"refused: {exc}"
            return
        results[name] = f"err {rel_err(got, ref):.3g}"

    x = randn((8 * world, 32), torch.float32, "bf16-x")
    b = randn((32, 16), torch.float32, "bf16-b")
    rows = slice(rank * 8, (rank + 1) * 8)
    for policy in ("fused", "oneshot", "fallback"):
        ag = tileweave.AllGatherGemm(policy=policy)
        attempt(f"ag_{policy}", lambda: ag(x[rows].bfloat16(), b.bfloat16()), x.double() @ b.double())
    k_rows = slice(rank * 32 // world, (rank + 1) * 32 // world)
    partial_sum = (x.double() @ b.double())[rows]
    for policy in ("fused", "oneshot", "fallback"):
        rs = tileweave.GemmReduceScatter(policy=policy)
        attempt(f"rs_{policy}", lambda: rs(x[:, k_rows].bfloat16(), b[k_rows].bfloat16()), partial_sum)
    w_col = randn((16 * world, 32), torch.float32, "bf16-wc")
    col = ColumnParallelLinear(32, 16 * world, bias=False, dtype=torch.bfloat16)
    col.load_full_state_dict({"weight": w_col})
    cols = slice(rank * 16, (rank + 1) * 16)
    attempt("column_layer", lambda: col(x[rows].bfloat16()), (x.double() @ w_col.double().t())[:, cols])
    w_row = randn((16, 32), torch.float32, "bf16-wr")
    row = RowParallelLinear(32, 16, bias=False, dtype=torch.bfloat16)
    row.load_full_state_dict({"weight": w_row})
    attempt("row_layer", lambda: row(x[:, k_rows].bfloat16()), (x.double() @ w_row.double().t())[rows])
    return results


def fallback_check(rank: int, world: int, m_chunk: int, k: int, n: int) -> dict[str, float]:
    """The unfused paths (collective, then GEMM / GEMM, then collective) against the same references."""
    shards = [randn((m_chunk, k), torch.float32, "fb", p) for p in range(world)]
    b = randn((k, n), torch.float32, "fb-b", rank)
    ag = tileweave.AllGatherGemm(policy="fallback")
    out, gathered = ag(shards[rank], b, return_gathered=True)
    a_all = [randn((m_chunk * world, k), torch.float32, "fb-a", p) for p in range(world)]
    b_all = [randn((k, n), torch.float32, "fb-bb", p) for p in range(world)]
    bias = randn((n,), torch.float32, "fb-bias")
    rs_out = tileweave.GemmReduceScatter(policy="fallback")(a_all[rank], b_all[rank], bias=bias)
    ref_rs = sum(x.double() @ y.double() for x, y in zip(a_all, b_all)) + bias.double()
    result = {"ag": rel_err(out, torch.cat(shards).double() @ b.double()),
              "gathered": float(torch.equal(gathered, torch.cat(shards))),
              "rs": rel_err(rs_out, ref_rs[rank * m_chunk:(rank + 1) * m_chunk]),
              "ag_path": tileweave.last_path("all_gather_gemm"), "rs_path": tileweave.last_path("gemm_reduce_scatter")}
    # Repeat calls of a signature already decided for the unfused path skip the checks and the
    # decision: fresh inputs each time still give the right answers, and a changed signature is
    # checked again (a wrong K or dtype still raises).
    rs = tileweave.GemmReduceScatter(policy="fallback")
    for it in range(3):
        shards = [randn((m_chunk, k), torch.float32, f"fb{it}", p) for p in range(world)]
        # The second repeat gathers into a caller's tensor (the decided route checks it too).
        given = torch.full((m_chunk * world, k), float("nan")) if it == 1 else None
        got, gathered = ag(shards[rank], b, return_gathered=True, gathered_out=given)
        result[f"ag_repeat{it}"] = max(rel_err(got, torch.cat(shards).double() @ b.double()),
                                       float(not torch.equal(gathered, torch.cat(shards))),
                                       float(given is not None and gathered is not given))
        a_all = [randn((m_chunk * world, k), torch.float32, f"fb-a{it}", p) for p in range(world)]
        ref = sum(x.double() @ y.double() for x, y in zip(a_all, b_all))
        result[f"rs_repeat{it}"] = rel_err(rs(a_all[rank], b_all[rank]), ref[rank * m_chunk:(rank + 1) * m_chunk])
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
    """``torch.compile(fullgraph=True)`` of a column-parallel GEMM, ReLU and a row-parallel GEMM built
    from both fused ops: the graphs captured, the tileweave ops in them, and the compiled output's
    relative error against the same block computed in float64 from the unsharded inputs (every
    rank's shard of x and of both weights, rebuilt here from seeds)."""
    tokens, hidden, ffn_loc, out_features = 16, 32, 24, 40
    device = device_name()
    shards = [randn((tokens, hidden), torch.float32, "cc-a", p, device=device) for p in range(world)]
    # Rank p's rows of the up weight and its columns of the down one.
    w_col = [randn((ffn_loc, hidden), torch.float32, "cc-w1", p, device=device) for p in range(world)]
    w_row = [randn((out_features, ffn_loc), torch.float32, "cc-w2", p, device=device) for p in range(world)]
    group = dist.group.WORLD

    def block(x):
        h = tileweave.all_gather_gemm(x, w_col[rank].t(), group)
        return tileweave.gemm_reduce_scatter(torch.relu(h), w_row[rank].t(), group)

    result, graphs, ops = compiled(block, shards[rank])
    x = torch.cat(shards).double()
    full = sum(torch.relu(x @ wc.double().t()) @ wr.double().t() for wc, wr in zip(w_col, w_row))
    return {"graphs": graphs, "err": rel_err(result, full[rank * tokens:(rank + 1) * tokens]),
            "shape": tuple(result.shape), "ops": ops}


def foreign_group_check(rank: int, world: int) -> str:
    """An op given a group this rank is not in must say so."""
    group = dist.new_group([0])  # collective: every rank creates it, only rank 0 is a member
    if rank == 0:
        return "member"
    try:
        tileweave.AllGatherGemm(group)(randn((4, 8), torch.float32, "fg"), randn((8, 4), torch.float32, "fg"))
    except tileweave.TileweaveError as exc:
        return str(exc)
    return "no error"


def capture_rules_check(rank: int, world: int) -> dict[str, str]:
    """What each op does when called under CUDA-graph capture, with capture simulated (the emulated
    ranks have no CUDA): the unfused path runs for a signature an eager call has agreed on; a first
    call, or one that would take a fused path, raises. Returns each outcome: an error or the result's
    error against float64."""
    real = common.capturing
    shards = [randn((8, 16), torch.float32, "cap-a", p) for p in range(world)]
    a_all = [randn((8 * world, 16), torch.float32, "cap-ra", p) for p in range(world)]
    b = randn((16, 12), torch.float32, "cap-b", rank)
    b_all = [randn((16, 12), torch.float32, "cap-rb", p) for p in range(world)]
    bias = randn((12,), torch.float32, "cap-bias")
    ag_ref = torch.cat(shards).double() @ b.double()
    rs_ref = sum(x.double() @ y.double() for x, y in zip(a_all, b_all))[rank * 8:(rank + 1) * 8]
    calls = {
        "ag": lambda op: rel_err(op(shards[rank], b), ag_ref),
        "ag_bias": lambda op: rel_err(op(shards[rank], b, bias=bias), ag_ref + bias.double()),
        "rs": lambda op: rel_err(op(a_all[rank], b_all[rank]), rs_ref),
        "rs_bias": lambda op: rel_err(op(a_all[rank], b_all[rank], bias=bias), rs_ref + bias.double()),
    }
    outcomes = {}

    def attempt(name, call, op):
        common.capturing = lambda t: True
        try:
            outcomes[name] = f"ok {call(op):.1e}"
        except tileweave.TileweaveError as exc:
            outcomes[name] = f"error: {exc}"
        finally:
            common.capturing = real

    for policy in ("fallback", "fused", "auto"):
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
    # gemm_all_reduce: its fused transports under capture, after an eager call of the signature
    ar_ref = sum(x.double() @ y.double() for x, y in zip(a_all, b_all))
    for policy in ("fused", "auto"):
        op = tileweave.GemmAllReduce(policy=policy)
        call = lambda op: rel_err(op(a_all[rank], b_all[rank]), ar_ref)  # noqa: E731
        call(op)
        attempt(f"{policy} ar after eager", call, op)
    return outcomes
