"""Ranks that share a GPU, for the GPU tests on a machine with fewer GPUs than ranks (tests only).

PyTorch symmetric memory refuses two ranks on one device, and NCCL does too. Here each rank is still its
own process with its own CUDA context, streams and copy stream, but its symmetric buffers are plain
allocations shared with the other processes through CUDA IPC (PyTorch's own sharing of CUDA tensors
between processes), and the group is gloo, which runs the unfused paths' collectives on CUDA tensors
through the host. Every fused path then runs its real kernels, stream memory ops and copies, so its
protocol and its arithmetic are checked on the GPU; its timing says nothing (the ranks' contexts take
turns on the GPU, and "peer" memory is local). What it cannot run: NCCL inside a CUDA graph, and
PyTorch's own symmetric memory (async-TP).

    install(torch.device("cuda", 0))  # in every rank, after init_process_group("gloo", ...)
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tileweave.runtime import backend as _backend


class SharedGpuBackend(_backend.CudaBackend):
    """``CudaBackend`` with symmetric buffers shared by CUDA IPC, so that ranks may share a GPU."""

    shares_gpus = True

    def __init__(self, group: dist.ProcessGroup, device: torch.device) -> None:
        super().__init__(group, device)
        self._opened: list[tuple[torch.Tensor, ...]] = []

    def allocate(self, nbytes: int) -> _backend.SymmetricBuffer:
        # Zeroed on this rank's stream and finished before any rank maps it: flags start below every epoch.
        tensor = torch.zeros(nbytes, dtype=torch.uint8, device=self.device)
        torch.cuda.synchronize(self.device)
        everyone: list = [None] * self.world_size
        dist.all_gather_object(everyone, tensor.untyped_storage()._share_cuda_(), group=self.group)
        views = []
        for peer, handle in enumerate(everyone):
            if peer == self.rank:
                views.append(tensor)
            else:
                storage = torch.UntypedStorage._new_shared_cuda(*handle)
                views.append(torch.empty(0, dtype=torch.uint8, device=self.device).set_(storage, 0, (nbytes,)))
        # Kept for the process's life: a peer may still map a buffer that this rank's workspace has
        # dropped (tests only; workspaces grow geometrically, so this stays small).
        self._opened.append(tuple(views))
        dist.barrier(group=self.group)
        return _backend.SymmetricBuffer(nbytes=nbytes, addresses=tuple(v.data_ptr() for v in views),
                                        views=tuple(views))


def install(device: torch.device, group: dist.ProcessGroup | None = None) -> SharedGpuBackend:
    """Make ``SharedGpuBackend`` the backend of ``group`` (default: the world) on ``device`` in this
    process, for every op whose first call comes afterwards (ops look their backend up then). Collective:
    every rank of the group calls it."""
    group = group if group is not None else dist.group.WORLD
    backend = SharedGpuBackend(group, device)
    _backend._BACKENDS[(group.group_name, device.type, device.index)] = backend
    return backend
