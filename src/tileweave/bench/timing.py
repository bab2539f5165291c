"""Steady-state timing that every rank runs in lockstep.

Why steady state: layers run back to back in training and serving, and under sustained load the SM
clock drops to the power cap (about 1480 MHz on an H200 against 1980 MHz idle). A cold call, or a host
sync before every call, measures a different machine. So: warm up for about ``warmup_s`` seconds, then
time ``reps`` batches of ``iters`` back-to-back calls between two CUDA events with no host sync inside,
take the median batch, then the max over ranks.

Why the warm-up is a call count and not a time limit: a loop bounded by wall time issues a different
number of collectives on each rank and hangs (docs/design.md). Every rank measures a short fixed probe,
derives a count, and the ranks agree on the largest count before any of them runs it.
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
import statistics
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from tileweave.tune.fields import bounded, check_bounds

L2_BYTES = 60 * 2**20
"""H200 L2 (60 MB); inputs smaller than this would be timed L2-hot."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class TimingConfig:
    """How long and how often to run each variant."""

    warmup_s: float = 0.5
    """Sustained load before timing, enough for clocks and power to settle (converted to a count)."""
    iters: int = bounded(20, low=20, why="docs/design.md steady-state rule")
    """Back-to-back calls between two events; per-call time is the batch time over ``iters``."""
    reps: int = bounded(5, low=5, why="docs/design.md steady-state rule")
    """Timed batches; the median is reported."""
    probe_calls: int = bounded(3, low=1)
    """Synchronised calls whose duration sizes the warm-up."""
    max_warmup_calls: int = 20000
    """Cap on the warm-up so a mis-timed probe cannot stall the run; 0.5 s of 25 us calls fits."""
    min_warmup_calls: int = bounded(5, low=0)
    """Floor so even the slowest shapes see a few back-to-back calls before timing."""

    def __post_init__(self) -> None:
        if not (self.warmup_s >= 0 and math.isfinite(self.warmup_s)):
            raise ValueError(f"warmup_s must be a finite number >= 0, got {self.warmup_s}")
        check_bounds(self)
        if self.min_warmup_calls > self.max_warmup_calls:
            raise ValueError(f"need min_warmup_calls <= max_warmup_calls, got {self.min_warmup_calls} and "
                             f"{self.max_warmup_calls}")


class Agreement(Protocol):
    """How ranks settle a value before acting on it: every rank calls the same methods in order."""

    def max_int(self, value: int) -> int: ...

    def max_floats(self, values: Sequence[float]) -> list[float]: ...


class LocalAgreement:
    """A group of one: nothing to agree with (the single-GPU ``gemm`` section)."""

    def max_int(self, value: int) -> int:
        return int(value)

    def max_floats(self, values: Sequence[float]) -> list[float]:
        return [float(v) for v in values]


class DistAgreement:
    """Element-wise MAX over the ranks of ``group`` with one ``all_reduce`` per call.

    A minimum is agreed as the max of a negated value; "no value" travels as ``-inf``, which loses
    to every real value.
    """

    def __init__(self, group: object, device: torch.device) -> None:
        self.group = group
        self.device = device

    def max_floats(self, values: Sequence[float]) -> list[float]:
        import torch.distributed as dist

        t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return t.tolist()

    def max_int(self, value: int) -> int:
        return int(self.max_floats([float(value)])[0])


def plan_warmup_calls(per_call_s: float, *, cfg: TimingConfig) -> int:
    """Calls that fill ``cfg.warmup_s`` at ``per_call_s`` seconds each, clamped to the config's bounds."""
    if not math.isfinite(per_call_s) or per_call_s <= 0:
        return cfg.max_warmup_calls
    return max(cfg.min_warmup_calls, min(cfg.max_warmup_calls, math.ceil(cfg.warmup_s / per_call_s)))


