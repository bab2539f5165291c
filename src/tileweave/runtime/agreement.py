"""Agreement between the ranks of a group before a call communicates: every rank posts what it was
called with and reads what every other rank posted, within a bounded wait, so that every rank judges
the same values and, when they are wrong, raises the same error at the same call.

The exchange goes through a shared-memory segment of the group's host (every rank of a TP group is on
one node), not a collective: a wait there can be bounded and abandoned without leaving a half-done
collective that a peer's next call would pair with, it costs no GPU synchronisation, and when the
ranks arrive together it takes microseconds (a store round trip takes hundreds). The segment is set up
at a group's first exchange through the group's key-value store (the one ``init_process_group`` made).

Layout: per rank two slots of ``SLOT_BYTES``, used by the rank's exchanges in turn; a slot holds a
stamp (the exchange's number + 1), the record's length and CRC, and the pickled record. A rank writes
exchange ``n`` into its slot ``n % 2`` only after reading every rank's exchange ``n - 1``, which every
rank posted only after reading exchange ``n - 2``: no slot is overwritten while a peer may still read
it. The CRC makes a reader that races a writer read again instead of taking half a record. After the
slots, per rank, whether it is in a signature's first call (``first_call``): its process id and since
when, so that a wait for it does not count the time it spends compiling that call's kernels.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import mmap
import os
import pickle
import struct
import time
import zlib

import torch.distributed as dist

from tileweave.runtime import files
from tileweave.runtime.backend import CollectiveTimeout, TileweaveError

SLOT_BYTES = 16 << 10
"""One record's slot: far above a call's signature and proposal (a few hundred bytes pickled)."""
_HEADER = struct.Struct("<qqq")  # stamp, length, crc32
_STAMP = struct.Struct("<q")
_PID = struct.Struct("<q")  # of a rank in a first call, 0 when none; then since when (time.monotonic)
_SINCE = struct.Struct("<d")
FIRST_CALL_ALLOWANCE_S = 600.0
"""How long a peer may stay in a signature's first call (``first_call``) before a wait for it counts
against the bound anyway: long enough for a cold compile of a call's kernels (seconds to a minute),
short of a compile that hangs."""


class _Segment:
    """One group's shared slots on this rank, and the number of its next exchange."""

    def __init__(self, memory: mmap.mmap, rank: int, world: int) -> None:
        self.memory, self.rank, self.world = memory, rank, world
        self.next = 0

    def offset(self, rank: int, n: int) -> int:
        return (2 * rank + n % 2) * SLOT_BYTES

    def post(self, n: int, payload: bytes) -> None:
        at = self.offset(self.rank, n)
        # The stamp last: a reader that sees it sees the rest (and the CRC catches a torn read anyway).
        self.memory[at + _HEADER.size:at + _HEADER.size + len(payload)] = payload
        _HEADER.pack_into(self.memory, at, 0, len(payload), zlib.crc32(payload))
        _STAMP.pack_into(self.memory, at, n + 1)

    def withdraw(self, n: int) -> None:
        _HEADER.pack_into(self.memory, self.offset(self.rank, n), 0, 0, 0)

    def first_call_offset(self, rank: int) -> int:
        return 2 * self.world * SLOT_BYTES + rank * (_PID.size + _SINCE.size)

    def mark_first_call(self, inside: bool) -> None:
        at = self.first_call_offset(self.rank)
        if inside:
            _SINCE.pack_into(self.memory, at + _PID.size, time.monotonic())
        _PID.pack_into(self.memory, at, os.getpid() if inside else 0)

    def in_first_call(self, rank: int) -> bool:
        """Whether rank ``rank`` is in a signature's first call, alive, for less than the allowance."""
        at = self.first_call_offset(rank)
        (pid,), (since,) = _PID.unpack_from(self.memory, at), _SINCE.unpack_from(self.memory, at + _PID.size)
        if not pid or time.monotonic() - since > FIRST_CALL_ALLOWANCE_S:
            return False
        try:
            os.kill(pid, 0)  # the ranks of a segment share a host, and so process ids
        except ProcessLookupError:
            return False
        except PermissionError:
            pass  # alive, another user's
        return True

    def read(self, rank: int, n: int) -> bytes | None:
        """Rank ``rank``'s record of exchange ``n``, or None while it has not (wholly) posted it."""
        at = self.offset(rank, n)
        stamp, length, crc = _HEADER.unpack_from(self.memory, at)
        if stamp != n + 1 or not 0 < length <= SLOT_BYTES - _HEADER.size:
            return None
        payload = bytes(self.memory[at + _HEADER.size:at + _HEADER.size + length])
        return payload if zlib.crc32(payload) == crc else None


