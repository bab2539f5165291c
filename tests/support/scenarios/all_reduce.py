"""Per-rank checks of GEMM + AllReduce, run on emulated ranks by the CPU tests and on GPUs by the GPU tests.
Each returns plain data (errors, paths, checksums) so that the caller asserts.

Inputs are regenerated from seeds on every rank, so the reference (float64 torch on every rank's inputs,
written here and sharing nothing with the op) needs no collective.
"""

from __future__ import annotations

import dataclasses
import time
import zlib

import torch
import torch.distributed as dist

from tileweave.ops import common
from tileweave.ops.all_reduce import GemmAllReduce
from tileweave.runtime.backend import CollectiveTimeout, TileweaveError
import tileweave
from support.scenarios.common import GemmCase, compiled, device_name, randn, rel_err
from support.scenarios.graphs import captured

TOL = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1e-2}


@dataclasses.dataclass(frozen=True)
class DecodeCase(GemmCase):
    """A case of GEMM + AllReduce: M (the same on every rank), the policy and the fused epilogue. The
    ranks' slices of K are uneven (rank p's is ``k + p``)."""

    m: int
    policy: str = "oneshot"
    residual: bool = False
    norm: bool = False


def _checksum(t: torch.Tensor) -> int:
    return zlib.crc32(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())


def case_inputs(case: DecodeCase, it: int, world: int, device) -> dict:
    """Every rank's inputs of call ``it`` of ``case`` (each rank rebuilds all of them from seeds)."""
    dtype = getattr(torch, case.dtype)
    tag = (case.seed, case.m, case.n, it)
    a = [randn((case.m, case.k + p), dtype, "a", *tag, p, device=device) for p in range(world)]
    if case.weight_layout:
        b = [randn((case.n, case.k + p), dtype, "w", *tag, p, device=device).t() for p in range(world)]
    else:
        b = [randn((case.k + p, case.n), dtype, "b", *tag, p, device=device) for p in range(world)]
    scale = 1.0 / (case.k + world) ** 0.5
    b = [x * scale for x in b]
    return {"a": a, "b": b,
            "bias": randn((case.n,), dtype, "bias", *tag, device=device) if case.bias else None,
            "residual": randn((case.m, case.n), dtype, "res", *tag, device=device) if case.residual else None,
            "norm": (1 + 0.5 * randn((case.n,), dtype, "g", *tag, device=device)) if case.norm else None}


