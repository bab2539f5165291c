"""Per-rank checks of the MoE pair ops, run on emulated ranks by the CPU tests and on GPUs by the GPU
tests (``tileweave.testing.emulated.run_ranks``). Each returns plain data for the caller to assert.

Inputs are regenerated from seeds on every rank, so each rank rebuilds the whole unsharded problem and
checks its own outputs against ``support.moe_reference`` with no collective."""

from __future__ import annotations

import dataclasses
import zlib

import torch

import tileweave

from tileweave.ops import common
from tileweave.ops.moe import MoEAllGatherGemm, MoEGemmReduceScatter, build_plan, moe_plan
from tileweave.runtime.backend import TileweaveError, set_producer_delay
from support import moe_reference
from support.scenarios.common import compiled


@dataclasses.dataclass(frozen=True)
class MoECase:
    tokens_per_rank: int
    """T / W."""
    hidden: int
    f_loc: int
    experts: int
    topk: int
    dtype: str = "float16"
    routing: str = "random"
    """"random" (k distinct experts per token where k <= E), "one_expert" (every pair to expert
    ``E - 1``), "skip_expert" (random, never expert 0: an expert with no tokens)."""
    policy: str = "fused"
    linear_layout: bool = True
    """Pass the weights as ``.transpose(1, 2)`` views of nn.Linear-style stacks (else row-major)."""
    iters: int = 2
    """Calls with fresh routing and inputs each."""
    repeat: bool = False
    """Call each layer a second time with the last call's inputs (the result must be bitwise the same)."""
    unweighted: bool = False
    """Call layer 1 with ``topk_weights_shard=None`` (every weight 1) on the last call."""
    straggler: int = -1
    """Rank whose copy engine is delayed by ``delay_s`` (-1: none)."""
    delay_s: float = 0.0
    seed: int = 0


def _gen(seed_parts: tuple) -> torch.Generator:
    # zlib.crc32, not hash(): string hashing is salted per process and every rank must agree.
    return torch.Generator().manual_seed(zlib.crc32(repr(seed_parts).encode()))


def _randn(shape, *seed_parts) -> torch.Tensor:
    return torch.randn(*shape, generator=_gen(seed_parts), dtype=torch.float32)


def routing(case: MoECase, world: int, it: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids [T, k] int64, weights [T, k] fp32)`` of the whole group for call ``it``."""
    tokens, k, e = case.tokens_per_rank * world, case.topk, case.experts
    g = _gen(("ids", case, world, it))
    if case.routing == "one_expert":
        ids = torch.full((tokens, k), e - 1, dtype=torch.int64)
    else:
        lo = 1 if case.routing == "skip_expert" else 0
        if k <= e - lo:
            ids = torch.stack([torch.randperm(e - lo, generator=g)[:k] for _ in range(tokens)]) + lo
        else:
            ids = torch.randint(lo, e, (tokens, k), generator=g)
    weights = torch.softmax(torch.randn(tokens, k, generator=g), dim=1)
    return ids, weights


def _weights(case: MoECase, world: int) -> tuple[list, list]:
    """Every rank's ``w0 [E, H, F_loc]`` and ``w1 [E, F_loc, H]`` (fp32, row-major)."""
    e, hid, f = case.experts, case.hidden, case.f_loc
    w0 = [_randn((e, hid, f), "w0", case, r) / hid ** 0.5 for r in range(world)]
    w1 = [_randn((e, f, hid), "w1", case, r) / f ** 0.5 for r in range(world)]
    return w0, w1


