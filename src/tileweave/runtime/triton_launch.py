"""The one place that touches Triton's private launcher, to save host time on every launch.

``JITFunction.run`` re-derives the specialisation of every argument on each call, tens of microseconds
of host time: more than a small GEMM on the GPU. The ops therefore keep each compiled kernel and call
its launcher directly with pointers as ints. That launcher is not public API, so it is used only on the
Triton versions listed in ``KNOWN_VERSIONS`` (its argument layout checked there); on any other version,
or with ``TILEWEAVE_FAST_LAUNCH=0``, every launch goes through Triton's public ``kernel[grid](...)``.
"""

from __future__ import annotations

import torch
import triton
from triton.runtime import _allocation

from tileweave.runtime import settings

KNOWN_VERSIONS = ("3.6",)
"""Triton versions (major.minor) whose compiled-kernel launcher layout this module was written for."""


def _known_version() -> bool:
    return ".".join(triton.__version__.split(".")[:2]) in KNOWN_VERSIONS


FAST = settings.flag(settings.FAST_LAUNCH, default=True) and _known_version()
"""Whether launches of kept kernels bypass Triton's public launch path."""


def _scratch(size: int, alignment: int, stream) -> torch.Tensor:
    # Global scratch for device-side tensor descriptors, on the current device, from torch's
    # stream-ordered caching allocator.
    return torch.empty(size, device="cuda" if torch.cuda.is_available() else "cpu", dtype=torch.int8)


def install_allocator() -> None:
    """Give Triton an allocator for descriptor scratch, unless the caller installed their own. Triton
    keeps it in a context variable, so a new thread starts without one: checked on every launch."""
    current = getattr(_allocation, "_allocator", None)
    if current is None or current.get() is getattr(_allocation, "_NULL_ALLOCATOR", None):
        triton.set_allocator(_scratch)


def kept(handle):
    """The compiled kernel behind what ``kernel[grid](...)`` or ``kernel.warmup(...)`` returned."""
    return handle.result() if hasattr(handle, "result") else handle


def _active_hook(hook):
    # Triton 3.6 keeps launch hooks in a chain object that is never None, so its own launch path builds
    # launch metadata and calls the (usually empty) chain on every launch; pass None when it is empty.
    if hook is None or not getattr(hook, "calls", True):
        return None
    return hook


def launch_compiled(kernel, device: int, programs: int, args: tuple, constexprs: tuple) -> None:
    """Launch a kept ``kernel`` on ``programs`` programs of the current stream of CUDA ``device``:
    ``args`` are its runtime arguments (pointers as ints), ``constexprs`` its constexpr values in order
    (the launcher takes one argument per kernel parameter)."""
    stream = torch._C._cuda_getCurrentRawStream(device)
    enter = _active_hook(triton.knobs.runtime.launch_enter_hook)
    leave = _active_hook(triton.knobs.runtime.launch_exit_hook)
    metadata = kernel.launch_metadata((programs, 1, 1), stream, *args, *constexprs) if enter else None
    launcher = kernel.run
    scratch = _cached_scratch(launcher, device, stream, programs)
    if scratch is _USE_TRITON:
        launcher(programs, 1, 1, stream, kernel.function, kernel.packed_metadata, metadata, enter, leave,
                 *args, *constexprs)
        return
    # Triton's launcher object would allocate the descriptors' global scratch through the allocator
    # on every launch; hand its C entry point a scratch buffer kept per stream instead.
    launcher.launch(programs, 1, 1, stream, kernel.function, launcher.launch_cooperative_grid,
                    launcher.launch_pdl, scratch, None, kernel.packed_metadata, metadata, enter, leave,
                    *args, *constexprs)


_scratch_buffers: dict[tuple[int, int], tuple[int, torch.Tensor]] = {}
_USE_TRITON = object()


def _cached_scratch(launcher, device: int, stream: int, programs: int):
    """Address of a global-scratch buffer for ``launcher`` on ``stream`` (None when the kernel needs
    none), or ``_USE_TRITON`` to let Triton's launcher allocate: an unknown launcher layout, profiling
    scratch, or a stream being captured.

    Kernels on one stream run one after another, so one buffer per stream is never in use by two
    launches at once. Under CUDA-graph capture the buffer would be baked into the graph and could be
    shared with work on another stream at replay, so captures keep Triton's per-launch allocation.
    """
    size = getattr(launcher, "global_scratch_size", None)
    if (size is None or getattr(launcher, "profile_scratch_size", 1) or not hasattr(launcher, "launch")
            or torch._C._cuda_isCurrentStreamCapturing()):
        return _USE_TRITON
    if size == 0:
        return None
    nbytes = programs * getattr(launcher, "num_ctas", 1) * size
    entry = _scratch_buffers.get((device, stream))
    if entry is None or entry[1].numel() < nbytes:
        buffer = torch.empty(max(nbytes, 1 << 16), dtype=torch.uint8, device=torch.device("cuda", device))
        entry = _scratch_buffers[(device, stream)] = (buffer.data_ptr(), buffer)
    return entry[0]
