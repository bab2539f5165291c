"""Start W emulated ranks on the CPU: processes with a gloo group and a shared symmetric heap.

    results = run_ranks(2, my_tests.check_rank, params)

runs ``fn(rank, world_size, *args)`` in every rank and returns the ranks' return values in rank order.
Inside a rank, CPU tensors passed to tileweave's fused ops run the real Triton kernels in the
interpreter against the emulated backend (``tileweave.runtime.emulated``).
"""

from __future__ import annotations

import ast
import multiprocessing as mp
import os
import pickle
import queue
import signal
import sys
import threading
import time
import traceback
from typing import Any, Callable

from tileweave.runtime import agreement, files
from tileweave.runtime.emulated import HEAP_BYTES_ENV, HEAP_PATH_ENV


def _context(gpus: bool) -> mp.context.BaseContext:
    """Emulated ranks fork from a server process that has imported torch once (most of a rank's start:
    ~2.5 s of ~3, which on two cores made a four-rank test's start ~7 s); the server imports nothing
    of Triton or tileweave, which read the environment as they load. GPU ranks spawn afresh."""
    if gpus or "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed"])
    return ctx


def _rank_main(rank: int, world_size: int, rendezvous: str, fn: Callable, args: tuple, results, gpus: bool,
               environ: dict[str, str], parent_pid: int) -> None:
    # A forked rank has the fork server's environment, not the caller's: take the caller's.
    os.environ.clear()
    os.environ.update(environ)
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), name="parent-watch", daemon=True).start()
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        # More ranks than GPUs: they share the GPUs in turn, over a gloo group (tileweave.testing.shared_gpu).
        shared = gpus and world_size > torch.cuda.device_count()
        device = torch.device("cuda", rank % torch.cuda.device_count()) if gpus else None
        if gpus:
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if gpus and not shared else "gloo", init_method=f"file://{rendezvous}",
                                rank=rank, world_size=world_size, device_id=None if shared else device)
        # No rank starts (and so none can finish and close its sockets) before every rank has joined: a
        # rank whose function returned at once used to exit while a peer was still connecting to it,
        # which failed the peer's start-up with gloo's "Connection closed by peer".
        dist.barrier()
        if shared:
            from tileweave.testing import shared_gpu

            shared_gpu.install(device)
        try:
            value = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        # Pickled here, by value: the queue's own pickler would share a tensor's storage through a file
        # descriptor of this process, which is gone by the time the parent unpickles it.
        results.put((rank, True, pickle.dumps(value)))
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
    """A rank raised, died or did not finish; the message names each such rank and why (with the
    tracebacks), ``summary`` the same in one line (each rank's error without its traceback)."""

    def __init__(self, message: str, summary: str | None = None) -> None:
        super().__init__(message)
        self.summary = summary or " ".join(message.split())


HEAP_PREFIX = "tileweave-heap-"
"""Heap files are named ``tileweave-heap-<pid>-<random>`` after the process that made them, which holds
an exclusive ``flock`` on the file while it runs (the kernel drops it when that process dies, however
it dies)."""

RENDEZVOUS_SUFFIX = ".rendezvous"
"""A run's rendezvous file is its heap file's name with this suffix (stale with it)."""


