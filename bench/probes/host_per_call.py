"""The host's time per call of each fused op at small shapes, where the host bounds a call: how long
issuing N calls takes before the GPU is waited for (``host_us``), the wall time per call once it is
(``wall_us``), and for each op the functions the host spends it in (cProfile, rank 0's top entries by
own time). Also the agreement's exchange alone (the MoE ops and ``gemm_all_reduce`` run one per call).

Run by hand on a GPU machine: ``PYTHONPATH=src python3 bench/probes/host_per_call.py OUT [WORLD]``
(WORLD ranks, default 2; more ranks than GPUs share them, ``tileweave.testing.shared_gpu``). Writes
``OUT/host_per_call.json`` and prints a table. Without a GPU it runs on emulated CPU ranks at tiny
shapes in fp32, to check the probe itself (interpreter times mean nothing)."""
import cProfile
import json
import os
import pstats
import sys
import time

import torch
import torch.distributed as dist

import tileweave
from tileweave.runtime.agreement import exchange
from tileweave.runtime.backend import get_backend
from tileweave.testing.emulated import run_ranks

GPU = torch.cuda.is_available()
CALLS = 200 if GPU else 2


def _sync() -> None:
    if GPU:
        torch.cuda.synchronize()


def _ops(rank: int, world: int, device: torch.device) -> dict:
    """Name -> a function making one call, each at a shape the host bounds."""
    gen = torch.Generator(device="cpu").manual_seed(rank)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=torch.bfloat16 if GPU else torch.float32)

    scale = 1 if GPU else 16
    m, k, n = 256 * world // scale, 1024 // scale, 1024 // scale
    a_shard, b = rand(m // world, k), rand(k, n)
    a_full, b_rows = rand(m, k // world), rand(k // world, n)
    x_dec, w_dec = rand(8, k // world), rand(k // world, n)
    tokens, hidden, f_loc, experts, topk = 512 * world // scale, 1024 // scale, 256 // scale, 16, 4
    x_shard = rand(tokens // world, hidden)
    w0, w1 = rand(experts, hidden, f_loc), rand(experts, f_loc, hidden)
    ids = torch.randint(0, experts, (tokens // world, topk), generator=gen).to(device)
    weights = torch.rand(tokens // world, topk, generator=gen).to(device)
    plan = tileweave.moe_plan(ids, num_experts=experts, validate=False)
    h = tileweave.moe_all_gather_gemm(x_shard, w0, plan)
    return {
        "all_gather_gemm": lambda: tileweave.all_gather_gemm(a_shard, b),
        "gemm_reduce_scatter": lambda: tileweave.gemm_reduce_scatter(a_full, b_rows),
        "gemm_all_reduce (M=8)": lambda: tileweave.gemm_all_reduce(x_dec, w_dec),
        "moe_plan": lambda: tileweave.moe_plan(ids, num_experts=experts, validate=False),
        "moe_all_gather_gemm": lambda: tileweave.moe_all_gather_gemm(x_shard, w0, plan),
        "moe_gemm_reduce_scatter": lambda: tileweave.moe_gemm_reduce_scatter(h, w1, plan, weights),
    }


def _profile(fn, calls: int, top: int = 12) -> list:
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        fn()
    profiler.disable()
    _sync()
    rows = [(f"{os.path.basename(path)}:{line}:{func}"[:70], round(n / calls, 1), round(own / calls * 1e6, 1),
             round(cum / calls * 1e6, 1)) for (path, line, func), (_, n, own, cum, _) in pstats.Stats(profiler).stats.items()]
    rows.sort(key=lambda r: -r[2])
    return rows[:top]


def _rank(rank: int, world: int) -> dict:
    device = torch.device("cuda", torch.cuda.current_device()) if GPU else torch.device("cpu")
    out = {}
    for name, fn in _ops(rank, world, device).items():
        for _ in range(5 if GPU else 1):
            fn()
        _sync()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(CALLS):
            fn()
        issued = time.perf_counter()
        _sync()
        end = time.perf_counter()
        dist.barrier()
        out[name] = {"host_us": (issued - start) / CALLS * 1e6, "wall_us": (end - start) / CALLS * 1e6,
                     "path": tileweave.last_path(name.split(" ")[0])}
        profile = _profile(fn, 50 if GPU else 1)  # every rank calls: the ops are collective
        out[name]["profile"] = profile if rank == 0 else []
        dist.barrier()
    backend = get_backend(dist.group.WORLD, device)
    start = time.perf_counter()
    for i in range(CALLS):
        exchange(backend.group, backend.rank, backend.world_size, "probe", ("probe", i), timeout_s=60)
    out["exchange alone"] = {"host_us": (time.perf_counter() - start) / CALLS * 1e6, "wall_us": None, "path": None,
                             "profile": []}
    return out


def main() -> None:
    out_dir = sys.argv[1]
    world = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    results = run_ranks(world, _rank, gpus=GPU, timeout_s=500)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "host_per_call.json"), "w") as f:
        json.dump({"world": world, "calls": CALLS, "ranks": results}, f, indent=1)
    print(f"{'op':28s} {'path':10s} " + " ".join(f"host_us[r{r}] wall_us[r{r}]" for r in range(world)))
    for name in results[0]:
        cells = " ".join(f"{res[name]['host_us']:11.1f} {res[name]['wall_us'] or 0:11.1f}" for res in results)
        print(f"{name:28s} {str(results[0][name]['path']):10s} {cells}")
    for name, entry in results[0].items():
        if entry["profile"]:
            print(f"\n{name} (rank 0, per call: calls, own us, cumulative us)")
            for func, calls, own, cum in entry["profile"]:
                print(f"  {func:70s} {calls:6.1f} {own:8.1f} {cum:8.1f}")


if __name__ == "__main__":
    main()
