"""Autotuning of the GEMM core: time candidate configs on the real shape and keep the winner on disk.

The cache is one JSON file per GPU model (``$TILEWEAVE_CACHE_DIR``, default ``~/.cache/tileweave``),
keyed by dtype, M bucket (the next power of two, so nearby token counts share an entry), N and K.
``select_config`` reads it before falling back to the heuristics of ``tileweave.tune.configs``. The fused
ops then pass their choice through ``agree`` so every rank of a group uses rank 0's config, whatever
each rank's cache holds.

    tileweave tune --m 4096,8192          # tune the suite's local GEMMs (tileweave.bench.tune)
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

from tileweave.runtime import settings
from tileweave.tune.configs import BIG_TILE, GemmConfig, choose_gemm_config

CACHE_DIR_ENV = settings.CACHE_DIR

CANDIDATES: tuple[GemmConfig, ...] = (
    BIG_TILE,
    GemmConfig(),
    GemmConfig(warp_specialize=True),
    GemmConfig(group_m=4),
    GemmConfig(c_tma=False),
    GemmConfig(block_n=128, num_stages=4),
    GemmConfig(block_n=128, num_stages=4, warp_specialize=True),
    GemmConfig(block_m=256, block_n=128),
    GemmConfig(stream_k=True),
    GemmConfig(block_n=128, num_stages=4, stream_k=True),
)
"""The configurations tried per shape: the default tiles and their neighbours in stages, warps, grouping,
warp specialisation, stores and stream-K. Not 128 x 256 x 64 tiles in 4 stages: with the TMA store's
tile they need 262 KB of shared memory, more than the 227 KB a program may have on sm_90."""


def m_bucket(m: int) -> int:
    return max(64, 1 << (m - 1).bit_length())


def shape_key(m: int, n: int, k: int, dtype: torch.dtype) -> str:
    return f"{str(dtype).removeprefix('torch.')}:{m_bucket(m)}:{n}:{k}"


def cache_path(gpu_name: str) -> Path:
    root = Path(settings.text(CACHE_DIR_ENV) or Path.home() / ".cache" / "tileweave")
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
                  interpreter: bool = False, stream_k: bool = True,
                  out_dtype: torch.dtype | None = None, scaling: str | None = None) -> GemmConfig:
    """The tuned config for this shape if the cache has one, else the heuristic choice (whole tiles
    only with ``stream_k=False``; ``out_dtype`` and ``scaling``: of float8 inputs, whose configs depend
    on them; their tuned entries are keyed by them too)."""
    memo = (m, n, k, dtype, device.type, device.index, interpreter, stream_k, out_dtype, scaling)
    config = _selected.get(memo)
    if config is None:
        key = shape_key(m, n, k, dtype) + (f":{scaling}:{str(out_dtype).removeprefix('torch.')}" if scaling else "")
        config = None if interpreter else _cache_for(device).get(key)
        config = config or choose_gemm_config(m, n, k, dtype, num_sms=num_sms, interpreter=interpreter,
                                              stream_k=stream_k, out_dtype=out_dtype, scaling=scaling)
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


def remember(device: torch.device, m: int, n: int, k: int, dtype: torch.dtype, config: GemmConfig, ms: float, *,
             save: bool = True) -> None:
    """Store ``config`` (timed at ``ms``) as the tuned config of this shape on ``device``'s cache (and
    on disk with ``save``); ``select_config`` returns it from now on."""
    cache = _cache_for(device)
    cache.put(shape_key(m, n, k, dtype), config, ms)
    if save:
        cache.save()
    _selected.clear()