def agree_warmup_calls(
    run: Callable[[int], object],
    *,
    cfg: TimingConfig,
    agree: Agreement,
    sync: Callable[[], None],
    clock: Callable[[], float] = time.perf_counter,
) -> int:
    """Run a fixed probe, derive a warm-up count, and return the count every rank agreed on.

    Every rank makes exactly ``1 + cfg.probe_calls`` calls here whatever its clock says: the first
    call absorbs JIT compilation and workspace allocation and is not timed. The result is the max over
    ranks, so each rank warms up for at least ``warmup_s`` by its own estimate.
    """
    run(0)
    sync()
    t0 = clock()
    for i in range(cfg.probe_calls):
        run(i + 1)
    sync()
    per_call = (clock() - t0) / cfg.probe_calls
    return agree.max_int(plan_warmup_calls(per_call, cfg=cfg))


MAX_ROTATION_SETS = 32
"""Enough for every suite row: the smallest set (a rank's inputs at TP=8, M=1024) is about 5 MB."""


def rotation_sets(set_bytes: int, *, l2_bytes: int = L2_BYTES, max_sets: int = MAX_ROTATION_SETS) -> int:
    """Input sets to rotate through so consecutive calls do not find their inputs in L2.

    One set larger than L2 evicts itself; smaller ones rotate until the sets together span twice L2,
    which with LRU-like replacement leaves a set cold by the time it comes round again.
    """
    if set_bytes <= 0:
        raise ValueError(f"set_bytes must be positive, got {set_bytes}")
    if set_bytes >= l2_bytes:
        return 1
    return max(2, min(max_sets, math.ceil(2 * l2_bytes / set_bytes)))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Timing:
    """One variant's steady-state result, already reduced over ranks."""

    ms: float
    """Per-call time: median over reps on each rank, then max over ranks."""
    rep_ms: tuple[float, ...]
    """This rank's per-call time of every rep (for spread; not reduced)."""
    warmup_calls: int
    """The agreed warm-up count."""
    clock_mhz: float | None
    """Lowest over ranks of the median SM clock while the timed batches ran (``ClockSampler``); None if
    unreadable."""
    host_ms: float | None = None
    """The host's time to issue one call onto an idle GPU (a batch of ``iters`` after the timed ones,
    max over ranks). Close to ``ms``: the host, not the GPU, set the pace."""


class MemoryWatch:
    """Peak GPU memory of one variant, from before its first call to the end of its timing.

    Two numbers, because symmetric memory does not come from the caching allocator:
    ``peak`` is the allocator's high-water mark above the starting level (outputs, temporaries,
    allocator-backed workspaces), and ``other`` is device memory that was taken outside the
    allocator and kept (symmetric workspaces, NCCL buffers). ``other`` is charged to the first row
    that needs the memory; later rows reuse it and show 0.
    """

    def __init__(self) -> None:
        torch.cuda.synchronize()
        self._free0, _ = torch.cuda.mem_get_info()
        self._reserved0 = torch.cuda.memory_reserved()
        self._alloc0 = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()

    def rearm(self) -> None:
        """Forget the peak so far, e.g. after a verification whose temporaries are not the op's."""
        torch.cuda.reset_peak_memory_stats()

    def read(self) -> tuple[int, int]:
        """``(peak_bytes, other_bytes)`` on this rank."""
        torch.cuda.synchronize()
        free1, _ = torch.cuda.mem_get_info()
        peak = max(0, torch.cuda.max_memory_allocated() - self._alloc0)
        other = (self._free0 - free1) - (torch.cuda.memory_reserved() - self._reserved0)
        return peak, max(0, other)


class ClockReader:
    """Reads the current SM clock in MHz, through NVML (``torch.cuda.clock_rate``) or ``nvidia-smi``.

    A method that fails once is not tried again: a missing tool costs one attempt, not one per row.
    """

    def __init__(self) -> None:
        self._nvml_ok = True
        self._smi = shutil.which("nvidia-smi")

    def read(self, device: int) -> float | None:
        if self._nvml_ok:
            try:
                return float(torch.cuda.clock_rate(device))
            except Exception:
                self._nvml_ok = False
        if self._smi is None:
            return None
        try:
            out = subprocess.run(
                [self._smi, "--query-gpu=clocks.sm", "--format=csv,noheader,nounits", "-i", _smi_id(device)],
                capture_output=True, text=True, timeout=5, check=True,
            ).stdout.strip()
            return float(out.splitlines()[0])
        except Exception:
            self._smi = None
            return None


