"""Stream memory operations from the CUDA driver: a 32-bit write or wait enqueued on a stream.

They run on the GPU's front end, not on an SM, so a flag written this way can never be starved by
spinning programs (the deadlock recorded in DESIGN.md), and a stream can wait on a peer's flag without
a kernel. We call the driver through ctypes so that nothing needs compiling.
"""

from __future__ import annotations

import ctypes
import functools

# cuStreamWaitValue32 flags (CUstreamWaitValue_flags): GEQ is the cyclic test
# (int32_t)(*addr - value) >= 0, which tolerates the epoch wrapping around.
_WAIT_VALUE_GEQ = 0x0
# cuStreamWriteValue32 flags (CUstreamWriteValue_flags): DEFAULT issues a system-wide memory fence
# before the write, so data copied earlier on the same stream is visible before the flag is.
_WRITE_VALUE_DEFAULT = 0x0


class DriverError(RuntimeError):
    pass


@functools.cache
def _functions():
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:  # pragma: no cover - only without an NVIDIA driver
        raise DriverError(f"cannot load the CUDA driver (libcuda.so.1): {exc}") from exc

    def bind(*names):
        for name in names:
            try:
                fn = getattr(lib, name)
            except AttributeError:
                continue
            fn.restype = ctypes.c_int
            fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
            return fn
        raise DriverError(f"the CUDA driver exports none of {names}")

    memcpy = lib.cuMemcpyAsync
    memcpy.restype = ctypes.c_int
    memcpy.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]

    get_error = lib.cuGetErrorString
    get_error.restype = ctypes.c_int
    get_error.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    return (bind("cuStreamWriteValue32_v2", "cuStreamWriteValue32"),
            bind("cuStreamWaitValue32_v2", "cuStreamWaitValue32"),
            get_error, memcpy)


def _check(result: int, what: str) -> None:
    if result != 0:
        message = ctypes.c_char_p()
        _functions()[2](result, ctypes.byref(message))
        text = message.value.decode() if message.value else "unknown error"
        raise DriverError(f"{what} failed with CUDA error {result}: {text}")


def stream_write_u32(stream_handle: int, address: int, value: int) -> None:
    """Enqueue ``*address = value`` on the stream (after a system fence)."""
    _check(_functions()[0](ctypes.c_void_p(stream_handle), address, value & 0xFFFFFFFF,
                           _WRITE_VALUE_DEFAULT), "cuStreamWriteValue32")


def stream_wait_u32(stream_handle: int, address: int, value: int) -> None:
    """Make the stream wait until ``(int32)(*address - value) >= 0``."""
    _check(_functions()[1](ctypes.c_void_p(stream_handle), address, value & 0xFFFFFFFF,
                           _WAIT_VALUE_GEQ), "cuStreamWaitValue32")


def memcpy_async(dst: int, src: int, nbytes: int, stream_handle: int) -> None:
    """Enqueue a copy of ``nbytes`` between device addresses. With a peer's address on either side
    the driver uses a copy engine, not an SM (measured on H200: DESIGN.md, Transport)."""
    _check(_functions()[3](dst, src, nbytes, ctypes.c_void_p(stream_handle)), "cuMemcpyAsync")
