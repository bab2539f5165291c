"""``TPMoE(fp8=...)`` on emulated ranks or GPUs: the layer's output and every gradient against float64 of
the same quantized math (``support.fp8_moe_layer_reference``) and against the exact layer, with every
cast and GEMM of its forward and backward captured and checked on its own (``support.fp8_moe_capture``).

The comparison with the same quantized math holds only where every activation before a cast is the
reference's to the last bit (the CPU); the captured checks, and the results against the exact layer
within ``END_TO_END_FACTOR`` times the quantization's own effect, hold on any hardware.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from support import fp8_moe_capture as capture
from support.fp8_checks import end_to_end, rel
from support.fp8_moe_layer_reference import fp8_moe_reference
from support.moe_layer_reference import reference_moe_grads, routing_gap
from support.moe_layer_scenarios import LayerCase, ops_for, layer_state, layer_tokens
from tileweave.nn import moe_fp8
from tileweave.nn.moe import TPMoE
from tileweave.ops import common
from tileweave.ops.compute.quantize import Quantized
from tileweave.runtime.backend import set_producer_delay

KEYS = ("out", "dx", "d_w0", "d_w1", "d_router")
END_TO_END_FACTOR = 1.5
"""The FP8 layer's output and each gradient may be at most this many times farther from the exact
float64 layer than the float64 reference of the same quantized math is (the quantization's own effect,
``fp8_checks.end_to_end``'s ``effect``). A float32-level difference before a cast flips some elements by
a whole float8 step, so a correct layer on other hardware is another draw of the same quantization
error, not a smaller one: on the CPU, relative noise of 1e-5 to 1e-2 on the reference's ``h`` and
``dy`` before their casts (what a GPU computes otherwise; ``x`` and ``dO`` are the layer's inputs)
moved its distance from the exact layer to 0.92-1.14 times the effect (every recipe, the GPU tests'
cases and the CPU tests', ten seeds each); one expert's ``w0`` scales doubled in the forward moved it
to 13-43 times for the output and 5-46 times for the gradients."""
EFFECT_MAX = 0.25
"""The effect must stay well under 1 (results unrelated to the exact ones are about 1.4 away), so that
``END_TO_END_FACTOR`` times it still tells a working layer from a broken one."""


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def tp_moe_fp8_check(rank: int, world: int, recipe: str, case: LayerCase, broken: tuple | None = None,
                     broken_cast: float | None = None, broken_h: float | None = None) -> dict:
    """``TPMoE(fp8=recipe)`` for ``case.steps`` steps (fresh tokens and routing each), every call captured.
    Returns: ``steps`` (per step, the relative errors of ``KEYS`` against ``fp8_moe_reference``, and
    ``out_exact`` against the exact layer); ``end_to_end`` (per key of ``KEYS``, over the steps:
    ``fp8_checks.end_to_end``'s ``quantized``, ``exact``, ``effect``); ``support.fp8_moe_capture.check``'s
    keys; ``links`` (labels where the layer's output or a weight's gradient is not the captured GEMM's
    output: empty when all are); ``gap`` (``routing_gap``), ``dtypes`` (of the output and gradients),
    ``dtype``, ``paths``. ``broken = (expert, factor)``: that expert's scales of the forward's ``w0``
    operand multiplied by ``factor`` on every rank, a deliberate bug; ``broken_cast``: a factor on the
    scales of the ``w1`` weight gradient's ``dO`` operand (as cast along the tokens), another;
    ``broken_h``: a factor on the first scale of ``h``'s cast as layer 0's epilogue returns it, a third."""
    device, dtype = _device(), getattr(torch, case.dtype)
    state = {k: v.to(dtype).float() for k, v in layer_state(case).items()}  # the references see them rounded
    layer = TPMoE(case.hidden, case.ffn, case.experts, case.top_k, normalize_topk=case.normalize_topk,
                  save_gathered=case.save_gathered, ops=ops_for(case.policy, dist.group.WORLD), fp8=recipe,
                  device=device, dtype=dtype)
    layer.load_full_state_dict({k: v.to(device=device, dtype=dtype) for k, v in state.items()})
    rows = slice(rank * case.tokens // world, (rank + 1) * case.tokens // world)
    quantize_experts = moe_fp8.quantize_experts
    if broken is not None:
        expert, factor = broken

        def quantize_broken(r, w, *, transpose=False, scale=None):
            b, scale_b, own = quantize_experts(r, w, transpose=transpose, scale=scale)
            if w is layer.w0 and not transpose:  # the forward's operand
                scale_b = scale_b.clone()
                scale_b[expert] *= factor
            return b, scale_b, own
        moe_fp8.quantize_experts = quantize_broken
    expert_wgrad = moe_fp8.expert_wgrad
    if broken_cast is not None:
        def expert_wgrad_broken(r, lhs, rhs, experts, out_dtype):
            if (lhs.data.shape[0], rhs.data.shape[0]) == (case.hidden, layer.ffn_local):  # w1's: dO.T @ (wt * h)
                lhs = lhs._replace(scale=lhs.scale * broken_cast)
            return expert_wgrad(r, lhs, rhs, experts, out_dtype)
        moe_fp8.expert_wgrad = expert_wgrad_broken
    ops = layer.ops
    if broken_h is not None:
        def layer0_broken(*args, **kw):
            result = ops.layer0(*args, **kw)
            q = result[0] if isinstance(result, tuple) and not isinstance(result, Quantized) else result
            if isinstance(q, Quantized):  # h's cast (the backward's layer 0 returns a tensor)
                q.scale.view(-1)[:1] *= broken_h
            return result
        layer.ops = dataclasses.replace(ops, layer0=layer0_broken)
    results: dict = {"steps": [], "dtypes": set(), "links": []}
    got, refs, exacts = ({k: [] for k in KEYS} for _ in range(3))
    inputs = {}
    set_producer_delay(0.05 if rank == case.straggler else 0.0)
    try:
        with capture.Capture(layer) as cap:
            for step in range(case.steps):
                cap.phase = f"step {step}"
                x_full, dout = (t.to(dtype).float() for t in layer_tokens(case, step))
                results.setdefault("gap", routing_gap(x_full, state["router.weight"], case.top_k))
                layer.zero_grad(set_to_none=True)
                x = x_full[rows].clone().to(device=device, dtype=dtype).requires_grad_(True)
                dout_shard = dout[rows].to(device=device, dtype=dtype)
                out = layer(x)
                out.backward(dout_shard)
                layer.all_reduce_replicated_grads()
                inputs[cap.phase] = (x.detach().cpu(), dout_shard.cpu())
                mine = {"out": out, "dx": x.grad, "d_w0": layer.w0.grad, "d_w1": layer.w1.grad,
                        "d_router": layer.router.weight.grad}
                captured = cap.outputs(cap.phase)
                for key, name in (("out", "h @ w1"), ("d_w0", "w0 grad"), ("d_w1", "w1 grad")):
                    if name not in captured or not torch.equal(mine[key].detach(), captured[name].to(mine[key].dtype)):
                        results["links"].append(f"{cap.phase} {key}")
                ref = fp8_moe_reference(recipe, x_full, state, dout, case.top_k, world,
                                        normalize_topk=case.normalize_topk, dtype=dtype)[rank]
                exact = reference_moe_grads(x_full, state, dout, case.top_k, world=world, rank=rank,
                                            normalize_topk=case.normalize_topk)
                results["dtypes"] |= {str(mine[k].dtype) for k in ("out", "dx", "d_w0", "d_w1")}
                results["steps"].append({**{k: rel(mine[k], ref[k]) for k in KEYS},
                                         "out_exact": rel(out, exact["out"])})
                for k in KEYS:
                    got[k].append(mine[k].detach().cpu())
                    refs[k].append(ref[k])
                    exacts[k].append(exact[k])
    finally:
        set_producer_delay(0.0)
        moe_fp8.quantize_experts = quantize_experts
        moe_fp8.expert_wgrad = expert_wgrad
        layer.ops = ops
    results.update(capture.check(cap, state, scaling=layer.fp8.scaling, world=world, rank=rank, dtype=dtype,
                                 inputs=inputs))
    results["end_to_end"] = {k: end_to_end(got[k], refs[k], exacts[k]) for k in KEYS}
    results["dtypes"] = sorted(results["dtypes"])
    results["dtype"] = str(dtype)
    results["paths"] = (common.last_path("moe_all_gather_gemm"), common.last_path("moe_gemm_reduce_scatter"))
    return results
