"""Autotuning of the GEMM core: time candidate configs on the real shape and keep the winner on disk.

The cache is one JSON file per GPU model (``$TILEWEAVE_CACHE_DIR``, default ``~/.cache/tileweave``),
keyed by dtype, M bucket (the next power of two, so nearby token counts share an entry), N and K.
``select_config`` reads it before falling back to the heuristics of ``tileweave.tune.configs``. The fused
ops then pass their choice through ``agree`` so every rank of a group uses rank 0's config, whatever
each rank's cache holds.

    tileweave tune --m 4096,8192          # tune the suite's local GEMMs on this machine's GPU
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import statistics
import tempfile
import time
from pathlib import Path

import torch

from tileweave.tune.configs import BIG_TILE, GemmConfig, choose_gemm_config

CACHE_DIR_ENV = "TILEWEAVE_CACHE_DIR"

CANDIDATES: tuple[GemmConfig, ...] = (
    BIG_TILE,
    GemmConfig(),
    GemmConfig(warp_specialize=True),
    GemmConfig(num_stages=4),
    GemmConfig(group_m=4),
    GemmConfig(c_tma=False),
    GemmConfig(block_n=128, num_stages=4),
    GemmConfig(block_n=128, num_stages=4, warp_specialize=True),
    GemmConfig(block_m=256, block_n=128),
    GemmConfig(stream_k=True),
    GemmConfig(block_n=128, num_stages=4, stream_k=True),
)
"""The configurations tried per shape (see NOTES.md, experiment 3, for why these)."""


def m_bucket(m: int) -> int:
    return max(64, 1 << (m - 1).bit_length())


def shape_key(m: int, n: int, k: int, dtype: torch.dtype) -> str:
    return f"{str(dtype).removeprefix('torch.')}:{m_bucket(m)}:{n}:{k}"


def cache_path(gpu_name: str) -> Path:
    root = Path(os.environ.get(CACHE_DIR_ENV) or Path.home() / ".cache" / "tileweave")
    return root / f"gemm-{re.sub(r'[^A-Za-z0-9]+', '-', gpu_name).strip('-').lower()}.json"


class ConfigCache:
    """Tuned configs of one GPU model, read from and written to one JSON file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.entries: dict[str, dict] = {}
        try:
            data = json.loads(path.read_text())
            if isinstance(data, dict) and isinstance(data.get("entries"), dict):
                self.entries = data["entries"]
        except (OSError, ValueError):
            pass  # no cache yet, or an unreadable one: tune again rather than fail

    def get(self, key: str) -> GemmConfig | None:
        entry = self.entries.get(key)
        if not entry:
            return None
        try:
            return GemmConfig.from_dict(entry["config"])
        except (KeyError, TypeError, ValueError):
            return None

    def put(self, key: str, config: GemmConfig, ms: float) -> None:
        self.entries[key] = {"config": dataclasses.asdict(config), "ms": ms}

    def save(self) -> None:
        # Write then rename, so a reader in another process never sees half a file.
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=self.path.parent, delete=False, suffix=".tmp") as f:
            json.dump({"version": 1, "entries": self.entries}, f, indent=1, sort_keys=True)
        os.replace(f.name, self.path)


_caches: dict[str, ConfigCache] = {}
_selected: dict[tuple, GemmConfig] = {}


def _gpu_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu-interpreter"


def _cache_for(device: torch.device) -> ConfigCache:
    name = _gpu_name(device)
    if name not in _caches:
        _caches[name] = ConfigCache(cache_path(name))
    return _caches[name]


def select_config(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device, *, num_sms: int,
                  interpreter: bool = False, stream_k: bool = True) -> GemmConfig:
    """The tuned config for this shape if the cache has one, else the heuristic choice (whole tiles
    only with ``stream_k=False``)."""
    memo = (m, n, k, dtype, device.type, device.index, interpreter, stream_k)
    config = _selected.get(memo)
    if config is None:
        config = None if interpreter else _cache_for(device).get(shape_key(m, n, k, dtype))
        config = config or choose_gemm_config(m, n, k, dtype, num_sms=num_sms, interpreter=interpreter,
                                              stream_k=stream_k)
        _selected[memo] = config
    return config


def time_ms(fn, device: torch.device, *, warmup: int, iters: int, reps: int) -> float:
    """Median per-call time of ``fn`` in ms over ``reps`` batches of ``iters`` back-to-back calls
    (CUDA events on a GPU, the wall clock on the CPU)."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / iters)
        else:
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            samples.append((time.perf_counter() - t0) * 1e3 / iters)
    return statistics.median(samples)


def autotune_gemm(m: int, n: int, k: int, dtype: torch.dtype = torch.bfloat16, *,
                  device: torch.device | str = "cuda", candidates: tuple[GemmConfig, ...] = CANDIDATES,
                  warmup: int = 5, iters: int = 10, reps: int = 5, save: bool = True) -> tuple[GemmConfig, float]:
    """Time every candidate on random ``[m, k] @ weight[n, k].T`` (each verified against
    ``torch.matmul`` first), store the fastest in the cache and return it with its time in ms."""
    from tileweave.ops.matmul import matmul

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
        ms = time_ms(lambda: matmul(a, w.t(), config=config), device, warmup=warmup, iters=iters, reps=reps)
        if best is None or ms < best[1]:
            best = (config, ms)
    if best is None:
        raise RuntimeError(f"no candidate config ran correctly for {m}x{n}x{k} {dtype}")
    cache = _cache_for(device)
    cache.put(shape_key(m, n, k, dtype), *best)
    if save:
        cache.save()
    _selected.clear()
    return best


def main(argv=None) -> int:
    """``tileweave tune``: tune the local GEMMs of the benchmark suite on GPU 0."""
    import argparse

    from tileweave.bench.suite import gemm_shapes, parse_ints

    parser = argparse.ArgumentParser(prog="tileweave tune", description=main.__doc__)
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
    print(f"cache: {cache_path(torch.cuda.get_device_name())}")
    return 0
