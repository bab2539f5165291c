"""One layer of the TP decoder (``tileweave.nn.decoder``): its config, its weights and its two ways to run.

Per layer, with ``x`` the residual stream:

    q, k, v = qkv(rms_norm(x)) (+ bias)        # column-parallel; q, k per head rms-normed if qk_norm
    h = x + o(attention(rope(q), rope(k), v))  # o row-parallel
    x' = h + down(silu(gate(rms_norm(h))) * up(rms_norm(h)))

Rank r of W runs query heads ``[r*heads/W, (r+1)*heads/W)`` and MLP features ``[r*ffn/W, (r+1)*ffn/W)``.
Key/value heads split the same way when ``kv_heads >= W``; with fewer key/value heads than ranks each
rank holds the one key/value head its query heads read (a copy of it lives on ``W / kv_heads`` ranks).

FP8 inference (``fp8="rowwise"`` or ``"blockwise"``, ``tileweave.nn.fp8_weights``): the four GEMM
weights (qkv, o, gate_up, down) are held in float8 e4m3 with their scales, quantized once (when built,
loaded or converted by ``to_fp8``); each GEMM quantizes its input per token on the device and runs in
float8 with fp32 accumulation, writing the model's dtype. Norms, RoPE, attention, the KV cache, the
residual stream and the biases stay in the model's dtype.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tileweave.nn import inference
from tileweave.nn.block import BlockConfig, rope
from tileweave.nn.checkpoint import Reader, to_interleaved
from tileweave.nn.fp8_weights import Float8Weight, check_scaling, gemm_operands, quantize_weight
from tileweave.nn.kv_cache import KVCache
from tileweave.nn.shards import gather_shards
from tileweave.ops.compute import decode_attention as attention_ops
from tileweave.ops.compute.matmul import matmul
from tileweave.ops.functional import all_gather_gemm, gemm_reduce_scatter


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """Llama 3.1's RoPE frequency scaling (Hugging Face ``rope_type: "llama3"``): wavelengths longer than
    ``original_max_position / low_freq_factor`` are stretched by ``factor``, those shorter than
    ``original_max_position / high_freq_factor`` kept, and those between blended smoothly."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position: int

    def __post_init__(self) -> None:
        if not self.factor > 0 or not self.high_freq_factor > self.low_freq_factor > 0:
            raise ValueError(f"RopeScaling needs factor > 0 and high_freq_factor > low_freq_factor > 0, got {self}")


