"""The TP MoE layer's FP8 training math in float64, written with plain torch from the recipe's table
(``tileweave.nn.moe_fp8``), independently of the library: the reference of ``TPMoE(fp8=...)``.

Each rank quantizes what it holds (``fp8_reference.qdq32``, from float32 values): its shard of the
tokens and of the output gradient (along H), its slice of each expert weight in both orientations
(the stack flattened to ``[E * N, K]``: one tensorwise scale per stack, a scale per row, or 128 x 128
blocks within each expert), its activations ``h`` and SwiGLU gradients ``dy`` of every (token, slot)
pair. Every product is then float64 of the dequantized values, pair by pair. The weight gradients sum
over each expert's (token, slot) pairs, grouped as the routing plan groups them (by source rank, the
rank whose shard holds the token, then in token and slot order): both operands quantized along those
pairs (``_along_tokens``), the gathered ``x`` and ``dO`` from their dequantized float8 values, ``dy`` and
``wt * h`` from the model's dtype: tensorwise over all pairs, rowwise per expert and feature, blockwise
per 128 pairs of a (source, expert) group and feature. The routing is the unquantized layer's (softmax,
top-k, renormalized), differentiated by autograd.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from support.fp8_reference import E4M3, Recipe, quantize_along_rows32


def _pairs(a: torch.Tensor, w: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``[T, k, N]``: ``a[t, j] @ w[ids[t, j]].T`` for ``a [T, k, K]`` (or ``[T, K]``, the same row for
    every slot) and ``w [E, N, K]``, expert by expert."""
    if a.dim() == 2:
        a = a[:, None, :].expand(-1, ids.shape[1], -1)
    out = torch.zeros(*ids.shape, w.shape[1], dtype=torch.float64)
    for e in range(w.shape[0]):
        chosen = ids == e
        out[chosen] = a[chosen] @ w[e].t()
    return out


def _stack(r: Recipe, w: torch.Tensor) -> torch.Tensor:
    """float64 dequantized ``[E, N, K]`` stack, quantized along K as ``[E * N, K]``."""
    e, n, k = w.shape
    return r.b(w.reshape(e * n, k).float()).view(e, n, k).double()


def _along_tokens(r: Recipe, values: torch.Tensor, groups: list[list[torch.Tensor]], grad: bool) -> torch.Tensor:
    """float64 ``values [T, k, C]`` (float32) dequantized from its cast as a weight gradient's operand:
    ``groups[e][s]`` are the ``(t, j)`` pairs of expert e from source s, ``[n, 2]``; quantized along the
    pairs in ``r``'s groups over those of every expert (tensorwise), of one expert (rowwise), or 128 pairs
    of one group (blockwise)."""
    t, k, c = values.shape
    flat = [p[:, 0] * k + p[:, 1] for e in groups for p in e]
    pieces = {"tensor": [torch.cat(flat)], "row": [torch.cat(flat[i:i + len(groups[0])])
                                                   for i in range(0, len(flat), len(groups[0]))],
              "1x128": flat}[r.a_groups]
    q, scale = quantize_along_rows32(values.reshape(t * k, c), pieces, r.a_groups,
                                     r.grad_dtype if grad else E4M3, r.pow2)
    return (q.double() * scale.double()).view(t, k, c)


def _plan_groups(ids: torch.Tensor, experts: int, world: int) -> list[list[torch.Tensor]]:
    """``[e][s]``: the ``(t, j)`` pairs of expert e whose token is in source s's shard, in plan order."""
    tc = ids.shape[0] // world
    groups = []
    for e in range(experts):
        per_source = []
        for s in range(world):
            chosen = torch.zeros_like(ids, dtype=torch.bool)
            chosen[s * tc:(s + 1) * tc] = ids[s * tc:(s + 1) * tc] == e
            per_source.append(chosen.nonzero())  # row-major: token order, then slot order
        groups.append(per_source)
    return groups


