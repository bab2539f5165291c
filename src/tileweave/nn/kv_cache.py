"""The TP decoder's KV cache: keys and values of this rank's heads, preallocated, with each slot's
validity and each sequence's next position held on the device.

Sequences of a batch share slots: step ``t`` of every sequence writes slot ``t``. A left-padded batch
marks its padding slots invalid, so no query attends to them, and positions count only valid tokens
(the first real token of each sequence is position 0). The slot and the positions of the next token
live in device tensors that a step updates in place, so that a decode step reads no host value and can
be captured once in a CUDA graph and replayed.
"""

from __future__ import annotations

import torch


class KVCache:
    """``k, v [layers, B, kv_heads_local, max_seq, head_dim]``; ``valid [B, max_seq]`` (bool: the slot
    holds a real token); ``next_pos [B]`` (int64: the position of each sequence's next token);
    ``slot`` (int64 scalar tensor: the next free slot); ``length`` (the same as a host int)."""

    def __init__(self, *, layers: int, batch: int, kv_heads: int, max_seq: int, head_dim: int, device=None,
                 dtype=None) -> None:
        shape = (layers, batch, kv_heads, max_seq, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.valid = torch.zeros(batch, max_seq, dtype=torch.bool, device=device)
        self.next_pos = torch.zeros(batch, dtype=torch.int64, device=device)
        self.slot = torch.zeros((), dtype=torch.int64, device=device)
        self.length = 0

    @property
    def batch(self) -> int:
        return self.k.shape[1]

    @property
    def max_seq(self) -> int:
        return self.k.shape[3]

    def begin(self, mask: torch.Tensor | None, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Take the next ``seq`` slots for tokens whose ``mask [B, seq]`` (bool; None: all real) marks the
        real ones: ``(positions [B, seq], slots [seq])``; the slots' validity and the next positions are
        updated in place (the host ``length`` is not: ``advance`` does it after the step)."""
        slots = self.slot + torch.arange(seq, device=self.slot.device)
        if mask is None:
            positions = self.next_pos[:, None] + torch.arange(seq, device=self.next_pos.device)
            # index_fill_ with a Python scalar: setting by index would copy a host True (not capturable)
            self.valid.index_fill_(1, slots, True)
            self.next_pos += seq
        else:
            mask = mask.to(device=self.valid.device, dtype=torch.bool)
            counted = mask.long().cumsum(1)
            # a padding token takes the position of the token before it (never read: nothing attends to it)
            positions = (self.next_pos[:, None] + counted - 1).clamp_min(0)
            self.valid[:, slots] = mask
            self.next_pos += counted[:, -1]
        self.slot += seq
        return positions, slots

    def advance(self, seq: int) -> None:
        """Count ``seq`` more filled slots on the host."""
        self.length += seq

    def allowed(self, slots: torch.Tensor, end: int) -> torch.Tensor:
        """``[B, 1, S, end]`` bool: query slot ``slots[i]`` may attend to key slot ``j`` if ``j`` is valid
        and not after it. A query attends to itself too, so a padding query (whose row would otherwise be
        empty) gives finite values that nothing reads."""
        keys = torch.arange(end, device=slots.device)
        causal = keys[None, :] <= slots[:, None]                               # [S, end]
        own = keys[None, :] == slots[:, None]
        return (self.valid[:, None, None, :end] & causal) | own
