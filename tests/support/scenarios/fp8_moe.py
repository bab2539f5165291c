"""The MoE pair in FP8 on emulated ranks (or GPUs): layer 0 (AllGather + grouped GEMM, plain or with the
SwiGLU epilogue) and layer 1 (grouped GEMM + top-k sum + ReduceScatter) with float8 operands and
tensorwise, rowwise or blockwise scales, against float64 of every rank's dequantized operands, computed
pair by pair here; and bad FP8 arguments, refused by name on every rank.

Quantization is ``fp8_dense``'s (plain torch, independent of the library): each rank quantizes its own
shard of the tokens (a tensorwise scale differs per rank: the ranks' magnitudes differ), each expert's
weight on its own (per-expert scales)."""

from __future__ import annotations

import zlib

import torch
import torch.distributed as dist
import torch.nn.functional as F

import tileweave
from tileweave.ops import common
from tileweave.ops.compute.grouped_gemm import SwiGLU
from tileweave.runtime.backend import set_producer_delay
from support.scenarios.common import rel_err
from support.scenarios.fp8_dense import dequantize_a, dequantize_b, quantize_a, quantize_b

# (scaling, tokens per rank, hidden, F_loc, experts, top-k, out dtype, swiglu, policy, straggler, delay_s)
FIELDS = ("scaling", "tc", "hidden", "f_loc", "experts", "topk", "out_dtype", "swiglu", "policy", "straggler",
          "delay_s")


def _gen(*parts) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(parts).encode()))


