"""An unsharded Llama-style decoder in plain torch, the reference for the TP decoder's tests and the
generation example. Written apart from ``tileweave.nn.decoder`` on purpose (no shared code): rotary
embedding in the rotate-half form (the decoder turns interleaved pairs), attention as an explicit masked
softmax, no KV cache (every step recomputes the whole sequence).

Weights are a flat state dict of unsharded tensors under a Hugging Face Llama's names (``nn.Linear``
layout ``[out, in]``; ``p = model.layers.i.``):

    model.embed_tokens.weight [V, H], model.norm.weight [H], lm_head.weight [V, H],
    p.input_layernorm.weight [H], p.self_attn.q_proj.weight [heads*hd, H],
    p.self_attn.k_proj.weight / p.self_attn.v_proj.weight [kv_heads*hd, H],
    p.self_attn.o_proj.weight [H, heads*hd], p.post_attention_layernorm.weight [H],
    p.mlp.gate_proj.weight / p.mlp.up_proj.weight [F, H], p.mlp.down_proj.weight [H, F]

``dims`` is any object with the attributes ``vocab, hidden, layers, heads, kv_heads, ffn, rope_theta,
norm_eps`` (``tileweave.nn.decoder.DecoderConfig`` is one). With a ``moe`` attribute that is not None
(``experts``, ``top_k``, ``normalize_topk``), the MLPs are Mixtral's mixtures of experts instead:
``p.block_sparse_moe.gate.weight [E, H]`` and per expert ``e`` ``p.block_sparse_moe.experts.e.w1.weight``
(gate) and ``w3`` (up) ``[F, H]``, ``w2`` (down) ``[H, F]``; every expert runs on every token, weighted by
its routing weight (0 where it is not among the token's top k).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch


def random_state_dict(dims, *, seed: int, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Random weights for ``dims``: linears ~ N(0, 1/in), norms ~ 1 + N(0, 0.1), embedding ~ N(0, 1)."""
    g = torch.Generator().manual_seed(seed)
    hd = dims.hidden // dims.heads

    def linear(out: int, inp: int) -> torch.Tensor:
        return torch.randn(out, inp, generator=g) / math.sqrt(inp)

    def norm() -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(dims.hidden, generator=g)

    state = {"model.embed_tokens.weight": torch.randn(dims.vocab, dims.hidden, generator=g)}
    for i in range(dims.layers):
        p = f"model.layers.{i}."
        state[p + "input_layernorm.weight"] = norm()
        state[p + "self_attn.q_proj.weight"] = linear(dims.heads * hd, dims.hidden)
        state[p + "self_attn.k_proj.weight"] = linear(dims.kv_heads * hd, dims.hidden)
        state[p + "self_attn.v_proj.weight"] = linear(dims.kv_heads * hd, dims.hidden)
        state[p + "self_attn.o_proj.weight"] = linear(dims.hidden, dims.heads * hd)
        state[p + "post_attention_layernorm.weight"] = norm()
        moe = getattr(dims, "moe", None)
        if moe is None:
            state[p + "mlp.gate_proj.weight"] = linear(dims.ffn, dims.hidden)
            state[p + "mlp.up_proj.weight"] = linear(dims.ffn, dims.hidden)
            state[p + "mlp.down_proj.weight"] = linear(dims.hidden, dims.ffn)
            continue
        state[p + "block_sparse_moe.gate.weight"] = linear(moe.experts, dims.hidden)
        for e in range(moe.experts):
            q = f"{p}block_sparse_moe.experts.{e}."
            state[q + "w1.weight"] = linear(dims.ffn, dims.hidden)
            state[q + "w3.weight"] = linear(dims.ffn, dims.hidden)
            state[q + "w2.weight"] = linear(dims.hidden, dims.ffn)
    state["model.norm.weight"] = norm()
    state["lm_head.weight"] = linear(dims.vocab, dims.hidden)
    return {k: v.to(dtype) for k, v in state.items()}


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(dim=-1, keepdim=True) + eps) * weight


def _rotate(x: torch.Tensor, theta: float) -> torch.Tensor:
    """``x [B, S, heads, hd]``: the pairs ``(x[i], x[i + hd/2])`` of position ``s`` turned by the angle
    ``s * theta ** (-2i / hd)`` (rotate-half, through complex numbers)."""
    b, s, h, hd = x.shape
    inv = theta ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    angle = torch.outer(torch.arange(s, dtype=torch.float64), inv)                # [S, hd/2]
    turn = torch.polar(torch.ones_like(angle), angle)[None, :, None, :]
    first, second = x.to(torch.float64).chunk(2, dim=-1)
    turned = torch.complex(first, second) * turn
    return torch.cat([turned.real, turned.imag], dim=-1).to(x.dtype)


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


