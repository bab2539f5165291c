"""Agreement between the ranks of a group before a call communicates: every rank posts what it was
called with and reads what every other rank posted, within a bounded wait, so that every rank judges
the same values and, when they are wrong, raises the same error at the same call.

The exchange goes through the group's key-value store (the one ``init_process_group`` set up), not a
collective: a wait on a store key can be bounded and abandoned without leaving a half-done collective
that a peer's next call would pair with, and it costs no GPU synchronisation. Exchange ``n`` of an op
on a group uses the keys ``tileweave/<op>/<n>/<rank>``; a rank deletes its key of exchange ``n - 1``
once every rank has posted exchange ``n`` (each posts only after reading all of exchange ``n - 1``).
"""

from __future__ import annotations

import datetime
import pickle

import torch
import torch.distributed as dist

from tileweave.runtime.backend import CollectiveTimeout, TileweaveError

_sequence: dict[tuple[str, str], int] = {}
"""(group name, op) -> the number of this process's exchanges so far: the next exchange's ``n``."""


def _store(group: dist.ProcessGroup):
    """The group's store, or None where this torch keeps it elsewhere (then the exchange is a
    collective, unbounded)."""
    try:
        from torch.distributed.distributed_c10d import _get_process_group_store

        return _get_process_group_store(group)
    except (ImportError, KeyError, AttributeError, RuntimeError):
        return None


def exchange(group: dist.ProcessGroup, rank: int, world: int, op: str, record: object, *,
             timeout_s: float) -> list:
    """Every rank's ``record`` (any picklable value), in rank order. Every rank of ``group`` must call
    this for ``op`` the same number of times, in the same order.

    Raises ``CollectiveTimeout`` naming the ranks that did not post within ``timeout_s`` seconds; this
    rank's post is then withdrawn and the exchange does not count, so the next call of every rank
    exchanges again at the same place."""
    if world == 1:
        return [record]
    store = _store(group)
    if store is None:
        everyone: list = [None] * world
        dist.all_gather_object(everyone, record, group=group)
        return everyone
    counter = (group.group_name, op)
    n = _sequence.get(counter, 0)
    keys = [f"tileweave/{op}/{n}/{r}" for r in range(world)]
    store.set(keys[rank], pickle.dumps(record))
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout_s))
    except RuntimeError:  # the store's timeout (DistStoreError)
        missing = [r for r in range(world) if not store.check([keys[r]])]
        if missing:
            _delete(store, keys[rank])
            ranks = ", ".join(str(r) for r in missing)
            raise CollectiveTimeout(
                f"{op} on rank {rank}: a bounded wait of {timeout_s:.0f} s for rank {ranks} to join this call "
                "expired; a peer is missing, far behind, raised before it reached the call, or calls the ops in "
                "a different order (TILEWEAVE_TIMEOUT_S, or TILEWEAVE_EMULATED_TIMEOUT_S on the CPU, sets "
                "this bound)") from None
    values = store.multi_get(keys)
    _sequence[counter] = n + 1
    if n:
        _delete(store, f"tileweave/{op}/{n - 1}/{rank}")
    return [pickle.loads(v) for v in values]


def _delete(store, key: str) -> None:
    try:
        store.delete_key(key)
    except RuntimeError:  # a store without deletion keeps the key: only its size grows
        pass


def describe(value: object, *, dims: tuple[int, ...] | None = None) -> object:
    """What the ranks compare of an argument, as text: a tensor's shape (``*`` for the dimensions not in
    ``dims`` when given, for a tensor whose other dimensions may differ by rank), dtype and device type,
    e.g. ``"[4, *] float16 on cuda"``; None; a number or string itself (its repr, so that NaN equals
    NaN); else the type's name."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        shape = list(value.shape)
        if dims is not None:
            kept = {d % len(shape) for d in dims if -len(shape) <= d < len(shape)}
            shape = [size if d in kept else "*" for d, size in enumerate(shape)]
        return f"[{', '.join(str(size) for size in shape)}] {str(value.dtype).removeprefix('torch.')} on " \
               f"{value.device.type}"
    if isinstance(value, (bool, int, float, str)):
        return repr(value)
    return type(value).__name__


_ERRORS = {"TypeError": TypeError, "ValueError": ValueError, "CollectiveTimeout": CollectiveTimeout}


def judge(op: str, everyone: list, *, hint: str = "") -> None:
    """Raise, the same error on every rank, if a rank's checks failed or the ranks' signatures differ.
    ``everyone``: each rank's ``(signature, failure, proposal)``, where ``failure`` is None or the
    ``(type name, message)`` of what that rank's checks raised. The lowest failing rank's error is
    raised; its message carries the rank unless every rank failed alike. A signature that is a dict
    (argument name: ``describe``'s text) gives a message that names the arguments that differ.
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
