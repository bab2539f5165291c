"""Per-rank checks of the TP decoder's FP8 inference, run on emulated ranks by the CPU tests (and on
GPUs by the GPU tests), with a float64 reference of the same quantized math written apart from the
library: ``tileweave.testing.decoder_reference`` (an unsharded decoder sharing no code with
``tileweave.nn``) with every layer's linear replaced by the float64 product of its operands quantized
by ``support.fp8_reference.qdq32`` (torch reductions and torch's own float8 cast). The weights are
quantized per checkpoint tensor (q_proj, k_proj, ...) in its Hugging Face layout, the activations per
token (rowwise) or per 1 x 128 block of a token (blockwise); the input of a row-parallel linear (o_proj,
down_proj) is quantized by each rank on its own slice of the features, so per token and rank slice;
the LM head is exact.

That end-to-end comparison holds only where every activation before a cast is the reference's to the
last bit (the CPU); ``fp8_decoder_gemm_check`` checks each cast and each GEMM on its own instead
(``support.fp8_decoder_capture``), and the logits against the exact model within a bound derived from
the quantization's own effect (``END_TO_END_FACTOR``), which holds on any hardware.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

import tileweave
from support import fp8_decoder_capture as capture
from support.fp8_checks import GROUPS, end_to_end
from support.fp8_reference import E4M3, qdq32
from tileweave.nn.decoder import DecoderConfig, MoEConfig, TPDecoder
from tileweave.testing.decoder_reference import random_state_dict, reference_generate, reference_logits

END_TO_END_FACTOR = 1.5
"""The FP8 model's logits may be at most this many times farther from the exact float64 model than the
float64 reference of the same quantized math is (the quantization's own effect, ``fp8_checks.end_to_end``'s
``effect``). A float32-level difference before a cast flips some activations by a whole float8 step, so
a correct model on other hardware is another draw of the same quantization error, not a smaller one:
on the CPU, relative noise of 1e-5 to 1e-2 on every quantized linear's input moved the reference's
distance from the exact model to 0.83-1.33 times the effect (both scalings, one and two ranks, 20
models and seeds); one layer's o_proj scales doubled moved it to 5.6-8.4 times."""
EFFECT_MAX = 0.25
"""The effect must stay well under 1 (logits unrelated to the exact ones are about 1.4 away), so that
``END_TO_END_FACTOR`` times it still tells a working model from a broken one."""


def quantized_linear(scaling: str, world: int):
    """``linear(x, name, w)`` for ``reference_logits``: float64 of the quantized operands (layer
    weights only; the LM head exact) at ``world`` ranks."""
    a_groups, w_groups = GROUPS[scaling]

    def linear(x: torch.Tensor, name: str, w: torch.Tensor) -> torch.Tensor:
        if name == "lm_head.weight":
            return x @ w.T
        rows = x.reshape(-1, x.shape[-1]).float()
        parts = world if name.endswith(("o_proj.weight", "down_proj.weight")) else 1
        xq = torch.cat([qdq32(p, a_groups, E4M3, False) for p in rows.chunk(parts, dim=1)], dim=1)
        return xq.double().reshape(x.shape) @ qdq32(w.float(), w_groups, E4M3, False).double().T
    return linear


