"""A Llama-style decoder stack with tensor parallelism, for inference: prefill and decode with a KV cache.

W ranks; each runs ``heads/W`` query heads, ``kv_heads/W`` key/value heads (one, replicated, when there
are fewer than W), ``ffn/W`` MLP features and ``vocab/W`` rows of the LM head. The embedding is replicated (every rank holds ``[vocab, hidden]``: a
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

A batch may be left-padded: an attention mask marks the real tokens; padding takes cache slots that no
query attends to, and positions count real tokens only (``tileweave.nn.kv_cache``). Every rank must
call the same methods with the same token ids, like any collective; the logits come back whole and
bitwise the same on every rank. The communicating calls are a seam (:class:`DecoderOps`), so that
other implementations (the benchmark's baselines) run the same layers.

FP8 inference: ``TPDecoder(config, fp8="rowwise" | "blockwise")`` (or ``tileweave.models.from_pretrained(...,
fp8=...)``, or ``model.to_fp8(...)`` on a loaded model) holds every layer's four GEMM weights in float8
e4m3, quantized once (rowwise: a scale per output row of each checkpoint weight; blockwise: per 128 x 128
block of each checkpoint weight, DeepSeek-V3's blocks); every GEMM quantizes its input on the device per
token (rowwise; a row-parallel GEMM's input per token of this rank's slice of the features, with no
communication) or per 1 x 128 block of a token (blockwise) and runs in float8 on the same ops, prefill and
decode alike (the decode step stays capturable in a CUDA graph). The embedding, the LM head, norms, RoPE,
attention and the KV cache stay in the model's dtype (``tileweave.nn.fp8_weights``, ``decoder_layer.check_fp8``).
"""

from __future__ import annotations


import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tileweave.nn import generation
from tileweave.nn.checkpoint import Reader, check_unused, dict_reader, to_rotate_half
from tileweave.nn.decoder_layer import (DecoderConfig, DecoderOps, MoEConfig, RopeScaling, RowNorm, Step,
                                        TPDecoderLayer, check_fp8, rms_norm, rope_tables)
from tileweave.nn.kv_cache import KVCache
from tileweave.nn.moe_decoder_layer import TPMoEDecoderLayer
from tileweave.nn.shards import gather_shards

__all__ = ["DecoderConfig", "DecoderOps", "KVCache", "MoEConfig", "RopeScaling", "RowNorm", "Step", "TPDecoder",
           "TPDecoderLayer", "TPMoEDecoderLayer", "rms_norm"]


