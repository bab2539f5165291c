"""Every float8 GEMM of the TP decoder captured as the model runs it, each checked on its own against
float64, with the attention between them: the per-cast counterpart of the end-to-end logits check.

An end-to-end comparison with "the same quantized math" holds only where every activation before a cast
equals the reference's to the last bit: a float32-level difference (another attention kernel, another
summation order) moves some activations across a float8 rounding boundary, a whole e4m3 step (6-12%)
each, and the flips compound over the layers. Checked one cast and one GEMM at a time, each against its
own inputs, nothing compounds:

* cast: the float8 activation and its scales that the layer made equal torch's own cast of the same
  high-precision activation (``support.fp8_reference.quantize32``), bit for bit;
* weight: the float8 weight operand and its scales, read as the GEMM reads them, equal torch's
  quantization of the rank's part of the checkpoint weight (dequantized in float64, where a product of
  an e4m3 value and a float32 scale is exact): a wrong scale or layout shows here, since the GEMM itself
  is checked against the operands it was given;
* GEMM: its output against float64 of its own dequantized operands (every rank's, for the gathered and
  the reduced forms), elementwise within a bound derived from the operands (``support.fp8_checks.bounds``); the RMSNorm
  fused into the replicated row-parallel GEMM against float64 of that GEMM's own sum;
* attention: its output against a float64 attention (RoPE, causal softmax) of its own q, k, v and the
  cache's keys and values; the keys and values it wrote against float64 RoPE of its own k, v.

``Capture`` wraps, while its context is open in one rank's process (the library is unchanged):
``Float8Weight.operands`` (the activation a layer hands to the cast, and what the cast gave back); the
GEMMs those operands go to, ``decoder_layer.matmul`` (replicated column-parallel),
``inference.gemm_all_reduce`` (replicated row-parallel, with the residual and the norm) and the model's
``DecoderOps.all_gather_gemm`` / ``gemm_reduce_scatter`` (sequence-parallel), each of which must receive
the very tensors that the cast produced; and each layer's ``attention``. Supported: dense layers without
q/k norms, biases or RoPE scaling, batches without padding.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from support.fp8_checks import (FLOAT8, GROUPS, Worst, bounds, dequantize_a, dequantize_b, exchange, rel, snapshot,
                                to_cpu)
from support.fp8_reference import E4M3, expand_scale, quantize32
from tileweave.nn import decoder_layer, inference
from tileweave.nn.decoder_layer import FP8_WEIGHTS
from tileweave.nn.fp8_weights import Float8Weight

ROW_PARALLEL = ("gemm_all_reduce", "gemm_reduce_scatter")



@dataclasses.dataclass
class GemmCall:
    """One float8 GEMM: what was cast (``x``), the operands as the GEMM received them (``a [M, K]``,
    ``b [K, N]``, their scales), and its output. ``gemm_all_reduce``: ``out`` is ``h`` (the residual
    plus the reduced sum), ``normed`` its RMSNorm."""

    phase: str
    layer: int
    name: str
    x: torch.Tensor
    a: torch.Tensor
    scale_a: torch.Tensor
    b: torch.Tensor
    scale_b: torch.Tensor
    op: str = ""
    bias: torch.Tensor | None = None
    out: torch.Tensor | None = None
    residual: torch.Tensor | None = None
    norm_weight: torch.Tensor | None = None
    eps: float = 0.0
    normed: torch.Tensor | None = None

    def label(self) -> str:
        return f"{self.phase} layer {self.layer} {self.name} ({self.op})"


@dataclasses.dataclass
class AttentionCall:
    """One layer's attention: its ``qkv [B*S, ...]`` input, its output, the cache's keys and values
    ``[B, kv_heads_local, keys, head_dim]`` after the call, the position of the step's first token."""

    phase: str
    layer: int
    qkv: torch.Tensor
    out: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    start: int
    batch: int
    seq: int