def fp8_moe_reference(recipe: str, x: torch.Tensor, state: dict, dout: torch.Tensor, top_k: int, world: int,
                      *, normalize_topk: bool = True, dtype: torch.dtype = torch.float32) -> list[dict]:
    """Per rank r: ``out`` (its rows), ``dx`` (its rows), ``d_w0 [E, 2F/W, H]`` and ``d_w1 [E, H, F/W]``
    (its slices), and ``d_router`` (over all tokens), float64; from full ``x [T, H]``, ``dout [T, H]``
    and ``state`` already in the model's ``dtype``, in which the layer also holds ``dy`` before
    quantizing it (rounded to it here too); ``h`` is cast from float32 (layer 0's epilogue casts the
    values it computes)."""
    r = Recipe(recipe)
    t, hid = x.shape
    gate, up, down = (state[n].double() for n in ("experts.gate", "experts.up", "experts.down"))
    e, f = gate.shape[:2]
    fl, tc = f // world, t // world
    xr = x.double().requires_grad_(True)
    router = state["router.weight"].double().requires_grad_(True)
    probs = torch.softmax(xr @ router.t(), dim=1)
    wt, ids = torch.topk(probs, top_k, dim=1)
    if normalize_topk:
        wt = wt / wt.sum(dim=1, keepdim=True)
    wd = wt.detach()
    shards = [slice(p * tc, (p + 1) * tc) for p in range(world)]
    xq = torch.cat([r.a(x[s].float()) for s in shards]).double()               # gathered float8 x
    doq = torch.cat([r.a(dout[s].float(), grad=True) for s in shards]).double()  # gathered float8 dO
    groups = _plan_groups(ids, e, world)
    out = torch.zeros(t, hid, dtype=torch.float64)
    dx_experts = torch.zeros(t, hid, dtype=torch.float64)
    dwt = torch.zeros(t, top_k, dtype=torch.float64)
    grads = []
    for c in range(world):
        cols = slice(c * fl, (c + 1) * fl)
        w0 = torch.cat([gate[:, cols], up[:, cols]], dim=1)                    # [E, 2fl, H]
        w1 = down[:, :, cols]                                                   # [E, H, fl]
        w0q, w1q = _stack(r, w0), _stack(r, w1)
        w0tq, w1tq = _stack(r, w0.transpose(1, 2)), _stack(r, w1.transpose(1, 2))  # [E, H, 2fl], [E, fl, H]
        pre = _pairs(xq, w0q, ids)                                             # [T, k, 2fl]
        g, u = pre[..., :fl], pre[..., fl:]
        h = F.silu(g) * u
        hq = r.a(h.float().reshape(t * top_k, fl)).view(t, top_k, fl).double()
        z = _pairs(hq, w1q, ids)
        out += (wd[:, :, None] * z).sum(1)
        gg = _pairs(doq, w1tq, ids)                                            # G = dO @ w1[e]
        dh = wd[:, :, None] * gg
        s = torch.sigmoid(g)
        dy = torch.cat([dh * u * (s + g * s * (1 - s)), dh * F.silu(g)], dim=2)  # [T, k, 2fl]
        dyq = r.a(dy.to(dtype).float().reshape(t * top_k, 2 * fl), grad=True).view(t, top_k, 2 * fl).double()
        dx_experts += _pairs(dyq, w0tq, ids).sum(1)
        dwt += (gg * h).sum(2)
        # The weight gradients' operands, each quantized along its expert's pairs (the plan's groups).
        expand = lambda rows: rows[:, None, :].expand(t, top_k, rows.shape[1]).float()
        dy_t = _along_tokens(r, dy.to(dtype).float(), groups, grad=True)
        x_t = _along_tokens(r, expand(xq), groups, grad=False)
        do_t = _along_tokens(r, expand(doq), groups, grad=True)
        wh_t = _along_tokens(r, (wd[:, :, None] * h).to(dtype).float(), groups, grad=False)
        d_w0 = torch.zeros(e, 2 * fl, hid, dtype=torch.float64)
        d_w1 = torch.zeros(e, hid, fl, dtype=torch.float64)
        for ex in range(e):
            chosen = ids == ex
            d_w0[ex] = dy_t[chosen].t() @ x_t[chosen]
            d_w1[ex] = do_t[chosen].t() @ wh_t[chosen]
        grads.append((d_w0, d_w1))
    dx_route, d_router = torch.autograd.grad(wt, (xr, router), dwt)
    dx = dx_experts + dx_route
    return [{"out": out[s], "dx": dx[s], "d_w0": grads[p][0], "d_w1": grads[p][1], "d_router": d_router}
            for p, s in enumerate(shards)]
