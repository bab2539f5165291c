"""Where the TP MoE layer's time goes on one GPU (world size 1): per-kernel CUDA time of one forward +
backward of ``TPMoE`` (torch.profiler, averaged over calls), the layer's fwd and fwd+bwd times (CUDA
events, back to back), and the pieces alone: layer 0 with the SwiGLU epilogue, the top-k reduce, the
weight-gradient kernel against ``torch._grouped_mm`` on expert-ordered copies. Prints a table; writes
profile.json to argv[1]. Run by hand: ``PYTHONPATH=src python3 bench/probes/moe_profile.py OUT [MODELS
[TOKENS [ROUTINGS [RECIPES]]]]`` (comma lists; routings ``uniform`` and ``zipf``, as the benchmark's: the
kernels that lose to skewed routing show side by side; recipes ``bf16`` and the FP8 ones, ``tensorwise``,
``rowwise``, ``blockwise``: ``TPMoE(fp8=Float8Recipe.<recipe>())``, the weight-gradient pieces bf16 only)."""
import json
import sys

import torch
import torch.distributed as dist

from tileweave.bench.moe import MODELS, Inputs, Row, _layer_module
from tileweave.nn.fp8 import Float8Recipe
from tileweave.nn.moe_autograd import TILEWEAVE_OPS
from tileweave.ops.compute.grouped_wgrad import grouped_wgrad
from tileweave.testing.emulated import run_ranks


def _time(fn, iters=20, reps=5):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / iters)
    return sorted(times)[len(times) // 2]


def probe(rank, world, models, tokens, routings=("uniform",), recipes=("bf16",)):
    group = dist.group.WORLD
    device = torch.device("cuda", torch.cuda.current_device())
    dtype = torch.bfloat16
    out = []
    for model, t, routing, recipe in ((m, t, r, c) for m in models for t in tokens for r in routings for c in recipes):
        row = Row(model, t, routing, "layer-bwd")
        inp = Inputs(row, rank=rank, world=world, smoke=False, dtype=dtype, device=device)
        fp8 = None if recipe == "bf16" else getattr(Float8Recipe, recipe)()
        layer = _layer_module(inp, TILEWEAVE_OPS, group, dtype, device, fp8)
        x = inp.x_shard.clone().requires_grad_(True)

        def fwd():
            with torch.no_grad():
                layer(x)

        def fwd_bwd():
            # as the benchmark's layer-bwd: gradients written, not accumulated into earlier ones
            x.grad = None
            layer.zero_grad(set_to_none=True)
            layer(x).backward(inp.dout_shard)

        entry = {"model": model, "T": t, "routing": routing, "recipe": recipe, "fwd_ms": _time(fwd), "fwd_bwd_ms": _time(fwd_bwd)}
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                fwd_bwd()
            torch.cuda.synchronize()
        kernels = {}
        for ev in prof.key_averages():
            if ev.device_type == torch.autograd.DeviceType.CUDA:
                kernels[ev.key[:90]] = (ev.device_time_total / 5 / 1e3, ev.count // 5)
        entry["kernels"] = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:25]
        if fp8 is not None:
            out.append(entry)
            _report(entry)
            del layer, x, inp
            torch.cuda.empty_cache()
            continue
        # The weight gradient alone: ours against torch._grouped_mm on expert-ordered copies.
        plan = TILEWEAVE_OPS.plan(inp.ids_shard, inp.e, group)
        xg = inp.x_shard
        dy = torch.randn(plan.rows, 2 * inp.f_loc, device=device, dtype=dtype)
        entry["wgrad_ours_ms"] = _time(lambda: grouped_wgrad(dy, xg, plan.offsets, experts=inp.e,
                                                             rhs_rows=plan.row_token))
        order = torch.argsort(plan.row_expert, stable=True)
        ends = torch.cumsum(plan.splits, 0, dtype=torch.int32)
        lhs, rhs = dy[order], xg[plan.row_token.long()][order]
        entry["wgrad_grouped_mm_ms"] = _time(lambda: torch._grouped_mm(lhs.t(), rhs, offs=ends))
        ref = torch._grouped_mm(lhs.t(), rhs, offs=ends).float()
        got = grouped_wgrad(dy, xg, plan.offsets, experts=inp.e, rhs_rows=plan.row_token).float()
        entry["wgrad_rel_err"] = ((got - ref).norm() / ref.norm()).item()
        out.append(entry)
        _report(entry)
        del layer, x, inp
        torch.cuda.empty_cache()
    return out


def _report(entry):
    line = f"{entry['model']} T={entry['T']} {entry['routing']} {entry['recipe']}: fwd {entry['fwd_ms']:.3f} ms, " \
           f"fwd+bwd {entry['fwd_bwd_ms']:.3f} ms"
    if "wgrad_ours_ms" in entry:
        line += f"; wgrad ours {entry['wgrad_ours_ms']:.3f} vs grouped_mm {entry['wgrad_grouped_mm_ms']:.3f} " \
                f"(err {entry['wgrad_rel_err']:.1e})"
    print(line, flush=True)
    for name, (ms, count) in entry["kernels"]:
        print(f"    {ms:8.3f} ms  x{count:<3d} {name}", flush=True)


if __name__ == "__main__":
    models = sys.argv[2].split(",") if len(sys.argv) > 2 else ["qwen3-30b-a3b", "deepseek-v2-lite", "mixtral-8x7b"]
    tokens = [int(v) for v in sys.argv[3].split(",")] if len(sys.argv) > 3 else [16384]
    routings = tuple(sys.argv[4].split(",")) if len(sys.argv) > 4 else ("uniform",)
    recipes = tuple(sys.argv[5].split(",")) if len(sys.argv) > 5 else ("bf16",)
    result = run_ranks(1, probe, models, tokens, routings, recipes, gpus=True, heap_bytes=64 << 20)[0]
    with open(f"{sys.argv[1]}/profile.json", "w") as f:
        json.dump(result, f, indent=1)
