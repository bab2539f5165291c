"""Independent float64 references of the MoE pair, from the unsharded inputs (shares no code with
``tileweave.ops.moe``): plain Python loops over tokens and slots, so that a test compares two
computations that could not share a mistake."""

from __future__ import annotations

import torch


def reference_plan(ids: list[list[int]], num_experts: int, world: int) -> dict:
    """The plan's order written out: pairs (t, j) sorted by (source rank, expert), then by token and
    slot; ``offsets`` of the W*E groups; ``pair_row`` as a dict (t, j) -> row."""
    tokens = len(ids)
    per_rank = tokens // world
    pairs = [(t, j) for t in range(tokens) for j in range(len(ids[t]))]
    pairs.sort(key=lambda p: (p[0] // per_rank, ids[p[0]][p[1]], p[0], p[1]))
    counts = [0] * (world * num_experts)
    for t, j in pairs:
        counts[(t // per_rank) * num_experts + ids[t][j]] += 1
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + c)
    row_of = {pair: row for row, pair in enumerate(pairs)}
    return {"row_token": [t for t, _ in pairs], "row_expert": [ids[t][j] for t, j in pairs], "offsets": offsets,
            "pair_row": [[row_of[(t, j)] for j in range(len(ids[t]))] for t in range(tokens)],
            "splits": [sum(row.count(e) for row in ids) for e in range(num_experts)]}


def layer0_reference(x: torch.Tensor, ids: torch.Tensor, w0: torch.Tensor) -> torch.Tensor:
    """``[T, k, F_loc]`` float64: ``x[t] @ w0[ids[t, j]]`` for every pair, ``w0 [E, H, F_loc]``."""
    tokens, topk = ids.shape
    x, w0 = x.double(), w0.double()
    out = torch.empty((tokens, topk, w0.shape[2]), dtype=torch.float64)
    for t in range(tokens):
        for j in range(topk):
            out[t, j] = x[t] @ w0[int(ids[t, j])]
    return out


def layer1_reference(h_pairs: list[torch.Tensor], ids: torch.Tensor, weights: torch.Tensor,
                     w1: list[torch.Tensor]) -> torch.Tensor:
    """``[T, H]`` float64: ``sum over ranks r, slots j of weights[t, j] * h_pairs[r][t, j] @ w1[r][e]``
    with ``h_pairs[r] [T, k, F_loc]`` (rank r's activations by pair) and ``w1[r] [E, F_loc, H]``."""
    tokens, topk = ids.shape
    out = torch.zeros((tokens, w1[0].shape[2]), dtype=torch.float64)
    for h_r, w_r in zip(h_pairs, w1):
        h_r, w_r = h_r.double(), w_r.double()
        for t in range(tokens):
            for j in range(topk):
                out[t] += float(weights[t, j]) * (h_r[t, j] @ w_r[int(ids[t, j])])
    return out