class ClockSampler:
    """The SM clock while the GPU works: ``reader`` sampled every ``period_s`` from a background thread
    inside the ``with`` block, the median of the samples after it. A single reading after the work can
    catch the clock once the GPU has gone idle; the median says what the variant ran at."""

    def __init__(self, reader: ClockReader, device: int, *, period_s: float = 0.02) -> None:
        self._reader, self._device, self._period_s = reader, device, period_s
        self._samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="clock-sampler", daemon=True)

    def _run(self) -> None:
        while True:
            started = time.perf_counter()
            mhz = self._reader.read(self._device)
            if mhz is None:
                return
            self._samples.append(mhz)
            # A slow reading (``nvidia-smi`` where NVML fails: a process each time) waits in proportion,
            # so that the sampler takes at most ~5% of the host that issues the timed calls.
            if self._stop.wait(max(self._period_s, 20 * (time.perf_counter() - started))):
                return

    def __enter__(self) -> "ClockSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        if not self._samples:  # work shorter than the thread's start: one reading now
            mhz = self._reader.read(self._device)
            if mhz is not None:
                self._samples.append(mhz)

    def median(self) -> float | None:
        return statistics.median(self._samples) if self._samples else None


def _smi_id(device: int) -> str:
    """The ``nvidia-smi -i`` name of torch's ``device``, which differs under CUDA_VISIBLE_DEVICES."""
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    return visible[device] if device < len(visible) else str(device)


def measure(
    call: Callable[[int], object],
    *,
    cfg: TimingConfig,
    agree: Agreement,
    clocks: ClockReader,
    fence: Callable[[], None] | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> Timing:
    """Time ``call`` in steady state on every rank of the agreement and reduce the result.

    ``call(i)`` enqueues one call on the current stream (``i`` picks the input set to rotate to);
    it must be safe to issue back to back without a host sync. ``fence``, if given, runs before the
    first and after the last timed batch (e.g. a symmetric-memory barrier) and never inside a batch.
    Issues the same collectives on every rank: the probe's agreement and one final reduction.
    """
    device = torch.cuda.current_device()
    n_warm = agree_warmup_calls(call, cfg=cfg, agree=agree, sync=torch.cuda.synchronize, clock=clock)
    i = 1 + cfg.probe_calls
    for _ in range(n_warm):
        call(i)
        i += 1
    if fence is not None:
        fence()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(cfg.reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(cfg.reps)]
    with ClockSampler(clocks, device) as sampler:
        for r in range(cfg.reps):
            starts[r].record()
            for _ in range(cfg.iters):
                call(i)
                i += 1
            ends[r].record()
        torch.cuda.synchronize()
    mhz = sampler.median()
    # The host's own cost per call: one more batch, issued onto an idle GPU. During the timed batches the
    # warm-up's backlog keeps the launch queue full, so the host waits on it and its time there is the
    # GPU's whatever its own cost (every variant would look host-bound).
    t0 = clock()
    for _ in range(cfg.iters):
        call(i)
        i += 1
    host_s = clock() - t0
    torch.cuda.synchronize()
    if fence is not None:
        fence()

    rep_ms = tuple(s.elapsed_time(e) / cfg.iters for s, e in zip(starts, ends, strict=True))
    ms, neg_mhz, host_ms = agree.max_floats([statistics.median(rep_ms), -mhz if mhz is not None else -math.inf,
                                             host_s / cfg.iters * 1e3])
    return Timing(
        ms=ms,
        rep_ms=rep_ms,
        warmup_calls=n_warm,
        clock_mhz=-neg_mhz if math.isfinite(neg_mhz) else None,
        host_ms=host_ms,
    )
