"""The grouped GEMM's checks of its synchronisation and range arguments (``grouped_gemm``'s ``gate``,
``signal``, ``group_range``, and its offsets under ``TILEWEAVE_DEBUG=1``)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from tileweave.ops import common


class Gate(NamedTuple):
    ready_flags: torch.Tensor
    epoch: int
    rank: int
    err: torch.Tensor
    max_spin: int


def check_range(group_range, groups: int) -> tuple[int, int]:
    if group_range is None:
        return 0, groups
    if (not isinstance(group_range, tuple) or len(group_range) != 2
            or not all(isinstance(v, int) for v in group_range)):
        raise ValueError(f"group_range must be a tuple (g_lo, g_hi) of ints, got {group_range!r}")
    g_lo, g_hi = group_range
    if not 0 <= g_lo <= g_hi <= groups:
        raise ValueError(f"group_range must satisfy 0 <= g_lo <= g_hi <= G = {groups}, got {group_range}")
    return g_lo, g_hi


def check_gate(gate, sources: int, device: torch.device) -> Gate | None:
    if gate is None:
        return None
    if not isinstance(gate, tuple) or len(gate) != 5:
        raise ValueError("gate must be a tuple (ready_flags, epoch, rank, err, max_spin)")
    ready, epoch, rank, err, max_spin = gate
    common.check_index("gate ready_flags", ready, device, (torch.int32,))
    if ready.numel() < sources:
        raise ValueError(f"gate ready_flags needs one word per source rank ({sources}), got {ready.numel()}")
    if not isinstance(rank, int) or not 0 <= rank < sources:
        raise ValueError(f"gate rank must be an int in [0, {sources}), got {rank!r}")
    common.check_index("gate err", err, device, (torch.int32,))
    if err.numel() != 1:
        raise ValueError(f"gate err must have one element, got {err.numel()}")
    for name, value in (("epoch", epoch), ("max_spin", max_spin)):
        if not isinstance(value, int):
            raise ValueError(f"gate {name} must be an int, got {value!r}")
    if not 0 < max_spin < 1 << 31:
        raise ValueError(f"gate max_spin must be in [1, 2**31), got {max_spin}")
    return Gate(ready, epoch, rank, err, max_spin)


def check_signal(signal, sources: int, device: torch.device) -> torch.Tensor | None:
    if signal is None:
        return None
    if not isinstance(signal, tuple) or len(signal) != 1:
        raise ValueError("signal must be a tuple (counters,)")
    counters = signal[0]
    common.check_index("signal counters", counters, device, (torch.int32,))
    if counters.numel() < sources:
        raise ValueError(f"signal counters needs one word per source rank ({sources}), got {counters.numel()}")
    return counters


def check_offsets(offsets: torch.Tensor, rows: int) -> None:
    values = offsets.cpu()
    if values[0] != 0 or values[-1] != rows or bool((values[1:] < values[:-1]).any()):
        raise ValueError(f"offsets must start at 0, not decrease and end at P = {rows}; got {values.tolist()}")