def reference(inputs: dict, eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """float64 from the unsharded problem: ``(y, resid)`` as the op documents them."""
    total = sum(a.double() @ b.double() for a, b in zip(inputs["a"], inputs["b"]))
    if inputs["bias"] is not None:
        total = total + inputs["bias"].double()
    if inputs["residual"] is not None:
        total = total + inputs["residual"].double()
    if inputs["norm"] is None:
        return total, None
    normed = total / torch.sqrt(total.pow(2).mean(dim=-1, keepdim=True) + eps) * inputs["norm"].double()
    return normed, total


def all_reduce_check(rank: int, world: int, cases: list[DecodeCase], eps: float = 1e-6) -> list[dict]:
    """Each case's calls on one op per (policy, graphable), with NaN-poisoned outputs: per call the
    error against float64, the path taken and checksums of the outputs (equal on every rank, and across
    protocols, for the same inputs)."""
    device = device_name()
    ops: dict[tuple, GemmAllReduce] = {}
    rows = []
    for case in cases:
        op = ops.setdefault((case.policy, case.graphable), GemmAllReduce(policy=case.policy, graphable=case.graphable))
        for it in range(case.iters):
            inputs = case_inputs(case, it, world, device)
            out = torch.full((case.m, case.n), float("nan"), dtype=getattr(torch, case.dtype), device=device)
            if rank == case.straggler:
                time.sleep(case.delay_s)
            start = time.monotonic()
            result = op(inputs["a"][rank], inputs["b"][rank], bias=inputs["bias"], residual=inputs["residual"],
                        norm_weight=inputs["norm"], eps=eps, out=out)
            y, resid = result if case.norm else (result, None)
            ref_y, ref_resid = reference(inputs, eps)
            err = rel_err(y, ref_y)
            if resid is not None:
                err = max(err, rel_err(resid, ref_resid))
            rows.append({"case": dataclasses.asdict(case), "it": it, "err": err, "tol": TOL[case.dtype],
                         "out_is_y": y is out, "seconds": time.monotonic() - start, "path": common.last_path("gemm_all_reduce"),
                         "sums": [_checksum(y)] + ([_checksum(resid)] if resid is not None else [])})
    return rows


def missing_peer_check(rank: int, world: int, kinds: list[tuple[str, bool]], max_spin: int) -> list[dict]:
    """Per ``(policy, graphable)`` in ``kinds``, an op of its own: every rank calls it once (the call that
    agrees on the signature), then rank 0 calls it again and the others do not: rank 0 must raise
    ``CollectiveTimeout`` naming rank 1: at the call's agreement with the peers, within the host's bound
    (``timeout_s`` of the backend), or, should the peer vanish after it, from the kernel's wait of
    ``max_spin`` polls (on the CPU at that call; on GPUs at the next, after a synchronize)."""
    device = device_name()
    outcomes = []
    for policy, graphable in kinds:
        op = GemmAllReduce(policy=policy, graphable=graphable, max_spin=max_spin)
        a = randn((4, 8), torch.float16, "mp-a", rank, device=device)
        b = randn((8, 24), torch.float16, "mp-b", rank, device=device)
        op(a, b)
        outcome = {"raised": False, "message": "", "seconds": 0.0}
        if device != "cpu":
            torch.cuda.synchronize()
        dist.barrier()
        if rank == 0:
            start = time.monotonic()
            try:
                for _ in range(2):
                    op(a, b)
                    if device != "cpu":
                        torch.cuda.synchronize()
            except CollectiveTimeout as exc:
                outcome.update(raised=True, message=str(exc))
            outcome["seconds"] = time.monotonic() - start
        if device != "cpu":
            torch.cuda.synchronize()
        dist.barrier()
        outcomes.append(outcome)
    return outcomes


def _outcomes(calls: dict) -> dict[str, str]:
    """Each call's error type and message ("no error" if it returned)."""
    outcomes = {}
    for name, call in calls.items():
        try:
            call()
            outcomes[name] = "no error"
        except (TypeError, ValueError, TileweaveError) as exc:
            outcomes[name] = f"{type(exc).__name__}: {exc}"
    return outcomes


def input_errors_check(rank: int, world: int) -> dict[str, str]:
    """Bad calls, each refused with a named error before anything runs; then a good call, which must
    still work (nothing half-done by the refused ones). Returns each call's error type and message."""
    device = device_name()
    op = GemmAllReduce(policy="oneshot")
    f16, f32 = torch.float16, torch.float32
    a = randn((4, 8), f16, "ie-a", rank, device=device)
    b = randn((8, 12), f16, "ie-b", rank, device=device)
    r = randn((4, 12), f16, "ie-r", device=device)
    g = randn((12,), f16, "ie-g", device=device)
    bad = {
        "a 3-D": lambda: op(a[None], b),
        "a int": lambda: op(a.to(torch.int32), b),
        "b shape": lambda: op(a, b[:7]),
        "b dtype": lambda: op(a, b.to(f32)),
        "bias shape": lambda: op(a, b, bias=g[:5]),
        "bias dtype": lambda: op(a, b, bias=g.to(f32)),
        "residual shape": lambda: op(a, b, residual=r[:3]),
        "residual dtype": lambda: op(a, b, residual=r.to(f32)),
        "residual device": lambda: op(a, b, residual=r.to("meta")),
        "norm without residual": lambda: op(a, b, norm_weight=g),
        "norm shape": lambda: op(a, b, residual=r, norm_weight=g[:4]),
        "eps": lambda: op(a, b, residual=r, norm_weight=g, eps=-1.0),
        "out shape": lambda: op(a, b, out=torch.empty((4, 11), dtype=f16, device=device)),
        "b device": lambda: op(a, b.to("meta")),
        "policy": lambda: GemmAllReduce(policy="ring"),
        "max_spin": lambda: GemmAllReduce(max_spin=0),
    }
    if device == "cpu":
        bad["bf16 forced fused"] = lambda: op(a.bfloat16(), b.bfloat16())
    others = dist.new_group([p for p in range(world) if p != 0])  # collective: every rank makes it
    if rank == 0:
        bad["foreign group"] = lambda: GemmAllReduce(others)(a, b)
    outcomes = _outcomes(bad)
    y = op(a, b)
    outcomes["good call after"] = f"{common.last_path('gemm_all_reduce')} {tuple(y.shape)} {bool(torch.isfinite(y).all())}"
    return outcomes


def cuda_graph_check(rank: int, world: int, policy: str, m: int, k: int, n: int, norm: bool,
                     dtype: str = "bfloat16") -> dict:
    """A graphable op's call (with bias, and residual + norm if ``norm``) captured in a CUDA graph after
    two eager calls, replayed with new inputs copied into the captured buffers: each replay against
    float64, six replays back to back without a host sync, then an eager call on the last inputs, which
    must give the replay's bits (the constant flags are back where every call starts)."""
    device = device_name()
    op = GemmAllReduce(policy=policy, graphable=True)
    case = DecodeCase(m=m, k=k, n=n, dtype=dtype, policy=policy, bias=True, residual=norm, norm=norm)
    first = case_inputs(case, 0, world, device)
    a = first["a"][rank].clone()
    weight = first["b"][rank]
    bias = first["bias"]
    residual = first["residual"].clone() if norm else None
    gamma = first["norm"]

    def call():
        return op(a, weight, bias=bias, residual=residual, norm_weight=gamma)

    def refill(it):
        inputs = case_inputs(case, it, world, device)
        # The weights, bias and norm of call 0 throughout: only a and residual change between replays.
        inputs.update(b=first["b"], bias=bias, norm=gamma)
        a.copy_(inputs["a"][rank])
        if norm:
            residual.copy_(inputs["residual"])
        return inputs

    warm_up = iter((100, 101))  # the eager calls before the capture, on inputs of their own
    graph, result = captured(call, lambda: refill(next(warm_up)))
    path = common.last_path("gemm_all_reduce")
    outs = result if norm else (result,)
    errors = []
    for it in range(3):
        inputs = refill(it)
        for t in outs:
            t.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = reference(inputs, 1e-6)
        errors.append(max(rel_err(t, r) for t, r in zip(outs, ref) if r is not None))
    inputs = refill(99)
    for _ in range(6):
        graph.replay()
    torch.cuda.synchronize()
    ref = reference(inputs, 1e-6)
    errors.append(max(rel_err(t, r) for t, r in zip(outs, ref) if r is not None))
    replayed = [_checksum(t) for t in outs]
    eager = call()
    torch.cuda.synchronize()
    eager_sums = [_checksum(t) for t in (eager if norm else (eager,))]
    dist.barrier()
    return {"path": path, "errors": errors, "tol": TOL[dtype], "replayed": replayed, "eager": eager_sums}


def compile_check(rank: int, world: int) -> dict:
    """``torch.compile(fullgraph=True)`` of ``gemm_all_reduce`` with and without the residual + RMSNorm
    (the functional form, as the inference layers call it): the graphs, the tileweave ops in them and
    each result's error against float64 from the unsharded inputs."""
    case = DecodeCase(m=5, k=24, n=40, dtype="float32", residual=True, norm=True)
    inputs = case_inputs(case, 0, world, device_name())
    a, b, res, g = inputs["a"][rank], inputs["b"][rank], inputs["residual"], inputs["norm"]

    def step(a, res):
        y = tileweave.gemm_all_reduce(a, b)
        normed, resid = tileweave.gemm_all_reduce(a, b, residual=res, norm_weight=g, eps=1e-6)
        return y, normed, resid

    (y, normed, resid), graphs, ops = compiled(step, a, res)
    plain, _ = reference({**inputs, "residual": None, "norm": None}, 1e-6)
    ref_normed, ref_resid = reference(inputs, 1e-6)
    return {"graphs": graphs, "ops": ops,
            "err": max(rel_err(y, plain), rel_err(normed, ref_normed), rel_err(resid, ref_resid))}


FP8_SCALINGS = ("tensorwise", "rowwise", "blockwise")


def _fp8_inputs(scaling: str, m: int, k: int, n: int, rank: int, device) -> tuple:
    """Rank ``rank``'s float8 ``a [m, k]``, ``b [k, n]`` and their float32 scales under ``scaling``,
    quantised from seeded float32 tensors (every rank rebuilds every rank's)."""
    a = randn((m, k), torch.float32, "fp8-a", scaling, rank)
    b = randn((k, n), torch.float32, "fp8-b", scaling, rank)
    if scaling == "tensorwise":
        sa, sb = a.abs().amax() / 448, b.abs().amax() / 448
        a8, b8 = (a / sa).to(torch.float8_e4m3fn), (b / sb).to(torch.float8_e4m3fn)
        sa, sb = sa.reshape(()), sb.reshape(())
    elif scaling == "rowwise":
        sa, sb = a.abs().amax(1, keepdim=True) / 448, b.abs().amax(0, keepdim=True) / 448
        a8, b8 = (a / sa).to(torch.float8_e4m3fn), (b / sb).to(torch.float8_e4m3fn)
    else:  # blockwise: 1 x 128 blocks of a, 128 x 128 blocks of b
        kb, nb = k // 128, -(-n // 128)
        sa = a.view(m, kb, 128).abs().amax(2) / 448
        a8 = (a.view(m, kb, 128) / sa[:, :, None]).view(m, k).to(torch.float8_e4m3fn)
        bp = torch.nn.functional.pad(b, (0, nb * 128 - n)).view(kb, 128, nb, 128)
        sb = bp.abs().amax((1, 3)) / 448
        b8 = (bp / sb[:, None, :, None]).view(k, nb * 128)[:, :n].to(torch.float8_e4m3fn)
    return a8.to(device), b8.to(device), sa.float().to(device), sb.float().to(device)


def _dequantized(scaling: str, a8, b8, sa, sb) -> tuple[torch.Tensor, torch.Tensor]:
    a, b = a8.double(), b8.double()
    if scaling == "blockwise":
        m, k = a.shape
        n = b.shape[1]
        a = (a.view(m, k // 128, 128) * sa.double()[:, :, None]).view(m, k)
        sb_full = sb.double().repeat_interleave(128, 0).repeat_interleave(128, 1)[:, :n]
        return a, b * sb_full
    return a * sa.double(), b * sb.double()


def fp8_check(rank: int, world: int, cases: list[tuple]) -> list[dict]:
    """Per case ``(scaling, policy, m, k_loc, n, out_dtype, norm)``: the FP8 GEMM + AllReduce (with a
    bias, and with ``norm`` a residual and RMSNorm) against float64 of every rank's dequantized
    partials; whether every rank got the same bits; the path."""
    device = device_name()
    rows = []
    for scaling, policy, m, k, n, out_dtype, norm in cases:
        dtype = getattr(torch, out_dtype)
        mine = _fp8_inputs(scaling, m, k, n, rank, device)
        bias = randn((n,), dtype, "fp8-bias", scaling, device=device)
        residual = randn((m, n), dtype, "fp8-res", scaling, device=device) if norm else None
        weight = randn((n,), dtype, "fp8-g", scaling, device=device) if norm else None
        op = GemmAllReduce(policy=policy)
        got = op(mine[0], mine[1], bias=bias, residual=residual, norm_weight=weight, scale_a=mine[2],
                 scale_b=mine[3], out_dtype=dtype)
        total = sum(torch.mm(*_dequantized(scaling, *_fp8_inputs(scaling, m, k, n, r, "cpu")))
                    for r in range(world)) + bias.double().cpu()
        if norm:
            resid_ref = total + residual.double().cpu()
            ref = resid_ref * torch.rsqrt(resid_ref.square().mean(-1, keepdim=True) + 1e-6) * weight.double().cpu()
            err = max(rel_err(got[0].cpu(), ref), rel_err(got[1].cpu(), resid_ref))
            got = got[0]
        else:
            err = rel_err(got.cpu(), total)
        everyone = [torch.empty_like(got) for _ in range(world)]
        dist.all_gather(everyone, got.contiguous())
        rows.append({"case": (scaling, policy, out_dtype, norm), "err": err, "dtype": str(got.dtype),
                     "same": all(torch.equal(other, got) for other in everyone),
                     "path": common.last_path("gemm_all_reduce")})
    return rows


def fp8_errors_check(rank: int, world: int) -> dict[str, str]:
    """Bad FP8 calls, one at a time, the same on every rank: each error's type and message."""
    device = device_name()
    a8, b8, sa, sb = _fp8_inputs("rowwise", 4, 32, 16, rank, device)
    op = GemmAllReduce(policy="oneshot")
    bad = {
        "no scales": lambda: op(a8, b8),
        "scale_a shape": lambda: op(a8, b8, scale_a=sa[:3], scale_b=sb),
        "scale dtype": lambda: op(a8, b8, scale_a=sa.half(), scale_b=sb),
        "mixed operands": lambda: op(a8, b8.float(), scale_a=sa, scale_b=sb),
        "scales on fp32": lambda: op(a8.float(), b8.float(), scale_a=sa, scale_b=sb),
        "out_dtype": lambda: op(a8, b8, scale_a=sa, scale_b=sb, out_dtype=torch.int32),
        "bias dtype": lambda: op(a8, b8, scale_a=sa, scale_b=sb, out_dtype=torch.float32,
                                 bias=torch.zeros(16, dtype=torch.float16, device=device)),
    }
    outcomes = _outcomes(bad)
    return outcomes