def _experts(m: torch.Tensor, w: dict[str, torch.Tensor], p: str, moe) -> torch.Tensor:
    """Mixtral's sparse MLP of ``m [B, S, H]``: softmax routing, top k (renormalised with
    ``normalize_topk``), every expert computed densely and weighted by its token's routing weight."""
    probs = torch.softmax(m @ w[p + "gate.weight"].T, dim=-1)                   # [B, S, E]
    top, ids = probs.topk(moe.top_k, dim=-1)
    if moe.normalize_topk:
        top = top / top.sum(dim=-1, keepdim=True)
    coef = torch.zeros_like(probs).scatter(-1, ids, top)                        # 0 for experts not chosen
    out = torch.zeros_like(m)
    for e in range(moe.experts):
        q = f"{p}experts.{e}."
        gate, up = m @ w[q + "w1.weight"].T, m @ w[q + "w3.weight"].T
        out = out + coef[..., e:e + 1] * ((gate * torch.sigmoid(gate) * up) @ w[q + "w2.weight"].T)
    return out


def _exact(x: torch.Tensor, name: str, weight: torch.Tensor) -> torch.Tensor:
    return x @ weight.T


def reference_logits(state: dict[str, torch.Tensor], dims, tokens: torch.Tensor,
                     dtype: torch.dtype = torch.float64, linear: Callable | None = None) -> torch.Tensor:
    """Logits ``[B, S, V]`` of every position of ``tokens [B, S]`` (int64), computed in ``dtype``.
    ``linear(x, name, weight)``: the product ``x [..., in] @ weight.T`` of each dense linear layer's
    weight (``name`` its state-dict name, ``...q_proj.weight`` to ``lm_head.weight``; default exact),
    for a reference of other arithmetic (say, quantized operands)."""
    lin = linear or _exact
    w = {k: v.to(dtype) for k, v in state.items()}
    b, s = tokens.shape
    hd = dims.hidden // dims.heads
    x = w["model.embed_tokens.weight"][tokens]                                  # [B, S, H]
    for i in range(dims.layers):
        p = f"model.layers.{i}."
        a = _rms(x, w[p + "input_layernorm.weight"], dims.norm_eps)
        proj = {n: lin(a, p + f"self_attn.{n}_proj.weight", w[p + f"self_attn.{n}_proj.weight"]) for n in "qkv"}
        q = _rotate(proj["q"].reshape(b, s, dims.heads, hd), dims.rope_theta)
        k = _rotate(proj["k"].reshape(b, s, dims.kv_heads, hd), dims.rope_theta)
        v = proj["v"].reshape(b, s, dims.kv_heads, hd)
        o = p + "self_attn.o_proj.weight"
        x = x + lin(_attend(q, k, v).reshape(b, s, dims.heads * hd), o, w[o])
        m = _rms(x, w[p + "post_attention_layernorm.weight"], dims.norm_eps)
        if getattr(dims, "moe", None) is not None:
            x = x + _experts(m, w, p + "block_sparse_moe.", dims.moe)
            continue
        gate, up = (lin(m, p + f"mlp.{n}_proj.weight", w[p + f"mlp.{n}_proj.weight"]) for n in ("gate", "up"))
        x = x + lin(gate * torch.sigmoid(gate) * up, p + "mlp.down_proj.weight", w[p + "mlp.down_proj.weight"])
    return lin(_rms(x, w["model.norm.weight"], dims.norm_eps), "lm_head.weight", w["lm_head.weight"])


def reference_generate(state: dict[str, torch.Tensor], dims, prompt: torch.Tensor, steps: int,
                       dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Greedy continuation ``[B, steps]`` of ``prompt [B, S]``: at each step the arg-max of the last
    position's logits, recomputing the whole sequence."""
    tokens = prompt
    for _ in range(steps):
        nxt = reference_logits(state, dims, tokens, dtype)[:, -1].argmax(dim=-1, keepdim=True)
        tokens = torch.cat([tokens, nxt], dim=1)
    return tokens[:, prompt.shape[1]:]
