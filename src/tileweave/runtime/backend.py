"""Where a fused op's memory lives and how its producer moves data: one interface, two backends.

``CudaBackend`` uses PyTorch symmetric memory, a high-priority copy-engine stream and the driver's
stream memory ops. ``EmulatedBackend`` (``tileweave.runtime.emulated``) gives ranks that are CPU
processes a shared heap and a producer thread, so the same op code and the same Triton kernels run in
the interpreter. The ops see only this interface.

Ordering model, identical in both backends: *main* is the caller's stream (kernels run there);
*comm* is the producer. ``comm_begin`` makes comm wait for everything issued on main so far;
``comm_end`` makes main wait for everything issued on comm so far. Waits and writes on flags are
32-bit and cyclic (see ``tileweave.kernels.sync``).
"""

from __future__ import annotations

import abc
import ctypes
import dataclasses
import math
import socket
import time
import warnings
from typing import Callable

import torch
import torch.distributed as dist

from tileweave.runtime import settings
from tileweave.runtime import driver


_producer_delay_s = 0.0


def set_producer_delay(seconds: float) -> None:
    """Delay every copy this process's producer makes (tests only): a straggling rank, to prove that
    consumers really wait for data instead of racing it."""
    global _producer_delay_s
    _producer_delay_s = float(seconds)


def producer_delay() -> float:
    return _producer_delay_s


class TileweaveError(RuntimeError):
    """A fused op cannot run as asked; the message names the argument and what to do."""


class CollectiveTimeout(TileweaveError):
    """A bounded wait for a peer's flag expired: a rank is missing, late by far, or out of step."""


@dataclasses.dataclass(frozen=True)
class SymmetricBuffer:
    """One allocation of ``nbytes`` on every rank of a group, addressable from this rank."""

    nbytes: int
    addresses: tuple[int, ...]
    """Base address of each rank's allocation, as seen from this process."""
    views: tuple[torch.Tensor, ...]
    """Each rank's allocation as a flat uint8 tensor usable from this process."""

    def view(self, rank: int, dtype: torch.dtype, shape: tuple[int, ...], offset: int = 0) -> torch.Tensor:
        itemsize = torch.empty((), dtype=dtype).element_size()
        count = math.prod(shape)
        end = offset + count * itemsize
        if offset % itemsize or end > self.nbytes:
            raise ValueError(f"view [{offset}, {end}) of {dtype} does not fit a {self.nbytes}-byte buffer")
        return self.views[rank][offset:end].view(dtype).view(shape)

    def address(self, rank: int, offset: int = 0) -> int:
        return self.addresses[rank] + offset


class Backend(abc.ABC):
    """A TP group as the fused ops see it."""

    rank: int
    world_size: int
    device: torch.device
    group: dist.ProcessGroup
    interpreter: bool
    launch_blocks: bool = False
    """A kernel launch returns only when the kernel is done (the interpreter). Stream work that a
    kernel waits for must then be queued before the launch; on GPUs it is queued after the launch,
    so a stream wait on the kernel's own flags can never hold up the launch behind it (two streams
    may share one hardware queue, e.g. under CUDA_DEVICE_MAX_CONNECTIONS=1)."""
    num_sms: int
    default_max_spin: int
    timeout_s: float
    """Seconds a host-side wait for a peer may take before it raises ``CollectiveTimeout``."""
    peer_access: bool = True
    """Every rank of the group can address every other's memory, so the fused paths can run. Without it
    (a group across nodes, or GPUs without peer-to-peer) every op takes its NCCL path."""
    one_host: bool = True
    """The group's ranks share a host, so their agreement before each call goes through its shared
    memory (``tileweave.runtime.agreement``); otherwise through a collective."""
    no_peer_access: str = ""
    """Why ``peer_access`` is False (for the warning that says so)."""

    @abc.abstractmethod
    def allocate(self, nbytes: int) -> SymmetricBuffer:
        """Collective: every rank must call with the same size in the same order."""

    @abc.abstractmethod
    def comm_begin(self) -> None: ...

    @abc.abstractmethod
    def comm_copy(self, dst: torch.Tensor, src: torch.Tensor) -> None: ...

    @abc.abstractmethod
    def comm_wait(self, address: int, value: int) -> None: ...

    @abc.abstractmethod
    def comm_write(self, address: int, value: int) -> None: ...

    @abc.abstractmethod
    def comm_end(self) -> None: ...

    @abc.abstractmethod
    def main_wait(self, address: int, value: int) -> None: ...

    @abc.abstractmethod
    def main_write(self, address: int, value: int) -> None: ...

    def max_programs(self, reducing: bool) -> int:
        """Upper bound on persistent programs. All programs must be resident at once, because the
        reduce-scatter's own chunk waits on tiles that peers' programs produce."""
        return self.num_sms

    def synchronize(self) -> None:
        pass

    def host_mirror(self) -> "HostMirror":
        """A pinned host copy of a device word, refreshed behind the caller's stream (CUDA only)."""
        raise NotImplementedError(f"{type(self).__name__} has no asynchronous host mirror")