_segments: dict[tuple[int, str], _Segment] = {}
SEGMENT_PREFIX = "tileweave-agreement-"
"""Agreement segments are ``tileweave-agreement-<pid of rank 0>-<random>`` in shared memory."""
_owned: dict[str, int] = {}
"""The segments this process made, by path: their lock's descriptor (held while the process runs)."""


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _remove_owned(path: str) -> None:
    _unlink(path)
    lock = _owned.pop(path, None)
    if lock is not None:
        os.close(lock)


def _store(group: dist.ProcessGroup):
    """The group's store, or None where this torch keeps it elsewhere."""
    try:
        from torch.distributed.distributed_c10d import _get_process_group_store

        return _get_process_group_store(group)
    except (ImportError, KeyError, AttributeError, RuntimeError):
        return None


def _segment(group: dist.ProcessGroup, rank: int, world: int, timeout_s: float) -> _Segment | None:
    """The group's segment, set up at its first exchange: rank 0 makes the file and publishes its
    name, every rank maps it, and the last to map it removes the name. None without a store (the
    exchange is then a collective)."""
    key = (id(group), group.group_name)
    segment = _segments.get(key)
    if segment is not None:
        return segment
    store = _store(group)
    if store is None:
        return None
    size = 2 * world * SLOT_BYTES + world * (_PID.size + _SINCE.size)
    name_key = "tileweave/agreement-segment"
    if rank == 0:
        # Named after this process and locked by it (runtime.files), so that a segment left behind when
        # a peer never maps it (it raised before its first op) is removed: at this process's exit, or
        # by the next segment's making once this process is gone.
        path, lock = files.make_owned(SEGMENT_PREFIX)
        _owned[path] = lock
        atexit.register(_remove_owned, path)
        handle = os.dup(lock)
        os.ftruncate(handle, size)
        store.set(name_key, path)
    else:
        try:
            store.wait([name_key], datetime.timedelta(seconds=timeout_s))
        except RuntimeError:  # the store's timeout (DistStoreError)
            raise CollectiveTimeout(f"rank {rank}: a bounded wait of {timeout_s:.0f} s for rank 0 to set up the "
                                    "group's agreement expired; rank 0 is missing or far behind") from None
        path = store.get(name_key).decode()
        handle = os.open(path, os.O_RDWR)
    try:
        memory = mmap.mmap(handle, size)
    finally:
        os.close(handle)
    if store.add("tileweave/agreement-mapped", 1) == world:
        _unlink(path)
    segment = _segments[key] = _Segment(memory, rank, world)
    return segment


def exchange(group: dist.ProcessGroup, rank: int, world: int, op: str, record: object, *,
             timeout_s: float, one_host: bool = True) -> list:
    """Every rank's ``record`` (any picklable value), in rank order. Every rank of ``group`` must call
    this the same number of times, in the same order (for whichever op: the exchanges of a group are
    numbered together, and ``judge`` finds ranks that are in different ops).

    Raises ``CollectiveTimeout`` naming the ranks that did not post within ``timeout_s`` seconds; this
    rank's post is then withdrawn and the exchange does not count, so the next call of every rank
    exchanges again at the same place. The time a late rank spends in a signature's first call
    (``first_call``: compiling its kernels) does not count, up to ``FIRST_CALL_ALLOWANCE_S``.
    ``one_host=False`` (a group across hosts, which share no memory): a collective, not bounded."""
    if world == 1:
        return [record]
    segment = _segment(group, rank, world, timeout_s) if one_host else None
    if segment is None:
        everyone: list = [None] * world
        dist.all_gather_object(everyone, (op, record), group=group)
        return _records(op, everyone)
    n = segment.next
    payload = pickle.dumps((op, record))
    if len(payload) > SLOT_BYTES - _HEADER.size:
        raise TileweaveError(f"{op}: the call's agreement record is {len(payload)} bytes, above the "
                             f"{SLOT_BYTES - _HEADER.size} of its slot")
    segment.post(n, payload)
    records: list = [None] * world
    records[rank] = payload
    deadline = time.monotonic() + timeout_s
    polls = 0
    while True:
        for r in range(world):
            if records[r] is None:
                records[r] = segment.read(r, n)
        if all(entry is not None for entry in records):
            break
        if time.monotonic() > deadline:
            late = [r for r, entry in enumerate(records) if entry is None]
            if any(segment.in_first_call(r) for r in late):
                # Compiling the kernels of a first call, at its own pace: the bound starts again after.
                deadline = time.monotonic() + timeout_s
                continue
            segment.withdraw(n)
            missing = ", ".join(str(r) for r in late)
            raise CollectiveTimeout(
                f"{op} on rank {rank}: a bounded wait of {timeout_s:.0f} s for rank {missing} to join this call "
                "expired; a peer is missing, far behind, raised before it reached the call, or calls the ops in "
                "a different order (TILEWEAVE_TIMEOUT_S, or TILEWEAVE_EMULATED_TIMEOUT_S on the CPU, sets "
                "this bound)")
        polls += 1
        # Spin while the peers are near (the usual case, microseconds), then yield the core: on a host
        # shared with the peers (emulated ranks) a spinning rank would slow the one it waits for.
        time.sleep(0 if polls < 200 else min(1e-3, 1e-6 * polls))
    segment.next = n + 1
    return _records(op, [pickle.loads(entry) for entry in records])


