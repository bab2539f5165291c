"""Per-rank functions for the TP MoE layer's tests (run with ``tileweave.testing.emulated.run_ranks``).

The data routes unambiguously: the first E features of a token carry a score per expert (its chosen k
experts well above the rest) that the router reads through a near-identity weight, so the layer in
its dtype and the float64 reference pick the same experts, and the routing (uniform, skewed, or with
empty experts) is what the case asks for.
"""

from __future__ import annotations

import dataclasses
import time

import torch
import torch.distributed as dist

from tileweave.nn.moe import TPMoE
from tileweave.nn.moe_autograd import TILEWEAVE_OPS, tileweave_ops
from tileweave.ops import common
from tileweave.runtime.backend import set_producer_delay
from support.moe_layer_reference import reference_moe, reference_moe_grads, routing_gap

ROUTINGS = ("uniform", "skewed", "empty")


@dataclasses.dataclass(frozen=True)
class LayerCase:
    tokens: int
    hidden: int
    ffn: int
    experts: int
    top_k: int
    routing: str = "uniform"
    """``uniform``: k distinct experts per token, uniformly; ``skewed``: Zipf over the experts (uneven
    counts); ``empty``: uniform over all experts but the last ``empty_experts``, which get no token."""
    dtype: str = "float32"
    normalize_topk: bool = True
    save_gathered: bool = True
    policy: str = "auto"
    steps: int = 1
    """Forward + backward calls, each on fresh tokens and fresh routing."""
    empty_experts: int = 1
    straggler: int = -1
    """A rank whose copies are delayed (its producer straggles), or -1."""
    fused_swiglu: bool = True
    """The layer's default form (the SwiGLU in layer 0's epilogue, ``FusedExperts``), or the two layers
    apart with the SwiGLU in torch (``ExpertsUp`` / ``ExpertsDown``, what ops without epilogues run)."""
    seed: int = 0


def _generator(*parts: int) -> torch.Generator:
    seed = 0
    for p in parts:
        seed = seed * 1000003 + int(p)
    return torch.Generator().manual_seed(seed % (1 << 62))


def layer_state(case: LayerCase) -> dict[str, torch.Tensor]:
    """Unsharded float32 weights; the router is ``2 I`` on the score features plus small noise."""
    e, h, f = case.experts, case.hidden, case.ffn
    g = _generator(case.seed, 1)
    router = 0.02 * torch.randn(e, h, generator=g)
    router[:, :e] += 2.0 * torch.eye(e)
    return {"router.weight": router,
            "experts.gate": torch.randn(e, f, h, generator=g) / h ** 0.5,
            "experts.up": torch.randn(e, f, h, generator=g) / h ** 0.5,
            "experts.down": torch.randn(e, h, f, generator=g) / f ** 0.5}


def layer_tokens(case: LayerCase, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x [T, H], dout [T, H])`` float32 for one step: x's first E features are the expert scores."""
    t, e, h, k = case.tokens, case.experts, case.hidden, case.top_k
    g = _generator(case.seed, 2, step)
    weights = torch.ones(e)
    if case.routing == "skewed":
        weights = 1.0 / torch.arange(1, e + 1, dtype=torch.float32) ** 1.5
    elif case.routing == "empty":
        weights[e - case.empty_experts:] = 0.0
    elif case.routing != "uniform":
        raise ValueError(f"routing must be one of {ROUTINGS}, got {case.routing!r}")
    chosen = torch.multinomial(weights.expand(t, e), k, replacement=False, generator=g)  # [T, k]
    scores = -0.5 * torch.rand(t, e, generator=g)
    scores.scatter_(1, chosen, 1.0 + 0.5 * torch.rand(t, k, generator=g))
    x = 0.5 * torch.randn(t, h, generator=g)
    x[:, :e] = scores
    return x, torch.randn(t, h, generator=g)


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    got = got.detach().double()
    if not torch.isfinite(got).all():
        return float("inf")
    return ((got - ref.detach().double()).norm() / ref.detach().double().norm().clamp_min(1e-30)).item()


def ops_for(policy: str, group: dist.ProcessGroup, fused_swiglu: bool = True):
    """The layer's ops under ``policy`` (``auto`` is the layer's default: tileweave's functional ops)."""
    ops = TILEWEAVE_OPS if policy == "auto" else tileweave_ops(policy=policy, group=group)
    return ops if fused_swiglu else dataclasses.replace(ops, swiglu=False)