def _randn(shape, *parts) -> torch.Tensor:
    return torch.randn(*shape, generator=_gen(*parts))


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _expert_weights(w: torch.Tensor, scaling: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(w8 [E, K, N] as the transpose view of a contiguous [E, N, K], scale_b, float64 dequantized
    [E, K, N])`` of float32 ``w [E, K, N]``, each expert quantized on its own."""
    q = [quantize_b(w[e], scaling) for e in range(w.shape[0])]
    w8 = torch.stack([d for d, _ in q]).transpose(1, 2).contiguous().transpose(1, 2)
    scale_b = torch.stack([s.reshape(s.shape if scaling == "blockwise" else (1, -1) if scaling == "rowwise" else ())
                           for _, s in q])
    deq = torch.stack([dequantize_b(d, s, scaling) for d, s in q])
    return w8, scale_b, deq


def _routing(tokens: int, k: int, e: int, *seed) -> tuple[torch.Tensor, torch.Tensor]:
    g = _gen("ids", *seed)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(tokens)])
    return ids, torch.softmax(torch.randn(tokens, k, generator=g), dim=1)


def _per_expert(a: torch.Tensor, w: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """float64 ``[T, k, N]``: ``a[t, j] @ w[ids[t, j]]`` for ``a [T, k, K]`` and ``w [E, K, N]``."""
    out = torch.zeros(*ids.shape, w.shape[2], dtype=torch.float64)
    for e in range(w.shape[0]):
        chosen = ids == e
        out[chosen] = a[chosen].double() @ w[e]
    return out


def _scale_rows(s: torch.Tensor, rows: int, scaling: str) -> torch.Tensor:
    """The gathered form of a shard's a-scales: ``[rows, KB]``, a tensorwise scale on every row."""
    return s.reshape(1, 1).expand(rows, 1) if scaling == "tensorwise" else s.reshape(rows, -1)


def fp8_moe_pair_check(rank: int, world: int, cases: list[tuple], iters: int = 1) -> list[dict]:
    """Per case (``FIELDS``) and call: layer 0's and layer 1's relative errors against float64, the
    paths, the output dtypes, and whether layer 0 returned the gathered float8 rows and scales bit for
    bit. Calls ``iters`` times with fresh routing and inputs."""
    device = _device()
    rows = []
    for case in cases:
        c = dict(zip(FIELDS, case))
        scaling, tc, hid, f, e, k = (c[name] for name in ("scaling", "tc", "hidden", "f_loc", "experts", "topk"))
        out_dtype = getattr(torch, c["out_dtype"])
        tokens = tc * world
        mine = slice(rank * tc, (rank + 1) * tc)
        layer0 = tileweave.MoEAllGatherGemm(policy=c["policy"])
        layer1 = tileweave.MoEGemmReduceScatter(policy=c["policy"])
        n0 = 2 * f if c["swiglu"] else f
        set_producer_delay(c["delay_s"] if rank == c["straggler"] else 0.0)
        try:
            for it in range(iters):
                seed = (case, world, it)
                ids, weights = _routing(tokens, k, e, *seed)
                # Every rank's shard, quantized by its owner; magnitudes differ per rank.
                shards = [quantize_a(_randn((tc, hid), "x", *seed, p) * (1 + p), scaling) for p in range(world)]
                x_deq = torch.cat([dequantize_a(x8, s) for x8, s in shards])
                w0 = [_expert_weights(_randn((e, hid, n0), "w0", *seed, r) / hid ** 0.5, scaling) for r in range(world)]
                plan = tileweave.moe_plan(ids[mine].to(device), num_experts=e)
                x8, sa = shards[rank]
                w8, sb, w_deq = w0[rank]
                y = torch.full((tokens * k, f), float("nan"), dtype=out_dtype, device=device)
                pre = torch.full((tokens * k, n0), float("nan"), dtype=out_dtype, device=device)
                epilogue = SwiGLU(pre=pre) if c["swiglu"] else None
                _, gathered, gathered_scales = layer0(
                    x8.to(device), w8.to(device), plan, out=y, return_gathered=True, epilogue=epilogue,
                    scale_a=sa.to(device), scale_b=sb.to(device), out_dtype=out_dtype)
                path0 = common.last_path("moe_all_gather_gemm")
                pair_rows = plan.pair_row.reshape(-1).long().cpu()
                ref0 = _per_expert(x_deq[:, None, :].expand(tokens, k, hid), w_deq, ids)
                err_pre = None
                if c["swiglu"]:
                    gate, up = ref0.split(f, dim=2)
                    # pre holds gate j and up j side by side (columns 2j, 2j + 1)
                    err_pre = rel_err(pre.cpu()[pair_rows].view(tokens, k, n0),
                                      torch.stack([gate, up], dim=3).reshape(tokens, k, n0))
                    ref0 = F.silu(gate) * up
                err0 = rel_err(y.cpu()[pair_rows].view(tokens, k, f), ref0)
                gathered_exact = (torch.equal(gathered.cpu().view(torch.uint8),
                                              torch.cat([x8 for x8, _ in shards]).view(torch.uint8))
                                  and torch.equal(gathered_scales.cpu(),
                                                  torch.cat([_scale_rows(s, tc, scaling) for _, s in shards])))
                # Layer 1 on float8 activations of every pair, each rank's quantized by that rank.
                h_pairs = [quantize_a(_randn((tokens * k, f), "h", *seed, r), scaling) for r in range(world)]
                w1 = [_expert_weights(_randn((e, f, hid), "w1", *seed, r) / f ** 0.5, scaling) for r in range(world)]
                h8_pairs, sh_pairs = h_pairs[rank]
                # Row p of the plan holds pair (t, j): rows and row scales placed by the plan.
                h8 = torch.empty_like(h8_pairs)
                h8.view(torch.uint8)[pair_rows] = h8_pairs.view(torch.uint8)
                sh = sh_pairs
                if scaling != "tensorwise":
                    sh = torch.empty_like(sh_pairs)
                    sh[pair_rows] = sh_pairs
                w18, sb1, _ = w1[rank]
                out = torch.full((tc, hid), float("nan"), dtype=out_dtype, device=device)
                layer1(h8.to(device), w18.to(device), plan, weights[mine].to(device), out=out, scale_a=sh.to(device),
                       scale_b=sb1.to(device), out_dtype=out_dtype)
                path1 = common.last_path("moe_gemm_reduce_scatter")
                ref1 = torch.zeros(tokens, hid, dtype=torch.float64)
                for r in range(world):
                    h_deq = dequantize_a(*h_pairs[r]).view(tokens, k, f)
                    z = _per_expert(h_deq, w1[r][2], ids)
                    ref1 += (weights.double()[:, :, None] * z).sum(1)
                err1 = rel_err(out.cpu(), ref1[mine])
                rows.append({"case": case, "it": it, "err0": err0, "err_pre": err_pre, "err1": err1, "path0": path0,
                             "path1": path1, "dtypes": sorted({str(y.dtype), str(out.dtype)}),
                             "gathered_exact": gathered_exact})
        finally:
            set_producer_delay(0.0)
    return rows


def _outcome(fn) -> str:
    try:
        fn()
    except (TypeError, ValueError, tileweave.TileweaveError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def fp8_moe_errors_check(rank: int, world: int) -> dict:
    """Each bad float8 argument of either layer, on every rank or on rank 1 only: the error each rank
    raised (before any kernel), then whether a good call still runs on every rank."""
    device = _device()
    tc, hid, f, e, k = 4, 128, 128, 2, 2
    bad = rank == 1
    ids, _ = _routing(tc * world, k, e, "errors", world)
    plan = tileweave.moe_plan(ids[rank * tc:(rank + 1) * tc].to(device), num_experts=e)
    x8, sa = (t.to(device) for t in quantize_a(_randn((tc, hid), "x", rank), "rowwise"))
    w0, sb0, _ = _expert_weights(_randn((e, hid, f), "w0", rank), "rowwise")
    h8, sh = (t.to(device) for t in quantize_a(_randn((tc * world * k, f), "h", rank), "rowwise"))
    w1, sb1, _ = _expert_weights(_randn((e, f, hid), "w1", rank), "rowwise")
    w0, sb0, w1, sb1 = (t.to(device) for t in (w0, sb0, w1, sb1))
    out_dtype = torch.float32
    layer0, layer1 = tileweave.MoEAllGatherGemm(), tileweave.MoEGemmReduceScatter()

    def call0(a=x8, w=w0, scale_a=sa, scale_b=sb0, **kw):
        kw.setdefault("out_dtype", out_dtype)
        return layer0(a, w, plan, scale_a=scale_a, scale_b=scale_b, **kw)

    def call1(a=h8, w=w1, scale_a=sh, scale_b=sb1, **kw):
        kw.setdefault("out_dtype", out_dtype)
        return layer1(a, w, plan, None, scale_a=scale_a, scale_b=scale_b, **kw)

    outcomes = {}
    for layer, call, a, s_a, s_b in (("layer 0", call0, x8, sa, sb0), ("layer 1", call1, h8, sh, sb1)):
        cases = {
            "no scales": lambda: call(scale_a=None, scale_b=None),
            "no scale_b": lambda: call(scale_b=None),
            "scale_a shape": lambda: call(scale_a=s_a[:-1]),
            "scale_b shape": lambda: call(scale_b=s_b[:, :, :-1]),
            "scale_b dtype": lambda: call(scale_b=s_b.double()),
            "scale_a device": lambda: call(scale_a=s_a.to("meta")),
            "scales on fp16": lambda: call(a=a.half(), w=(w0 if call is call0 else w1).half(), out_dtype=None),
            "mixed operands": lambda: call(a=a.half(), out_dtype=None),
            "out_dtype": lambda: call(out_dtype=torch.int32),
            "blockwise K": lambda: call(a=a[:, :96], w=(w0 if call is call0 else w1)[:, :96],
                                        scale_a=s_a.new_ones(a.shape[0], 1), scale_b=s_b.new_ones(e, 1, 1)),
            "scale_a shape, one rank": lambda: call(scale_a=s_a[:-1] if bad else s_a),
            "scale_b dtype, one rank": lambda: call(scale_b=s_b.half() if bad else s_b),
            "no scales, one rank": lambda: call(scale_a=None if bad else s_a),
        }
        if common.interpreting():
            cases["bf16 out on the CPU"] = lambda: call(out_dtype=torch.bfloat16)
        for name, fn in cases.items():
            outcomes[f"{layer}: {name}"] = _outcome(fn)
            dist.barrier()
    # Still in step: a good call on every rank.
    call0()
    call1()
    outcomes["after"] = "ok"
    return outcomes


def fp8_moe_walk_check(rank: int, world: int) -> dict:
    """The walk of one input (``support.walk``) through float8 calls of both layers on each path, the
    scales among the inputs: per ``(layer, policy)`` the files of the first and the repeat call."""
    from support import walk
    from tileweave.runtime.backend import get_backend

    get_backend(None, torch.device("cpu"))
    rule = walk.Rule(walk.PACKAGE)
    tc, hid, f, e, k = 4, 32, 16, 2, 2
    ids, weights = _routing(tc * world, k, e, "walk", world)
    plan = tileweave.moe_plan(ids[rank * tc:(rank + 1) * tc], num_experts=e)
    x8, sa = quantize_a(_randn((tc, hid), "x", rank), "rowwise")
    w0, sb0, _ = _expert_weights(_randn((e, hid, f), "w0", rank), "rowwise")
    h8, sh = quantize_a(_randn((tc * world * k, f), "h", rank), "rowwise")
    w1, sb1, _ = _expert_weights(_randn((e, f, hid), "w1", rank), "rowwise")
    wt = weights[rank * tc:(rank + 1) * tc]
    found = {}
    for policy in ("auto", "fallback"):
        for layer, op, args in (
                ("layer 0", tileweave.MoEAllGatherGemm(policy=policy), (x8, w0, plan, sa, sb0)),
                ("layer 1", tileweave.MoEGemmReduceScatter(policy=policy), (h8, w1, plan, wt, sh, sb1))):
            if layer == "layer 0":
                call = lambda: op(x8, w0, plan, scale_a=sa, scale_b=sb0, out_dtype=torch.float32)  # noqa: E731
            else:
                call = lambda: op(h8, w1, plan, wt, scale_a=sh, scale_b=sb1, out_dtype=torch.float32)  # noqa: E731
            found[layer, policy] = [sorted(walk.trace(call, inputs=args, op=op, rule=rule).files) for _ in range(2)]
    return found