class Capture:
    """``with Capture(model) as cap:`` records ``cap.gemms`` and ``cap.attention`` of the calls made
    inside, labelled with ``cap.phase`` (set it before each call); module docstring."""

    def __init__(self, model) -> None:
        self.model = model
        self.phase = ""
        self.gemms: list[GemmCall] = []
        self.attention: list[AttentionCall] = []
        self._pending: tuple | None = None
        self._saved: list[tuple] = []

    def __enter__(self) -> "Capture":
        m = self.model
        self._names = {getattr(layer, n).data_ptr(): (i, n) for i, layer in enumerate(m.layers) for n in FP8_WEIGHTS}
        self._saved = [(Float8Weight, "operands", Float8Weight.operands),
                       (decoder_layer, "matmul", decoder_layer.matmul),
                       (inference, "gemm_all_reduce", inference.gemm_all_reduce), (m, "ops", m.ops)]
        Float8Weight.operands = self._operands(Float8Weight.operands)
        decoder_layer.matmul = self._gemm("matmul", decoder_layer.matmul)
        inference.gemm_all_reduce = self._gemm("gemm_all_reduce", inference.gemm_all_reduce)
        m.ops = dataclasses.replace(m.ops, all_gather_gemm=self._gemm("all_gather_gemm", m.ops.all_gather_gemm),
                                    gemm_reduce_scatter=self._gemm("gemm_reduce_scatter", m.ops.gemm_reduce_scatter))
        for i, layer in enumerate(m.layers):
            layer.attention = self._attention(i, layer.attention)  # an instance attribute over the method
        return self

    def __exit__(self, kind, value, tb) -> None:
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        for layer in self.model.layers:
            del layer.attention
        if kind is None and self._pending is not None:
            raise AssertionError(f"{self._pending[-1].label()}: a cast whose operands reached no GEMM")

    def _operands(self, operands):
        def wrapped(weight, x):
            a, b, fp8 = operands(weight, x)
            if self._pending is not None:
                raise AssertionError(f"{self._pending[-1].label()}: cast again before its GEMM ran")
            layer, name = self._names[weight.data.data_ptr()]
            call = GemmCall(self.phase, layer, name, *map(snapshot, (x, a, fp8["scale_a"], b, fp8["scale_b"])))
            self._pending = (a, b, fp8["scale_a"], fp8["scale_b"], call)
            return a, b, fp8
        return wrapped

    def _gemm(self, op: str, gemm):
        def wrapped(a, b, *args, **kw):
            if not (isinstance(a, torch.Tensor) and a.dtype in FLOAT8):
                return gemm(a, b, *args, **kw)  # the LM head
            if self._pending is None:
                raise AssertionError(f"{op}: float8 operands that no cast of a layer weight produced")
            pa, pb, psa, psb, call = self._pending
            self._pending = None
            if not (a is pa and b is pb and kw.get("scale_a") is psa and kw.get("scale_b") is psb):
                raise AssertionError(f"{call.label()} ({op}): operands other than those the cast produced")
            call.op, call.bias = op, snapshot(kw.get("bias"))
            call.residual, call.norm_weight = snapshot(kw.get("residual")), snapshot(kw.get("norm_weight"))
            call.eps = kw.get("eps", 0.0)
            out = gemm(a, b, *args, **kw)
            if op == "gemm_all_reduce":
                call.normed, call.out = snapshot(out[0]), snapshot(out[1])
            else:
                call.out = snapshot(out)
            self.gemms.append(call)
            return out
        return wrapped

    def _attention(self, index: int, attention):
        def wrapped(qkv, cache, i, step):
            start, qkv_in = cache.length, snapshot(qkv)
            out = attention(qkv, cache, i, step)
            keys = step.allowed.shape[-1]
            self.attention.append(AttentionCall(self.phase, index, qkv_in, snapshot(out),
                                                snapshot(cache.k[i, :, :, :keys]), snapshot(cache.v[i, :, :, :keys]),
                                                start, step.batch, step.seq))
            return out
        return wrapped


# -- the checks ------------------------------------------------------------------------------------------

