"""Stream memory operations and events from the CUDA driver: a 32-bit write or wait enqueued on a
stream, copies, and the events that order two streams.

They run on the GPU's front end, not on an SM, so a flag written this way can never be starved by
spinning programs (the deadlock recorded in docs/design.md), and a stream can wait on a peer's flag without
a kernel. We call the driver through ctypes so that nothing needs compiling; a call cost 4-8 us of host
time on the GPU hosts we measured, less than the same work through torch's Python objects: the host time of a fused op's call is what small shapes are bound by.
"""

from __future__ import annotations

import ctypes
import functools
import types

# cuStreamWaitValue32 flags (CUstreamWaitValue_flags): GEQ is the cyclic test
# (int32_t)(*addr - value) >= 0, which tolerates the epoch wrapping around.
_WAIT_VALUE_GEQ = 0x0
# cuStreamWriteValue32 flags (CUstreamWriteValue_flags): DEFAULT issues a system-wide memory fence
# before the write, so data copied earlier on the same stream is visible before the flag is.
_WRITE_VALUE_DEFAULT = 0x0
_EVENT_DISABLE_TIMING = 0x2  # CUevent_flags
_ERROR_NOT_READY = 600  # CUresult of cuEventQuery for work not yet done


class DriverError(RuntimeError):
    pass


@functools.cache
def _functions():
    """The driver entry points, typed once. Handles (streams, events) and device addresses are passed as
    64-bit integers, so a call converts no Python object into a ctypes one."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:  # pragma: no cover - only without an NVIDIA driver
        raise DriverError(f"cannot load the CUDA driver (libcuda.so.1): {exc}") from exc

    def bind(argtypes, *names):
        for name in names:
            try:
                fn = getattr(lib, name)
            except AttributeError:
                continue
            fn.restype = ctypes.c_int
            fn.argtypes = argtypes
            return fn
        raise DriverError(f"the CUDA driver exports none of {names}")

    u64, u32 = ctypes.c_uint64, ctypes.c_uint32
    return types.SimpleNamespace(
        write_value=bind([u64, u64, u32, ctypes.c_uint], "cuStreamWriteValue32_v2", "cuStreamWriteValue32"),
        wait_value=bind([u64, u64, u32, ctypes.c_uint], "cuStreamWaitValue32_v2", "cuStreamWaitValue32"),
        error_string=bind([ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)], "cuGetErrorString"),
        memcpy=bind([u64, u64, ctypes.c_size_t, u64], "cuMemcpyAsync"),
        event_create=bind([ctypes.POINTER(u64), ctypes.c_uint], "cuEventCreate"),
        event_record=bind([u64, u64], "cuEventRecord"),
        event_query=bind([u64], "cuEventQuery"),
        stream_wait_event=bind([u64, u64, ctypes.c_uint], "cuStreamWaitEvent"),
    )


def _check(result: int, what: str) -> None:
    if result != 0:
        message = ctypes.c_char_p()
        _functions().error_string(result, ctypes.byref(message))
        text = message.value.decode() if message.value else "unknown error"
        raise DriverError(f"{what} failed with CUDA error {result}: {text}")


def stream_write_u32(stream_handle: int, address: int, value: int) -> None:
    """Enqueue ``*address = value`` on the stream (after a system fence)."""
    _check(_functions().write_value(stream_handle, address, value & 0xFFFFFFFF, _WRITE_VALUE_DEFAULT),
           "cuStreamWriteValue32")


def stream_wait_u32(stream_handle: int, address: int, value: int) -> None:
    """Make the stream wait until ``(int32)(*address - value) >= 0``."""
    _check(_functions().wait_value(stream_handle, address, value & 0xFFFFFFFF, _WAIT_VALUE_GEQ),
           "cuStreamWaitValue32")


def memcpy_async(dst: int, src: int, nbytes: int, stream_handle: int) -> None:
    """Enqueue a copy of ``nbytes`` between device addresses. With a peer's address on either side
    the driver uses a copy engine, not an SM (measured on H200: docs/design.md, "Measuring")."""
    _check(_functions().memcpy(dst, src, nbytes, stream_handle), "cuMemcpyAsync")


def event_create() -> int:
    """A new event without timing, in the calling thread's current context (make the device current
    first). Events are cheap and live as long as the process."""
    handle = ctypes.c_uint64()
    _check(_functions().event_create(ctypes.byref(handle), _EVENT_DISABLE_TIMING), "cuEventCreate")
    return handle.value


def event_record(event: int, stream_handle: int) -> None:
    """Enqueue ``event`` on the stream: it completes when the work issued there before it has."""
    _check(_functions().event_record(event, stream_handle), "cuEventRecord")


def stream_wait_event(stream_handle: int, event: int) -> None:
    """Make the stream wait for the last record of ``event`` (the host does not wait)."""
    _check(_functions().stream_wait_event(stream_handle, event, 0), "cuStreamWaitEvent")


def event_done(event: int) -> bool:
    """Whether the work before the last record of ``event`` has finished (never blocks)."""
    result = _functions().event_query(event)
    if result == _ERROR_NOT_READY:
        return False
    _check(result, "cuEventQuery")
    return True
