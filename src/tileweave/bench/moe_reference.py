"""float64 results of the MoE benchmark's parts (``tileweave.bench.moe``), computed from the
definitions, and the checks of the variants' results against them (``errors``, ``rel_err``, ``route_err``,
``bounded``).

Independent of the code under test: no tileweave op, no plan. The pairs of each expert are found by a
mask over the routing ids, and the work runs one expert at a time: only that expert's weights and the
rows routed to it are cast to float64, so the extra memory is about one expert's float64 weights, its
rows' float64 activations and the float64 results (never ``w.double()`` of every expert, nor a float64
copy of every gathered token per pair). The layer's backward is written out (SwiGLU, top-k
normalisation and softmax derivatives) instead of float64 autograd over the whole graph.

Shapes (per rank; W ranks, T tokens over the group, k slots, E experts, F_loc = F / W):
``x_shard [T/W, H]``, ``ids_shard [T/W, k]``, ``w0 [E, 2*F_loc, H]`` (gate rows, then up rows),
``w1 [E, H, F_loc]``, ``router [E, H]``, ``h_rows [T*k, F_loc]`` (pair ``t*k + j``),
``weights_shard [T/W, k]``, ``dout_shard [T/W, H]``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist

from tileweave.nn.moe_autograd import gather_rows

ROUTE_TIE = 1e-4
"""``route``: a pair routed to another expert than float64's top-k passes only if both experts' float64
probabilities agree within this relative gap (a tie: the router runs in fp32, whose logits carry
relative rounding errors near 1e-6, whatever the layer's dtype)."""


def _experts(ids: torch.Tensor, num_experts: int):
    """``(e, pairs)`` for each expert with pairs: the flat indices (into ``ids.reshape(-1)``) routed to e."""
    flat = ids.reshape(-1)
    for e in range(num_experts):
        pairs = (flat == e).nonzero().squeeze(1)
        if pairs.numel():
            yield e, pairs


def _silu(g: torch.Tensor) -> torch.Tensor:
    return g * torch.sigmoid(g)


def _pairs_gemm(w: torch.Tensor, ids: torch.Tensor, rows_of) -> torch.Tensor:
    """float64 ``out[i] = a_i @ w[ids[i]].T`` for ``w [E, N, K]``, where ``rows_of(pairs)`` gives the
    rows ``a_i [len(pairs), K]`` of the pairs (any dtype; cast here)."""
    out = torch.zeros((ids.numel(), w.shape[1]), dtype=torch.float64, device=w.device)
    for e, pairs in _experts(ids, w.shape[0]):
        out[pairs] = rows_of(pairs).double() @ w[e].double().t()
    return out


def _swiglu_gemms(x: torch.Tensor, w0: torch.Tensor, w1: torch.Tensor, ids: torch.Tensor, f_loc: int,
                  token: torch.Tensor) -> torch.Tensor:
    """float64 ``[T*k, H]``: per pair, ``silu(gate) * up`` of ``x[token] @ w0[e].T``, then ``@ w1[e].T``."""
    out = torch.zeros((ids.numel(), w1.shape[1]), dtype=torch.float64, device=w1.device)
    for e, pairs in _experts(ids, w0.shape[0]):
        gate, up = (x[token[pairs]].double() @ w0[e].double().t()).split(f_loc, dim=1)
        out[pairs] = (_silu(gate) * up) @ w1[e].double().t()
    return out


def reference(part: str, variant: str, inp, group, device) -> list[torch.Tensor]:
    """float64 results of ``part`` in the variants' shared form (``inp``: the row's inputs on this rank,
    ``tileweave.bench.moe.Inputs``):

    * ``layer0``: ``[T*k, 2*F_loc]`` per (token, slot) pair;
    * ``layer1``: this rank's ``[T/W, H]`` (``floor``: ``[T*k, H]`` per pair, unweighted);
    * ``layer``: this rank's ``[T/W, H]`` (``floor``: ``[T*k, H]`` per pair, imposed ids);
    * ``layer-bwd``: the output, the input gradient (this rank's tokens, summed over the ranks), and
      this rank's expert weight shards' gradients ``[E, 2*F_loc, H]``, ``[E, H, F_loc]`` (not the
      router's, which each rank holds for its own tokens only); ``floor`` as ``layer``;
    * ``route``: this rank's top-k weights ``[T/W, k]``, every token's top-k ids ``[T, k]`` (int64)
      and softmax probabilities ``[T, E]`` (ties are judged on these).

    Collective: every rank of ``group`` calls it with the same part."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    t, k = inp.t, inp.k
    rows = slice(rank * t // world, (rank + 1) * t // world)
    if part == "route":
        return _route(inp, group, rows)
    token = torch.arange(t, device=device).repeat_interleave(k)
    ids = gather_rows(inp.ids_shard, group).reshape(-1)
    if part == "layer1":
        if variant == "floor":
            return [_pairs_gemm(inp.w1, ids, lambda pairs: inp.h_rows[pairs])]
        weights = gather_rows(inp.weights_shard, group).double().reshape(-1)
        out = torch.zeros((t, inp.h), dtype=torch.float64, device=device)
        for e, pairs in _experts(ids, inp.e):
            z = inp.h_rows[pairs].double() @ inp.w1[e].double().t()
            out.index_add_(0, token[pairs], z * weights[pairs, None])
        dist.all_reduce(out, group=group)
        return [out[rows]]
    x = gather_rows(inp.x_shard, group)  # the input dtype: rows are cast per expert
    if part == "layer0":
        return [_pairs_gemm(inp.w0, ids, lambda pairs: x[token[pairs]])]
    if variant == "floor":
        return [_swiglu_gemms(x, inp.w0, inp.w1, ids, inp.f_loc, token)]
    return _layer(part, inp, x, group, rows, token)


def _logits(x: torch.Tensor, router: torch.Tensor, block: int = 4096) -> torch.Tensor:
    """float64 ``x @ router.T`` (``[n, E]``), casting ``block`` rows of ``x`` at a time."""
    return torch.cat([x[i:i + block].double() @ router.t() for i in range(0, x.shape[0], block)])


def _route(inp, group, rows: slice) -> list[torch.Tensor]:
    """float64 routing of every token: softmax of the router logits over the E experts, the top k,
    the k weights divided by their sum (``TPMoE``'s default ``normalize_topk``)."""
    logits = gather_rows(_logits(inp.x_shard, inp.router.double()), group)
    probs = torch.softmax(logits, dim=1)
    top, ids = probs.topk(inp.k, dim=1)
    return [(top / top.sum(dim=1, keepdim=True))[rows], ids, probs]


def _layer(part: str, inp, x: torch.Tensor, group, rows: slice, token: torch.Tensor) -> list[torch.Tensor]:
    """The layer routed by its own router (float64 top-k); this rank's F_loc part of every token's
    output is computed per expert and summed over the ranks. With ``layer-bwd`` the gradients of
    ``sum(out * dout)`` follow, per expert, from the chain rule written out:

        y = x[t] @ w0[e].T, gate | up = y, a = silu(gate) * up, z = a @ w1[e].T, out[t] += c[t,j] z
        dz = c dout[t]           dw1[e] += dz.T a        da = dz @ w1[e]
        dgate = da * up * silu'(gate), silu'(g) = s (1 + g (1 - s)), s = sigmoid(g)
        dup = da * silu(gate)    dw0[e] += [dgate|dup].T x[t]     dx[t] += [dgate|dup] @ w0[e]
        dc[t,j] = <dout[t], z>   (then through the top-k normalisation and the softmax to the logits,
                                  and dx += dlogits @ router)
    """
    t, k, f_loc = inp.t, inp.k, inp.f_loc
    device = x.device
    router = inp.router.double()
    probs = torch.softmax(_logits(x, router), dim=1)  # [T, E]
    top, chosen = probs.topk(k, dim=1)
    total = top.sum(dim=1, keepdim=True)
    coeff = (top / total).reshape(-1)
    bwd = part == "layer-bwd"
    dout = gather_rows(inp.dout_shard, group) if bwd else None
    out = torch.zeros((t, inp.h), dtype=torch.float64, device=device)
    if bwd:
        dx = torch.zeros_like(out)
        dw0 = torch.zeros(inp.w0.shape, dtype=torch.float64, device=device)
        dw1 = torch.zeros(inp.w1.shape, dtype=torch.float64, device=device)
        dcoeff = torch.zeros(t * k, dtype=torch.float64, device=device)
    for e, pairs in _experts(chosen, inp.e):
        tok = token[pairs]
        w0, w1 = inp.w0[e].double(), inp.w1[e].double()
        xe = x[tok].double()
        gate, up = (xe @ w0.t()).split(f_loc, dim=1)
        sig = torch.sigmoid(gate)
        act = gate * sig * up
        z = act @ w1.t()
        c = coeff[pairs, None]
        out.index_add_(0, tok, c * z)
        if not bwd:
            continue
        de = dout[tok].double()
        dcoeff[pairs] = (de * z).sum(dim=1)
        dz = c * de
        dw1[e] = dz.t() @ act
        da = dz @ w1
        dy = torch.cat([da * up * sig * (1 + gate * (1 - sig)), da * gate * sig], dim=1)
        dw0[e] = dy.t() @ xe
        dx.index_add_(0, tok, dy @ w0)
        del xe, gate, up, sig, act, z, de, dz, da, dy
    dist.all_reduce(out, group=group)
    if not bwd:
        return [out[rows]]
    # c_j = p_j / S over the k chosen p: dp_j = (dc_j - sum_i dc_i c_i) / S; softmax: dl = p (dp - <dp, p>)
    dc = dcoeff.view(t, k)
    dtop = (dc - (dc * coeff.view(t, k)).sum(dim=1, keepdim=True)) / total
    dprobs = torch.zeros_like(probs).scatter_(1, chosen, dtop)
    dlogits = probs * (dprobs - (dprobs * probs).sum(dim=1, keepdim=True))
    dx += dlogits @ router
    dist.all_reduce(dx, group=group)
    return [out[rows], dx[rows], dw0, dw1]


# Checks of the variants' results against the reference.

def errors(got: list[torch.Tensor], ref: list[torch.Tensor], block: int = 1 << 26) -> list[tuple[float, float]]:
    """Per result, ``(relative Frobenius error |got - ref| / |ref|, gain <got, ref> / <ref, ref>)``: the
    gain is the factor of ``ref`` that best fits ``got`` (1 for a result off ref by noise alone, 1.1 for
    one scaled by 1.1). ``(inf, inf)`` for a wrong shape or a non-finite value. ``block`` elements at a
    time: no float64 copy of a whole result."""
    out = []
    for g, r in zip(got, ref, strict=True):
        if g.shape != r.shape:
            out.append((math.inf, math.inf))
            continue
        g, r = g.detach().reshape(-1), r.reshape(-1)
        diff = dot = norm = 0.0
        for i in range(0, g.numel(), block):
            gi, ri = g[i:i + block].double(), r[i:i + block]
            if not torch.isfinite(gi).all():
                diff = dot = math.inf
                break
            diff += (gi - ri).square().sum().item()
            dot += (gi * ri).sum().item()
            norm += ri.square().sum().item()
        norm = max(norm, 1e-60)
        out.append((math.sqrt(diff / norm), dot / norm))
    return out


def rel_err(got: list[torch.Tensor], ref: list[torch.Tensor], block: int = 1 << 26) -> float:
    """The largest relative Frobenius error ``|got - ref| / |ref|`` over the results (inf for a wrong
    shape or a non-finite value; ``errors``)."""
    return max((err for err, _ in errors(got, ref, block)), default=0.0)


def bounded(err: Callable, ref: list[torch.Tensor], tol: float) -> Callable[[list[torch.Tensor]], tuple[float, str]]:
    """A check ``got -> (error, why)`` of a variant's results: ``err(got, ref)`` (``rel_err``,
    ``route_err``) and, where it exceeds ``tol``, why the results fail ("" where they pass)."""

    def check(got: list[torch.Tensor]) -> tuple[float, str]:
        e = err(got, ref)
        return e, "" if e <= tol else f"rel_err {e:.3g} > {tol:g}"
    return check


def route_err(got: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    """``route``: ``got = [weights_shard, pair_row, row_token, row_expert]`` (the routing and its plan),
    ``ref = [weights_shard, ids, probs]`` in float64 (``reference``). The plan must hold
    every (token, slot) pair in a row of that token and of the expert the float64 top-k picks (a swap
    of two experts whose float64 probabilities agree within ``ROUTE_TIE`` is a tie, not an error);
    returns the weights' relative error. Raises ``ValueError`` naming the first misrouted pair."""
    weights, pair_row, row_token, row_expert = got
    ref_weights, ref_ids, probs = ref
    t, k = ref_ids.shape
    if tuple(pair_row.shape) != (t, k):
        raise ValueError(f"route: plan.pair_row must be [{t}, {k}], got {list(pair_row.shape)}")
    rows = pair_row.long()
    tokens = torch.arange(t, device=rows.device)[:, None].expand(t, k)
    if not torch.equal(row_token.long()[rows], tokens):
        bad = (row_token.long()[rows] != tokens).nonzero()[0].tolist()
        raise ValueError(f"route: the plan row of pair (token {bad[0]}, slot {bad[1]}) holds token "
                         f"{row_token[rows[bad[0], bad[1]]].item()}")
    ids = row_expert.long()[rows]
    wrong = ids != ref_ids
    if wrong.any():
        p_got, p_ref = probs.gather(1, ids.clamp(0, probs.shape[1] - 1)), probs.gather(1, ref_ids)
        gap = ((p_got - p_ref).abs() / p_ref).masked_fill(~wrong, 0)
        gap = gap.masked_fill((ids < 0) | (ids >= probs.shape[1]), math.inf)
        if gap.max().item() > ROUTE_TIE:
            tok, slot = (gap > ROUTE_TIE).nonzero()[0].tolist()
            raise ValueError(f"route: {int((gap > ROUTE_TIE).sum())} pairs misrouted; (token {tok}, slot {slot}) "
                             f"goes to expert {ids[tok, slot].item()}, float64 top-k picks "
                             f"{ref_ids[tok, slot].item()}")
    return rel_err([weights], [ref_weights])