class TPDecoder(nn.Module):
    """The whole stack (module docstring), inference only (no gradients).

    ``model(input_ids [B, S], attention_mask=None)`` returns the logits ``[B, S, vocab]`` of a batch
    (``attention_mask [B, S]``: 1 for real tokens, 0 for left padding), the same on every rank;
    ``generate`` continues a batch (``tileweave.nn.generation.generate``). Step by step:
    ``new_cache(batch)``, then ``prefill(tokens [B, S], cache)`` and ``decode(tokens [B], cache)`` return
    the logits ``[B, S, vocab]`` / ``[B, vocab]`` of the new tokens and advance the cache.

    ``prefill_sequence_parallel``: run prefill sequence-parallel where ``B*S`` divides by W (else, or
    when False, replicated like decode). ``ops``: the communicating calls (:class:`DecoderOps`).
    ``dtype``: float16, bfloat16 or float32 (what the ops take; on the CPU float16 or float32).
    ``fp8``: None, ``"rowwise"`` or ``"blockwise"``: FP8 inference (module docstring); the weights are
    quantized as each layer is built and again whenever they are loaded. Refused, the same on every
    rank and before any kernel runs (``ValueError`` naming the sizes): mixtures of experts, and
    blockwise where a rank's part of a weight is not whole 128 x 128 blocks.
    A cache belongs to one sequence batch and one call at a time: calls that share a cache, or run on
    the same group from several threads, must not overlap. Weights: ``load_full_state_dict`` and
    ``full_state_dict`` use a Hugging Face causal LM's names and layouts (``model.layers.0.self_attn.
    q_proj.weight``, ...); ``tileweave.models.from_pretrained`` reads a checkpoint directory.
    """

    def __init__(self, config: DecoderConfig, *, group: dist.ProcessGroup | None = None,
                 prefill_sequence_parallel: bool = True, ops: DecoderOps | None = None, device=None,
                 dtype=None, fp8: str | None = None) -> None:
        super().__init__()
        self.config = config
        self.group = group if group is not None else dist.group.WORLD
        self.rank, self.world = dist.get_rank(self.group), dist.get_world_size(self.group)
        check_fp8(config, self.world, fp8)
        for name in ("vocab", "heads", "ffn"):
            if getattr(config, name) % self.world:
                raise ValueError(f"DecoderConfig.{name}={getattr(config, name)} must be divisible by the "
                                 f"TP group size {self.world}")
        kv = config.kv_heads
        if (kv >= self.world and kv % self.world) or (kv < self.world and self.world % kv):
            raise ValueError(f"DecoderConfig.kv_heads={kv} must be divisible by the TP group size {self.world}, "
                             f"or divide it (then each key/value head is replicated on {self.world}/kv_heads ranks)")
        self.prefill_sequence_parallel = prefill_sequence_parallel
        self.ops = ops if ops is not None else DecoderOps()
        kw = dict(device=device, dtype=dtype)
        self.embed = nn.Parameter(torch.randn(config.vocab, config.hidden, **kw))
        if config.moe is None:
            self.layers = nn.ModuleList(TPDecoderLayer(config, self.world, self.rank, group=self.group, fp8=fp8, **kw)
                                        for _ in range(config.layers))
        else:
            self.layers = nn.ModuleList(TPMoEDecoderLayer(config, self.world, self.rank, group=self.group, **kw)
                                        for _ in range(config.layers))
        self.norm = nn.Parameter(torch.ones(config.hidden, **kw))
        self.lm_head = nn.Parameter(torch.empty(config.vocab // self.world, config.hidden, **kw))
        nn.init.normal_(self.lm_head, std=config.hidden ** -0.5)
        self._tables: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def fp8(self) -> str | None:
        """The scaling of the float8 weights, or None."""
        return self.layers[0].fp8

    @torch.no_grad()
    def to_fp8(self, scaling: str) -> "TPDecoder":
        """Quantize a loaded model's GEMM weights once, in place, for FP8 inference (``scaling``:
        ``"rowwise"`` or ``"blockwise"``; module docstring), layer by layer, dropping the
        high-precision weights. Returns the model. Every rank must call it alike."""
        check_fp8(self.config, self.world, scaling)
        for layer in self.layers:
            layer.to_fp8(scaling)
        return self

    def new_cache(self, batch: int, max_seq: int | None = None) -> KVCache:
        """An empty KV cache for ``batch`` sequences of up to ``max_seq`` tokens (default
        ``config.max_seq``) on the model's device and dtype."""
        c = self.config
        max_seq = c.max_seq if max_seq is None else max_seq
        if not 1 <= max_seq <= c.max_seq:
            raise ValueError(f"max_seq={max_seq} must be in [1, DecoderConfig.max_seq={c.max_seq}]")
        return KVCache(layers=c.layers, batch=batch, kv_heads=self.layers[0].local_kv_heads, max_seq=max_seq,
                       head_dim=c.head_dim, device=self.embed.device, dtype=self.embed.dtype)

    def rope_tables(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin) [length, head_dim/2]`` in the model's dtype, computed once per length."""
        key = (length, self.embed.device, self.embed.dtype)
        if key not in self._tables:
            with torch.no_grad():
                self._tables[key] = rope_tables(self.config, length, self.embed.device, self.embed.dtype)
        return self._tables[key]

    def _check(self, tokens: torch.Tensor, cache: KVCache, mask: torch.Tensor | None) -> tuple[int, int]:
        if tokens.dim() != 2 or tokens.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"tokens must be integer [batch, seq], got {tokens.dtype} {tuple(tokens.shape)}")
        batch, seq = tokens.shape
        if batch != cache.batch:
            raise ValueError(f"tokens has batch {batch}, the cache was made for {cache.batch}")
        if cache.length + seq > cache.max_seq:
            raise ValueError(f"{cache.length} cached + {seq} new tokens exceed max_seq={cache.max_seq}")
        if mask is not None and tuple(mask.shape) != (batch, seq):
            raise ValueError(f"attention_mask must have the shape of the tokens {[batch, seq]}, "
                             f"got {list(mask.shape)}")
        return batch, seq

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[B, S, vocab]`` of ``input_ids [B, S]`` on a fresh cache; ``attention_mask [B, S]``
        (1: a real token, 0: left padding; None: all real). Rows of padding tokens hold finite values
        that mean nothing."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
        cache = self.new_cache(input_ids.shape[0], input_ids.shape[1])
        return self.prefill(input_ids, cache, attention_mask)

    @torch.no_grad()
    def prefill(self, tokens: torch.Tensor, cache: KVCache, attention_mask: torch.Tensor | None = None
                ) -> torch.Tensor:
        """Logits ``[B, S, vocab]`` of ``tokens [B, S]`` (the prompt, or more tokens after it);
        ``attention_mask [B, S]`` marks the real ones (None: all)."""
        batch, seq = self._check(tokens, cache, attention_mask)
        if tokens.numel():
            # Prompt ids come from the caller (decode steps feed back the model's own choices): checked
            # here, where every rank holds the same ids and so raises alike, not as an index error in the
            # rank whose vocabulary shard the id would fall in.
            low, high = (int(v) for v in torch.aminmax(tokens))
            if low < 0 or high >= self.config.vocab:
                raise ValueError(f"token ids must be in [0, vocab={self.config.vocab}), got ids from {low} to {high}")
        step = Step.begin(cache, self.rope_tables(cache.max_seq), attention_mask, batch, seq, cache.length + seq)
        tokens = tokens.reshape(-1).to(self.embed.device)
        if self.prefill_sequence_parallel and (batch * seq) % self.world == 0:
            logits = self._sequence_parallel(tokens, cache, step)
        else:
            logits = self._replicated(tokens, cache, step)
        cache.advance(seq)
        return gather_shards(logits, 1, self.group).view(batch, seq, -1)

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Logits ``[B, vocab]`` of one new token per sequence, ``tokens [B]``; replicated activations."""
        self._check(tokens.view(-1, 1), cache, None)
        logits = self.decode_shard(tokens, cache, cache.length + 1)
        cache.advance(1)
        return gather_shards(logits, 1, self.group)

    def decode_shard(self, tokens: torch.Tensor, cache: KVCache, keys: int) -> torch.Tensor:
        """This rank's vocabulary columns ``[B, vocab/W]`` of the logits of ``tokens [B]``, attending to
        the first ``keys`` cache slots (``cache.max_seq``: a step whose shapes never change, for a CUDA
        graph). Reads no host value of the cache and leaves ``cache.length`` to the caller; no checks."""
        step = Step.begin(cache, self.rope_tables(cache.max_seq), None, tokens.shape[0], 1, keys)
        return self._replicated(tokens.reshape(-1), cache, step)

    def _replicated(self, tokens: torch.Tensor, cache: KVCache, step: Step) -> torch.Tensor:
        c = self.config
        resid = self.embed[tokens]                                           # [M, H]
        normed = rms_norm(resid, self.layers[0].attn_norm, c.norm_eps)
        for i, layer in enumerate(self.layers):
            after = self.layers[i + 1].attn_norm if i + 1 < len(self.layers) else self.norm
            normed, resid = layer.forward_replicated(normed, resid, after, cache, i, step, self.ops, self.group)
        return F.linear(normed, self.lm_head)

    def _sequence_parallel(self, tokens: torch.Tensor, cache: KVCache, step: Step) -> torch.Tensor:
        rows = tokens.shape[0] // self.world
        x = self.embed[tokens[self.rank * rows:(self.rank + 1) * rows]]   # [M/W, H]
        for i, layer in enumerate(self.layers):
            x = layer.forward_sequence_parallel(x, cache, i, step, self.ops, self.group)
        return self.ops.all_gather_gemm(rms_norm(x, self.norm, self.config.norm_eps), self.lm_head.t(), self.group)

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, **options) -> torch.Tensor:
        """The new tokens ``[B, n]`` (``n <= max_new_tokens``) after ``input_ids [B, S]``: greedy, or
        sampled with ``temperature`` and ``top_p``; options in ``tileweave.nn.generation.generate``."""
        return generation.generate(self, input_ids, max_new_tokens, **options)

    @torch.no_grad()
    def load(self, read: Reader) -> None:
        """This rank's shards of every weight, from ``read`` (``tileweave.nn.checkpoint.Reader``)."""
        c, n = self.config, self.lm_head.shape[0]
        self.embed.copy_(read("model.embed_tokens.weight", (c.vocab, c.hidden)))
        self.norm.copy_(read("model.norm.weight", (c.hidden,)))
        head = "model.embed_tokens.weight" if c.tie_embeddings else "lm_head.weight"
        self.lm_head.copy_(read(head, (c.vocab, c.hidden), 0, self.rank * n, (self.rank + 1) * n))
        for i, layer in enumerate(self.layers):
            layer.load(read, f"model.layers.{i}.")

    @torch.no_grad()
    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """This rank's shards of an unsharded model's weights, named and laid out as a Hugging Face
        causal LM's state dict (``full_state_dict`` gives one). Every tensor's shape is checked; a missing
        tensor, a wrong shape or a tensor the model has no place for raises an error naming it."""
        owner = "TPDecoder.load_full_state_dict"
        used: set[str] = set()
        read = dict_reader(state, owner)

        def recording(name, *args):
            used.add(name)
            return read(name, *args)

        self.load(recording)
        check_unused(state, used, owner)

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The unsharded weights under Hugging Face names and layouts (what ``load_full_state_dict``
        takes), the same on every rank; float8 weights dequantized to the model's dtype. Collective:
        every rank must call it."""
        c, hd, g = self.config, self.config.head_dim, self.group
        out = {"model.embed_tokens.weight": self.embed.detach().clone(), "model.norm.weight": self.norm.detach().clone()}
        if not c.tie_embeddings:
            out["lm_head.weight"] = gather_shards(self.lm_head, 0, g)
        replicas = max(1, self.world // c.kv_heads)

        def kv(t: torch.Tensor) -> torch.Tensor:  # one copy of each key/value head
            full = gather_shards(t, 0, g)
            return full.view(self.world, *t.shape)[::replicas].reshape(-1, *t.shape[1:])

        for i, layer in enumerate(self.layers):
            p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
            sizes = [layer.local_heads * hd, layer.local_kv_heads * hd, layer.local_kv_heads * hd]
            named = [("weight", layer.full_weight("qkv"))]
            named += [("bias", layer.qkv_bias)] if layer.qkv_bias is not None else []
            for kind, t in named:
                q, k, v = t.split(sizes)
                out[f"{a}q_proj.{kind}"] = gather_shards(to_rotate_half(q, hd), 0, g)
                out[f"{a}k_proj.{kind}"] = kv(to_rotate_half(k, hd))
                out[f"{a}v_proj.{kind}"] = kv(v)
            if layer.q_norm is not None:
                out[a + "q_norm.weight"] = to_rotate_half(layer.q_norm.detach(), hd)
                out[a + "k_norm.weight"] = to_rotate_half(layer.k_norm.detach(), hd)
            out[a + "o_proj.weight"] = gather_shards(layer.full_weight("o"), 1, g)
            out[p + "input_layernorm.weight"] = layer.attn_norm.detach().clone()
            out[p + "post_attention_layernorm.weight"] = layer.mlp_norm.detach().clone()
            out.update(layer.mlp_full_state(p, g))
        return out