MOE_NAMINGS = ("mixtral", "qwen3_moe")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoEConfig:
    """A decoder whose MLPs are mixtures of SwiGLU experts (``tileweave.nn.moe.TPMoE``), in every layer;
    each expert is ``DecoderConfig.ffn`` wide (Mixtral 8x7B: 8 experts, top 2, ffn 14336)."""

    experts: int
    """Experts per layer."""
    top_k: int
    """Experts per token, from 1 to ``experts``."""
    normalize_topk: bool = True
    """Divide each token's k routing weights by their sum (Mixtral; Qwen3-MoE's ``norm_topk_prob``)."""
    naming: str = "mixtral"
    """The checkpoint's names of the expert tensors: ``"mixtral"`` (``block_sparse_moe.gate``,
    ``block_sparse_moe.experts.{e}.w1/w3/w2``: gate, up, down) or ``"qwen3_moe"`` (``mlp.gate``,
    ``mlp.experts.{e}.gate_proj/up_proj/down_proj``)."""

    def __post_init__(self) -> None:
        if self.experts < 1 or not 1 <= self.top_k <= self.experts:
            raise ValueError(f"MoEConfig needs experts >= 1 and top_k in [1, experts], got {self}")
        if self.naming not in MOE_NAMINGS:
            raise ValueError(f"MoEConfig.naming must be one of {MOE_NAMINGS}, got {self.naming!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecoderConfig(BlockConfig):
    """Shape of the model: ``layers`` layers of a block's shape (the fields of ``BlockConfig``), the
    vocabulary, the longest sequence and the per-family options (Llama 3 8B: vocab 128256, hidden 4096,
    layers 32, heads 32, kv_heads 8, ffn 14336)."""

    vocab: int
    """Vocabulary size; divisible by the TP group size (the LM head is split by vocabulary rows)."""
    layers: int
    """Decoder layers."""
    max_seq: int = 2048
    """Longest sequence (prompt plus generated tokens) a KV cache may hold."""
    head_dim: int | None = None
    """Size of a head (even); None: ``hidden // heads``. Qwen3 sets it apart from ``hidden``."""
    qkv_bias: bool = False
    """A bias on the q, k and v projections (Qwen2)."""
    qk_norm: bool = False
    """An RMSNorm over each query and key head before RoPE, one weight ``[head_dim]`` each (Qwen3)."""
    tie_embeddings: bool = False
    """The LM head is the embedding matrix (its checkpoint has no ``lm_head.weight``)."""
    rope_scaling: RopeScaling | None = None
    """Llama 3.1's frequency scaling; None: plain RoPE."""
    moe: MoEConfig | None = None
    """Mixture-of-experts MLPs in every layer (then ``ffn`` is one expert's width); None: dense MLPs."""

    def __post_init__(self) -> None:
        for name in ("vocab", "hidden", "layers", "heads", "kv_heads", "ffn", "max_seq"):
            if getattr(self, name) < 1:
                raise ValueError(f"DecoderConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.head_dim is None:
            if self.hidden % self.heads:
                raise ValueError(f"hidden={self.hidden} must be divisible by heads={self.heads} "
                                 "(or give head_dim)")
            object.__setattr__(self, "head_dim", self.hidden // self.heads)
        if self.head_dim < 2 or self.head_dim % 2:
            raise ValueError(f"DecoderConfig.head_dim must be even and >= 2, got {self.head_dim}")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads={self.heads} must be divisible by kv_heads={self.kv_heads}")


def rope_frequencies(config: DecoderConfig) -> torch.Tensor:
    """The angle per position of each of a head's ``head_dim / 2`` rotating pairs (float64)."""
    d = config.head_dim
    inv = 1.0 / config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    s = config.rope_scaling
    if s is None:
        return inv
    wavelen = 2 * math.pi / inv
    low_wavelen = s.original_max_position / s.low_freq_factor
    high_wavelen = s.original_max_position / s.high_freq_factor
    scaled = torch.where(wavelen > low_wavelen, inv / s.factor, inv)
    smooth = (s.original_max_position / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    blended = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)


def rope_tables(config: DecoderConfig, length: int, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)``, each ``[length, head_dim / 2]``, of positions ``0 .. length-1``: angles in fp32
    (as the checkpoints' reference implementations compute them), then cast to ``dtype``."""
    inv = rope_frequencies(config).to(device=device, dtype=torch.float32)
    angles = torch.arange(length, device=device, dtype=torch.float32)[:, None] * inv[None, :]
    return angles.cos().to(dtype), angles.sin().to(dtype)


RowNorm = Callable[..., tuple[torch.Tensor, torch.Tensor]]
"""``(x [M, K/W], weight [N, K/W], residual [M, N], norm_weight [N], eps, group) -> (normed, h)``,
``h = residual + sum over ranks of x @ weight.T``, ``normed = rms_norm(h) * norm_weight``."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecoderOps:
    """The decoder's communicating calls: tileweave's ops by default."""

    row_parallel_norm: RowNorm = inference.row_parallel_residual_norm
    """Replicated row-parallel GEMM with the residual add and RMSNorm after it."""
    all_gather_gemm: Callable[..., torch.Tensor] = all_gather_gemm
    """``(x_shard_m [M/W, K], b [K, N/W], group, *, bias=None) -> [M, N/W]`` (sequence-parallel column GEMMs)."""
    gemm_reduce_scatter: Callable[..., torch.Tensor] = gemm_reduce_scatter
    """``(x [M, K/W], b [K/W, N], group) -> [M/W, N]`` (sequence-parallel row GEMMs)."""


@dataclasses.dataclass(frozen=True)
class Step:
    """What every layer of one step shares: ``B`` sequences of ``S`` new tokens, their RoPE
    ``cos, sin [B, 1, S, head_dim/2]``, their cache ``slots [S]``, the attention mask ``allowed [B, 1, S,
    keys]`` over the first ``keys`` slots of the cache (``KVCache.allowed``)."""

    batch: int
    seq: int
    cos: torch.Tensor
    sin: torch.Tensor
    slots: torch.Tensor
    allowed: torch.Tensor

    @classmethod
    def begin(cls, cache: KVCache, tables: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor | None,
              batch: int, seq: int, keys: int) -> "Step":
        """Take the next ``seq`` slots of ``cache`` (``KVCache.begin``) and build the step over them."""
        positions, slots = cache.begin(mask, seq)
        cos, sin = tables
        return cls(batch, seq, cos[positions][:, None], sin[positions][:, None], slots,
                   cache.allowed(slots, keys))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / rms(x) * weight`` over the last axis, in fp32, returned in ``x``'s dtype."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def local_heads(config: DecoderConfig, world: int, rank: int) -> tuple[int, int, int]:
    """``(query heads, key/value heads, first key/value head)`` of ``rank``."""
    kv_local = max(1, config.kv_heads // world)
    return config.heads // world, kv_local, rank * config.kv_heads // world


def check_fp8(config: DecoderConfig, world: int, scaling: str | None) -> None:
    """Refuse an FP8 scaling that ``world`` ranks cannot run for ``config`` (the same on every rank):
    mixtures of experts, and for blockwise a local size that is not a multiple of 128. Blockwise
    quantizes every checkpoint weight (``q_proj``, ``k_proj``, ...) in its own 128 x 128 blocks, so each
    rank's part of each weight must be whole blocks along both axes (as vLLM requires), and a head's
    rows, which the RoPE layout reorders within the head, must lie in one block (head_dim divides 128)."""
    if scaling is None:
        return
    check_scaling(scaling)
    if config.moe is not None:
        raise ValueError(f"fp8={scaling!r}: FP8 inference is not available for mixture-of-experts layers "
                         "(DecoderConfig.moe) yet; load the model without fp8")
    if scaling != "blockwise":
        return
    heads, kv_local, _ = local_heads(config, world, 0)
    hd = config.head_dim
    sizes = {"hidden": config.hidden, "query rows per rank (heads/W * head_dim)": heads * hd,
             "key/value rows per rank": kv_local * hd, "ffn per rank (ffn/W)": config.ffn // world}
    bad = {name: size for name, size in sizes.items() if size % 128}
    if bad:
        got = ", ".join(f"{name} = {size}" for name, size in bad.items())
        raise ValueError(f"fp8='blockwise' needs every local weight dimension to be a multiple of 128 at TP size "
                         f"{world}, got {got}; use fp8='rowwise' (or another TP size)")
    if 128 % hd:
        raise ValueError(f"fp8='blockwise' needs head_dim to divide 128 (a head's q/k rows are reordered for RoPE "
                         f"within the head, which must stay inside one 128-row block), got head_dim = {hd}; use "
                         "fp8='rowwise'")


FP8_WEIGHTS = ("qkv", "o", "gate_up", "down")
"""The layer's weights that FP8 inference holds in float8 (each ``[N, K]``, with ``<name>_scale``)."""
ROW_PARALLEL = ("o", "down")
"""Of those, the weights whose columns (K) are split over the ranks."""


class TPDecoderLayer(nn.Module):
    """One layer's weights (this rank's shards) and its two ways to run (``tileweave.nn.decoder``).
    ``fp8``: None, ``"rowwise"`` or ``"blockwise"`` (module docstring; ``check_fp8``'s refusals)."""

    def __init__(self, config: DecoderConfig, world: int, rank: int = 0, *, group: dist.ProcessGroup | None = None,
                 device=None, dtype=None, fp8: str | None = None) -> None:
        super().__init__()
        check_fp8(config, world, fp8)
        c, hd = config, config.head_dim
        self.config = config
        self.local_heads, self.local_kv_heads, self.kv_start = local_heads(c, world, rank)
        self.local_ffn = c.ffn // world
        self.rank = rank
        self.world = world
        self.group = group
        kw = dict(device=device, dtype=dtype)
        self.attn_norm = nn.Parameter(torch.ones(c.hidden, **kw))
        # [q | k | v] of this rank's heads and [gate | up] of its features: one GEMM each. q and k rows
        # are in the interleaved RoPE layout (tileweave.nn.checkpoint).
        qkv_rows = (self.local_heads + 2 * self.local_kv_heads) * hd
        self.qkv = nn.Parameter(torch.empty(qkv_rows, c.hidden, **kw))
        self.qkv_bias = nn.Parameter(torch.zeros(qkv_rows, **kw)) if c.qkv_bias else None
        self.q_norm = nn.Parameter(torch.ones(hd, **kw)) if c.qk_norm else None
        self.k_norm = nn.Parameter(torch.ones(hd, **kw)) if c.qk_norm else None
        self.o = nn.Parameter(torch.empty(c.hidden, self.local_heads * hd, **kw))
        self.mlp_norm = nn.Parameter(torch.ones(c.hidden, **kw))
        for w in (self.qkv, self.o):
            nn.init.normal_(w, std=w.shape[1] ** -0.5)
        self.init_mlp(group, kw)
        self.fp8: str | None = None
        """None, or the scaling of the float8 weights (``to_fp8``)."""
        if fp8 is not None:
            self.to_fp8(fp8)

    @torch.no_grad()
    def to_fp8(self, scaling: str) -> None:
        """Quantize the GEMM weights (``FP8_WEIGHTS``) once, in place: each parameter becomes a float8
        buffer of the same name and a float32 ``<name>_scale`` (``tileweave.nn.fp8_weights``); the
        high-precision weights are dropped. Collective (rowwise, W > 1: each row's amax over the ranks
        that hold parts of it). Refusals: ``check_fp8``; a layer already in FP8."""
        if self.fp8 is not None:
            raise ValueError(f"the layer's weights are already float8 ({self.fp8!r}); build or load the model "
                             "again to change the scaling")
        check_fp8(self.config, self.world, scaling)
        self.model_dtype = self.attn_norm.dtype
        for name in FP8_WEIGHTS:
            w = getattr(self, name).detach()
            delattr(self, name)
            q = self._quantize(name, w, scaling)
            self.register_buffer(name, q.data)
            self.register_buffer(name + "_scale", q.scale)
        self.fp8 = scaling

    def _quantize(self, name: str, w: torch.Tensor, scaling: str) -> Float8Weight:
        """Rowwise scales are per row of the whole checkpoint weight, so that the quantized model is the
        same at every TP size: a row-parallel weight's row amax is the maximum over the ranks."""
        if scaling != "rowwise" or name not in ROW_PARALLEL or self.world == 1 or w.is_meta:
            return quantize_weight(w, scaling)
        amax = w.abs().amax(1, keepdim=True).float()
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=self.group)
        return quantize_weight(w, scaling, row_amax=amax)

    def weight(self, name: str) -> torch.Tensor | Float8Weight:
        """The weight ``name`` as the GEMMs take it: the parameter, or a ``Float8Weight``."""
        if self.fp8 is None:
            return getattr(self, name)
        return Float8Weight(getattr(self, name), getattr(self, name + "_scale"), self.fp8)

    def full_weight(self, name: str) -> torch.Tensor:
        """The weight ``name`` in the model's dtype (float8 weights dequantized)."""
        w = self.weight(name)
        return w.dequantize(self.model_dtype) if isinstance(w, Float8Weight) else w.detach()

    def store(self, name: str, value: torch.Tensor) -> None:
        """Set the weight ``name`` to ``value`` (its full local shape): copied, or quantized (collective,
        as ``to_fp8``)."""
        if self.fp8 is None:
            getattr(self, name).copy_(value)
            return
        q = self._quantize(name, value.to(device=self.attn_norm.device, dtype=self.model_dtype), self.fp8)
        getattr(self, name).copy_(q.data)
        getattr(self, name + "_scale").copy_(q.scale)

    def init_mlp(self, group: dist.ProcessGroup | None, kw: dict) -> None:
        """The MLP's weights: this rank's ``gate | up`` rows and ``down`` columns (a subclass's own MLP
        replaces this and the other ``mlp_*`` methods)."""
        hidden = self.config.hidden
        self.gate_up = nn.Parameter(torch.empty(2 * self.local_ffn, hidden, **kw))
        self.down = nn.Parameter(torch.empty(hidden, self.local_ffn, **kw))
        for w in (self.gate_up, self.down):
            nn.init.normal_(w, std=w.shape[1] ** -0.5)

    def attention(self, qkv: torch.Tensor, cache: KVCache, index: int, step: Step) -> torch.Tensor:
        """``qkv [B*S, (hl + 2 kvl) hd]`` of the step's tokens -> ``[B*S, hl hd]``; writes their keys and
        values into layer ``index`` of the cache at the step's slots."""
        c, hd, hl, kvl = self.config, self.config.head_dim, self.local_heads, self.local_kv_heads
        b, s = step.batch, step.seq
        q, k, v = qkv.split([hl * hd, kvl * hd, kvl * hd], dim=1)
        q, k, v = q.view(b, s, hl, hd), k.view(b, s, kvl, hd), v.view(b, s, kvl, hd)
        if self.q_norm is not None:
            q, k = rms_norm(q, self.q_norm, c.norm_eps), rms_norm(k, self.k_norm, c.norm_eps)
        tables = (step.cos, step.sin)
        q = rope(q.transpose(1, 2), c.rope_theta, tables)
        k = rope(k.transpose(1, 2), c.rope_theta, tables)
        cache.k[index].index_copy_(2, step.slots, k)
        cache.v[index].index_copy_(2, step.slots, v.transpose(1, 2))
        keys = step.allowed.shape[-1]
        if s == 1 and keys > cache.length + 1 and attention_ops.suits(q, cache.k):
            # A decode step whose keys span slots not yet filled (a step replayed from a CUDA graph over
            # the whole preallocated cache): over the filled slots only, their count read on the device.
            # A step whose keys are the filled slots (eager, the host's length) keeps torch's attention.
            out = attention_ops.decode_attention(q[:, :, 0], cache.k[index], cache.v[index], cache.valid, step.slots,
                                                 limit=keys)
            return out.reshape(b, hl * hd)
        out = F.scaled_dot_product_attention(q, cache.k[index, :, :, :keys], cache.v[index, :, :, :keys],
                                             attn_mask=step.allowed, enable_gqa=hl != kvl)
        return out.transpose(1, 2).reshape(b * s, hl * hd)

    def forward_replicated(self, normed: torch.Tensor, resid: torch.Tensor, next_norm: torch.Tensor,
                           cache: KVCache, index: int, step: Step, ops: DecoderOps,
                           group: dist.ProcessGroup) -> tuple[torch.Tensor, torch.Tensor]:
        """``(normed, resid)`` in, both ``[M, H]`` on every rank (``normed``: this layer's attention norm
        of ``resid``) -> the same for the next layer, normed with ``next_norm``."""
        eps = self.config.norm_eps
        qkv = self.column_linear(normed, "qkv", self.qkv_bias, group)
        attn = self.attention(qkv, cache, index, step)
        normed, resid = ops.row_parallel_norm(attn, self.weight("o"), resid, self.mlp_norm, eps, group)
        return self.mlp_replicated(normed, resid, next_norm, ops, group)

    def mlp_replicated(self, normed: torch.Tensor, resid: torch.Tensor, next_norm: torch.Tensor, ops: DecoderOps,
                       group: dist.ProcessGroup) -> tuple[torch.Tensor, torch.Tensor]:
        """The MLP on replicated rows: ``(rms_norm(h) * next_norm, h)`` with ``h = resid + mlp(normed)``."""
        gate, up = self.column_linear(normed, "gate_up", None, group).chunk(2, dim=1)
        return ops.row_parallel_norm(F.silu(gate) * up, self.weight("down"), resid, next_norm, self.config.norm_eps,
                                     group)

    def column_linear(self, x: torch.Tensor, name: str, bias: torch.Tensor | None,
                      group: dist.ProcessGroup) -> torch.Tensor:
        """``x [M, K] @ weight.T + bias`` of a column-parallel weight on replicated rows (local)."""
        w = self.weight(name)
        if not isinstance(w, Float8Weight):
            return inference.column_parallel_linear(x, w, bias, group)
        a, b, fp8 = w.operands(x)
        return matmul(a, b, bias=bias, **fp8)

    def forward_sequence_parallel(self, x_shard: torch.Tensor, cache: KVCache, index: int, step: Step,
                                  ops: DecoderOps, group: dist.ProcessGroup) -> torch.Tensor:
        """``x_shard_m [M/W, H]`` -> the layer's output rows ``[M/W, H]``."""
        eps = self.config.norm_eps
        bias = {} if self.qkv_bias is None else {"bias": self.qkv_bias}
        a, b, fp8 = gemm_operands(rms_norm(x_shard, self.attn_norm, eps), self.weight("qkv"))
        qkv = ops.all_gather_gemm(a, b, group, **bias, **fp8)
        attn = self.attention(qkv, cache, index, step)
        a, b, fp8 = gemm_operands(attn, self.weight("o"))
        h = x_shard + ops.gemm_reduce_scatter(a, b, group, **fp8)
        return h + self.mlp_sequence_parallel(rms_norm(h, self.mlp_norm, eps), ops, group)

    def mlp_sequence_parallel(self, x_shard: torch.Tensor, ops: DecoderOps, group: dist.ProcessGroup) -> torch.Tensor:
        """The MLP of this rank's rows ``x_shard_m [M/W, H]`` (normed) -> ``[M/W, H]``."""
        a, b, fp8 = gemm_operands(x_shard, self.weight("gate_up"))
        gate, up = ops.all_gather_gemm(a, b, group, **fp8).chunk(2, dim=1)
        a, b, fp8 = gemm_operands(F.silu(gate) * up, self.weight("down"))
        return ops.gemm_reduce_scatter(a, b, group, **fp8)

    @torch.no_grad()
    def load(self, read: Reader, prefix: str) -> None:
        """This rank's shards of the layer's checkpoint tensors ``prefix + name`` (Hugging Face names:
        ``self_attn.q_proj.weight``, ..., ``mlp.down_proj.weight``), shapes checked by ``read``."""
        c, hd, hl, kvl = self.config, self.config.head_dim, self.local_heads, self.local_kv_heads
        h, q0, kv0 = c.hidden, self.rank * hl, self.kv_start
        a = prefix + "self_attn."
        self.attn_norm.copy_(read(prefix + "input_layernorm.weight", (h,)))
        self.mlp_norm.copy_(read(prefix + "post_attention_layernorm.weight", (h,)))

        def heads(kind: str, count: int, first: int, n: int, rotate: bool) -> tuple[torch.Tensor, ...]:
            rows = slice(first * hd, (first + n) * hd)
            w = read(f"{a}{kind}_proj.weight", (count * hd, h), 0, rows.start, rows.stop)
            b = read(f"{a}{kind}_proj.bias", (count * hd,), 0, rows.start, rows.stop) if c.qkv_bias else None
            if rotate:
                w, b = to_interleaved(w, hd), None if b is None else to_interleaved(b, hd)
            return w, b

        parts = [heads("q", c.heads, q0, hl, True), heads("k", c.kv_heads, kv0, kvl, True),
                 heads("v", c.kv_heads, kv0, kvl, False)]
        self.store("qkv", torch.cat([w for w, _ in parts]))
        if self.qkv_bias is not None:
            self.qkv_bias.copy_(torch.cat([b for _, b in parts]))
        if self.q_norm is not None:
            self.q_norm.copy_(to_interleaved(read(a + "q_norm.weight", (hd,)), hd))
            self.k_norm.copy_(to_interleaved(read(a + "k_norm.weight", (hd,)), hd))
        self.store("o", read(a + "o_proj.weight", (h, c.heads * hd), 1, q0 * hd, (q0 + hl) * hd))
        self.load_mlp(read, prefix)

    def load_mlp(self, read: Reader, prefix: str) -> None:
        """This rank's shards of the MLP's tensors (``mlp.gate_proj.weight``, ...)."""
        c, f0, m = self.config, self.rank * self.local_ffn, prefix + "mlp."
        h = c.hidden
        self.store("gate_up", torch.cat([read(m + "gate_proj.weight", (c.ffn, h), 0, f0, f0 + self.local_ffn),
                                         read(m + "up_proj.weight", (c.ffn, h), 0, f0, f0 + self.local_ffn)]))
        self.store("down", read(m + "down_proj.weight", (h, c.ffn), 1, f0, f0 + self.local_ffn))

    @torch.no_grad()
    def mlp_full_state(self, prefix: str, group: dist.ProcessGroup) -> dict[str, torch.Tensor]:
        """The MLP's unsharded tensors under their checkpoint names (collective)."""
        gate, up = self.full_weight("gate_up").chunk(2)
        m = prefix + "mlp."
        return {m + "gate_proj.weight": gather_shards(gate, 0, group), m + "up_proj.weight": gather_shards(up, 0, group),
                m + "down_proj.weight": gather_shards(self.full_weight("down"), 1, group)}