def local_weights(state: dict, config, scaling: str, world: int, rank: int, layer: int, dtype) -> dict:
    """float64 of torch's quantization of each checkpoint weight of ``layer`` (as loaded, in ``dtype``),
    cut to ``rank``'s part in the decoder's layout ``[N/W, K]`` / ``[N, K/W]``: q and k rows of a head
    interleaved (row 2i of a head is the checkpoint's row i, row 2i+1 its row i + head_dim/2)."""
    groups, hd = GROUPS[scaling][1], config.head_dim
    p = f"model.layers.{layer}."

    def deq(name: str) -> torch.Tensor:
        q, scale = quantize32(state[p + name].to(dtype).float(), groups, E4M3, False)
        return q.double() * expand_scale(scale, groups, *q.shape).double()

    pairs = torch.arange(hd).view(2, hd // 2).t().reshape(-1)

    def heads(w: torch.Tensor, first: int, n: int, rotate: bool) -> torch.Tensor:
        rows = w[first * hd:(first + n) * hd].reshape(n, hd, -1)
        return (rows[:, pairs] if rotate else rows).reshape(n * hd, -1)

    hl, kvl = config.heads // world, max(1, config.kv_heads // world)
    q0, kv0, f = rank * hl, rank * config.kv_heads // world, config.ffn // world
    f0 = rank * f
    return {"qkv": torch.cat([heads(deq("self_attn.q_proj.weight"), q0, hl, True),
                              heads(deq("self_attn.k_proj.weight"), kv0, kvl, True),
                              heads(deq("self_attn.v_proj.weight"), kv0, kvl, False)]),
            "o": deq("self_attn.o_proj.weight")[:, q0 * hd:(q0 + hl) * hd],
            "gate_up": torch.cat([deq("mlp.gate_proj.weight")[f0:f0 + f], deq("mlp.up_proj.weight")[f0:f0 + f]]),
            "down": deq("mlp.down_proj.weight")[:, f0:f0 + f]}


def _gemm_reference(call: GemmCall, operands: list, scaling: str, rank: int, world: int):
    """``(ref, magnitude, K)``: float64 of the call's result from every rank's operands ``(a, scale_a, b,
    scale_b)``, the sum of the magnitudes of its terms, and the length of its whole contraction."""
    parts = [(dequantize_a(a, sa, scaling), dequantize_b(b, sb, scaling)) for a, sa, b, sb in operands]
    a_own, b_own = parts[rank]
    if call.op == "matmul":
        ref, mag, k = a_own @ b_own, a_own.abs() @ b_own.abs(), a_own.shape[1]
    elif call.op == "all_gather_gemm":
        a_all = torch.cat([a for a, _ in parts])
        ref, mag, k = a_all @ b_own, a_all.abs() @ b_own.abs(), a_all.shape[1]
    else:  # the row-parallel forms: a sum over the ranks' K slices
        ref = sum(a @ b for a, b in parts)
        mag = sum(a.abs() @ b.abs() for a, b in parts)
        k = sum(a.shape[1] for a, _ in parts) + world
        if call.op == "gemm_reduce_scatter":
            rows = ref.shape[0] // world
            ref, mag = ref[rank * rows:(rank + 1) * rows], mag[rank * rows:(rank + 1) * rows]
    if call.bias is not None:
        ref, mag = ref + call.bias.double(), mag + call.bias.double().abs()
    if call.residual is not None:
        ref, mag = ref + call.residual.double(), mag + call.residual.double().abs()
    return ref, mag, k


def _attention_reference(call: AttentionCall, config, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [B*S, hl*hd], new keys and values [B, 2 kvl, S, hd])`` in float64 from the call's own
    ``qkv`` and cache: interleaved RoPE at positions ``start ..``, causal softmax attention, each query
    head reading key/value head ``head // (hl / kvl)``."""
    hd, b, s = config.head_dim, call.batch, call.seq
    hl, kvl = config.heads // world, max(1, config.kv_heads // world)
    q, k, v = call.qkv.double().split([hl * hd, kvl * hd, kvl * hd], dim=1)
    pos = torch.arange(call.start, call.start + s, dtype=torch.float64)
    angle = pos[:, None] * config.rope_theta ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)[None, :]
    cos, sin = angle.cos()[None, :, None], angle.sin()[None, :, None]

    def rope(t: torch.Tensor, heads: int) -> torch.Tensor:
        pairs = t.reshape(b, s, heads, hd // 2, 2)
        x1, x2 = pairs[..., 0], pairs[..., 1]
        return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), -1).reshape(b, s, heads, hd).transpose(1, 2)

    q, k, v = rope(q, hl), rope(k, kvl), v.reshape(b, s, kvl, hd).transpose(1, 2)
    keys, values = call.k.double(), call.v.double()
    group = hl // kvl
    scores = q @ keys.repeat_interleave(group, 1).transpose(-1, -2) / math.sqrt(hd)   # [B, hl, S, keys]
    allowed = torch.arange(keys.shape[2])[None, :] <= (call.start + torch.arange(s))[:, None]
    weights = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    out = (weights @ values.repeat_interleave(group, 1)).transpose(1, 2).reshape(b * s, hl * hd)
    return out, torch.cat([k, v], dim=1)


