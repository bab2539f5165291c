"""Where a TP block step spends its GPU time, per variant, on two GPUs: the step time (steady state, as
the ``block`` bench section), then a profile of a few steps summed by kernel class (GEMM, NCCL, peer
copies, attention, elementwise and the rest) and the largest kernels, so that two variants' steps can
be compared kernel by kernel.

    python3 bench/probes/block_probe.py [--out DIR] [--rows llama3-8b:8192,...] [--variants ours,torch,floor]

``--env KEY=VALUE,...`` sets tileweave options for the ``ours`` variants (for example
``TILEWEAVE_RS_TRANSPORT=chunked``). The variant ``ours+`` is ours with ``--patch
module.NAME=VALUE,...`` applied (module constants such as
``tileweave.ops.reduce_scatter.rule.MIN_CHUNKED_K_LOCAL=2048``), on fresh shared ops; ``ours=`` is ours on the
shared ops of the previous ours variant (no new workspaces). Variants may repeat, and ``churn`` and
``idle`` between them change the allocator's state or let the GPU cool (they time nothing), to find
what one variant leaves behind for the next: ``--variants torch,ours,floor,ours,churn,ours,idle,ours``.
``--host-profile`` adds, per variant, the host's time per step by function (cProfile over a few steps,
rank 0's top entries by own time): where a host-bound step's time goes.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import importlib
import json
import os
import pstats
import sys
import time
from unittest import mock

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "src"))

from tileweave.bench.block import BlockRow, block_variant, make_block_inputs  # noqa: E402
from tileweave.testing.emulated import run_ranks  # noqa: E402
from tileweave.tune.autotune import time_ms  # noqa: E402

CLASSES = (("nccl", ("nccl",)), ("copy", ("memcpy", "memset")), ("attention", ("flash", "fmha", "attention", "sdpa")),
           ("gemm", ("gemm", "nvjet", "sm90", "cutlass", "xmma", "matmul")),
           ("elementwise", ("elementwise", "vectorized", "reduce", "copy_kernel", "cat", "index")))


def _class(name: str) -> str:
    low = name.lower()
    for label, keys in CLASSES:
        if any(k in low for k in keys):
            return label
    return "other"


def _profile(step, steps: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    step(0)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(steps):
            step(i)
        torch.cuda.synchronize()
    by_class: dict[str, float] = {}
    kernels = []
    for e in prof.key_averages():
        total = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if not total or e.key.startswith("ProfilerStep"):
            continue
        us = total / steps
        kernels.append((e.key[:90], e.count // steps, round(us, 1)))
        by_class[_class(e.key)] = by_class.get(_class(e.key), 0.0) + us
    kernels.sort(key=lambda r: -r[2])
    return {"classes_us": {k: round(v, 1) for k, v in sorted(by_class.items())}, "kernels": kernels[:14]}


def _host_profile(step, steps: int, top: int = 25) -> list:
    """Host time per step by function: ``(function, calls per step, own us per step, cumulative us per
    step)``, the ``top`` largest by own time. The GPU queue is filled first, so that the host does not
    wait on an idle GPU; cProfile's own cost inflates every entry alike."""
    for i in range(3):
        step(i)
    profiler = cProfile.Profile()
    profiler.enable()
    for i in range(steps):
        step(i)
    profiler.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(profiler).stats
    rows = []
    for (path, line, func), (_, calls, own, cum, _) in stats.items():
        rows.append((f"{os.path.basename(path)}:{line}:{func}"[:80], round(calls / steps, 1),
                     round(own / steps * 1e6, 1), round(cum / steps * 1e6, 1)))
    rows.sort(key=lambda r: -r[2])
    total = round(sum(r[2] for r in rows), 1)
    return [("total", 0, total, total)] + rows[:top]


def _fresh_ops() -> None:
    from tileweave.ops.all_gather.op import AllGatherGemm
    from tileweave.ops.reduce_scatter.op import GemmReduceScatter

    AllGatherGemm._shared.clear()
    GemmReduceScatter._shared.clear()


@contextlib.contextmanager
def _patched(patch: dict[str, str]):
    """Module constants set from ``module.NAME=VALUE`` for the duration, then restored."""
    saved = []
    try:
        for target, value in patch.items():
            module_name, name = target.rsplit(".", 1)
            module = importlib.import_module(module_name)
            old = getattr(module, name)
            saved.append((module, name, old))
            setattr(module, name, type(old)(value))
        yield
    finally:
        for module, name, old in reversed(saved):
            setattr(module, name, old)


