"""A Llama-style decoder stack with tensor parallelism, for inference: prefill and decode with a KV cache.

W ranks; each runs ``heads/W`` query heads, ``kv_heads/W`` key/value heads, ``ffn/W`` MLP features and
``vocab/W`` rows of the LM head. The embedding is replicated (every rank holds ``[vocab, hidden]``: a
lookup needs no communication, at the cost of ``vocab * hidden`` elements per rank). Per layer:

    h = x + o(attention(rope(qkv(rms_norm(x)))))           # qkv column-, o row-parallel
    x' = h + down(silu(gate(rms_norm(h))) * up(rms_norm(h)))  # gate/up column-, down row-parallel
    logits = lm_head(rms_norm(x_last))                     # vocab-parallel, gathered over the ranks

Two ways to run a step of ``B`` sequences of ``S`` new tokens (``M = B*S`` rows, batch-major):

* **sequence-parallel** (prefill, when ``M`` divides by W): activations between the halves are
  sharded by rows, ``x_shard_m [M/W, H]``; the column-parallel GEMMs are ``all_gather_gemm`` and the
  row-parallel ones ``gemm_reduce_scatter`` (the fused AG/RS ops).
* **replicated** (decode, and prefill otherwise): every rank holds ``x [M, H]``; the column-parallel
  GEMMs are local and each row-parallel GEMM is one ``gemm_all_reduce`` that also adds the residual
  and applies the RMSNorm that follows it: attention-out with the layer's MLP norm, MLP-down with the
  next layer's attention norm (the final norm after the last layer).

Every sequence of a batch has the same length (the cache holds one position counter). Every rank must
call the same methods with the same token ids, like any collective; the logits come back whole and
bitwise the same on every rank. The communicating calls are a seam (:class:`DecoderOps`), so that
other implementations (the benchmark's baselines) run the same layers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tileweave.nn import inference
from tileweave.nn.block import BlockConfig, RopeCache, split_heads
from tileweave.nn.shards import gather_shards
from tileweave.ops.functional import all_gather_gemm, gemm_reduce_scatter


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecoderConfig(BlockConfig):
    """Shape of the model: ``layers`` layers of a block's shape (the fields of ``BlockConfig``), the
    vocabulary and the longest sequence (Llama 3 8B: vocab 128256, hidden 4096, layers 32, heads 32,
    kv_heads 8, ffn 14336)."""

    vocab: int
    """Vocabulary size; divisible by the TP group size (the LM head is split by vocabulary rows)."""
    layers: int
    """Decoder layers."""
    max_seq: int = 2048
    """Longest sequence (prompt plus generated tokens) a KV cache holds."""

    def __post_init__(self) -> None:
        for name in ("vocab", "hidden", "layers", "heads", "kv_heads", "ffn", "max_seq"):
            if getattr(self, name) < 1:
                raise ValueError(f"DecoderConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.hidden % self.heads or (self.hidden // self.heads) % 2:
            raise ValueError(f"hidden={self.hidden} must be heads={self.heads} times an even head size")
        super().__post_init__()


RowNorm = Callable[..., tuple[torch.Tensor, torch.Tensor]]
"""``(x [M, K/W], weight [N, K/W], residual [M, N], norm_weight [N], eps, group) -> (normed, h)``,
``h = residual + sum over ranks of x @ weight.T``, ``normed = rms_norm(h) * norm_weight``."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecoderOps:
    """The decoder's communicating calls: tileweave's ops by default."""

    row_parallel_norm: RowNorm = inference.row_parallel_residual_norm
    """Replicated row-parallel GEMM with the residual add and RMSNorm after it."""
    all_gather_gemm: Callable[..., torch.Tensor] = all_gather_gemm
    """``(x_shard_m [M/W, K], b [K, N/W], group) -> [M, N/W]`` (sequence-parallel column GEMMs)."""
    gemm_reduce_scatter: Callable[..., torch.Tensor] = gemm_reduce_scatter
    """``(x [M, K/W], b [K/W, N], group) -> [M/W, N]`` (sequence-parallel row GEMMs)."""