def config_for(scaling: str, world: int, layers: int) -> DecoderConfig:
    """Rowwise: a small model with grouped-query attention; blockwise: the smallest whose every rank's
    part of every weight is whole 128 x 128 blocks at one and two ranks (head_dim 128)."""
    if scaling == "rowwise":
        kv = max(2, world)
        return DecoderConfig(vocab=16 * world, hidden=16 * kv, layers=layers, heads=2 * kv, kv_heads=kv,
                             ffn=24 * world, rope_theta=10000.0, max_seq=16)
    return DecoderConfig(vocab=16 * world, hidden=256, layers=layers, heads=2, kv_heads=2, ffn=256,
                         rope_theta=10000.0, max_seq=16)


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    got, ref = got.detach().double().cpu(), ref.detach().double().cpu()
    if not torch.isfinite(got).all():
        return float("inf")
    return ((got - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _same_on_every_rank(t: torch.Tensor) -> bool:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return all(torch.equal(p, parts[0]) for p in parts)


def fp8_decoder_check(rank: int, world: int, scaling: str, batch: int, chunks: list[int], steps: int, layers: int,
                      seed: int, convert: bool = False, dtype: str = "float32") -> dict:
    """The FP8 decoder against the float64 reference of its quantized math: the prompt prefilled in
    ``chunks`` (a chunk after the first attends to the cache; sequence-parallel where its rows divide
    by W), then ``steps`` decode steps fed the reference's greedy tokens. Returns the worst relative
    error of prefill and decode logits against the quantized reference (``prefill``, ``decode``) and
    against the exact one (``prefill_exact``, ``decode_exact``: the quantization's own effect), whether
    the logits were bitwise the same on every rank, the ops' paths, the float8 weights' dtypes, and
    whether ``full_state_dict`` gives back the dequantized weights. ``convert``: build the model in its
    dtype, load, then ``to_fp8`` (else ``TPDecoder(fp8=...)`` quantizes as it loads)."""
    device, dt = _device(), getattr(torch, dtype)
    c = config_for(scaling, world, layers)
    state = random_state_dict(c, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    prompt = torch.randint(0, c.vocab, (batch, sum(chunks)), generator=g)
    linear = quantized_linear(scaling, world)
    want = reference_generate(state, c, prompt, steps)
    full = torch.cat([prompt, want], dim=1)
    ref = reference_logits(state, c, full, linear=linear)
    exact = reference_logits(state, c, full)

    if convert:
        model = TPDecoder(c, device=device, dtype=dt)
        model.load_full_state_dict({k: v.to(dt) for k, v in state.items()})
        model.to_fp8(scaling)
    else:
        model = TPDecoder(c, device=device, dtype=dt, fp8=scaling)
        model.load_full_state_dict({k: v.to(dt) for k, v in state.items()})
    layer = model.layers[0]
    out: dict = {"prefill": 0.0, "decode": 0.0, "prefill_exact": 0.0, "decode_exact": 0.0, "same": True,
                 "paths": set(), "fp8": model.fp8,
                 "weights": sorted({str(layer.weight(n).data.dtype) for n in ("qkv", "o", "gate_up", "down")})}
    cache = model.new_cache(batch)
    start = 0
    for length in chunks:
        logits = model.prefill(full[:, start:start + length].to(device), cache)
        out["prefill"] = max(out["prefill"], _rel_err(logits, ref[:, start:start + length]))
        out["prefill_exact"] = max(out["prefill_exact"], _rel_err(logits, exact[:, start:start + length]))
        out["same"] &= _same_on_every_rank(logits)
        sp = (batch * length) % world == 0
        names = ("all_gather_gemm", "gemm_reduce_scatter") if sp else ("gemm_all_reduce",)
        out["paths"].add("prefill " + ", ".join(f"{n}={tileweave.last_path(n)}" for n in names))
        start += length
    for _ in range(steps):
        logits = model.decode(full[:, start].to(device), cache)
        out["decode"] = max(out["decode"], _rel_err(logits, ref[:, start]))
        out["decode_exact"] = max(out["decode_exact"], _rel_err(logits, exact[:, start]))
        out["same"] &= _same_on_every_rank(logits)
        out["paths"].add(f"decode gemm_all_reduce={tileweave.last_path('gemm_all_reduce')}")
        start += 1
    out["paths"] = sorted(out["paths"])
    # full_state_dict: the dequantized float8 weights, which the reference's quantizer reproduces
    back = model.full_state_dict()
    a_groups, w_groups = GROUPS[scaling]
    names = [n for n in state if n.endswith("_proj.weight")]
    out["state_dict"] = max(_rel_err(back[n], qdq32(state[n].float(), w_groups, E4M3, False)) for n in names)
    return out


def fp8_refusals_check(rank: int, world: int) -> dict[str, str]:
    """The FP8 decoder's refusals, each raised while the model is built (no kernel, no collective): the
    message per bad input."""
    out = {}

    def attempt(name, fn):
        try:
            fn()
        except ValueError as exc:
            out[name] = str(exc)
        else:
            out[name] = "no error"

    rowwise = config_for("rowwise", world, 1)
    block = config_for("blockwise", world, 1)
    attempt("scaling", lambda: TPDecoder(rowwise, fp8="tensorwise"))
    attempt("moe", lambda: TPDecoder(dataclasses.replace(rowwise, moe=MoEConfig(experts=4, top_k=2)), fp8="rowwise"))
    attempt("ffn", lambda: TPDecoder(dataclasses.replace(block, ffn=192 * world), fp8="blockwise"))
    attempt("hidden", lambda: TPDecoder(dataclasses.replace(block, hidden=320, head_dim=128), fp8="blockwise"))
    attempt("head_dim", lambda: TPDecoder(dataclasses.replace(block, heads=2 * world, kv_heads=world, hidden=256,
                                                              head_dim=256), fp8="blockwise"))
    model = TPDecoder(rowwise, fp8="rowwise")
    attempt("twice", lambda: model.to_fp8("rowwise"))
    attempt("convert", lambda: TPDecoder(rowwise).to_fp8("blockwise"))
    return out


def fp8_decoder_gemm_check(rank: int, world: int, scaling: str, batch: int, chunks: list[int], steps: int,
                           layers: int, seed: int, dtype: str = "float32", broken: tuple | None = None) -> dict:
    """The FP8 decoder run as ``fp8_decoder_check`` runs it (the prompt prefilled in ``chunks``, then
    ``steps`` decode steps fed the reference's greedy tokens) with every float8 GEMM and attention
    captured and checked on its own (``support.fp8_decoder_capture.check``: its keys); ``expected``:
    whether the GEMMs that ran are exactly those expected, in order (a chunk sequence-parallel where its
    rows divide by W); the end-to-end logits (``end_to_end``: its keys); ``same`` and ``state_dict`` as
    in ``fp8_decoder_check``. ``broken = (layer, name, factor)``: that float8 weight's scales multiplied
    by ``factor`` after loading, a deliberate bug."""
    device, dt = _device(), getattr(torch, dtype)
    c = config_for(scaling, world, layers)
    state = random_state_dict(c, seed=seed)
    prompt = torch.randint(0, c.vocab, (batch, sum(chunks)), generator=torch.Generator().manual_seed(seed + 1))
    full = torch.cat([prompt, reference_generate(state, c, prompt, steps)], dim=1)
    ref = reference_logits(state, c, full, linear=quantized_linear(scaling, world))
    exact = reference_logits(state, c, full)
    model = TPDecoder(c, device=device, dtype=dt, fp8=scaling)
    model.load_full_state_dict({k: v.to(dt) for k, v in state.items()})
    if broken is not None:
        layer, name, factor = broken
        getattr(model.layers[layer], name + "_scale").mul_(factor)
    got, refs, exacts, phases = [], [], [], []
    cache = model.new_cache(batch)
    start = 0
    with capture.Capture(model) as cap:
        for i, length in enumerate(chunks):
            cap.phase = f"prefill {i}"
            phases.append((cap.phase, (batch * length) % world == 0))
            got.append(model.prefill(full[:, start:start + length].to(device), cache))
            refs.append(ref[:, start:start + length])
            exacts.append(exact[:, start:start + length])
            start += length
        for i in range(steps):
            cap.phase = f"decode {i}"
            phases.append((cap.phase, False))
            got.append(model.decode(full[:, start].to(device), cache))
            refs.append(ref[:, start])
            exacts.append(exact[:, start])
            start += 1
    out = capture.check(cap, state, c, scaling, world=world, rank=rank, dtype=dt)
    out["expected"] = out["calls"] == capture.expected_calls(phases, layers)
    out.update(end_to_end(got, refs, exacts))
    out["same"] = all([_same_on_every_rank(g) for g in got])  # a list: every rank makes every collective
    back = model.full_state_dict()
    w_groups = GROUPS[scaling][1]
    out["state_dict"] = max(_rel_err(back[n], qdq32(state[n].to(dt).float(), w_groups, E4M3, False))
                            for n in state if n.endswith("_proj.weight"))
    return out


def fp8_graph_decode_check(rank: int, world: int, scaling: str, dtype: str, steps: int, seed: int) -> dict:
    """On GPUs: the FP8 decoder's decode steps captured once in a CUDA graph and replayed
    (``generation.DecodeStep(cuda_graph=True)``, graphable ops), teacher-forced with the reference's
    tokens, against the same steps run eagerly on a second cache (``graph_vs_eager``) and against the
    float64 references (``end_to_end``'s keys, of the graph's logits); the eager prefill and steps with
    every float8 GEMM and attention checked on its own (``support.fp8_decoder_capture.check``'s keys,
    ``expected``); whether a graph was captured and replayed (``captured``)."""
    from tileweave.nn.generation import DecodeStep

    device, dt = _device(), getattr(torch, dtype)
    c = dataclasses.replace(config_for("blockwise", world, 2), vocab=64 * world, max_seq=32)
    state = random_state_dict(c, seed=seed)
    prompt = torch.randint(0, c.vocab, (4, 8), generator=torch.Generator().manual_seed(seed + 1))
    want = reference_generate(state, c, prompt, steps)
    full = torch.cat([prompt, want], dim=1)
    ref = reference_logits(state, c, full, linear=quantized_linear(scaling, world))
    exact = reference_logits(state, c, full)
    model = TPDecoder(c, device=device, dtype=dt, fp8=scaling)
    model.load_full_state_dict({k: v.to(dt) for k, v in state.items()})
    graph_cache, eager_cache = model.new_cache(4), model.new_cache(4)
    model.prefill(prompt.to(device), graph_cache)
    cap = capture.Capture(model)
    phases = [("prefill", (4 * 8) % world == 0)]
    with cap:
        cap.phase = "prefill"
        model.prefill(prompt.to(device), eager_cache)
    step = DecodeStep(model, graph_cache, cuda_graph=True)
    out = {"graph_vs_eager": 0.0}
    got, refs, exacts = [], [], []
    for i in range(steps):
        tokens = full[:, prompt.shape[1] + i].to(device)
        logits = step(tokens)
        with cap:  # the eager step only: nothing is wrapped while the graph is captured or replayed
            cap.phase = f"decode {i}"
            phases.append((cap.phase, False))
            eager = model.decode(tokens, eager_cache)
        at = prompt.shape[1] + i
        got.append(logits.clone())
        refs.append(ref[:, at])
        exacts.append(exact[:, at])
        out["graph_vs_eager"] = max(out["graph_vs_eager"], _rel_err(logits, eager))
    out.update(capture.check(cap, state, c, scaling, world=world, rank=rank, dtype=dt))
    out["expected"] = out["calls"] == capture.expected_calls(phases, c.layers)
    out.update(end_to_end(got, refs, exacts))
    out["captured"] = step.graph is not None and step.eager_steps == 1
    return out
