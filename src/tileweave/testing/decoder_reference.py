"""An unsharded Llama-style decoder in plain torch, the reference for the TP decoder's tests and the
generation example. Written apart from ``tileweave.nn.decoder`` on purpose (no shared code): rotary
embedding through complex numbers, attention as an explicit masked softmax, no KV cache (every step
recomputes the whole sequence).

Weights are a flat state dict of unsharded tensors (``nn.Linear`` layout ``[out, in]``):

    embed [V, H], norm [H], lm_head [V, H], and for layer i: layers.i.attn_norm [H],
    layers.i.q [heads*hd, H], layers.i.k / layers.i.v [kv_heads*hd, H], layers.i.o [H, heads*hd],
    layers.i.mlp_norm [H], layers.i.gate / layers.i.up [F, H], layers.i.down [H, F]

``dims`` is any object with the attributes ``vocab, hidden, layers, heads, kv_heads, ffn, rope_theta,
norm_eps`` (``tileweave.nn.decoder.DecoderConfig`` is one).
"""

from __future__ import annotations

import math

import torch


def random_state_dict(dims, *, seed: int, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Random weights for ``dims``: linears ~ N(0, 1/in), norms ~ 1 + N(0, 0.1), embedding ~ N(0, 1)."""
    g = torch.Generator().manual_seed(seed)
    hd = dims.hidden // dims.heads

    def linear(out: int, inp: int) -> torch.Tensor:
        return torch.randn(out, inp, generator=g) / math.sqrt(inp)

    def norm() -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(dims.hidden, generator=g)

    state = {"embed": torch.randn(dims.vocab, dims.hidden, generator=g)}
    for i in range(dims.layers):
        p = f"layers.{i}."
        state[p + "attn_norm"] = norm()
        state[p + "q"] = linear(dims.heads * hd, dims.hidden)
        state[p + "k"] = linear(dims.kv_heads * hd, dims.hidden)
        state[p + "v"] = linear(dims.kv_heads * hd, dims.hidden)
        state[p + "o"] = linear(dims.hidden, dims.heads * hd)
        state[p + "mlp_norm"] = norm()
        state[p + "gate"] = linear(dims.ffn, dims.hidden)
        state[p + "up"] = linear(dims.ffn, dims.hidden)
        state[p + "down"] = linear(dims.hidden, dims.ffn)
    state["norm"] = norm()
    state["lm_head"] = linear(dims.vocab, dims.hidden)
    return {k: v.to(dtype) for k, v in state.items()}


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(dim=-1, keepdim=True) + eps) * weight


def _rotate(x: torch.Tensor, theta: float) -> torch.Tensor:
    """``x [B, S, heads, hd]``: consecutive pairs ``(x[2i], x[2i+1])`` of position ``s`` turned by the
    angle ``s * theta ** (-2i / hd)``."""
    b, s, h, hd = x.shape
    inv = theta ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    angle = torch.outer(torch.arange(s, dtype=torch.float64), inv)                # [S, hd/2]
    turn = torch.polar(torch.ones_like(angle), angle)[None, :, None, :]
    pairs = torch.view_as_complex(x.to(torch.float64).reshape(b, s, h, hd // 2, 2).contiguous())
    return torch.view_as_real(pairs * turn).reshape(b, s, h, hd).to(x.dtype)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal grouped-query attention: ``q [B, S, heads, hd]``, ``k, v [B, S, kv_heads, hd]``."""
    b, s, heads, hd = q.shape
    group = heads // k.shape[2]
    out = torch.empty_like(q)
    future = torch.ones(s, s, dtype=torch.bool).triu(1)
    for head in range(heads):
        kv = head // group                                                      # query head -> its kv head
        scores = q[:, :, head] @ k[:, :, kv].transpose(1, 2) / math.sqrt(hd)   # [B, S, S]
        weights = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
        out[:, :, head] = weights @ v[:, :, kv]
    return out


def reference_logits(state: dict[str, torch.Tensor], dims, tokens: torch.Tensor,
                     dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Logits ``[B, S, V]`` of every position of ``tokens [B, S]`` (int64), computed in ``dtype``."""
    w = {k: v.to(dtype) for k, v in state.items()}
    b, s = tokens.shape
    hd = dims.hidden // dims.heads
    x = w["embed"][tokens]                                                      # [B, S, H]
    for i in range(dims.layers):
        p = f"layers.{i}."
        a = _rms(x, w[p + "attn_norm"], dims.norm_eps)
        q = _rotate((a @ w[p + "q"].T).reshape(b, s, dims.heads, hd), dims.rope_theta)
        k = _rotate((a @ w[p + "k"].T).reshape(b, s, dims.kv_heads, hd), dims.rope_theta)
        v = (a @ w[p + "v"].T).reshape(b, s, dims.kv_heads, hd)
        x = x + _attend(q, k, v).reshape(b, s, dims.heads * hd) @ w[p + "o"].T
        m = _rms(x, w[p + "mlp_norm"], dims.norm_eps)
        gate, up = m @ w[p + "gate"].T, m @ w[p + "up"].T
        x = x + (gate * torch.sigmoid(gate) * up) @ w[p + "down"].T
    return _rms(x, w["norm"], dims.norm_eps) @ w["lm_head"].T


def reference_generate(state: dict[str, torch.Tensor], dims, prompt: torch.Tensor, steps: int,
                       dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Greedy continuation ``[B, steps]`` of ``prompt [B, S]``: at each step the arg-max of the last
    position's logits, recomputing the whole sequence."""
    tokens = prompt
    for _ in range(steps):
        nxt = reference_logits(state, dims, tokens, dtype)[:, -1].argmax(dim=-1, keepdim=True)
        tokens = torch.cat([tokens, nxt], dim=1)
    return tokens[:, prompt.shape[1]:]