class HostMirror:
    """A device int32 word copied into pinned host memory behind the work queued on the caller's stream,
    and read by the host without waiting: the fused ops' error word, checked one call late so that no
    call synchronises. Driver calls throughout: the error word's share of a call's host time fell from
    38-45 us (torch's pinned copy and event objects) to 13-20 us on the GPU hosts."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._host = torch.zeros(1, dtype=torch.int32, pin_memory=True)
        self._value = ctypes.c_int32.from_address(self._host.data_ptr())
        with torch.cuda.device(device):
            self._event = driver.event_create()
        self._queued = False

    def refresh(self, word: torch.Tensor) -> None:
        """Queue a copy of ``word`` on the caller's stream, after what is queued there now."""
        stream = torch._C._cuda_getCurrentRawStream(self._device.index)
        driver.memcpy_async(self._host.data_ptr(), word.data_ptr(), 4, stream)
        driver.event_record(self._event, stream)
        self._queued = True

    def read(self) -> int:
        """The word as of the last refresh that has landed; 0 while none has."""
        if not self._queued or not driver.event_done(self._event):
            return 0
        return self._value.value

    def clear(self) -> None:
        self._value.value = 0


class HostWord:
    """An int32 in pinned host memory that kernels write directly (under unified addressing a pinned
    allocation's address is valid on the device too) and the host reads with no driver call: an error
    word that costs a call nothing to check. A CPU tensor on the CPU (the interpreter writes it)."""

    def __init__(self, device: torch.device) -> None:
        self.tensor = torch.zeros(1, dtype=torch.int32, pin_memory=device.type == "cuda")
        self._value = ctypes.c_int32.from_address(self.tensor.data_ptr())

    def read(self) -> int:
        return self._value.value

    def clear(self) -> None:
        self._value.value = 0


def _group_size(group: dist.ProcessGroup | None) -> tuple[dist.ProcessGroup, int, int]:
    if not dist.is_available() or not dist.is_initialized():
        raise TileweaveError("torch.distributed is not initialised: call dist.init_process_group first "
                             "(or pass world-size-1 inputs to tileweave.matmul)")
    group = group if group is not None else dist.group.WORLD
    rank = dist.get_rank(group)
    if rank < 0:
        raise TileweaveError(f"this process (global rank {dist.get_rank()}) is not a member of the group "
                             f"passed to tileweave ({dist.get_world_size(group)} ranks): pass a group it "
                             "belongs to")
    return group, rank, dist.get_world_size(group)


def judge_topology(everyone: list[tuple[str, int, str, str]], rank: int, *, shares_gpus: bool,
                   can_access: Callable[[int], bool]) -> str:
    """Why the group cannot run the fused paths, seen from ``rank`` ("" if it can). ``everyone``: each
    rank's ``(host, device index, GPU uuid, GPU name)``; ``can_access(device index)``: whether this
    rank's GPU reaches that GPU of its host. A group across hosts, or a GPU without peer access to a
    peer's, runs on NCCL (the reason says so). Raises ``TileweaveError`` for what no path serves: ranks
    sharing a GPU (unless ``shares_gpus``), GPU models mixed within a host."""
    hosts = sorted({entry[0] for entry in everyone})
    gpus = [entry[:3:2] for entry in everyone]  # (host, uuid)
    if len(set(gpus)) < len(gpus) and not shares_gpus:
        shared = sorted(r for r, gpu in enumerate(gpus) if gpus.count(gpu) > 1)
        raise TileweaveError(f"ranks {shared} of the TP group use the same GPU ({everyone[shared[0]][3]}, "
                             f"device {everyone[shared[0]][1]}); tileweave needs one GPU per rank "
                             "(set the device with torch.cuda.set_device(local_rank) before the first call)")
    if len(hosts) > 1:
        return f"the TP group spans {len(hosts)} hosts ({', '.join(hosts)})"
    names = sorted({entry[3] for entry in everyone})
    if len(names) > 1:
        raise TileweaveError(f"the TP group mixes GPU models {names}; use one model per group")
    me = everyone[rank][1]
    for entry in everyone:
        if entry[1] != me and not can_access(entry[1]):
            return f"GPU {me} has no peer access to GPU {entry[1]}"
    return ""


