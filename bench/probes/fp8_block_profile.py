"""Where the TP block's training step goes on one GPU (world size 1), bf16 against each FP8 recipe:
per-kernel CUDA time of one forward + backward + AdamW step (torch.profiler, averaged over steps),
summed into kinds (the GEMMs, quantization, attention, norms and elementwise, the optimizer), and the
step's time with CUDA events. Prints a table; writes block_profile.json to argv[1]. Run by hand:
``PYTHONPATH=src python3 bench/probes/fp8_block_profile.py OUT [RECIPES [MODEL [TOKENS]]]``
(RECIPES comma-separated from bf16, tensorwise, rowwise, blockwise; the suffix ``-fast`` accumulates the
backward GEMMs on the tensor cores; ``@torch``, e.g. ``blockwise@torch``: the same FP8 block on NCCL and
torch's scaled matmul, the ``block`` section's ``torch`` variant). ``fwd_bwd_ms``: forward + backward
alone (no optimizer, gradients set to None first), as the benchmark's block section times it. With
``TILEWEAVE_PROBE_TILES`` naming a ``quantize_tiles.json`` of ``fp8_block_parts.py``, the quantize
launches take its best tiles; with ``TILEWEAVE_PROBE_OPS=1`` the torch ops that launch the kernels are
listed too, by their own CUDA time and input shapes (which op makes the block's copies and elementwise
kernels, say)."""
import dataclasses
import json
import os
import sys

import torch
import torch.distributed as dist

from tileweave.bench import block_fp8
from tileweave.nn import BlockConfig, Float8Recipe, TPTransformerBlock
from tileweave.testing.emulated import run_ranks

WIDTHS = {"8b": dict(hidden=4096, heads=32, kv_heads=8, ffn=14336),
          "70b": dict(hidden=8192, heads=64, kv_heads=8, ffn=28672)}
KINDS = (  # first match wins; kernel names lower-cased
    ("quantize", ("quant", "amax", "_cast", "scale_kernel")),
    ("attention", ("flash", "attention", "fmha", "sdpa")),
    ("gemm-fp8", ("fp8", "scaled", "sm90_xmma_gemm_e4m3", "e4m3", "qqtst", "ablk128")),
    ("gemm", ("gemm", "matmul", "nvjet", "cutlass", "xmma", "sm90_")),
    ("optimizer", ("adam", "multi_tensor", "foreach")),
    ("norm", ("norm",)),
    ("copy", ("copy", "memcpy", "memset", "fill")),
)


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, keys in KINDS:
        if any(key in low for key in keys):
            return kind
    return "elementwise/other"