def tp_moe_check(rank: int, world: int, case: LayerCase) -> dict:
    """The layer against ``reference_moe``: output, input gradient and every parameter gradient (each
    rank's shard; the router's summed over ranks) per step, the state dict's round trip, the paths."""
    dtype = getattr(torch, case.dtype)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    group = dist.group.WORLD
    state = layer_state(case)
    state = {k: v.to(dtype=dtype, device=device) for k, v in state.items()}  # the reference sees them rounded
    layer = TPMoE(case.hidden, case.ffn, case.experts, case.top_k, normalize_topk=case.normalize_topk,
                  save_gathered=case.save_gathered, ops=ops_for(case.policy, group, case.fused_swiglu), device=device,
                  dtype=dtype)
    layer.load_full_state_dict(state)
    rows = slice(rank * case.tokens // world, (rank + 1) * case.tokens // world)
    set_producer_delay(0.05 if rank == case.straggler else 0.0)
    results: dict = {"steps": []}
    for step in range(case.steps):
        x_full, dout = layer_tokens(case, step)
        x_full, dout = x_full.to(dtype=dtype, device=device), dout.to(dtype=dtype, device=device)
        results.setdefault("gap", routing_gap(x_full, state["router.weight"], case.top_k))
        layer.zero_grad(set_to_none=True)
        x = x_full[rows].clone().requires_grad_(True)
        out = layer(x)
        out.backward(dout[rows])
        layer.all_reduce_replicated_grads()

        ref = reference_moe_grads(x_full, state, dout, case.top_k, world=world, rank=rank,
                                  normalize_topk=case.normalize_topk)
        results["steps"].append({
            "out": _rel_err(out, ref["out"]), "dx": _rel_err(x.grad, ref["dx"]),
            "d_w0": _rel_err(layer.w0.grad, ref["d_w0"]), "d_w1": _rel_err(layer.w1.grad, ref["d_w1"]),
            "d_router": _rel_err(layer.router.weight.grad, ref["d_router"]),
        })
    set_producer_delay(0.0)
    full = layer.full_state_dict()
    results["round_trip"] = all(torch.equal(full[k], state[k]) for k in state)
    results["paths"] = (common.last_path("moe_all_gather_gemm"), common.last_path("moe_gemm_reduce_scatter"))
    results["cpu_s"] = time.process_time()
    return results


def tp_moe_errors_check(rank: int, world: int) -> dict:
    """Bad arguments to the layer: each error text, keyed by what was wrong."""
    found = {}
    for key, make in {"ffn": lambda: TPMoE(16, 2 * world + 1, 4, 2),
                      "top_k": lambda: TPMoE(16, 16, 4, 5),
                      "hidden": lambda: TPMoE(16, 16, 4, 2)(torch.randn(4, 8)),
                      "state": lambda: TPMoE(16, 16, 4, 2).load_full_state_dict(
                          {"router.weight": torch.zeros(4, 16), "experts.gate": torch.zeros(4, 16, 8),
                           "experts.up": torch.zeros(4, 16, 16), "experts.down": torch.zeros(4, 16, 16)})}.items():
        try:
            make()
        except (ValueError, KeyError) as exc:
            found[key] = str(exc)
        else:
            found[key] = "no error"
    return found


def tp_moe_seq_sharded_check(rank: int, world: int, case: LayerCase, batch: int) -> dict:
    """The layer on ``[B, S/W, hidden]`` (every sequence's positions ``[r*S/W, (r+1)*S/W)``) against
    ``reference_moe`` of all ``B * S`` tokens: output and input gradient."""
    state = layer_state(case)
    layer = TPMoE(case.hidden, case.ffn, case.experts, case.top_k, normalize_topk=case.normalize_topk)
    layer.load_full_state_dict(state)
    x_full, dout = layer_tokens(case, 0)
    seq = case.tokens // batch
    cols = slice(rank * seq // world, (rank + 1) * seq // world)
    xb, gb = x_full.view(batch, seq, -1), dout.view(batch, seq, -1)
    x = xb[:, cols].clone().requires_grad_(True)
    out = layer(x)
    out.backward(gb[:, cols])
    xr = x_full.double().requires_grad_(True)
    ref = reference_moe(xr, {k: v.double() for k, v in state.items()}, case.top_k, normalize_topk=case.normalize_topk)
    ref.backward(dout.double())
    return {"shape": tuple(out.shape) == tuple(x.shape), "out": _rel_err(out, ref.detach().view(batch, seq, -1)[:, cols]),
            "dx": _rel_err(x.grad, xr.grad.view(batch, seq, -1)[:, cols])}


def tp_moe_fp8_errors_check(rank: int, world: int) -> dict:
    """``TPMoE(fp8=...)``'s refusals: each error text, keyed by what was wrong."""
    found = {}
    for key, make in {"blockwise hidden": lambda: TPMoE(96, 256 * world, 4, 2, fp8="blockwise"),
                      "blockwise ffn": lambda: TPMoE(128, 64 * world, 4, 2, fp8="blockwise"),
                      "recipe": lambda: TPMoE(16, 16, 4, 2, fp8="mxfp8"),
                      "ops": lambda: TPMoE(16, 16, 4, 2, fp8="rowwise",
                                           ops=dataclasses.replace(TILEWEAVE_OPS, fp8=False))}.items():
        try:
            make()
        except (ValueError, TypeError) as exc:
            found[key] = str(exc)
        else:
            found[key] = "no error"
    return found
