"""A small Llama in plain torch, with torchtitan's module names, and its tensor-parallel plan.

The model knows nothing of parallelism: ``parallelize_module(model, mesh["tp"], llama_tp_plan(model))``
shards it with tileweave's styles (``torch_styles=True``: torch's, as torchtitan writes them), and
``fully_shard`` shards it over a data-parallel mesh dimension. Unsharded, in float64, it is the
reference that the 2-D training tests and ``examples/train_2d.py`` check against.

Inside a block, activations are ``[B, S, dim]``; modules read the sequence length from ``x.shape``,
which a sequence-sharded DTensor gives whole.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor import parallel as torch_parallel

from tileweave import parallel as tileweave_parallel


@dataclasses.dataclass(frozen=True, kw_only=True)
class LlamaConfig:
    """Shape of the model; ``heads``, ``kv_heads`` and ``ffn`` must be divisible by the TP size."""

    vocab: int = 64
    """Vocabulary size (the output projection's width; divisible by the TP size)."""
    dim: int = 32
    """Model width."""
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    """Key/value heads (grouped-query attention); divides ``heads``."""
    ffn: int = 64
    """MLP width."""
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        if self.dim % self.heads or self.heads % self.kv_heads:
            raise ValueError(f"dim={self.dim} must be divisible by heads={self.heads}, and heads by "
                             f"kv_heads={self.kv_heads}")


def _rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half RoPE over the sequence axis of ``x [B, S, heads, head_dim]``."""
    seq, dim = x.shape[1], x.shape[-1]
    freqs = theta ** (-torch.arange(0, dim, 2, device=x.device, dtype=torch.float64) / dim)
    angles = torch.arange(seq, device=x.device, dtype=torch.float64)[:, None] * freqs[None, :]
    cos, sin = (t.to(x.dtype).repeat(1, 2)[None, :, None, :] for t in (angles.cos(), angles.sin()))
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, c: LlamaConfig) -> None:
        super().__init__()
        self.c, self.head_dim = c, c.dim // c.heads
        self.wq = nn.Linear(c.dim, c.heads * self.head_dim, bias=False)
        self.wk = nn.Linear(c.dim, c.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(c.dim, c.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(c.heads * self.head_dim, c.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        # -1: the heads this rank holds (all of them unsharded).
        q = _rope(self.wq(x).view(batch, seq, -1, self.head_dim), self.c.rope_theta)
        k = _rope(self.wk(x).view(batch, seq, -1, self.head_dim), self.c.rope_theta)
        v = self.wv(x).view(batch, seq, -1, self.head_dim)
        groups = q.shape[2] // k.shape[2]
        k, v = k.repeat_interleave(groups, dim=2), v.repeat_interleave(groups, dim=2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    def __init__(self, c: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(c.dim, c.ffn, bias=False)
        self.w2 = nn.Linear(c.ffn, c.dim, bias=False)
        self.w3 = nn.Linear(c.dim, c.ffn, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, c: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(c.dim, eps=c.norm_eps)
        self.attention = Attention(c)
        self.ffn_norm = nn.RMSNorm(c.dim, eps=c.norm_eps)
        self.feed_forward = FeedForward(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    """``forward(tokens [B, S]) -> logits [B, S, vocab]``."""

    def __init__(self, c: LlamaConfig) -> None:
        super().__init__()
        self.config = c
        self.tok_embeddings = nn.Embedding(c.vocab, c.dim)
        self.layers = nn.ModuleDict({str(i): Block(c) for i in range(c.layers)})
        self.norm = nn.RMSNorm(c.dim, eps=c.norm_eps)
        self.output = nn.Linear(c.dim, c.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h)
        return self.output(self.norm(h))


def llama_tp_plan(model: Llama, *, torch_styles: bool = False) -> dict:
    """The tensor-parallel plan of ``model``, sequence-parallel between blocks (``Shard(1)``), for
    ``parallelize_module(model, tp_mesh, plan)``: tileweave's styles, whose column-parallel linears take
    the sequence shard and gather it inside their GEMMs, or (``torch_styles``) torch's, as torchtitan
    writes them (a ``PrepareModuleInput`` gathers each block half's input first)."""
    styles = torch_parallel if torch_styles else tileweave_parallel
    ColwiseParallel, RowwiseParallel, SequenceParallel = (styles.ColwiseParallel, styles.RowwiseParallel,
                                                          styles.SequenceParallel)
    PrepareModuleInput = torch_parallel.PrepareModuleInput
    plan = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }
    for name in model.layers:
        plan[f"layers.{name}.attention_norm"] = SequenceParallel()
        plan[f"layers.{name}.ffn_norm"] = SequenceParallel()
        plan[f"layers.{name}.attention.wo"] = RowwiseParallel(output_layouts=Shard(1))
        plan[f"layers.{name}.feed_forward.w2"] = RowwiseParallel(output_layouts=Shard(1))
        for linear in ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3"):
            # torch: the block half's input is gathered once, before its linears; tileweave: each linear
            # gathers it inside its GEMM.
            plan[f"layers.{name}.{linear}"] = ColwiseParallel() if torch_styles else ColwiseParallel(
                input_layouts=Shard(1))
        if torch_styles:
            plan[f"layers.{name}.attention"] = PrepareModuleInput(input_layouts=(Shard(1),),
                                                                  desired_input_layouts=(Replicate(),))
            plan[f"layers.{name}.feed_forward"] = PrepareModuleInput(input_layouts=(Shard(1),),
                                                                     desired_input_layouts=(Replicate(),))
    return plan
