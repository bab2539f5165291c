"""Emulated ranks: CPU processes that share a symmetric heap, for running the real kernels in Triton's
interpreter and the real flag protocol without GPUs.

Each rank is a process (``tileweave.testing.emulated.run_ranks`` starts them with a gloo group). The
heap is one shared file mapped by every rank: the process of global rank ``g`` owns region ``g``, every
rank can address every region, and a group's symmetric allocation lies at the same offset of each of
its members' regions, like symmetric memory. The offset is the highest free offset among the members
(one cursor per process, shared by all its groups), so the groups of a world split into several (data
parallel x tensor parallel) never share bytes, and a process in two groups keeps their buffers apart.
The copy engine is a producer thread that executes the comm queue in order while the kernel runs, so a
kernel's wait really blocks on a concurrent producer (or, with ``ONE_QUEUE_ENV`` set, the caller's thread
runs it in issue order, as one hardware queue would). Flags are read and written with aligned 32-bit
accesses, which are atomic on the CPUs we run on.
"""

from __future__ import annotations

import ctypes
import os
import queue
import threading
import time

import torch
import torch.distributed as dist

from tileweave.runtime import settings
from tileweave.runtime.backend import (Backend, CollectiveTimeout, SymmetricBuffer, TileweaveError, _group_size,
                                       producer_delay, register_backend)

HEAP_PATH_ENV = "TILEWEAVE_EMULATED_HEAP"
HEAP_BYTES_ENV = "TILEWEAVE_EMULATED_HEAP_BYTES"
HOSTS_ENV = "TILEWEAVE_EMULATED_HOSTS"
"""Set to n > 1, the world's ranks are taken to sit on n hosts (global rank g on host ``g * n // world``):
a group across them has no peer access and no shared memory, as on real nodes, so its ops take their NCCL
paths and agree through a collective."""
ONE_QUEUE_ENV = "TILEWEAVE_EMULATED_ONE_QUEUE"
"""Set to 1, the copy stream's work runs in the caller's thread in issue order (``EmulatedBackend.one_queue``),
for protocols without a fused kernel (the chunked transports): a wait issued before the work a peer needs
from this rank then deadlocks here as it can on a GPU whose streams share a hardware queue."""
_ALIGN = 256

INTERPRETER_POLL_S = 1.2e-3
"""Time of one poll of ``tileweave.kernels.sync.wait_epoch`` in Triton's interpreter (each poll is an
interpreted atomic and a compare): 0.9-1.2 ms measured on an idle core; longer on a loaded machine,
which stretches a bound counted in polls by as much."""

EXPIRIES_PER_CALL = 2
"""Bounded waits of one call that expire one after another when a peer is missing: the interpreter
runs a grid's programs in turn, so each program that waits on the missing peer's data spends the
whole bound (two for the all-gather GEMM at two ranks; one for the one-shot kernels)."""


def default_max_spin(timeout_s: float) -> int:
    """The in-kernel spin bound that reports a missing peer within about ``timeout_s``, the host's
    own bound: ``timeout_s / (EXPIRIES_PER_CALL * INTERPRETER_POLL_S)`` polls, 25 000 for 60 s."""
    return max(1, int(timeout_s / (EXPIRIES_PER_CALL * INTERPRETER_POLL_S)))


def _read_u32(address: int) -> int:
    return ctypes.c_uint32.from_address(address).value


def _write_u32(address: int, value: int) -> None:
    ctypes.c_uint32.from_address(address).value = value & 0xFFFFFFFF


def _reached(current: int, target: int) -> bool:
    diff = (current - target) & 0xFFFFFFFF
    return diff < 0x80000000


_cursor = 0
"""The first free byte of this process's region of the heap, after the buffers of all its groups."""
_heaps: dict[str, torch.Tensor] = {}


def _heap(path: str, nbytes: int) -> torch.Tensor:
    """The shared heap file mapped once per process, for every group's backend."""
    heap = _heaps.get(path)
    if heap is None:
        heap = _heaps[path] = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
    return heap