def probe(rank, world, recipes, model, tokens, steps=5):
    device = torch.device("cuda", torch.cuda.current_device())
    config = BlockConfig(**WIDTHS[model])
    batch = 2
    gen = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(tokens, config.hidden, device=device, dtype=torch.bfloat16, generator=gen)
    target = torch.randn(tokens, config.hidden, device=device, dtype=torch.bfloat16, generator=gen)
    dy = torch.randn(tokens, config.hidden, device=device, dtype=torch.bfloat16, generator=gen) * tokens ** -0.5
    if os.environ.get("TILEWEAVE_PROBE_TILES"):
        from tileweave.ops.compute import quantize as quantize_mod
        with open(os.environ["TILEWEAVE_PROBE_TILES"]) as fh:
            best = {kind: tuple(v["tiles"]) for kind, v in json.load(fh).items()}
        real = quantize_mod.tiles_of

        def tiles_of(group, stride_xr, stride_xc, *, interpreter):
            kind = group if not (stride_xr == 1 and stride_xc != 1) else f"{group}_t"
            return best.get(kind) or real(group, stride_xr, stride_xc, interpreter=interpreter)

        quantize_mod.tiles_of = tiles_of
        print(f"quantize tiles: {best}", flush=True)
    out = []
    for name in recipes:
        recipe, ops = None, None
        scaling, _, theirs = name.partition("@")
        if scaling != "bf16":
            base, fast = scaling.removesuffix("-fast"), scaling.endswith("-fast")
            recipe = dataclasses.replace(getattr(Float8Recipe, base)(), backward_fast_accum=fast)
        if theirs == "torch":
            mm, why = block_fp8.torch_matmul(scaling, device)
            assert mm is not None, why
            ops = block_fp8.fp8_ops(mm)
        torch.manual_seed(0)
        block = TPTransformerBlock(config, device=device, dtype=torch.bfloat16, fp8=recipe, ops=ops)
        opt = torch.optim.AdamW(block.parameters(), lr=1e-4)

        def step():
            loss = torch.nn.functional.mse_loss(block(x, batch).float(), target.float())
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        xg = x.detach().requires_grad_(True)

        def fwd_bwd():  # as the block section's step: the input's gradient too
            for p in block.parameters():
                p.grad = None
            xg.grad = None
            block(xg, batch).backward(dy)

        for _ in range(3):
            step()
            fwd_bwd()
        torch.cuda.synchronize()
        times, fb_times = [], []
        for _ in range(steps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
            start.record()
            fwd_bwd()
            end.record()
            torch.cuda.synchronize()
            fb_times.append(start.elapsed_time(end))
        ops_too = os.environ.get("TILEWEAVE_PROBE_OPS") == "1"
        activities = [torch.profiler.ProfilerActivity.CUDA] + ([torch.profiler.ProfilerActivity.CPU] if ops_too else [])
        with torch.profiler.profile(activities=activities, record_shapes=ops_too) as prof:
            for _ in range(3):
                step()
            torch.cuda.synchronize()
        kernels, kinds = {}, {}
        for ev in prof.key_averages():
            if ev.device_type == torch.autograd.DeviceType.CUDA and ev.device_time_total > 0:
                ms = ev.device_time_total / 3 / 1e3
                kernels[ev.key[:100]] = (ms, ev.count // 3)
                kinds[kind_of(ev.key)] = kinds.get(kind_of(ev.key), 0.0) + ms
        entry = {"recipe": name, "model": model, "tokens": tokens, "step_ms": sorted(times)[len(times) // 2],
                 "fwd_bwd_ms": sorted(fb_times)[len(fb_times) // 2],
                 "kinds_ms": dict(sorted(kinds.items(), key=lambda kv: -kv[1])),
                 "kernels": sorted(kernels.items(), key=lambda kv: -kv[1][0])[:30]}
        if ops_too:  # which torch ops launch the kernels, by their own CUDA time and input shapes
            ops = [(ev.self_device_time_total / 3 / 1e3, ev.count // 3, ev.key, str(ev.input_shapes)[:80])
                   for ev in prof.key_averages(group_by_input_shape=True)
                   if ev.device_type == torch.autograd.DeviceType.CPU and ev.key.startswith("aten::")
                   and ev.self_device_time_total > 0]
            entry["ops"] = sorted(ops, reverse=True)[:30]
        out.append(entry)
        print(f"{name}: fwd+bwd {entry['fwd_bwd_ms']:.2f} ms, step {entry['step_ms']:.2f} ms (kernel sum {sum(kinds.values()):.2f} ms): "
              + ", ".join(f"{k} {v:.2f}" for k, v in entry["kinds_ms"].items()), flush=True)
        for kname, (ms, count) in entry["kernels"][:30]:
            print(f"    {ms:8.3f} ms  x{count:<3d} {kname}", flush=True)
        for ms, count, op, shapes in entry.get("ops", []):
            print(f"    op {ms:8.3f} ms  x{count:<3d} {op} {shapes}", flush=True)
        del block, opt
        torch.cuda.empty_cache()
    dist.barrier()
    return out


if __name__ == "__main__":
    recipes = sys.argv[2].split(",") if len(sys.argv) > 2 else ["bf16", "tensorwise", "rowwise", "blockwise"]
    model = sys.argv[3] if len(sys.argv) > 3 else "70b"
    tokens = int(sys.argv[4]) if len(sys.argv) > 4 else 8192
    result = run_ranks(1, probe, recipes, model, tokens, gpus=True, heap_bytes=64 << 20)[0]
    with open(f"{sys.argv[1]}/block_profile.json", "w") as f:
        json.dump(result, f, indent=1)
