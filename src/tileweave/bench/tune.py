"""``tileweave tune``: time the candidate configs of the GEMM core on the benchmark suite's local GEMMs
and keep each winner in the autotune cache (``tileweave.tune.autotune``), which ``select_config`` reads."""

from __future__ import annotations

import argparse

import torch

from tileweave.bench.suite import gemm_shapes, parse_ints
from tileweave.ops.compute.matmul import matmul
from tileweave.tune import autotune
from tileweave.tune.configs import GemmConfig


def autotune_gemm(m: int, n: int, k: int, dtype: torch.dtype = torch.bfloat16, *,
                  device: torch.device | str = "cuda", candidates: tuple[GemmConfig, ...] = autotune.CANDIDATES,
                  warmup: int = 5, iters: int = 10, reps: int = 5, save: bool = True) -> tuple[GemmConfig, float]:
    """Time every candidate on random ``[m, k] @ weight[n, k].T`` (each verified against
    ``torch.matmul`` first), store the fastest in the cache and return it with its time in ms."""
    device = torch.device(device)
    a = torch.randn(m, k, dtype=dtype, device=device)
    w = torch.randn(n, k, dtype=dtype, device=device) / k ** 0.5
    ref = (a.double() @ w.double().t()) if device.type == "cpu" else torch.matmul(a, w.t()).double()
    tol = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    best: tuple[GemmConfig, float] | None = None
    for config in candidates:
        try:
            out = matmul(a, w.t(), config=config)
        except Exception:  # a config that cannot compile here is simply not a candidate
            continue
        err = ((out.double() - ref).norm() / ref.norm()).item()
        if not err < tol:
            continue
        ms = autotune.time_ms(lambda: matmul(a, w.t(), config=config), device, warmup=warmup, iters=iters, reps=reps)
        if best is None or ms < best[1]:
            best = (config, ms)
    if best is None:
        raise RuntimeError(f"no candidate config ran correctly for {m}x{n}x{k} {dtype}")
    autotune.remember(device, m, n, k, dtype, *best, save=save)
    return best


def main(argv=None) -> int:
    """``tileweave tune``: tune the local GEMMs of the benchmark suite on GPU 0."""
    parser = argparse.ArgumentParser(prog="tileweave tune",
                                     description="Tune the local GEMMs of the benchmark suite on GPU 0 and cache the winners.")
    parser.add_argument("--m", default="1024,2048,4096,8192,16384", help="token counts (comma list)")
    parser.add_argument("--layer", nargs="+", default=None, help="suite layer filters, as for bench")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("tileweave tune: needs a CUDA GPU")
        return 1
    shapes = gemm_shapes(layers=args.layer, m_values=parse_ints(args.m, name="--m"))
    for shape in shapes:
        config, ms = autotune_gemm(shape.m, shape.n, shape.k)
        print(f"{shape.m:6d} x {shape.n:6d} x {shape.k:6d}  {ms:8.3f} ms  {config.key()}", flush=True)
    print(f"cache: {autotune.cache_path(torch.cuda.get_device_name())}")
    return 0
