"""Host time of one call, split by what the host does, on two GPUs (``--op ag`` and ``rs`` also on one:
its two ranks then share it, over gloo, so ``by_hand`` times gloo there, not NCCL).

Each backend verb, driver call and torch call inside an op is wrapped with a timer, and the calls are
issued while the GPU is kept busy, so that no call waits for the GPU and the times are the host's
alone. Next to each op: the same work written out by hand with NCCL and cuBLAS.

    python3 scripts/host_probe.py --op ag [--shape MxKxN] [--out DIR]   # AllGather+GEMM, both transports
    python3 scripts/host_probe.py --op rs [--shape MxK_locxN]           # GEMM+ReduceScatter
    python3 scripts/host_probe.py --op matmul [--shapes MxNxK,...] [--configs dp128x128,...]
                                                                        # plain GEMM: host and graph-replay
    python3 scripts/host_probe.py --profile MxK_locxN                   # cProfile of the functional RS op

For ``--op matmul`` the "graph" column is the GPU's time per call with the host out of the way (20 calls
captured once in a CUDA graph and replayed), so host-bound and kernel-bound shapes can be told apart.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

import tileweave  # noqa: E402
from tileweave.ops import _launch  # noqa: E402
from tileweave.ops import matmul as matmul_module  # noqa: E402
from tileweave.runtime import driver  # noqa: E402
from tileweave.testing.emulated import run_ranks  # noqa: E402
from tileweave.tune.configs import GemmConfig  # noqa: E402

CALLS = 40
VERBS = ("comm_begin", "comm_end", "comm_copy", "comm_wait", "comm_write", "main_wait", "main_write")


def _timed(table, name, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        start = time.perf_counter_ns()
        try:
            return fn(*args, **kwargs)
        finally:
            table[name][0] += time.perf_counter_ns() - start
            table[name][1] += 1
    return wrapper


def _issue(fn, device, table, calls=CALLS):
    """Host microseconds per call of ``fn``, issued behind 0.3 s of GPU work."""
    fn()
    torch.cuda.synchronize(device)
    dist.barrier()
    torch.cuda._sleep(int(0.3 * 1.4e9))
    table.clear()
    start = time.perf_counter_ns()
    for _ in range(calls):
        fn()
    total = (time.perf_counter_ns() - start) / calls / 1e3
    torch.cuda.synchronize(device)
    dist.barrier()
    return total


def _patch(table, targets):
    """Wrap ``(owner, name)`` attributes with timers; returns what to restore."""
    saved = []
    for owner, name in targets:
        fn = getattr(owner, name, None)
        if fn is None:  # an older tree without this function
            continue
        saved.append((owner, name, fn))
        label = f"{getattr(owner, '__name__', type(owner).__name__)}.{name}"
        setattr(owner, name, _timed(table, label, fn))
    return saved


def _restore(saved):
    for owner, name, fn in reversed(saved):
        setattr(owner, name, fn)


def _parts(table):
    return {key: [v[0] / CALLS / 1e3, v[1] / CALLS] for key, v in table.items()}


def _fused_rank(rank, world, op_name, shape):
    device = torch.device("cuda", torch.cuda.current_device())  # ranks may share a GPU (testing.shared_gpu)
    m, k, n = shape
    table = collections.defaultdict(lambda: [0, 0])
    group = dist.group.WORLD
    if op_name == "ag":
        a = torch.randn(m // world, k, device=device, dtype=torch.bfloat16)
        variants = [(t, tileweave.AllGatherGemm(policy="fused", transport=t)) for t in ("chunked", "mesh")]
        variants.append(("fallback", tileweave.AllGatherGemm(policy="fallback")))

        def by_hand():
            gathered = torch.empty((m, k), dtype=a.dtype, device=device)
            dist.all_gather_into_tensor(gathered, a, group=group)
            torch.matmul(gathered, b)
    else:
        a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        variants = [(t, tileweave.GemmReduceScatter(policy="fused", transport=t)) for t in ("chunked", "store")]
        variants.append(("fallback", tileweave.GemmReduceScatter(policy="fallback")))

        def by_hand():
            out = torch.empty((m // world, n), dtype=a.dtype, device=device)
            dist.reduce_scatter_tensor(out, torch.matmul(a, b), group=group)
    b = (torch.randn(n, k, device=device, dtype=torch.bfloat16) / k ** 0.5).t()
    results = {}
    for transport, op in variants:
        op(a, b)
        backend = op._backend
        saved = _patch(table, [(driver, name) for name in ("memcpy_async", "stream_wait_u32", "stream_write_u32",
                                                           "event_record", "stream_wait_event")]
                       + [(torch, "matmul"), (torch, "mm"), (torch, "addmm"), (torch, "empty"), (_launch, "launch"),
                          (dist, "all_gather_into_tensor"), (dist, "reduce_scatter_tensor")])
        # Instance attributes shadow the class's: bound methods and static methods alike.
        for name in VERBS:
            setattr(backend, name, _timed(table, f"backend.{name}", getattr(backend, name)))
        for name in ("_finish", "_finish_without_kernel", "_check_previous", "_chunked", "_chunked_pull",
                     "_chunked_gemms", "_decide", "_start", "_push", "_fallback", "_unfused_route"):
            if hasattr(op, name):
                setattr(op, name, _timed(table, f"op.{name}", getattr(op, name)))
        total = _issue(lambda: op(a, b), device, table)
        results[transport] = {"us_per_call": total, "path": _launch.last_path(op.op_name), "parts": _parts(table)}
        for name in VERBS:
            delattr(backend, name)
        for name in list(vars(op)):
            if name.startswith("_") and callable(vars(op)[name]) and hasattr(type(op), name):
                delattr(op, name)
        _restore(saved)
    results["by_hand"] = {"us_per_call": _issue(by_hand, device, table)}
    results["torch_matmul_only"] = {"us_per_call": _issue(lambda: torch.matmul(a, b), device, table)}
    return results


def _graph_us(fn, device, calls=20, replays=10):
    """GPU microseconds per call with the host out of the way: ``calls`` calls captured in one graph."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize(device)
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        fn()  # outside the graph: first-use allocations
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(calls):
                fn()
    torch.cuda.synchronize(device)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(5):
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / (calls * replays))
    return sorted(samples)[len(samples) // 2]


CONFIGS = {
    "dp128x128": GemmConfig(block_n=128, num_stages=4),
    "dp128x128w4": GemmConfig(block_n=128, num_stages=4, num_warps=4),
    "dp128x128k128": GemmConfig(block_n=128, block_k=128, num_stages=2),
    "dp128x256": GemmConfig(),
    "sk128x128": GemmConfig(block_n=128, num_stages=4, stream_k=True),
    "sk128x128k128": GemmConfig(block_n=128, block_k=128, num_stages=2, stream_k=True),
    "sk128x256": GemmConfig(stream_k=True),
    "sk64x128": GemmConfig(block_m=64, block_n=128, num_stages=4, num_warps=4, stream_k=True),
    # Split-K as stream-K with a multiple of the tile count for programs: every tile then splits into
    # equal K ranges (1024x768: 48 tiles of 128 x 128 or 24 of 128 x 256; 2048x768 and 1024x1280: 48
    # and 40 of 128 x 256).
    "sk128x128p96": GemmConfig(block_n=128, num_stages=4, stream_k=True, programs=96),
    "sk128x256p72": GemmConfig(stream_k=True, programs=72),
    "sk128x256p96": GemmConfig(stream_k=True, programs=96),
    "sk128x256p120": GemmConfig(stream_k=True, programs=120),
    "sk128x256p80": GemmConfig(stream_k=True, programs=80),
    "dp64x256": GemmConfig(block_m=64, num_stages=4),
    "dp256x128": GemmConfig(block_m=256, block_n=128),
    "dp128x256s4ct0": GemmConfig(num_stages=4, c_tma=False),
    "dp64x128w4": GemmConfig(block_m=64, block_n=128, num_stages=4, num_warps=4),
    "dp64x128w4s6": GemmConfig(block_m=64, block_n=128, num_stages=6, num_warps=4),
    "dp64x128w8s6": GemmConfig(block_m=64, block_n=128, num_stages=6, num_warps=8),
    # Tiles of block_n + block_n2 columns: widths cuBLAS picks so that a small grid is ~one tile per SM
    # (its kernel names: 1024x768 64 x 96, 2048x768 128 x 96, 1024x1280 128 x 80). Only with the tile
    # loop unflattened (flattened, two accumulators ran 2x slower: NOTES.md entry 71).
    "w64x96w4s6nf": GemmConfig(block_m=64, block_n=64, block_n2=32, num_stages=6, num_warps=4, flatten=False),
    "dp64x64w4s6": GemmConfig(block_m=64, block_n=64, num_stages=6, num_warps=4),
    "dp64x128w4s8": GemmConfig(block_m=64, block_n=128, num_stages=8, num_warps=4),
    "dp64x128w4s6nf": GemmConfig(block_m=64, block_n=128, num_stages=6, num_warps=4, flatten=False),
    "dp64x128w4s5nfws": GemmConfig(block_m=64, block_n=128, num_stages=5, num_warps=4, flatten=False,
                                   warp_specialize=True),
    "dp64x128k128w4s4nf": GemmConfig(block_m=64, block_n=128, block_k=128, num_stages=4, num_warps=4,
                                     flatten=False),
    "w64x192w4nf": GemmConfig(block_m=64, block_n=128, block_n2=64, num_stages=4, num_warps=4, flatten=False),
    "dp64x128w4s5nf": GemmConfig(block_m=64, block_n=128, num_stages=5, num_warps=4, flatten=False),
    "dp128x256ct0": GemmConfig(c_tma=False),
    "dp128x256s4ct0nf": GemmConfig(num_stages=4, c_tma=False, flatten=False),
    "dp128x128s5ct0": GemmConfig(block_n=128, num_stages=5, c_tma=False),
    "dp128x128nf": GemmConfig(block_n=128, num_stages=4, flatten=False),
    "w128x96nf": GemmConfig(block_m=128, block_n=64, block_n2=32, num_stages=5, num_warps=8, flatten=False),
    "w64x160w4nf": GemmConfig(block_m=64, block_n=128, block_n2=32, num_stages=5, num_warps=4, flatten=False),
    "w128x160nf": GemmConfig(block_m=128, block_n=128, block_n2=32, num_stages=4, num_warps=8, flatten=False),
    "w128x192nf": GemmConfig(block_m=128, block_n=128, block_n2=64, num_stages=3, num_warps=8, flatten=False,
                             c_tma=False),
}


def _matmul_rank(rank, world, shapes, configs):
    device = torch.device("cuda", rank)
    table = collections.defaultdict(lambda: [0, 0])
    results = {}
    for m, n, k in shapes:
        a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        b = (torch.randn(n, k, device=device, dtype=torch.bfloat16) / k ** 0.5).t()
        row = {}
        for name, fn in (("torch", lambda: torch.matmul(a, b)), ("ours", lambda: tileweave.matmul(a, b))):
            row[name] = {"issue_us": _issue(fn, device, table, calls=200), "graph_us": _graph_us(fn, device)}
        for name in configs:
            config = CONFIGS[name]
            try:
                out = tileweave.matmul(a, b, config=config)
                err = ((out.double() - a.double() @ b.double()).norm() / (a.double() @ b.double()).norm()).item()
                row[name] = {"graph_us": _graph_us(lambda: tileweave.matmul(a, b, config=config), device),
                             "rel_err": err}
            except Exception as exc:  # noqa: BLE001 - a config the shape or the GPU cannot run
                row[name] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
        row["torch"]["kernels"] = _kernel_names(lambda: torch.matmul(a, b))
        row["ours"]["launch_us"] = _launch_args_us(a, b, device, table)
        saved = _patch(table, [(torch, "empty"), (matmul_module, "_plan_key"), (_launch, "relaunch"),
                               (_launch, "_launch_compiled"), (_launch, "_cached_scratch")])
        _issue(lambda: tileweave.matmul(a, b), device, table)
        row["ours"]["parts"] = _parts(table)
        _restore(saved)
        results[f"{m}x{n}x{k}"] = row
    return results


def _kernel_names(fn):
    """Names of the GPU kernels one call of ``fn`` runs (cuBLAS's name its tiles, cluster and split)."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sorted({e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA})


def _launch_args_us(a, b, device, table):
    """Host microseconds of the compiled kernel's launch alone, its pointers given as tensors (Triton's
    launcher then calls data_ptr() and cuPointerGetAttribute for each) and as ints."""
    out = tileweave.matmul(a, b)
    plan = matmul_module._plans[matmul_module._plan_key(a, b, None, None, None)]
    # A stream-K plan reads its partial-tile workspace and arrival counts: hand it the library's.
    parts, locks = _launch.stream_k_buffers(device, *plan.stream_k) if plan.stream_k else (out, out)
    tensors = (a, a, b, out, out, out, out, out, out, parts, locks)
    pointers = tuple(t.data_ptr() for t in tensors)
    timed = {}
    for name, first in (("tensors", tensors), ("ints", pointers), ("tensors_again", tensors)):
        args = (*first, 0, 0, *plan.ints)
        timed[name] = _issue(lambda: _launch._launch_compiled(plan.compiled[0], device.index, plan.programs, args,
                                                              plan.constexprs), device, table, calls=200)
    return timed


def _profile_rank(rank, world, m, k, n):
    """cProfile of the functional op's host path next to the same work written out by hand."""
    import cProfile
    import io
    import pstats

    device = torch.device("cuda", rank)
    a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    b = (torch.randn(n, k, device=device, dtype=torch.bfloat16) / k ** 0.5).t()
    group = dist.group.WORLD

    def by_hand():
        out = torch.empty((m // world, n), dtype=a.dtype, device=device)
        dist.reduce_scatter_tensor(out, torch.matmul(a, b), group=group)

    def ours():
        tileweave.gemm_reduce_scatter(a, b, group)

    results = {}
    for name, fn in (("by_hand", by_hand), ("ours", ours)):
        results[name] = {"us_per_call": _issue(fn, device, collections.defaultdict(list))}
        prof = cProfile.Profile()
        torch.cuda._sleep(int(0.3 * 1.4e9))
        prof.enable()
        for _ in range(CALLS):
            fn()
        prof.disable()
        torch.cuda.synchronize(device)
        dist.barrier()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(22)
        results[name]["profile"] = text.getvalue()
    return results


def _print_parts(prefix, parts):
    for part, (us, count) in sorted(parts.items(), key=lambda kv: -kv[1][0]):
        print(f"{prefix}     {part:34s} {us:8.1f} us  x{count:g}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--op", choices=("ag", "rs", "matmul"), default="rs")
    parser.add_argument("--shape", default="", help="MxKxN of the op (ag: gathered M, K, N_loc; rs: M, K_loc, N)")
    parser.add_argument("--shapes", default="1024x768x4096,2048x768x4096,4096x768x4096,1024x1280x8192,"
                        "1024x3072x4096,1024x4096x512", help="matmul: MxNxK,...")
    parser.add_argument("--configs", default="", help=f"matmul: also time these in graph mode: {','.join(CONFIGS)}")
    parser.add_argument("--ranks", type=int, default=2, help="matmul: processes, one GPU each (1 on one GPU)")
    parser.add_argument("--profile", default="", help="MxK_locxN: cProfile the functional RS op (auto policy)")
    parser.add_argument("--tag", default="")
    args = parser.parse_args()
    if args.profile:
        m, k, n = (int(x) for x in args.profile.split("x"))
        ranks = run_ranks(2, _profile_rank, m, k, n, gpus=True, timeout_s=200)
        for name, r in ranks[0].items():
            print(f"[r0] {name}: {r['us_per_call']:.1f} us/call")
            print(r["profile"][-3200:])
        return
    if args.op == "matmul":
        shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
        configs = [c for c in args.configs.split(",") if c]
        ranks = run_ranks(args.ranks, _matmul_rank, shapes, configs, gpus=True, timeout_s=500)
    else:
        default = {"ag": "4096x4096x3072", "rs": "4096x2048x4096"}[args.op]
        shape = tuple(int(x) for x in (args.shape or default).split("x"))
        ranks = run_ranks(2, _fused_rank, args.op, shape, gpus=True, timeout_s=300)
    name = f"host_probe_{args.op}{'_' + args.tag if args.tag else ''}.json"
    with open(os.path.join(args.out, name), "w") as f:
        json.dump(ranks, f, indent=1)
    for rank, res in enumerate(ranks):
        for key, r in res.items():
            if args.op == "matmul":
                t, o = r["torch"], r["ours"]
                print(f"[r{rank}] {key:18s} issue torch {t['issue_us']:6.1f} ours {o['issue_us']:6.1f} us | "
                      f"graph torch {t['graph_us']:6.1f} ours {o['graph_us']:6.1f} us "
                      f"({t['graph_us'] / o['graph_us']:.2f}x)")
                for kernel in t.get("kernels", []):
                    print(f"[r{rank}]     cuBLAS: {kernel[:150]}")
                if "launch_us" in o:
                    print(f"[r{rank}]     launch alone, pointers as " +
                          ", ".join(f"{k} {v:5.1f}" for k, v in o["launch_us"].items()) + " us")
                _print_parts(f"[r{rank}]", o.get("parts", {}))
                for name, v in r.items():
                    if name not in ("torch", "ours"):
                        print(f"[r{rank}]     {name:16s} " + (f"graph {v['graph_us']:6.1f} us ({t['graph_us'] / v['graph_us']:.2f}x)"
                                                         f" err {v['rel_err']:.1e}" if "graph_us" in v else v["error"]))
            else:
                print(f"[r{rank}] {key:18s} {r['us_per_call']:8.1f} us/call {r.get('path') or ''}")
                _print_parts(f"[r{rank}]", r.get("parts", {}))


if __name__ == "__main__":
    main()