class KVCache:
    """Keys and values of this rank's heads: ``k, v [layers, B, kv_heads/W, max_seq, head_dim]``;
    ``length`` tokens of every sequence are filled."""

    def __init__(self, config: DecoderConfig, batch: int, local_kv_heads: int, *, device=None,
                 dtype=None) -> None:
        shape = (config.layers, batch, local_kv_heads, config.max_seq, config.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.length = 0

    @property
    def batch(self) -> int:
        return self.k.shape[1]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / rms(x) * weight`` over the last axis, in fp32, returned in ``x``'s dtype."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


class TPDecoderLayer(nn.Module):
    """One layer's weights (this rank's shards) and its two ways to run (module docstring)."""

    def __init__(self, config: DecoderConfig, world: int, *, device=None, dtype=None) -> None:
        super().__init__()
        c, hd = config, config.head_dim
        self.config = config
        self.local_heads, self.local_kv_heads, self.local_ffn = c.heads // world, c.kv_heads // world, c.ffn // world
        kw = dict(device=device, dtype=dtype)
        self.attn_norm = nn.Parameter(torch.ones(c.hidden, **kw))
        # [q | k | v] of this rank's heads and [gate | up] of its features: one GEMM each.
        self.qkv = nn.Parameter(torch.empty((self.local_heads + 2 * self.local_kv_heads) * hd, c.hidden, **kw))
        self.o = nn.Parameter(torch.empty(c.hidden, self.local_heads * hd, **kw))
        self.mlp_norm = nn.Parameter(torch.ones(c.hidden, **kw))
        self.gate_up = nn.Parameter(torch.empty(2 * self.local_ffn, c.hidden, **kw))
        self.down = nn.Parameter(torch.empty(c.hidden, self.local_ffn, **kw))
        for w in (self.qkv, self.o, self.gate_up, self.down):
            nn.init.normal_(w, std=w.shape[1] ** -0.5)

    def attention(self, qkv: torch.Tensor, cache: KVCache, index: int, rope_cs, batch: int,
                  seq: int) -> torch.Tensor:
        """``qkv [B*S, (hl + 2 kvl) hd]`` of tokens at positions ``cache.length ..`` -> ``[B*S, hl hd]``;
        writes their keys and values into layer ``index`` of the cache."""
        hd, hl, kvl = self.config.head_dim, self.local_heads, self.local_kv_heads
        pos = cache.length
        q, k, v = split_heads(qkv, batch, hl, kvl, hd, self.config.rope_theta, rope_cs)
        cache.k[index, :, :, pos:pos + seq] = k
        cache.v[index, :, :, pos:pos + seq] = v
        keys, values = cache.k[index, :, :, :pos + seq], cache.v[index, :, :, :pos + seq]
        if seq == 1 or pos == 0:  # one new token sees every key; a fresh prompt is plainly causal
            out = F.scaled_dot_product_attention(q, keys, values, is_causal=seq > 1, enable_gqa=hl != kvl)
        else:  # new token i (position pos + i) sees keys 0 .. pos + i
            allowed = torch.ones(seq, pos + seq, dtype=torch.bool, device=q.device).tril(pos)
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=allowed, enable_gqa=hl != kvl)
        return out.transpose(1, 2).reshape(batch * seq, hl * hd)

    def forward_replicated(self, normed: torch.Tensor, resid: torch.Tensor, next_norm: torch.Tensor,
                           cache: KVCache, index: int, rope_cs, batch: int, seq: int, ops: DecoderOps,
                           group: dist.ProcessGroup) -> tuple[torch.Tensor, torch.Tensor]:
        """``(normed, resid)`` in, both ``[M, H]`` on every rank (``normed``: this layer's attention norm
        of ``resid``) -> the same for the next layer, normed with ``next_norm``."""
        eps = self.config.norm_eps
        qkv = inference.column_parallel_linear(normed, self.qkv, None, group)
        attn = self.attention(qkv, cache, index, rope_cs, batch, seq)
        normed, resid = ops.row_parallel_norm(attn, self.o, resid, self.mlp_norm, eps, group)
        gate, up = inference.column_parallel_linear(normed, self.gate_up, None, group).chunk(2, dim=1)
        return ops.row_parallel_norm(F.silu(gate) * up, self.down, resid, next_norm, eps, group)

    def forward_sequence_parallel(self, x_shard: torch.Tensor, cache: KVCache, index: int, rope_cs,
                                  batch: int, seq: int, ops: DecoderOps,
                                  group: dist.ProcessGroup) -> torch.Tensor:
        """``x_shard_m [M/W, H]`` -> the layer's output rows ``[M/W, H]``."""
        eps = self.config.norm_eps
        qkv = ops.all_gather_gemm(rms_norm(x_shard, self.attn_norm, eps), self.qkv.t(), group)
        attn = self.attention(qkv, cache, index, rope_cs, batch, seq)
        h = x_shard + ops.gemm_reduce_scatter(attn, self.o.t(), group)
        gate, up = ops.all_gather_gemm(rms_norm(h, self.mlp_norm, eps), self.gate_up.t(), group).chunk(2, dim=1)
        return h + ops.gemm_reduce_scatter(F.silu(gate) * up, self.down.t(), group)

    @torch.no_grad()
    def load_full_state_dict(self, state: dict[str, torch.Tensor], prefix: str, rank: int) -> None:
        """This rank's shards of the unsharded weights ``prefix + name`` (names as in
        ``tileweave.testing.decoder_reference``)."""
        def rows(t: torch.Tensor, n: int) -> torch.Tensor:
            return t[rank * n:(rank + 1) * n]

        hd = self.config.head_dim
        self.attn_norm.copy_(state[prefix + "attn_norm"])
        self.mlp_norm.copy_(state[prefix + "mlp_norm"])
        self.qkv.copy_(torch.cat([rows(state[prefix + "q"], self.local_heads * hd),
                                  rows(state[prefix + "k"], self.local_kv_heads * hd),
                                  rows(state[prefix + "v"], self.local_kv_heads * hd)]))
        self.o.copy_(rows(state[prefix + "o"].t(), self.local_heads * hd).t())
        self.gate_up.copy_(torch.cat([rows(state[prefix + "gate"], self.local_ffn),
                                      rows(state[prefix + "up"], self.local_ffn)]))
        self.down.copy_(rows(state[prefix + "down"].t(), self.local_ffn).t())