class EmulatedBackend(Backend):
    def __init__(self, group: dist.ProcessGroup) -> None:
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise TileweaveError("CPU tensors run only in Triton's interpreter: set TRITON_INTERPRET=1 "
                                 "before importing triton (tileweave.testing.emulated.run_ranks does)")
        path = os.environ.get(HEAP_PATH_ENV)
        if not path:
            raise TileweaveError("CPU tensors need emulated ranks: start them with "
                                 "tileweave.testing.emulated.run_ranks, which sets up the shared heap")
        self.group, self.rank, self.world_size = _group_size(group)
        self.device = torch.device("cpu")
        self.interpreter = True
        self.launch_blocks = True
        self.num_sms = 4
        self.timeout_s = settings.emulated_timeout_s()
        self.default_max_spin = settings.max_spin(default_max_spin(self.timeout_s))
        self.region = int(os.environ[HEAP_BYTES_ENV])
        self.heap = _heap(path, self.region * dist.get_world_size())
        # Global ranks of the group's members, in group-rank order: whose regions the group's buffers use.
        self.members = tuple(dist.get_process_group_ranks(self.group))
        hosts = int(os.environ.get(HOSTS_ENV) or 1)
        spanned = len({g * hosts // dist.get_world_size() for g in self.members})
        if spanned > 1:
            self.one_host = self.peer_access = False
            self.no_peer_access = f"the TP group spans {spanned} hosts (emulated)"
        # One hardware queue for every stream (as under CUDA_DEVICE_MAX_CONNECTIONS=1, and as two
        # streams may share one on a GPU): the copy stream's work runs on the host in issue order, so a
        # stream wait on a peer's flag holds up everything issued after it.
        self.one_queue = os.environ.get(ONE_QUEUE_ENV, "0") not in ("", "0")
        self._queue: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._worker = threading.Thread(target=self._run, name=f"producer-rank{self.rank}", daemon=True)
        self._worker.start()

    def max_programs(self, reducing: bool) -> int:
        # The interpreter runs a grid's programs one after another, so a program that waits on tiles
        # made by a later program of a peer would wait forever; one program per rank keeps the
        # reduce-scatter's dependencies acyclic. Gathers only wait on producers, so they may use more.
        return 1 if reducing else self.num_sms

    def allocate(self, nbytes: int) -> SymmetricBuffer:
        global _cursor
        everyone: list = [None] * self.world_size
        dist.all_gather_object(everyone, (_cursor, nbytes), group=self.group)
        if len({size for _, size in everyone}) != 1:
            raise TileweaveError(f"ranks allocated symmetric buffers out of step: {everyone}")
        offset = max(cursor for cursor, _ in everyone)
        end = offset + (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
        if end > self.region:
            raise TileweaveError(f"emulated heap exhausted: {end} > {self.region} bytes per rank; "
                                 f"raise {HEAP_BYTES_ENV}")
        _cursor = end
        views = tuple(self.heap[g * self.region + offset:g * self.region + offset + nbytes] for g in self.members)
        views[self.rank].zero_()
        dist.barrier(group=self.group)
        return SymmetricBuffer(nbytes=nbytes, addresses=tuple(v.data_ptr() for v in views), views=views)

    # The producer thread: one in-order queue, like a stream.
    def _run(self) -> None:
        # Like a stream: after a failure the remaining work is skipped, but markers (comm_end's) still
        # fire so that the caller learns of the failure instead of waiting.
        while True:
            task, is_marker = self._queue.get()
            try:
                if is_marker or self._error is None:
                    with torch.no_grad():
                        task()
            except BaseException as exc:  # recorded and raised by comm_end on the main thread
                self._error = exc
            finally:
                self._queue.task_done()

    def _issue(self, task) -> None:
        """Queue copy-stream work, or run it now in one-queue mode."""
        if self.one_queue:
            with torch.no_grad():
                task()
        else:
            self._queue.put((task, False))

    def _poll(self, address: int, value: int, what: str) -> None:
        deadline = time.monotonic() + self.timeout_s
        while not _reached(_read_u32(address), value):
            if time.monotonic() > deadline:
                raise CollectiveTimeout(f"rank {self.rank}: {what} waited {self.timeout_s:.0f} s for a flag to "
                                        f"reach {value} (it holds {_read_u32(address)}): a peer is missing "
                                        "or its calls are out of step with this rank's")
            time.sleep(0)

    def comm_begin(self) -> None:
        pass  # main is synchronous here: everything issued on it has already happened

    def comm_copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if not (dst.is_contiguous() and src.is_contiguous()) or dst.nbytes != src.nbytes:
            # The GPU backend's contract (one flat copy between device addresses), checked alike here.
            raise ValueError("comm_copy needs two contiguous tensors of the same size")

        def copy() -> None:
            if producer_delay():
                time.sleep(producer_delay())
            dst.copy_(src)
        self._issue(copy)

    def comm_wait(self, address: int, value: int) -> None:
        self._issue(lambda: self._poll(address, value, "the producer"))

    def comm_write(self, address: int, value: int) -> None:
        self._issue(lambda: _write_u32(address, value))

    def comm_end(self) -> None:
        done = threading.Event()
        self._queue.put((done.set, True))
        if not done.wait(self.timeout_s * 2):
            raise CollectiveTimeout(f"rank {self.rank}: the producer did not finish within "
                                    f"{2 * self.timeout_s:.0f} s")
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def synchronize(self) -> None:
        self.comm_end()

    def main_wait(self, address: int, value: int) -> None:
        self._poll(address, value, "the caller's stream")

    def main_write(self, address: int, value: int) -> None:
        _write_u32(address, value)


register_backend("cpu", EmulatedBackend)