def _between(name: str) -> None:
    """Pseudo-variants that time nothing, to find what a variant leaves behind for the next: ``churn``
    allocates and frees 4 GiB in 64 MiB pieces through the caching allocator; ``idle`` lets the GPU
    sit idle for 10 s (clocks and temperature recover)."""
    torch.cuda.synchronize()
    if name == "churn":
        pieces = [torch.empty(64 << 20, dtype=torch.uint8, device="cuda") for _ in range(64)]
        pieces.clear()
    else:
        time.sleep(10)
    torch.cuda.synchronize()
    dist.barrier()


def _rank(rank, world, rows, variants, env, patch, profile, empty_cache, host_profile):
    device = torch.device("cuda", rank)
    out = []
    for model, m in rows:
        row = BlockRow(model, m)
        x = make_block_inputs(row, rank=rank, world_size=world, group=dist.group.WORLD)
        result = {"row": f"{model}:{m}"}
        for i, name in enumerate(variants):
            label = f"{i}:{name}"
            if name in ("churn", "idle"):
                _between(name)
                continue
            if name.startswith("ours") and name != "ours=":
                _fresh_ops()
            if empty_cache:
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
            ours_env = env if name.startswith("ours") else {}
            with mock.patch.dict(os.environ, ours_env), _patched(patch if name == "ours+" else {}):
                v = block_variant("ours" if name.startswith("ours") else name, x, rank=rank, world_size=world,
                                  reference=None)
                if v.call is None:
                    continue
                step = v.call
                dist.barrier()
                result[f"{label}_ms"] = round(time_ms(lambda: step(0), device, warmup=5, iters=5, reps=5), 3)
                dist.barrier()
                if profile:
                    result[f"{label}_profile"] = _profile(step, 3)
                if host_profile:
                    result[f"{label}_host"] = _host_profile(step, 10)
                    torch.cuda.synchronize()
                    dist.barrier()
                if v.path is not None:
                    result["path"] = v.path()
        out.append(result)
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--rows", default="llama3-8b:8192")
    parser.add_argument("--variants", default="ours,torch,floor")
    parser.add_argument("--env", default="")
    parser.add_argument("--patch", default="")
    parser.add_argument("--no-profile", action="store_true", help="step times only")
    parser.add_argument("--empty-cache", action="store_true", help="empty the allocator cache before each variant")
    parser.add_argument("--host-profile", action="store_true", help="host time per step by function (cProfile)")
    args = parser.parse_args()
    rows = [(r.split(":")[0], int(r.split(":")[1])) for r in args.rows.split(",")]
    env = dict(kv.split("=", 1) for kv in args.env.split(",") if kv)
    patch = dict(kv.split("=", 1) for kv in args.patch.split(",") if kv)
    os.environ.setdefault("TILEWEAVE_TIMEOUT_S", "15")
    ranks = run_ranks(2, _rank, rows, args.variants.split(","), env, patch, not args.no_profile, args.empty_cache,
                      args.host_profile, gpus=True, timeout_s=500)
    with open(os.path.join(args.out, "block_probe.json"), "w") as f:
        json.dump(ranks, f, indent=1)
    labels = [f"{i}:{name}" for i, name in enumerate(args.variants.split(","))]
    for r0, r1 in zip(*ranks):
        print(r0["row"], r0.get("path", ""))
        for label in labels:
            if f"{label}_ms" not in r0:
                continue
            line = f"  {label:8s} step r0 {r0[label + '_ms']:7.3f} r1 {r1[label + '_ms']:7.3f} ms"
            p = r0.get(f"{label}_profile")
            if p:
                busy = sum(p["classes_us"].values())
                line += f"; GPU kernels r0 {busy / 1e3:7.3f} ms: " + ", ".join(
                    f"{k} {v / 1e3:.3f}" for k, v in p["classes_us"].items())
            print(line)
        for label in labels:
            for kname, count, us in r0.get(f"{label}_profile", {}).get("kernels", []):
                print(f"    {label:8s} {us:8.1f} us x{count:<3d} {kname}")
        for label in labels:
            for func, calls, own, cum in r0.get(f"{label}_host", []):
                print(f"    host {label:8s} own {own:8.1f} cum {cum:8.1f} us x{calls:<5} {func}")


if __name__ == "__main__":
    main()