class TPDecoder(nn.Module):
    """The whole stack (module docstring). ``prefill(tokens [B, S], cache)`` and ``decode(tokens [B],
    cache)`` return the logits ``[B, S, vocab]`` / ``[B, vocab]`` of the new tokens, the same on every
    rank, and advance the cache; ``new_cache(batch)`` makes one. Inference only (no gradients).

    ``prefill_sequence_parallel``: run prefill sequence-parallel where ``B*S`` divides by W (else, or
    when False, replicated like decode). ``ops``: the communicating calls (:class:`DecoderOps`).
    ``dtype``: float16, bfloat16 or float32 (what the ops take; on the CPU float16 or float32).
    A cache belongs to one sequence batch and one call at a time: calls that share a cache, or run on
    the same group from several threads, must not overlap.
    """

    def __init__(self, config: DecoderConfig, *, group: dist.ProcessGroup | None = None,
                 prefill_sequence_parallel: bool = True, ops: DecoderOps | None = None, device=None,
                 dtype=None) -> None:
        super().__init__()
        self.config = config
        self.group = group if group is not None else dist.group.WORLD
        self.rank, self.world = dist.get_rank(self.group), dist.get_world_size(self.group)
        for name in ("vocab", "heads", "kv_heads", "ffn"):
            if getattr(config, name) % self.world:
                raise ValueError(f"DecoderConfig.{name}={getattr(config, name)} must be divisible by the "
                                 f"TP group size {self.world}")
        self.prefill_sequence_parallel = prefill_sequence_parallel
        self.ops = ops if ops is not None else DecoderOps()
        kw = dict(device=device, dtype=dtype)
        self.embed = nn.Parameter(torch.randn(config.vocab, config.hidden, **kw))
        self.layers = nn.ModuleList(TPDecoderLayer(config, self.world, **kw) for _ in range(config.layers))
        self.norm = nn.Parameter(torch.ones(config.hidden, **kw))
        self.lm_head = nn.Parameter(torch.empty(config.vocab // self.world, config.hidden, **kw))
        nn.init.normal_(self.lm_head, std=config.hidden ** -0.5)
        self._rope = RopeCache(config.head_dim, config.rope_theta)

    def new_cache(self, batch: int) -> KVCache:
        """An empty KV cache for ``batch`` sequences on the model's device and dtype."""
        return KVCache(self.config, batch, self.config.kv_heads // self.world, device=self.embed.device,
                       dtype=self.embed.dtype)

    def _rope_tables(self, pos: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self._rope(self.config.max_seq, self.embed.device, self.embed.dtype)
        return cos[pos:pos + seq], sin[pos:pos + seq]

    def _check(self, tokens: torch.Tensor, cache: KVCache) -> tuple[int, int]:
        if tokens.dim() != 2 or tokens.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"tokens must be integer [batch, seq], got {tokens.dtype} {tuple(tokens.shape)}")
        batch, seq = tokens.shape
        if batch != cache.batch:
            raise ValueError(f"tokens has batch {batch}, the cache was made for {cache.batch}")
        if cache.length + seq > self.config.max_seq:
            raise ValueError(f"{cache.length} cached + {seq} new tokens exceed max_seq={self.config.max_seq}")
        return batch, seq

    @torch.no_grad()
    def prefill(self, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Logits ``[B, S, vocab]`` of ``tokens [B, S]`` (the prompt, or more tokens after it)."""
        batch, seq = self._check(tokens, cache)
        if self.prefill_sequence_parallel and (batch * seq) % self.world == 0:
            logits = self._sequence_parallel(tokens.reshape(-1), cache, batch, seq)
        else:
            logits = self._replicated(tokens.reshape(-1), cache, batch, seq)
        cache.length += seq
        return logits.view(batch, seq, -1)

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Logits ``[B, vocab]`` of one new token per sequence, ``tokens [B]``; replicated activations."""
        batch, _ = self._check(tokens.view(-1, 1), cache)
        logits = self._replicated(tokens.reshape(-1), cache, batch, 1)
        cache.length += 1
        return logits

    def _replicated(self, tokens: torch.Tensor, cache: KVCache, batch: int, seq: int) -> torch.Tensor:
        c = self.config
        rope_cs = self._rope_tables(cache.length, seq)
        resid = self.embed[tokens]                                           # [M, H]
        normed = rms_norm(resid, self.layers[0].attn_norm, c.norm_eps)
        for i, layer in enumerate(self.layers):
            after = self.layers[i + 1].attn_norm if i + 1 < len(self.layers) else self.norm
            normed, resid = layer.forward_replicated(normed, resid, after, cache, i, rope_cs, batch, seq,
                                                     self.ops, self.group)
        return self._gather_vocab(F.linear(normed, self.lm_head))

    def _sequence_parallel(self, tokens: torch.Tensor, cache: KVCache, batch: int, seq: int) -> torch.Tensor:
        c = self.config
        rope_cs = self._rope_tables(cache.length, seq)
        rows = tokens.shape[0] // self.world
        x = self.embed[tokens[self.rank * rows:(self.rank + 1) * rows]]   # [M/W, H]
        for i, layer in enumerate(self.layers):
            x = layer.forward_sequence_parallel(x, cache, i, rope_cs, batch, seq, self.ops, self.group)
        return self._gather_vocab(self.ops.all_gather_gemm(rms_norm(x, self.norm, c.norm_eps),
                                                           self.lm_head.t(), self.group))

    def _gather_vocab(self, logits_shard: torch.Tensor) -> torch.Tensor:
        """``[M, vocab/W]`` of this rank's vocabulary rows -> ``[M, vocab]``."""
        return gather_shards(logits_shard, 1, self.group)

    @torch.no_grad()
    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """This rank's shards of an unsharded model's weights (names in
        ``tileweave.testing.decoder_reference``)."""
        self.embed.copy_(state["embed"])
        self.norm.copy_(state["norm"])
        n = self.lm_head.shape[0]
        self.lm_head.copy_(state["lm_head"][self.rank * n:(self.rank + 1) * n])
        for i, layer in enumerate(self.layers):
            layer.load_full_state_dict(state, f"layers.{i}.", self.rank)

    @torch.no_grad()
    def generate(self, prompt: torch.Tensor, steps: int) -> torch.Tensor:
        """Greedy continuation ``[B, steps]`` of ``prompt [B, S]``: one prefill, then ``steps - 1``
        decode steps on a fresh cache."""
        cache = self.new_cache(prompt.shape[0])
        nxt = self.prefill(prompt, cache)[:, -1].argmax(-1)
        out = [nxt]
        for _ in range(steps - 1):
            nxt = self.decode(nxt, cache).argmax(-1)
            out.append(nxt)
        return torch.stack(out, dim=1)
