"""Float64 references for the tests, written apart from the code under test: they share no helper with
``tileweave.nn`` or ``tileweave.ops``, so that a defect there cannot cancel out in a comparison."""

from __future__ import annotations

import math

import torch


def _rms_norm(t: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return t / torch.sqrt((t * t).mean(dim=-1, keepdim=True) + eps) * weight


def _rotary(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding of ``x [batch, heads, seq, dim]`` as a complex rotation: the pair of features
    ``(2i, 2i+1)`` at position ``p`` is the complex number ``x_2i + j x_2i+1``, multiplied by
    ``exp(j p theta^(-2i/dim))``."""
    seq, dim = x.shape[-2], x.shape[-1]
    exponent = torch.arange(dim // 2, dtype=torch.float64, device=x.device) * 2 / dim
    angle = torch.outer(torch.arange(seq, dtype=torch.float64, device=x.device), theta ** -exponent)
    pairs = torch.view_as_complex(x.reshape(*x.shape[:-1], dim // 2, 2).contiguous())
    return torch.view_as_real(pairs * torch.polar(torch.ones_like(angle), angle)).reshape(x.shape)


def _causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Softmax attention with a causal mask, ``q [B, H, S, D]``, ``k, v [B, H_kv, S, D]``: query head
    ``h`` reads key/value head ``h // (H / H_kv)``."""
    heads, kv_heads = q.shape[1], k.shape[1]
    kv_of = torch.arange(heads, device=q.device) // (heads // kv_heads)
    k, v = k[:, kv_of], v[:, kv_of]
    scores = torch.einsum("bhsd,bhtd->bhst", q, k) / math.sqrt(q.shape[-1])
    seq = q.shape[2]
    future = torch.ones(seq, seq, dtype=torch.bool, device=q.device).triu(1)
    weights = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
    return torch.einsum("bhst,bhtd->bhsd", weights, v)


def transformer_block(x: torch.Tensor, state: dict[str, torch.Tensor], *, heads: int, kv_heads: int,
                      rope_theta: float, norm_eps: float, batch: int, linear=None) -> torch.Tensor:
    """A pre-norm Llama block on the full, unsharded ``x [batch * seq, hidden]``:
    ``h = x + o(attention(rope(q(n1(x))), rope(k(n1(x))), v(n1(x))))``, then
    ``h + down(silu(gate(n2(h))) * up(n2(h)))``; weights ``[out, in]`` in ``state`` (``q, k, v, o, gate,
    up, down, attn_norm, mlp_norm``). Causal attention over each sequence, grouped-query heads.
    ``linear(a, w, kind)``: ``a @ w.T`` (the default), or another form of it, called once for q, k and v
    together, once for gate and up together (``kind`` "column"), once each for o and down ("row")."""
    m, hidden = x.shape
    seq, hd = m // batch, hidden // heads
    linear = linear or (lambda a, w, kind: a @ w.T)

    def split_heads(t: torch.Tensor, count: int) -> torch.Tensor:
        return t.reshape(batch, seq, count, hd).permute(0, 2, 1, 3)

    a = _rms_norm(x, state["attn_norm"], norm_eps)
    qkv = linear(a, torch.cat([state["q"], state["k"], state["v"]]), "column")
    q, k, v = qkv.split([heads * hd, kv_heads * hd, kv_heads * hd], dim=1)
    q = _rotary(split_heads(q, heads), rope_theta)
    k = _rotary(split_heads(k, kv_heads), rope_theta)
    v = split_heads(v, kv_heads)
    attn = _causal_attention(q, k, v).permute(0, 2, 1, 3).reshape(m, hidden)
    h = x + linear(attn, state["o"], "row")
    b = _rms_norm(h, state["mlp_norm"], norm_eps)
    gate, up = linear(b, torch.cat([state["gate"], state["up"]]), "column").chunk(2, dim=1)
    return h + linear(gate * torch.sigmoid(gate) * up, state["down"], "row")