def check(cap: Capture, state: dict, config, scaling: str, *, world: int, rank: int, dtype) -> dict:
    """Every captured call checked (module docstring). Collective (the ranks exchange their operands).
    Returns: ``casts`` and ``weights`` (labels of the calls whose float8 activation / weight operand
    differs from torch's quantization: empty when all are equal bit for bit), ``gemm`` (the worst
    relative Frobenius error of a GEMM output against float64 of its operands), ``gemm_fp32`` and
    ``gemm_mma`` (the worst ratio of an element's error to its ``fp8_checks.bounds``: at most 1 when every
    element is within), ``worst`` (the call with the worst ``gemm_fp32``), ``norm`` (the fused RMSNorm's
    worst relative error), ``attention`` and ``cache`` (the attention's), ``calls``: ``(phase, layer,
    name, op)`` of every GEMM in order."""
    if config.qk_norm or config.qkv_bias or config.rope_scaling is not None:
        raise ValueError("the captured checks cover layers without q/k norms, biases or RoPE scaling")
    gemms = [to_cpu(c) for c in cap.gemms]
    everyone = exchange([(c.a, c.scale_a, c.b, c.scale_b) for c in gemms])
    if len({len(ops) for ops in everyone}) != 1:
        raise AssertionError(f"the ranks ran different numbers of float8 GEMMs: {[len(o) for o in everyone]}")
    weights = {i: local_weights(state, config, scaling, world, rank, i, dtype) for i in range(config.layers)}
    a_groups = GROUPS[scaling][0]
    worst = Worst()
    out = {"casts": [], "weights": [], "norm": 0.0, "attention": 0.0, "cache": 0.0,
           "calls": [(c.phase, c.layer, c.name, c.op) for c in gemms]}
    for j, call in enumerate(gemms):
        q, scale = quantize32(call.x.float(), a_groups, E4M3, False)
        if not (torch.equal(call.a.view(torch.uint8), q.view(torch.uint8)) and torch.equal(call.scale_a, scale)):
            out["casts"].append(call.label())
        if not torch.equal(dequantize_b(call.b, call.scale_b, scaling).t(), weights[call.layer][call.name]):
            out["weights"].append(call.label())
        ref, mag, k = _gemm_reference(call, [ops[j] for ops in everyone], scaling, rank, world)
        worst.add(call.label(), call.out, ref, (call.out.double() - ref).abs(),
                  *bounds(call.out.dtype, ref, mag, k, reduced=call.op in ROW_PARALLEL))
        if call.normed is not None:
            h = call.out.double()
            normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + call.eps) * call.norm_weight.double()
            out["norm"] = max(out["norm"], rel(call.normed, normed))
    for call in map(to_cpu, cap.attention):
        ref, new = _attention_reference(call, config, world)
        out["attention"] = max(out["attention"], rel(call.out, ref))
        got = torch.cat([call.k, call.v], dim=1)[:, :, call.start:call.start + call.seq]
        out["cache"] = max(out["cache"], rel(got, new))
    return {**out, **worst.keys()}


def expected_calls(phases: list[tuple[str, bool]], layers: int) -> list[tuple[str, int, str, str]]:
    """``(phase, layer, name, op)`` of every float8 GEMM of steps ``(phase, sequence_parallel)``, in order."""
    ops = {True: ("all_gather_gemm", "gemm_reduce_scatter"), False: ("matmul", "gemm_all_reduce")}
    return [(phase, i, name, ops[sp][name in ("o", "down")]) for phase, sp in phases for i in range(layers)
            for name in FP8_WEIGHTS]