def _as_op_weight(w: torch.Tensor, case: MoECase, dtype, device) -> torch.Tensor:
    if case.linear_layout:
        return w.transpose(1, 2).contiguous().to(dtype=dtype, device=device).transpose(1, 2)
    return w.to(dtype=dtype, device=device).contiguous()


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    got = got.double().cpu()
    if not torch.isfinite(got).all():
        return float("inf")
    return ((got - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def pair_check(rank: int, world: int, cases: list[MoECase]) -> list[dict]:
    """Layers 0 and 1 on every case: per call, the plan against the reference order, each layer's error
    against float64, the paths taken, and (``repeat``) whether a repeat of the last call is bitwise identical (None where not repeated)."""
    device = _device()
    rows = []
    ops = {}
    for case in cases:
        dtype = getattr(torch, case.dtype)
        tc, k, e, hid, f = case.tokens_per_rank, case.topk, case.experts, case.hidden, case.f_loc
        tokens = tc * world
        if case.policy not in ops:
            ops[case.policy] = (MoEAllGatherGemm(policy=case.policy), MoEGemmReduceScatter(policy=case.policy))
        layer0, layer1 = ops[case.policy]
        w0_all, w1_all = _weights(case, world)
        w0 = _as_op_weight(w0_all[rank], case, dtype, device)
        w1 = _as_op_weight(w1_all[rank], case, dtype, device)
        set_producer_delay(case.delay_s if rank == case.straggler else 0.0)
        try:
            for it in range(case.iters):
                ids, weights = routing(case, world, it)
                x = _randn((tokens, hid), "x", case, it).to(dtype)
                mine = slice(rank * tc, (rank + 1) * tc)
                plan = moe_plan(ids[mine].to(device), num_experts=e)
                ref_plan = moe_reference.reference_plan(ids.tolist(), e, world)
                plan_ok = (plan.offsets.tolist() == ref_plan["offsets"]
                           and plan.row_token.tolist() == ref_plan["row_token"]
                           and plan.row_expert.tolist() == ref_plan["row_expert"]
                           and plan.pair_row.tolist() == ref_plan["pair_row"]
                           and plan.splits.tolist() == ref_plan["splits"])
                # Layer 0, into a NaN-poisoned output.
                x_shard = x[mine].to(device)
                y = torch.full((tokens * k, f), float("nan"), dtype=dtype, device=device)
                _, gathered = layer0(x_shard, w0, plan, out=y, return_gathered=True)
                path0 = common.last_path("moe_all_gather_gemm")
                pair_rows = plan.pair_row.reshape(-1).long()
                y_pairs = y[pair_rows].view(tokens, k, f)
                ref0 = moe_reference.layer0_reference(x, ids, w0_all[rank].to(dtype))
                err0 = _rel_err(y_pairs, ref0)
                gathered_exact = torch.equal(gathered.cpu(), x)
                last = case.repeat and it == case.iters - 1
                repeat0 = torch.equal(layer0(x_shard, w0, plan), y) if last else None
                # Layer 1 on activations generated per pair (every rank can rebuild every rank's).
                h_pairs = [_randn((tokens, k, f), "h", case, it, r).to(dtype) for r in range(world)]
                h = torch.empty((tokens * k, f), dtype=dtype, device=device)
                h[pair_rows] = h_pairs[rank].reshape(tokens * k, f).to(device)
                wt_dtype = torch.float32 if it % 2 == 0 else dtype
                if case.unweighted and it == case.iters - 1:
                    weights, wt_shard = torch.ones_like(weights), None
                else:
                    wt_shard = weights[mine].to(wt_dtype).to(device)
                out = torch.full((tc, hid), float("nan"), dtype=dtype, device=device)
                layer1(h, w1, plan, wt_shard, out=out)
                path1 = common.last_path("moe_gemm_reduce_scatter")
                ref1 = moe_reference.layer1_reference(h_pairs, ids, weights.to(wt_dtype).double(),
                                                      [w.to(dtype) for w in w1_all])
                err1 = _rel_err(out, ref1[mine])
                repeat1 = torch.equal(layer1(h, w1, plan, wt_shard), out) if last else None
                rows.append({"case": dataclasses.asdict(case), "it": it, "plan_ok": plan_ok, "path0": path0,
                             "path1": path1, "err0": err0, "err1": err1, "gathered_exact": gathered_exact,
                             "repeat0": repeat0, "repeat1": repeat1})
        finally:
            set_producer_delay(0.0)
    return rows


def _error(fn) -> tuple[str, str] | None:
    try:
        fn()
    except (TypeError, ValueError, TileweaveError) as exc:
        return type(exc).__name__, str(exc)
    return None


BAD_INPUT_ERRORS = {
    "ids_float": ("TypeError", "topk_ids"), "ids_1d": ("ValueError", "topk_ids must be"),
    "ids_high": ("ValueError", "outside [0, num_experts=4)"), "ids_negative": ("ValueError", "expert id -1"),
    "tokens_not_divisible": ("ValueError", "divisible"), "plan_shard_high": ("ValueError", "topk_ids_shard"),
    "w0_experts": ("ValueError", "E=4 experts but the weights have 3"), "w0_hidden": ("ValueError", "w0"),
    "w0_2d": ("ValueError", "w0 must be 3-D"), "w0_dtype": ("TypeError", "w0 has dtype"),
    "x_dtype": ("TypeError", "x_shard"), "plan_world": ("ValueError", "world_size="),
    "plan_tokens": ("ValueError", "tokens"), "plan_type": ("TypeError", "MoEPlan"), "out_shape": ("ValueError", "out"),
    "h_rows": ("ValueError", "h has"), "w1_experts": ("ValueError", "weights have"), "w1_rows": ("ValueError", "w1"),
    "weights_shape": ("ValueError", "topk_weights_shard"), "weights_dtype": ("TypeError", "topk_weights_shard"),
    "plan_ranks_disagree": ("TileweaveError", "every rank must route"),
    "layer0_ranks_disagree": ("TileweaveError", "every rank of the group must pass the same"),
}
"""What ``bad_inputs`` must see for each bad input: the exception type and a part of its message."""


def bad_inputs(rank: int, world: int) -> dict:
    """Each bad input's ``(exception type, message)`` (None if nothing was raised), then whether the
    ops still work after them (the errors left no rank out of step)."""
    device = _device()
    tc, k, e, hid, f = 4, 2, 4, 32, 16
    tokens = tc * world
    g = _gen(("bad", world))
    ids = torch.randint(0, e, (tokens, k), generator=g).to(device)
    mine = slice(rank * tc, (rank + 1) * tc)
    x = torch.randn(tc, hid, generator=g).half().to(device)
    w0 = torch.randn(e, hid, f, generator=g).half().to(device)
    w1 = torch.randn(e, f, hid, generator=g).half().to(device)
    wt = torch.rand(tc, k, generator=g).to(device)
    layer0, layer1 = MoEAllGatherGemm(policy="fused"), MoEGemmReduceScatter(policy="fused")
    plan = moe_plan(ids[mine], num_experts=e)
    h = torch.randn(tokens * k, f, generator=g).half().to(device)
    too_high = ids.clone()
    too_high[tokens // 2, 1] = e
    errors = {
        "ids_float": _error(lambda: build_plan(ids.float(), num_experts=e, world_size=world)),
        "ids_1d": _error(lambda: build_plan(ids[:, 0], num_experts=e, world_size=world)),
        "ids_high": _error(lambda: build_plan(too_high, num_experts=e, world_size=world)),
        "ids_negative": _error(lambda: build_plan(ids - 1, num_experts=e, world_size=world)),
        "tokens_not_divisible": _error(lambda: build_plan(ids[:tokens - 1], num_experts=e, world_size=world)),
        "plan_shard_high": _error(lambda: moe_plan(ids[mine] + e, num_experts=e)),
        "w0_experts": _error(lambda: layer0(x, w0[:e - 1], plan)),
        "w0_hidden": _error(lambda: layer0(x, w0[:, :hid - 1], plan)),
        "w0_2d": _error(lambda: layer0(x, w0[0], plan)),
        "w0_dtype": _error(lambda: layer0(x, w0.float(), plan)),
        "x_dtype": _error(lambda: layer0(x.to(torch.int32), w0, plan)),
        "plan_world": _error(lambda: layer0(x, w0, build_plan(ids, num_experts=e, world_size=world * 2))),
        "plan_tokens": _error(lambda: layer0(x[:tc - 1], w0, plan)),
        "plan_type": _error(lambda: layer0(x, w0, ids)),
        "out_shape": _error(lambda: layer0(x, w0, plan, out=torch.empty(tokens * k, f + 1, dtype=x.dtype,
                                                                        device=device))),
        "h_rows": _error(lambda: layer1(h[1:], w1, plan, wt)),
        "w1_experts": _error(lambda: layer1(h, w1[1:], plan, wt)),
        "w1_rows": _error(lambda: layer1(h, w1[:, 1:], plan, wt)),
        "weights_shape": _error(lambda: layer1(h, w1, plan, wt[:, :1])),
        "weights_dtype": _error(lambda: layer1(h, w1, plan, wt.to(torch.int64))),
    }
    # Ranks that disagree (each at a shape it has not called with before, where the ranks check it):
    # the check is collective and fails on every rank alike.
    other_k = ids[mine, :1] if rank == 0 else torch.cat([ids[mine], ids[mine, :1]], dim=1)
    errors["plan_ranks_disagree"] = _error(lambda: moe_plan(other_k, num_experts=e))
    wide = torch.randn(e, hid, f + 8 * (rank == 0), generator=g).half().to(device)
    errors["layer0_ranks_disagree"] = _error(lambda: layer0(x, wide, plan))
    y = layer0(x, w0, plan)
    out = layer1(h, w1, plan, wt)
    return {"errors": errors, "after_ok": bool(torch.isfinite(y).all() and torch.isfinite(out).all())}


def no_host_sync_check(rank: int, world: int, policy: str) -> dict:
    """A second call of the plan and both layers (same shapes, fresh routing) under
    ``torch.cuda.set_sync_debug_mode("error")``: any host synchronisation raises (GPUs only; the
    first call may synchronise, it agrees on the shapes). Returns the paths and the outputs' errors."""
    device = _device()
    case = MoECase(64, 256, 128, 8, 2, dtype="bfloat16", policy=policy)
    tc, k, e = case.tokens_per_rank, case.topk, case.experts
    mine = slice(rank * tc, (rank + 1) * tc)
    w0_all, w1_all = _weights(case, world)
    w0 = _as_op_weight(w0_all[rank], case, torch.bfloat16, device)
    w1 = _as_op_weight(w1_all[rank], case, torch.bfloat16, device)
    layer0, layer1 = MoEAllGatherGemm(policy=policy), MoEGemmReduceScatter(policy=policy)
    result = {}
    for it in range(2):
        ids, weights = routing(case, world, it)
        x = _randn((tc * world, case.hidden), "x", case, it).to(torch.bfloat16)
        x_shard, ids_shard, wt = x[mine].to(device), ids[mine].to(device), weights[mine].to(device)
        torch.cuda.synchronize()
        if it == 1:
            torch.cuda.set_sync_debug_mode("error")
        try:
            plan = moe_plan(ids_shard, num_experts=e, validate=it == 0)
            y = layer0(x_shard, w0, plan)
            out = layer1(y, w1, plan, wt)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        # y as layer 1's input: its reference is layer 0's output, per pair, on every rank; checked here
        # for layer 0 only, and for layer 1 through finiteness (pair_check covers its arithmetic).
        y_pairs = y[plan.pair_row.reshape(-1).long()].view(tc * world, k, case.f_loc)
        result = {"path0": common.last_path("moe_all_gather_gemm"), "path1": common.last_path("moe_gemm_reduce_scatter"),
                  "err0": _rel_err(y_pairs, moe_reference.layer0_reference(x, ids, w0_all[rank].to(torch.bfloat16))),
                  "finite1": bool(torch.isfinite(out).all())}
    return result


def graph_capture_check(rank: int, world: int) -> dict:
    """The plan and both layers captured in a CUDA graph (policy "auto", after an eager call of these
    shapes), then replayed on new routing and tokens copied into the captured inputs: the replay's
    layer 0 output against the float64 reference of the new inputs, the paths taken under capture
    (the fallback: the fused path's epochs would not advance), and whether ``policy="fused"`` refuses
    to be captured on every rank. GPUs with NCCL only."""
    device = _device()
    case = MoECase(64, 256, 128, 8, 2, dtype="bfloat16")
    tc, k, e = case.tokens_per_rank, case.topk, case.experts
    mine = slice(rank * tc, (rank + 1) * tc)
    w0_all, w1_all = _weights(case, world)
    w0 = _as_op_weight(w0_all[rank], case, torch.bfloat16, device)
    w1 = _as_op_weight(w1_all[rank], case, torch.bfloat16, device)
    layer0, layer1 = MoEAllGatherGemm(), MoEGemmReduceScatter()

    def inputs(it: int):
        ids, weights = routing(case, world, it)
        x = _randn((tc * world, case.hidden), "x", case, it).to(torch.bfloat16)
        return x, ids, x[mine].to(device), ids[mine].to(device), weights[mine].to(device)

    _, _, x_static, ids_static, wt_static = inputs(0)

    def step():
        plan = moe_plan(ids_static, num_experts=e, validate=False)
        y = layer0(x_static, w0, plan)
        return plan, y, layer1(y, w1, plan, wt_static)

    step()  # eager: agrees on the shapes
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan, y, out = step()
    paths = (common.last_path("moe_all_gather_gemm"), common.last_path("moe_gemm_reduce_scatter"))
    x, ids, x_shard, ids_shard, wt = inputs(1)
    x_static.copy_(x_shard)
    ids_static.copy_(ids_shard)
    wt_static.copy_(wt)
    graph.replay()
    torch.cuda.synchronize()
    y_pairs = y[plan.pair_row.reshape(-1).long()].view(tc * world, k, case.f_loc)
    err0 = _rel_err(y_pairs, moe_reference.layer0_reference(x, ids, w0_all[rank].to(torch.bfloat16)))
    refused = None
    try:
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            MoEAllGatherGemm(policy="fused")(x_static, w0, plan)
    except TileweaveError as exc:
        refused = str(exc)
    return {"paths": paths, "err0": err0, "finite1": bool(torch.isfinite(out).all()), "refused": refused}


def gate_timeout_check(rank: int, world: int, late: int, delay_s: float, max_spin: int) -> str | None:
    """Layer 0 with rank ``late``'s copy engine ``delay_s`` late and a spin bound of ``max_spin`` polls on
    the other ranks (the late rank keeps the default bound, so that only they can give up): their gated
    tiles give up waiting for its shard and the call raises (the message is returned; None where
    nothing was raised) instead of hanging or returning wrong rows silently."""
    device = _device()
    case = MoECase(4, 32, 16, 4, 2)
    ids, _ = routing(case, world, 0)
    mine = slice(rank * 4, (rank + 1) * 4)
    layer0 = MoEAllGatherGemm(policy="fused", max_spin=None if rank == late else max_spin)
    plan = moe_plan(ids[mine].to(device), num_experts=case.experts)
    x = _randn((4, 32), "x", rank).half().to(device)
    w0 = _randn((4, 32, 16), "w0", rank).half().to(device)
    set_producer_delay(delay_s if rank == late else 0.0)
    try:
        layer0(x, w0, plan)
    except TileweaveError as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        set_producer_delay(0.0)
    return None


def compile_check(rank: int, world: int) -> dict:
    """``torch.compile(fullgraph=True)`` of the MoE pair's functional forms on a plan built eagerly:
    layer 0 (with the gathered input) and layer 1, the graphs, the tileweave ops in them and each
    layer's error against float64 from the unsharded inputs."""
    case = MoECase(tokens_per_rank=6, hidden=16, f_loc=24, experts=4, topk=2, dtype="float32")
    tc, k, e, f = case.tokens_per_rank, case.topk, case.experts, case.f_loc
    tokens = tc * world
    device = _device()
    ids, weights = routing(case, world, 0)
    mine = slice(rank * tc, (rank + 1) * tc)
    plan = moe_plan(ids[mine].to(device), num_experts=e)
    w0_all, w1_all = _weights(case, world)
    w0, w1 = _as_op_weight(w0_all[rank], case, torch.float32, device), _as_op_weight(w1_all[rank], case,
                                                                                     torch.float32, device)
    x = _randn((tokens, case.hidden), "x", case)
    h_pairs = [_randn((tokens, k, f), "h", case, r) for r in range(world)]
    pair_rows = plan.pair_row.reshape(-1).long()
    h = torch.empty((tokens * k, f), device=device)
    h[pair_rows] = h_pairs[rank].reshape(tokens * k, f).to(device)

    def pair(x_shard, h, wt):
        y, gathered = tileweave.moe_all_gather_gemm(x_shard, w0, plan, return_gathered=True)
        return y, gathered, tileweave.moe_gemm_reduce_scatter(h, w1, plan, wt)

    (y, gathered, out), graphs, ops = compiled(pair, x[mine].to(device), h, weights[mine].to(device))
    ref0 = moe_reference.layer0_reference(x, ids, w0_all[rank])
    ref1 = moe_reference.layer1_reference(h_pairs, ids, weights.double(), w1_all)
    return {"graphs": graphs, "ops": ops, "err0": _rel_err(y[pair_rows].view(tokens, k, f), ref0),
            "err1": _rel_err(out, ref1[mine]), "gathered_exact": torch.equal(gathered.cpu(), x)}
