"""An unsharded SwiGLU mixture-of-experts layer in float64, written from its definition: the reference
the TP MoE layer's tests compare against. It runs every expert densely on every token and masks the
result, so it shares no routing plan, index map or grouped GEMM with the code under test.

State names (per expert an ``nn.Linear`` weight, ``[out, in]``): ``router.weight [E, H]``,
``experts.gate [E, F, H]``, ``experts.up [E, F, H]``, ``experts.down [E, H, F]``.
"""

from __future__ import annotations

import torch


def reference_moe(x: torch.Tensor, state: dict[str, torch.Tensor], top_k: int, *,
                  normalize_topk: bool = True) -> torch.Tensor:
    """``[T, H]``: for each token t, ``sum over its k most probable experts e of c[t, e] * expert_e(x[t])``,
    ``expert_e(v) = down_e(silu(gate_e v) * up_e v)``, ``c`` the softmax probability of e (divided by
    the sum over the chosen k with ``normalize_topk``). Differentiable in ``x`` and every state tensor
    (the choice of experts is not: it is a mask)."""
    x = x.double()
    router, gate, up, down = (state[n].double() for n in ("router.weight", "experts.gate", "experts.up",
                                                          "experts.down"))
    logits = x @ router.t()                                           # [T, E]
    probs = logits.exp() / logits.exp().sum(dim=1, keepdim=True)
    chosen = _top_mask(probs.detach(), top_k)                         # [T, E] bool
    coeff = torch.where(chosen, probs, torch.zeros_like(probs))
    if normalize_topk:
        coeff = coeff / coeff.sum(dim=1, keepdim=True)
    out = torch.zeros_like(x)
    for e in range(router.shape[0]):
        a = x @ gate[e].t()
        b = x @ up[e].t()
        expert_out = (a * torch.sigmoid(a) * b) @ down[e].t()         # every token through expert e
        out = out + coeff[:, e:e + 1] * expert_out
    return out


def _top_mask(probs: torch.Tensor, k: int) -> torch.Tensor:
    """Boolean ``[T, E]``: the k largest entries of each row, by a rank count (no sort)."""
    greater = (probs[:, None, :] > probs[:, :, None]).sum(dim=2)      # [T, E]: entries above entry e
    return greater < k


def routing_gap(x: torch.Tensor, router_weight: torch.Tensor, top_k: int) -> float:
    """The smallest margin, over tokens, between the k-th and (k+1)-th router logit (inf for k = E): how
    far a routing choice is from a tie, so a test can insist that its data routes unambiguously."""
    logits = x.double() @ router_weight.double().t()
    if top_k >= logits.shape[1]:
        return float("inf")
    ordered = logits.sort(dim=1, descending=True).values
    return float((ordered[:, top_k - 1] - ordered[:, top_k]).min())


def reference_moe_grads(x: torch.Tensor, state: dict[str, torch.Tensor], dout: torch.Tensor, top_k: int, *,
                        world: int, rank: int, normalize_topk: bool = True) -> dict[str, torch.Tensor]:
    """float64 of the layer's results for rank ``rank`` of ``world`` (TPMoE's shards), by autograd through
    ``reference_moe`` of the full ``x [T, H]`` for the output gradient ``dout [T, H]``: ``out`` and ``dx``
    (its rows), ``d_w0 [E, 2F/W, H]`` (its gate rows, then its up rows), ``d_w1 [E, H, F/W]`` (its
    columns) and ``d_router [E, H]`` (over all tokens)."""
    params = {k: v.double().requires_grad_(True) for k, v in state.items()}
    xr = x.double().requires_grad_(True)
    out = reference_moe(xr, params, top_k, normalize_topk=normalize_topk)
    out.backward(dout.double())
    d = {k: v.grad for k, v in params.items()}
    t, f = x.shape[0], state["experts.gate"].shape[1]
    rows, cols = slice(rank * t // world, (rank + 1) * t // world), slice(rank * f // world, (rank + 1) * f // world)
    return {"out": out.detach()[rows], "dx": xr.grad[rows],
            "d_w0": torch.cat([d["experts.gate"][:, cols], d["experts.up"][:, cols]], 1),
            "d_w1": d["experts.down"][:, :, cols], "d_router": d["router.weight"]}