def run_ranks(world_size: int, fn: Callable, *args: Any, heap_bytes: int = 16 << 20,
              timeout_s: float = 600.0, env: dict[str, str] | None = None, gpus: bool = False) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` emulated ranks; return their results.

    With ``gpus=True`` the ranks are real: one process per CUDA GPU with an NCCL group, no interpreter;
    with more ranks than GPUs, rank r runs on GPU r mod the GPU count, over a gloo group
    (``tileweave.testing.shared_gpu``).
    ``fn`` must be importable by name (module level). Raises ``RankFailed`` with every failing rank's
    traceback as soon as one fails, as soon as a rank dies without a result (its exit code or
    signal), or if the ranks do not finish within ``timeout_s``; the other ranks are then killed.

    Cleanup: the heap file goes when the call returns or raises, also on SIGTERM (turned into
    ``KeyboardInterrupt`` while the call runs in the main thread) and Ctrl-C; ranks exit by themselves
    when the calling process is gone. A caller killed outright (SIGKILL) leaves its heap and rendezvous
    files behind: the next call removes them (``remove_stale_heaps``).
    """
    script = _unguarded_script(sys._getframe(1))
    if script is not None:
        raise RuntimeError(f"run_ranks is called at the top level of the script {script} without "
                           "'if __name__ == \"__main__\":'. The ranks import the script to find the function they "
                           "run, which would start ranks again: put the call under that guard.")
    ctx = _context(gpus)
    heap_path, heap_lock = _make_heap()
    procs: list = []
    saved: dict[str, str | None] = {}
    previous_sigterm = _raise_on_sigterm()
    ok = False
    # The ranks' file rendezvous, named after the heap: fresh for every run (a TCP port picked free and
    # released could be taken by a concurrent run first), created by the store, and removed with the heap
    # by remove_stale_heaps when this process is killed before it can remove it.
    rendezvous = heap_path + RENDEZVOUS_SUFFIX
    try:
        if gpus:
            overrides = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                         "NVSHMEM_DISABLE_NVLS": "1", "TRITON_INTERPRET": "0", **(env or {})}
        else:
            overrides = {"TRITON_INTERPRET": "1", HEAP_PATH_ENV: heap_path, HEAP_BYTES_ENV: str(heap_bytes),
                         **(env or {})}
        saved = {key: os.environ.get(key) for key in overrides}
        os.environ.update(overrides)
        results = ctx.Queue()
        environ = dict(os.environ)
        for rank in range(world_size):
            proc = ctx.Process(target=_rank_main, daemon=True,
                               args=(rank, world_size, rendezvous, fn, args, results, gpus, environ, os.getpid()))
            proc.start()  # a process that failed to start has nothing to join, and its error is the one to see
            procs.append(proc)
        values = _collect(procs, results, timeout_s)
        ok = True
        return values
    finally:
        for proc in procs:
            if ok:
                proc.join(timeout=5)
            if proc.is_alive():  # after a failure the others are stuck in a collective: end them now
                proc.kill()
                proc.join(timeout=5)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        _remove_heap(heap_path, heap_lock)
        if os.path.exists(rendezvous):
            os.unlink(rendezvous)
        # An agreement segment that a rank made and a peer never mapped (it raised before its first op)
        # outlives its ranks, whose exit runs no cleanup of their own: theirs are gone now.
        files.remove_stale(agreement.SEGMENT_PREFIX)
        _restore_sigterm(previous_sigterm)



def _unguarded_script(frame) -> str | None:
    """The path of the script whose top-level code (``frame``) calls ``run_ranks`` outside an
    ``if __name__ == "__main__":`` block, or None (a guarded call, a call from a function or module)."""
    if frame.f_code.co_name != "<module>" or frame.f_globals.get("__name__") != "__main__":
        return None
    path = frame.f_globals.get("__file__")
    try:
        tree = ast.parse(open(path).read())
    except (OSError, TypeError, SyntaxError, ValueError):
        return None  # no source to read (an interactive session): nothing to say
    for node in ast.walk(tree):
        if (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
                and "__name__" in ast.unparse(node.test) and "__main__" in ast.unparse(node.test)
                and node.lineno <= frame.f_lineno <= (node.end_lineno or node.lineno)):
            return None
    return path

def _collect(procs: list, results, timeout_s: float) -> list[Any]:
    """Every rank's result in rank order, or ``RankFailed`` at the first failure, death or the timeout."""
    world_size = len(procs)
    deadline = time.monotonic() + timeout_s
    collected: dict[int, tuple[bool, Any]] = {}

    def take(wait_s: float) -> bool:
        try:
            rank, ok, value = results.get(timeout=wait_s)
        except queue.Empty:
            return False
        collected[rank] = (ok, pickle.loads(value) if ok else value)
        return True

    def dead() -> list[int]:
        return [rank for rank, proc in enumerate(procs) if rank not in collected and proc.exitcode is not None]

    while len(collected) < world_size:
        if take(min(0.2, max(0.0, deadline - time.monotonic()))):
            if all(ok for ok, _ in collected.values()):
                continue
            # A rank raised, perhaps because a peer died under it: name the dead too (a death takes a
            # moment to be seen), and take the reports of the others that raised (a rank that has
            # reported and exited is not dead: its report may still be in the pipe).
            grace = time.monotonic() + 1.0
            while len(collected) < world_size and time.monotonic() < grace:
                if not take(0.05) and len(dead()) + len(collected) >= world_size:
                    break
            while take(0.2):
                pass
        elif dead():
            # A rank's result is in the pipe before it exits; take what is there before calling it dead.
            while take(0.5):
                pass
            if not dead():
                continue
        elif time.monotonic() < deadline:
            continue
        else:
            missing = sorted(set(range(world_size)) - set(collected))
            raise RankFailed(f"ranks {missing} did not finish within {timeout_s:.0f} s")
        deaths = [f"rank {rank} {_exit_reason(procs[rank].exitcode)} before returning a result" for rank in dead()]
        failed = [(rank, value) for rank, (ok, value) in sorted(collected.items()) if not ok]
        failures = [f"rank {rank}:\n{value}" for rank, value in failed]
        # One line: each distinct error (a traceback's last line) with the ranks that raised it.
        errors: dict[str, list[int]] = {}
        for rank, value in failed:
            errors.setdefault(value.strip().splitlines()[-1] if value.strip() else "?", []).append(rank)
        summary = "; ".join(deaths + [f"{'rank' if len(ranks) == 1 else 'ranks'} {', '.join(map(str, ranks))}: {error}"
                                      for error, ranks in errors.items()])
        raise RankFailed("\n".join(deaths + failures), summary)
    return [collected[rank][1] for rank in range(world_size)]


def _exit_reason(exitcode: int) -> str:
    if exitcode < 0:
        try:
            return f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with code {exitcode}"


def _raise_on_sigterm():
    """Turn SIGTERM into KeyboardInterrupt while ranks run (main thread only), so that cleanup runs."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")

    return signal.signal(signal.SIGTERM, interrupt)


def _restore_sigterm(previous) -> None:
    if previous is not None:
        signal.signal(signal.SIGTERM, previous)


def _heap_dir() -> str:
    return files.shm_dir()


def _make_heap() -> tuple[str, int]:
    """A new heap file named after this process and locked by it, after removing stale ones."""
    return files.make_owned(HEAP_PREFIX, _heap_dir())


def _remove_heap(path: str, fd: int) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    os.close(fd)


def remove_stale_heaps(directory: str | None = None) -> list[str]:
    """Delete the heap files (and rendezvous files) of processes that are gone (killed before they could
    clean up); return their paths. A file counts as stale only when the process its name gives is not
    running and nobody holds its lock; files named otherwise are left alone."""
    return files.remove_stale(HEAP_PREFIX, directory or _heap_dir())


def _exit_with_parent(parent_pid: int) -> None:
    """Background thread of a rank: end the rank once the process that started it is gone (it was
    killed and cannot end its ranks itself)."""
    while files.process_alive(parent_pid):
        time.sleep(1.0)
    os._exit(70)
