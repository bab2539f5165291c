"""Start W emulated ranks on the CPU: processes with a gloo group and a shared symmetric heap.

    results = run_ranks(2, scenarios.all_gather_gemm_check, params)

runs ``fn(rank, world_size, *args)`` in every rank and returns the ranks' return values in rank order.
Inside a rank, CPU tensors passed to tileweave's fused ops run the real Triton kernels in the
interpreter against the emulated backend (``tileweave.runtime.emulated``).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import tempfile
import traceback
from typing import Any, Callable

from tileweave.runtime.emulated import HEAP_BYTES_ENV, HEAP_PATH_ENV


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _context(gpus: bool) -> mp.context.BaseContext:
    """Emulated ranks fork from a server process that has imported torch once (most of a rank's start:
    ~2.5 s of ~3, which on two cores made a four-rank test's start ~7 s); the server imports nothing
    of Triton or tileweave, which read the environment as they load. GPU ranks spawn afresh."""
    if gpus or "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed"])
    return ctx


def _rank_main(rank: int, world_size: int, port: int, fn: Callable, args: tuple, results, gpus: bool,
               environ: dict[str, str]) -> None:
    # A forked rank has the fork server's environment, not the caller's: take the caller's.
    os.environ.clear()
    os.environ.update(environ)
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        # More ranks than GPUs: they share the GPUs in turn, over a gloo group (tileweave.testing.shared_gpu).
        shared = gpus and world_size > torch.cuda.device_count()
        device = torch.device("cuda", rank % torch.cuda.device_count()) if gpus else None
        if gpus:
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if gpus and not shared else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                                rank=rank, world_size=world_size, device_id=None if shared else device)
        if shared:
            from tileweave.testing import shared_gpu

            shared_gpu.install(device)
        try:
            value = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        results.put((rank, True, value))
    except BaseException:  # reported to the parent with its traceback
        results.put((rank, False, traceback.format_exc()))


GPU_RANKS_ENV = "TILEWEAVE_GPU_RANKS"


def gpu_ranks() -> int:
    """Ranks the GPU tests start: ``TILEWEAVE_GPU_RANKS`` if set (more than the GPUs: they share them),
    else one per visible GPU."""
    import torch

    value = os.environ.get(GPU_RANKS_ENV, "")
    if value and not (value.isdigit() and int(value) >= 1):
        raise ValueError(f"{GPU_RANKS_ENV}={value!r}: give a number of ranks, 1 or more")
    return int(value) if value else torch.cuda.device_count()


class RankFailed(RuntimeError):
    pass


def run_ranks(world_size: int, fn: Callable, *args: Any, heap_bytes: int = 16 << 20,
              timeout_s: float = 600.0, env: dict[str, str] | None = None, gpus: bool = False) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` emulated ranks; return their results.

    With ``gpus=True`` the ranks are real: one process per CUDA GPU with an NCCL group, no interpreter;
    with more ranks than GPUs, rank r runs on GPU r mod the GPU count, over a gloo group
    (``tileweave.testing.shared_gpu``).
    ``fn`` must be importable by name (module level). Raises ``RankFailed`` with every failing rank's
    traceback, or if the ranks do not finish within ``timeout_s``.
    """
    ctx = _context(gpus)
    with tempfile.NamedTemporaryFile(prefix="tileweave-heap-", dir=_heap_dir(), delete=False) as f:
        heap_path = f.name
    if gpus:
        overrides = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                     "NVSHMEM_DISABLE_NVLS": "1", "TRITON_INTERPRET": "0", **(env or {})}
    else:
        overrides = {"TRITON_INTERPRET": "1", HEAP_PATH_ENV: heap_path, HEAP_BYTES_ENV: str(heap_bytes),
                     **(env or {})}
    saved = {key: os.environ.get(key) for key in overrides}
    os.environ.update(overrides)
    results = ctx.Queue()
    port = _free_port()
    environ = dict(os.environ)
    procs = [ctx.Process(target=_rank_main, args=(rank, world_size, port, fn, args, results, gpus, environ),
                         daemon=True)
             for rank in range(world_size)]
    started = []
    try:
        for proc in procs:
            proc.start()
            started.append(proc)
        collected: dict[int, tuple[bool, Any]] = {}
        for _ in range(world_size):
            try:
                rank, ok, value = results.get(timeout=timeout_s)
            except Exception:
                break
            collected[rank] = (ok, value)
            if not ok:
                break
        failures = [f"rank {rank}:\n{value}" for rank, (ok, value) in sorted(collected.items()) if not ok]
        if failures:
            raise RankFailed("\n".join(failures))
        if len(collected) < world_size:
            missing = sorted(set(range(world_size)) - set(collected))
            raise RankFailed(f"ranks {missing} did not finish within {timeout_s:.0f} s")
        return [collected[rank][1] for rank in range(world_size)]
    finally:
        for proc in started:  # a process that failed to start has nothing to join, and its error is the one to see
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        os.unlink(heap_path)


def _heap_dir() -> str | None:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
