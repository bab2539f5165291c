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