class CudaBackend(Backend):
    """PyTorch symmetric memory, a priority -1 copy-engine stream, driver stream memory ops."""

    shares_gpus = False
    """Whether ranks of the group may share a GPU. PyTorch symmetric memory refuses it, so this backend
    raises a clear error first; ``tileweave.testing.shared_gpu`` allows it for tests on one GPU."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device) -> None:
        self.group, self.rank, self.world_size = _group_size(group)
        self.device = device
        self.interpreter = False
        self.num_sms = torch.cuda.get_device_properties(device).multi_processor_count
        # The in-kernel bound, in polls of kernels.sync.wait_epoch. A poll is one system-scope acquire
        # atomic on a flag in this GPU's memory (every flag a kernel waits on is local; peers write
        # into it) and a compare: ~0.21 us on an H200 with one program polling, ~0.22 us with all 132
        # (measured: 2**26 polls took 14.9 s), so 2**26 polls are ~15 s per wait. That is far above
        # any straggler (a late rank is milliseconds behind) and short enough that a lost peer
        # becomes an error well within a minute and within the host's bound below, even where a
        # program's waits on one missing peer expire one after another (once per chunk of that peer
        # it takes: at most a few). Stream waits are not bounded on the GPU; the host bounds them in
        # synchronize (timeout_s).
        self.default_max_spin = settings.max_spin(1 << 26)
        self.timeout_s = settings.timeout_s()
        self.comm_stream = torch.cuda.Stream(device=device, priority=-1)
        self._comm_handle = self.comm_stream.cuda_stream
        with torch.cuda.device(device):
            self._begin_event = driver.event_create()
            self._end_event = driver.event_create()
        self._check_topology()

    def _check_topology(self) -> None:
        props = torch.cuda.get_device_properties(self.device)
        me = (socket.gethostname(), self.device.index, str(getattr(props, "uuid", self.device.index)),
              props.name)
        everyone: list = [None] * self.world_size
        dist.all_gather_object(everyone, me, group=self.group)
        visible = torch.cuda.device_count()
        # Every rank judges its own peers; the group takes the fused paths only if every rank can.
        mine = judge_topology(everyone, self.rank, shares_gpus=self.shares_gpus,
                              can_access=lambda peer: peer >= visible or torch.cuda.can_device_access_peer(
                                  self.device.index, peer))
        reasons: list = [None] * self.world_size
        dist.all_gather_object(reasons, mine, group=self.group)
        self.one_host = len({entry[0] for entry in everyone}) == 1
        self.no_peer_access = next((reason for reason in reasons if reason), "")
        self.peer_access = not self.no_peer_access

    def allocate(self, nbytes: int) -> SymmetricBuffer:
        from torch.distributed import _symmetric_memory as symm_mem

        tensor = symm_mem.empty(nbytes, dtype=torch.uint8, device=self.device)
        handle = symm_mem.rendezvous(tensor, self.group.group_name)
        # Symmetric memory comes uninitialised, and flags must start below every epoch: zero it, and
        # let no rank touch a peer's copy before every rank has.
        tensor.zero_()
        torch.cuda.synchronize(self.device)
        dist.barrier(group=self.group)
        views = tuple(tensor if peer == self.rank else handle.get_buffer(peer, (nbytes,), torch.uint8)
                      for peer in range(self.world_size))
        return SymmetricBuffer(nbytes=nbytes, addresses=tuple(v.data_ptr() for v in views), views=views)

    def _main_handle(self) -> int:
        return torch._C._cuda_getCurrentRawStream(self.device.index)

    def comm_begin(self) -> None:
        driver.event_record(self._begin_event, self._main_handle())
        driver.stream_wait_event(self._comm_handle, self._begin_event)

    def comm_copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if not (dst.is_contiguous() and src.is_contiguous()) or dst.nbytes != src.nbytes:
            raise ValueError("comm_copy needs two contiguous tensors of the same size")
        if _producer_delay_s:
            # The host waits before issuing the copy. A sleeping kernel on the copy stream would need
            # an SM, and none is free while a fused kernel's programs wait for this stream's earlier
            # copies: the starvation of docs/design.md's deadlock, not a straggler.
            time.sleep(_producer_delay_s)
        # A copy whose source or destination is a peer's memory runs on a copy engine, not on an SM.
        driver.memcpy_async(dst.data_ptr(), src.data_ptr(), src.nbytes, self._comm_handle)

    def comm_wait(self, address: int, value: int) -> None:
        driver.stream_wait_u32(self._comm_handle, address, value)

    def comm_write(self, address: int, value: int) -> None:
        driver.stream_write_u32(self._comm_handle, address, value)

    def comm_end(self) -> None:
        driver.event_record(self._end_event, self._comm_handle)
        driver.stream_wait_event(self._main_handle(), self._end_event)

    def main_wait(self, address: int, value: int) -> None:
        driver.stream_wait_u32(self._main_handle(), address, value)

    def main_write(self, address: int, value: int) -> None:
        driver.stream_write_u32(self._main_handle(), address, value)

    def host_mirror(self) -> HostMirror:
        return HostMirror(self.device)

    def synchronize(self) -> None:
        """Wait for the caller's stream and the copy stream, but not forever: stream waits on a
        peer's flag block the GPU until the peer arrives, so a lost peer would otherwise hang the host
        here. Used after each call in debug mode (TILEWEAVE_DEBUG=1)."""
        events = []
        for stream in (torch.cuda.current_stream(self.device), self.comm_stream):
            event = torch.cuda.Event()
            event.record(stream)
            events.append(event)
        deadline = time.monotonic() + self.timeout_s
        while not all(event.query() for event in events):
            if time.monotonic() > deadline:
                raise CollectiveTimeout(f"rank {self.rank}: the GPU streams did not finish within "
                                        f"{self.timeout_s:.0f} s; a peer is missing or its calls are out of "
                                        "step (TILEWEAVE_TIMEOUT_S sets this bound)")
            time.sleep(1e-4)


_BACKENDS: dict[tuple, Backend] = {}
_FACTORIES: dict[str, Callable[[dist.ProcessGroup], Backend]] = {}
"""Backend classes by device type besides CUDA's: ``tileweave.runtime.emulated`` registers the CPU's
emulated ranks when it is imported (``tileweave.testing.emulated.run_ranks`` does)."""


def register_backend(device_type: str, factory: Callable[[dist.ProcessGroup], Backend]) -> None:
    """Make ``get_backend`` build ``factory(group)`` for tensors on ``device_type``."""
    _FACTORIES[device_type] = factory


def get_backend(group: dist.ProcessGroup | None, device: torch.device) -> Backend:
    """The backend for ``group`` on ``device``, created once (collectively) and cached."""
    group, _, _ = _group_size(group)
    key = (group.group_name, device.type, device.index)
    backend = _BACKENDS.get(key)
    if backend is None:
        if device.type == "cuda":
            backend = CudaBackend(group, device)
        elif device.type in _FACTORIES:
            backend = _FACTORIES[device.type](group)
        elif device.type == "cpu":
            raise TileweaveError("CPU tensors need emulated ranks: start them with "
                                 "tileweave.testing.emulated.run_ranks")
        else:
            raise TileweaveError(f"unsupported device {device}; tileweave runs on CUDA GPUs "
                                 "(or on the CPU with emulated ranks for testing)")
        if not backend.peer_access and backend.rank == 0:
            warnings.warn(f"tileweave: {backend.no_peer_access}: this TP group of {backend.world_size} ranks runs "
                          "every op on its NCCL path (no fused communication). Keep TP groups within a node with "
                          "peer access (e.g. mesh['tp'] of a (dp, tp) mesh) to fuse them.", stacklevel=2)
        _BACKENDS[key] = backend
    return backend
