"""Per-rank functions for the tests of ``TPMoE.replicated`` (the MoE layer's decode mode), run with
``tileweave.testing.emulated.run_ranks``, and their float64 reference, written here from the layer's
definition (softmax routing, top k, SwiGLU experts), sharing no code with ``tileweave``.

Routing is steered, not left to chance: feature 0 of every token is large and positive, and the router
reads it with a weight per expert, so experts with a large weight take most tokens (uneven counts) and
experts with a very negative one take none (empty experts); the other features add noise that spreads
the rest.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F


def weights(experts: int, hidden: int, ffn: int, empty: int, seed: int) -> dict[str, torch.Tensor]:
    """Unsharded float32 weights: ``router [E, H]``, ``gate``/``up [E, F, H]``, ``down [E, H, F]``; the
    last ``empty`` experts' router weight on feature 0 is so negative that they never win."""
    g = torch.Generator().manual_seed(seed)
    router = 0.4 * torch.randn(experts, hidden, generator=g)
    router[:, 0] = torch.linspace(1.0, 0.0, experts)  # uneven: earlier experts favoured
    if empty:
        router[experts - empty:, 0] = -20.0
    return {"router.weight": router,
            "experts.gate": torch.randn(experts, ffn, hidden, generator=g) / hidden ** 0.5,
            "experts.up": torch.randn(experts, ffn, hidden, generator=g) / hidden ** 0.5,
            "experts.down": torch.randn(experts, hidden, ffn, generator=g) / ffn ** 0.5}


def tokens(count: int, hidden: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(count, hidden, generator=g)
    x[:, 0] = 3.0 + 0.5 * torch.rand(count, generator=g)
    return x


def reference(state: dict[str, torch.Tensor], x: torch.Tensor, top_k: int, normalize: bool) -> dict:
    """float64 output ``[T, H]``, each expert's token count, and the smallest gap between the k-th and
    the (k+1)-th routing probability (how far the routing is from a tie)."""
    d = {k: v.double() for k, v in state.items()}
    x = x.double()
    probs = torch.softmax(x @ d["router.weight"].t(), dim=-1)
    ranked, order = probs.sort(dim=-1, descending=True)
    gap = (ranked[:, top_k - 1] - ranked[:, top_k]).min().item() if top_k < probs.shape[1] else 1.0
    out = torch.zeros_like(x)
    counts = [0] * probs.shape[1]
    for t in range(x.shape[0]):
        chosen = order[t, :top_k]
        wt = ranked[t, :top_k]
        if normalize:
            wt = wt / wt.sum()
        for e, w in zip(chosen.tolist(), wt):
            counts[e] += 1
            h = F.silu(d["experts.gate"][e] @ x[t]) * (d["experts.up"][e] @ x[t])
            out[t] += w * (d["experts.down"][e] @ h)
    return {"out": out, "counts": counts, "gap": gap}


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    if not torch.isfinite(got).all():
        return float("inf")
    return ((got.double() - want).norm() / want.norm()).item()


def replicated_check(rank: int, world: int, experts: int, top_k: int, count: int, hidden: int, ffn: int,
                     empty: int, normalize: bool, steps: int) -> dict:
    """``TPMoE.replicated`` over ``steps`` calls, each with fresh weights and tokens (the same on every
    rank): relative errors of the output and of the fused residual + norm form against ``reference``,
    whether every rank holds the same bits, and the reference's expert counts."""
    from tileweave.nn.moe import TPMoE
    from tileweave.ops.common import last_path

    group = dist.group.WORLD
    moe = TPMoE(hidden, ffn, experts, top_k, group=group, normalize_topk=normalize, dtype=torch.float32)
    out = {"errors": [], "norm_errors": [], "counts": [], "gaps": [], "same": True, "paths": set()}
    for step in range(steps):
        state = weights(experts, hidden, ffn, empty, seed=100 * step + 1)
        moe.load_full_state_dict(state)
        x = tokens(count, hidden, seed=100 * step + 2)
        ref = reference(state, x, top_k, normalize)
        y = moe.replicated(x)
        out["paths"].add(last_path("gemm_all_reduce"))
        out["errors"].append(_rel(y, ref["out"]))
        out["counts"].append(ref["counts"])
        out["gaps"].append(ref["gap"])
        # with the residual add and the next RMSNorm fused into the sum
        g = torch.Generator().manual_seed(100 * step + 3)
        residual, norm_w = torch.randn(count, hidden, generator=g), 1 + 0.1 * torch.randn(hidden, generator=g)
        normed, resid = moe.replicated(x, residual=residual, norm_weight=norm_w, eps=1e-6)
        want_resid = residual.double() + ref["out"]
        want_normed = want_resid * torch.rsqrt(want_resid.pow(2).mean(-1, keepdim=True) + 1e-6) * norm_w.double()
        out["norm_errors"].append(max(_rel(resid, want_resid), _rel(normed, want_normed)))
        everyone = [torch.empty_like(y) for _ in range(world)]
        dist.all_gather(everyone, y, group=group)
        out["same"] &= all(torch.equal(e, y) for e in everyone)
    out["paths"] = sorted(out["paths"])
    return out


def replicated_errors_check(rank: int, world: int) -> dict:
    """A bad ``x`` on one rank only: every rank raises the same error, before any kernel."""
    from tileweave.nn.moe import TPMoE

    moe = TPMoE(16, 8 * world, 4, 2, group=dist.group.WORLD, dtype=torch.float32)
    x = torch.randn(3, 16 if rank == 0 else 15)
    try:
        moe.replicated(x)
    except ValueError as exc:
        return {"error": str(exc)}
    return {"error": None}
