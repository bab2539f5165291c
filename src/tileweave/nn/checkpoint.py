"""Reading a TP layer's shards out of unsharded, checkpoint-named weights, and the q/k row layout.

A layer asks a *reader* for each tensor it needs by name, with the tensor's full shape, and for the slice
of one axis that this rank holds; the reader checks the shape and returns only that slice. Two readers
serve every layer: ``dict_reader`` over a state dict of whole tensors (``load_full_state_dict``) and
``tileweave.models``' reader of safetensors files, which reads the slice from disk without loading the rest.

Hugging Face checkpoints lay out the rows of each query and key head for rotate-half RoPE: row ``j`` of
a head pairs with row ``j + head_dim/2``. tileweave's RoPE turns consecutive pairs ``(2i, 2i+1)``, so a
head's rows are interleaved on load (``to_interleaved``) and put back on save (``to_rotate_half``); the
attention scores are unchanged, since the same permutation applies to a head's queries and keys.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

Reader = Callable[..., torch.Tensor]
"""``read(name, shape, dim=0, start=None, stop=None)`` -> the slice ``start:stop`` along axis ``dim``
of the tensor ``name``, whose full shape must be ``shape`` (``ValueError`` naming the tensor, the expected
and the actual shape; ``KeyError`` if it is missing)."""


def shape_error(owner: str, name: str, expected, actual) -> ValueError:
    return ValueError(f"{owner}: tensor {name!r} must have shape {list(expected)} (from the model config), "
                      f"got {list(actual)}")


def dict_reader(state: Mapping[str, torch.Tensor], owner: str) -> Reader:
    """A reader over whole tensors: ``state[name]`` checked against the expected shape, then sliced."""
    def read(name: str, shape, dim: int = 0, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        if name not in state:
            raise KeyError(f"{owner}: missing tensor {name!r} (expected shape {list(shape)})")
        t = state[name]
        if tuple(t.shape) != tuple(shape):
            raise shape_error(owner, name, shape, t.shape)
        return t.narrow(dim, start or 0, (shape[dim] if stop is None else stop) - (start or 0))
    return read


def check_unused(state: Mapping[str, torch.Tensor], used: set[str], owner: str) -> None:
    """Refuse tensors that the model has no place for: loading them silently would drop weights."""
    extra = sorted(set(state) - used)
    if extra:
        raise ValueError(f"{owner}: the state dict has tensors the model does not use: {extra[:8]}"
                         f"{' ...' if len(extra) > 8 else ''}")


def _pairing(head_dim: int, device) -> torch.Tensor:
    """Row ``2i`` of an interleaved head is rotate-half row ``i``, row ``2i+1`` is row ``i + head_dim/2``."""
    return torch.arange(head_dim, device=device).view(2, head_dim // 2).t().reshape(-1)


def to_interleaved(rows: torch.Tensor, head_dim: int) -> torch.Tensor:
    """``rows [heads * head_dim, ...]`` of whole heads (weights, biases or a per-head norm weight) from the
    rotate-half layout to the interleaved one."""
    heads = rows.shape[0] // head_dim
    perm = _pairing(head_dim, rows.device)
    return rows.reshape(heads, head_dim, *rows.shape[1:])[:, perm].reshape(rows.shape)


def to_rotate_half(rows: torch.Tensor, head_dim: int) -> torch.Tensor:
    """The inverse of ``to_interleaved``."""
    heads = rows.shape[0] // head_dim
    inverse = torch.argsort(_pairing(head_dim, rows.device))
    return rows.reshape(heads, head_dim, *rows.shape[1:])[:, inverse].reshape(rows.shape)