_inside_first_call = 0


@contextlib.contextmanager
def first_call():
    """Within the block, this process is in a signature's first call, after its agreement: it launches,
    and so compiles, the call's kernels (seconds to a minute with a cold cache, each rank at its own
    pace). Marked on the segment of every group this process has exchanged in (the compile holds up
    its calls on any of them), so that a peer's bounded wait for this rank there (its next call's
    agreement) does not count the time spent here. Nothing where there is no segment (groups of one,
    exchanges that are collectives, unbounded anyway). Blocks may nest."""
    global _inside_first_call
    _inside_first_call += 1
    if _inside_first_call == 1:
        for segment in _segments.values():
            segment.mark_first_call(True)
    try:
        yield
    finally:
        _inside_first_call -= 1
        if _inside_first_call == 0:
            for segment in _segments.values():
                segment.mark_first_call(False)


def _records(op: str, everyone: list) -> list:
    """The records of ``everyone``'s ``(op, record)``, after checking that every rank is in ``op``."""
    if any(theirs != op for theirs, _ in everyone):
        calls = ", ".join(f"rank {r} {theirs}" for r, (theirs, _) in enumerate(everyone))
        raise TileweaveError(f"the ranks of the group are in different calls ({calls}): every rank must call the "
                             "ops in the same order, the same number of times")
    return [record for _, record in everyone]


_ERRORS = {"TypeError": TypeError, "ValueError": ValueError, "CollectiveTimeout": CollectiveTimeout}


def judge(op: str, everyone: list, *, hint: str = "") -> None:
    """Raise, the same error on every rank, if a rank's checks failed or the ranks' signatures differ.
    ``everyone``: each rank's ``(signature, failure, proposal)``, where ``failure`` is None or the
    ``(type name, message)`` of what that rank's checks raised. The lowest failing rank's error is
    raised; its message carries the rank unless every rank failed alike. A signature that is a dict
    (argument name: ``tileweave.ops.common.signature_of``'s text) gives a message that names the arguments that differ.
    ``hint``: appended to the message of differing signatures (what every rank must share)."""
    failures = [(r, entry[1]) for r, entry in enumerate(everyone) if entry[1] is not None]
    if failures:
        rank, (kind, message) = failures[0]
        if len(failures) < len(everyone) or any(f != failures[0][1] for _, f in failures):
            message = f"{message} (the arguments of rank {rank}; every rank of the group raises this error)"
        raise _ERRORS.get(kind, TileweaveError)(message)
    first = everyone[0][0]
    for rank, entry in enumerate(everyone):
        theirs = entry[0]
        if theirs == first:
            continue
        if isinstance(first, dict) and isinstance(theirs, dict) and first.keys() == theirs.keys():
            names = [name for name in first if first[name] != theirs[name]]
            first = "; ".join(f"{name} {first[name]}" for name in names)
            theirs = "; ".join(f"{name} {theirs[name]}" for name in names)
        raise TileweaveError(f"{op}: every rank of the group must pass the same shapes and dtypes, but rank 0 "
                             f"passed {first} and rank {rank} passed {theirs}{hint}")
