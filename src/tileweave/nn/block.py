"""A Llama-style transformer block with tensor and sequence parallelism on the fused ops.

Activations between the two halves are sharded by tokens (``x_shard_m [M/W, hidden]``, M = batch x
seq over the group); each half gathers the tokens in its column-parallel GEMM and scatters them in its
row-parallel GEMM:

    h = x + o_proj(attention(rope(qkv_proj(rms_norm(x)))))        # qkv: column-, o: row-parallel
    y = h + down_proj(silu(gate(rms_norm(h))) * up(rms_norm(h)))  # gate_up: column-, down: row-parallel

Each rank runs heads/W attention heads and ffn/W MLP features. With ``fp8=`` a recipe
(``tileweave.nn.fp8``) the four linears run their forward and backward GEMMs in float8; RoPE and
attention stay in the model's dtype, and the RMSNorms and the SwiGLU run in the kernels that cast
their outputs to float8 for the linears after them (``ColumnParallelLinear(x, norm=...)``,
``RowParallelLinear(gate_up, swiglu=True)``): those outputs are never written in high precision. With ``TILEWEAVE_POLICY=fallback`` set
before the first call, the same block runs NCCL collectives around cuBLAS GEMMs (Megatron-style, no
overlap), for comparison.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tileweave.nn.checkpoint import Reader, check_unused, dict_reader, to_interleaved, to_rotate_half
from tileweave.nn.fp8 import Float8Recipe
from tileweave.nn.linear import ColumnParallelLinear, RowParallelLinear, TPOps
from tileweave.nn.shards import from_rank_major, gather_shards, to_rank_major
from tileweave.ops.compute.rope import rope_qkv, rope_qkv_backward

STATE_NAMES = ("input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
               "self_attn.v_proj.weight", "self_attn.o_proj.weight", "post_attention_layernorm.weight",
               "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")
"""The block's tensors, as a Hugging Face Llama decoder layer names them (``[out, in]`` weights)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class BlockConfig:
    """Shape of one block (Llama 3 8B: hidden 4096, heads 32, kv_heads 8, ffn 14336)."""

    hidden: int
    """Model width."""
    heads: int
    """Query heads; divisible by the TP group size."""
    kv_heads: int
    """Key/value heads (grouped-query attention); divides ``heads`` and divisible by the TP group size."""
    ffn: int
    """MLP width; divisible by the TP group size."""
    rope_theta: float = 500000.0
    """RoPE base."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""

    def __post_init__(self) -> None:
        if self.hidden % self.heads:
            raise ValueError(f"hidden={self.hidden} must be divisible by heads={self.heads}")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads={self.heads} must be divisible by kv_heads={self.kv_heads}")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


def rope_tables(seq: int, dim: int, theta: float, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)``, each ``[seq, dim / 2]``: the rotation angles of positions ``0..seq-1``."""
    freqs = theta ** (-torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim)
    angles = torch.arange(seq, device=device, dtype=torch.float32)[:, None] * freqs[None, :]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rope(x: torch.Tensor, theta: float, tables: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Rotary position embedding over the sequence axis of ``x [batch, heads, seq, head_dim]``;
    ``tables``: ``rope_tables`` of ``x``'s sequence length, head size and dtype (computed if None)."""
    cos, sin = tables if tables is not None else rope_tables(x.shape[-2], x.shape[-1], theta, x.device, x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class RopeCache:
    """``rope_tables`` per (sequence length, device, dtype) of one head size and base, computed once:
    building them every step costs the host a series of small launches."""

    def __init__(self, head_dim: int, theta: float) -> None:
        self.head_dim, self.theta = head_dim, theta
        self._tables: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, seq: int, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` of positions ``0..seq-1``, each ``[seq, head_dim / 2]``."""
        key = (seq, device, dtype)
        tables = self._tables.get(key)
        if tables is None:
            with torch.no_grad():
                tables = self._tables[key] = rope_tables(seq, self.head_dim, self.theta, device, dtype)
        return tables


class _RotaryQKV(torch.autograd.Function):
    """``rope_qkv`` with its backward: the split, the rotation of q and k and its inverse, and the
    join of the gradients, one pass each way."""

    @staticmethod
    def forward(ctx, qkv, cos, sin, seq, heads, kv_heads, head_dim):
        ctx.save_for_backward(cos, sin)
        ctx.rows, ctx.dtype = qkv.shape[0], qkv.dtype
        ctx.shape = dict(seq=seq, heads=heads, kv_heads=kv_heads, head_dim=head_dim)
        return rope_qkv(qkv, cos, sin, **ctx.shape)

    @staticmethod
    def backward(ctx, dq, dk, dv):
        cos, sin = ctx.saved_tensors
        grads = []
        for g, n in zip((dq, dk, dv), (ctx.shape["heads"], ctx.shape["kv_heads"], ctx.shape["kv_heads"])):
            if g is None:  # an output the loss did not use
                g = torch.zeros((ctx.rows, n * ctx.shape["head_dim"]), dtype=ctx.dtype, device=cos.device)
            grads.append(g if g.stride(-1) == 1 else g.contiguous())
        return rope_qkv_backward(*grads, cos, sin, **ctx.shape), None, None, None, None, None, None


def split_heads(qkv: torch.Tensor, batch: int, heads: int, kv_heads: int, head_dim: int,
                tables: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``qkv [B*S, (heads + 2 kv_heads) * head_dim]`` of ``batch`` sequences of S tokens (batch-major;
    per row ``[q | k | v]``) -> ``q [B, heads, S, head_dim]``, ``k, v [B, kv_heads, S, head_dim]``, with
    ``q`` and ``k`` rotated by ``tables`` (``rope_tables`` of the S tokens' positions, in ``qkv``'s
    dtype). One kernel each way (``tileweave.ops.compute.rope``); the three are views of token-major
    storage (``[B, S, heads, head_dim]``), the layout attention kernels take as it is."""
    m = qkv.shape[0]
    seq = m // batch
    cos, sin = tables
    q, k, v = _RotaryQKV.apply(qkv, cos, sin, seq, heads, kv_heads, head_dim)
    return tuple(t.view(batch, seq, n, head_dim).transpose(1, 2)
                 for t, n in ((q, heads), (k, kv_heads), (v, kv_heads)))


class TPTransformerBlock(nn.Module):
    """One block; ``forward(x_shard_m [M/W, hidden], batch)`` returns ``[M/W, hidden]`` (and
    ``forward(x_shard [B, S/W, hidden])`` the sequence-sharded ``[B, S/W, hidden]``).

    Rows of the full ``[M, hidden]`` activation are ``batch`` sequences of ``M / batch`` tokens, rank r
    holding rows ``[r*M/W, (r+1)*M/W)``.
    """

    def __init__(self, config: BlockConfig, *, group: dist.ProcessGroup | None = None, device=None,
                 dtype=None, ops: TPOps | None = None, fp8: Float8Recipe | str | None = None) -> None:
        """``ops``: the communication GEMMs of the four TP layers (``TPOps``; None: tileweave's);
        ``fp8``: the FP8 recipe of their forward and backward GEMMs (``tileweave.nn.fp8``; None: no
        float8). Blockwise needs ``hidden``, ``hidden / W``, ``(heads + 2 kv_heads) * head_dim / W``,
        ``ffn / W`` and ``2 ffn / W`` to be multiples of 128 (each layer names the one that is not)."""
        super().__init__()
        self.config = config
        self.group = group if group is not None else dist.group.WORLD
        w = self.world = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        for name in ("heads", "kv_heads", "ffn"):
            if getattr(config, name) % w:
                raise ValueError(f"BlockConfig.{name}={getattr(config, name)} must be divisible by the TP size {w}")
        self.local_heads, self.local_kv_heads = config.heads // w, config.kv_heads // w
        hd = config.head_dim
        kw = dict(group=self.group, device=device, dtype=dtype, ops=ops, fp8=fp8)
        self.attn_norm = nn.RMSNorm(config.hidden, eps=config.norm_eps, device=device, dtype=dtype)
        self.mlp_norm = nn.RMSNorm(config.hidden, eps=config.norm_eps, device=device, dtype=dtype)
        # Fused projections are laid out per rank: [q | k | v] and [gate | up] of this rank's heads and
        # features, so that one column-parallel GEMM serves them (load_full_state_dict does the layout).
        self.qkv = ColumnParallelLinear(config.hidden, (config.heads + 2 * config.kv_heads) * hd, bias=False, **kw)
        self.o = RowParallelLinear(config.hidden, config.hidden, bias=False, **kw)
        self.gate_up = ColumnParallelLinear(config.hidden, 2 * config.ffn, bias=False, **kw)
        self.down = RowParallelLinear(config.ffn, config.hidden, bias=False, **kw)
        self._rope = RopeCache(hd, config.rope_theta)

    @property
    def fp8(self) -> Float8Recipe | None:
        """The FP8 recipe of the block's four linears (None: no float8)."""
        return self.qkv.fp8

    @property
    def ops(self) -> TPOps:
        """The communication GEMMs the block's TP layers run on; set it to run them on others."""
        return self.qkv.ops

    @ops.setter
    def ops(self, ops: TPOps) -> None:
        for layer in (self.qkv, self.o, self.gate_up, self.down):
            layer.ops = ops

    def forward(self, x_shard: torch.Tensor, batch: int | None = None) -> torch.Tensor:
        """``x_shard [M/W, H]`` with ``batch`` (the class docstring) -> ``[M/W, H]``; or ``x_shard [B, S/W,
        H]``, sharded on the sequence (positions ``[r*S/W, (r+1)*S/W)`` of each of the B sequences) ->
        ``[B, S/W, H]`` (``batch`` None or B). With B > 1 the attention's input and output are copied
        once each between the fused ops' rank-major row order and whole sequences."""
        if x_shard.dim() == 3:
            b, s_loc, h = x_shard.shape
            if batch not in (None, b):
                raise ValueError(f"TPTransformerBlock: x_shard {list(x_shard.shape)} holds {b} sequences, "
                                 f"but batch={batch}")
            return self._forward(x_shard.reshape(b * s_loc, h), b, s_loc).view(b, s_loc, h)
        if batch is None:
            raise ValueError("TPTransformerBlock: a 2-D x_shard [M/W, H] needs batch (the number of sequences)")
        return self._forward(x_shard, batch, None)

    def _forward(self, x_shard: torch.Tensor, batch: int, seq_shard: int | None) -> torch.Tensor:
        # seq_shard: rows in rank-major order of [B, S/W] blocks (a sequence-sharded input), else None
        hd = self.config.head_dim
        qkv = self.qkv(x_shard, norm=self.attn_norm)                  # [M, (hl + 2 kvl) hd]
        m = qkv.shape[0]
        if seq_shard is not None:
            qkv = from_rank_major(qkv, self.world, (batch, seq_shard), 1).reshape(m, -1)
        tables = self._rope(m // batch, qkv.device, qkv.dtype)
        q, k, v = split_heads(qkv, batch, self.local_heads, self.local_kv_heads, hd, tables)
        # Grouped keys and values go to attention as they are: its kernels share each kv head among its
        # query heads (no copies repeated per head); the output keeps q's token-major layout.
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                              enable_gqa=self.local_heads != self.local_kv_heads)
        attn = attn.transpose(1, 2)  # [B, S, hl, hd]
        attn = attn.reshape(m, self.local_heads * hd) if seq_shard is None else \
            to_rank_major(attn.reshape(batch, m // batch, -1), self.world, 1)
        h = x_shard + self.o(attn)
        gate_up = self.gate_up(h, norm=self.mlp_norm)                 # [M, 2 ffn / W]: gate | up
        return h + self.down(gate_up, swiglu=True)

    @torch.no_grad()
    def load(self, read: Reader, prefix: str = "") -> None:
        """This rank's shards of the block's tensors ``prefix + name``, named like a Hugging Face Llama
        decoder layer's (``STATE_NAMES``), shapes checked by ``read`` (``tileweave.nn.checkpoint``). The
        query and key rows come in the checkpoint's rotate-half layout and are interleaved for this
        block's RoPE."""
        c, hd, w, r = self.config, self.config.head_dim, self.world, self.rank
        h, hl, kvl, fl = c.hidden, self.local_heads, self.local_kv_heads, c.ffn // w

        def rows(name: str, total: int, local: int) -> torch.Tensor:
            return read(prefix + name, (total, h), 0, r * local, (r + 1) * local)

        self.attn_norm.weight.copy_(read(prefix + "input_layernorm.weight", (h,)))
        self.mlp_norm.weight.copy_(read(prefix + "post_attention_layernorm.weight", (h,)))
        q = to_interleaved(rows("self_attn.q_proj.weight", c.heads * hd, hl * hd), hd)
        k = to_interleaved(rows("self_attn.k_proj.weight", c.kv_heads * hd, kvl * hd), hd)
        v = rows("self_attn.v_proj.weight", c.kv_heads * hd, kvl * hd)
        self.qkv.weight.copy_(torch.cat([q, k, v]))
        self.gate_up.weight.copy_(torch.cat([rows("mlp.gate_proj.weight", c.ffn, fl),
                                             rows("mlp.up_proj.weight", c.ffn, fl)]))
        self.o.weight.copy_(read(prefix + "self_attn.o_proj.weight", (h, c.heads * hd), 1, r * hl * hd,
                                 (r + 1) * hl * hd))
        self.down.weight.copy_(read(prefix + "mlp.down_proj.weight", (h, c.ffn), 1, r * fl, (r + 1) * fl))

    def load_full_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Take this rank's shards from the unsharded tensors of ``full_state_dict``'s names and layout
        (a Hugging Face Llama decoder layer's, without its ``model.layers.N.`` prefix). Raises
        ``ValueError`` naming a tensor of the wrong shape or one the block has no place for, ``KeyError``
        for a missing one."""
        used: set[str] = set()
        reader = dict_reader(state, "TPTransformerBlock.load_full_state_dict")

        def read(name, *args):
            used.add(name)
            return reader(name, *args)

        self.load(read)
        check_unused(state, used, "TPTransformerBlock.load_full_state_dict")

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The unsharded weights named like a Hugging Face Llama decoder layer's (``STATE_NAMES``), query
        and key rows in the rotate-half layout: what ``load_full_state_dict`` takes. Collective: every
        rank of the group must call it."""
        c, hd, w = self.config, self.config.head_dim, self.world
        hl, kvl, fl = self.local_heads, self.local_kv_heads, c.ffn // w
        qkv = gather_shards(self.qkv.weight, 0, self.group).view(w, (hl + 2 * kvl) * hd, c.hidden)
        q, k, v = (part.reshape(-1, c.hidden) for part in qkv.split([hl * hd, kvl * hd, kvl * hd], dim=1))
        gate, up = (part.reshape(-1, c.hidden)
                    for part in gather_shards(self.gate_up.weight, 0, self.group).view(w, 2 * fl, c.hidden)
                    .split([fl, fl], dim=1))
        return {"input_layernorm.weight": self.attn_norm.weight.detach().clone(),
                "self_attn.q_proj.weight": to_rotate_half(q, hd), "self_attn.k_proj.weight": to_rotate_half(k, hd),
                "self_attn.v_proj.weight": v, "self_attn.o_proj.weight": gather_shards(self.o.weight, 1, self.group),
                "post_attention_layernorm.weight": self.mlp_norm.weight.detach().clone(),
                "mlp.gate_proj.weight": gate, "mlp.up_proj.weight": up,
                "mlp.down_proj.weight": gather_shards(self.down.weight, 1, self.group)}
