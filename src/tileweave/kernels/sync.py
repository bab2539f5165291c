"""Synchronisation primitives shared by every fused kernel.

Flags are int32 words that carry an epoch (the call count of the op that owns them), never 0/1, so they
are never reset and a reader of an older epoch cannot be fooled. Comparisons are cyclic, like
``cuStreamWaitValue32``'s GEQ: ``(int32)(value - epoch) >= 0``.

Every primitive here is built from ``tl.atomic_*`` with ``sem``/``scope`` (no inline PTX), so the same
code runs compiled on the GPU and in Triton's interpreter on the CPU.
"""

import triton
import triton.language as tl


@triton.jit
def epoch_missed(value, epoch):
    return (value - epoch) < 0


@triton.jit
def wait_epoch(flag_ptr, epoch, err_ptr, err_code, max_spin):
    """Spin until ``*flag_ptr`` reaches ``epoch`` (acquire, system scope) or ``max_spin`` polls pass.

    On time-out it records ``err_code`` in ``*err_ptr`` (atomic max) and returns anyway: a kernel must
    never hang, and the host turns the error word into an exception. Returns 0 when the flag was
    reached and 1 otherwise; callers add that to an address so that the loads after the wait depend
    on the flag's value and cannot be scheduled above it.
    """
    value = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
    spins = 0
    while epoch_missed(value, epoch) & (spins < max_spin):
        value = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
        spins += 1
    missed = epoch_missed(value, epoch).to(tl.int32)
    if missed != 0:
        tl.atomic_max(err_ptr, err_code, sem="relaxed", scope="gpu")
    return missed


@triton.jit
def signal_epoch(flag_ptr, epoch):
    """Publish ``epoch`` at ``*flag_ptr`` after every thread's earlier stores (CTA barrier, then release).

    The barrier makes the other threads' stores part of what this release publishes; the system scope
    makes them visible to a peer GPU that reads the flag over NVLink.
    """
    tl.debug_barrier()
    tl.atomic_xchg(flag_ptr, epoch, sem="release", scope="sys")


@triton.jit
def release_add(counter_ptr, count, SCOPE: tl.constexpr):
    """Add ``count`` to ``*counter_ptr`` after every thread's earlier stores (CTA barrier, then a
    release at ``SCOPE``): a consumer that sees the total also sees the data it counts. ``"sys"`` for
    a reader on another GPU; ``"gpu"`` where the reader is this GPU's own copy engine or stream."""
    tl.debug_barrier()
    tl.atomic_add(counter_ptr, count, sem="release", scope=SCOPE)
