"""The MoE benchmark's float64 reference (``tileweave.bench.moe_reference``), which works one expert at a
time with the layer's backward written out, against the whole-graph form it replaced (every expert's
weights in float64, float64 autograd over the layer), on small odd shapes, 1 and 2 emulated ranks;
and its checks (``errors``, ``rel_err``, ``route_err``)."""

import math
import types

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tileweave.bench.moe_reference import errors, reference, rel_err, route_err
from tileweave.nn.moe import route
from tileweave.nn.moe_autograd import gather_rows
from tileweave.ops.moe import build_plan
from tileweave.testing.emulated import run_ranks

# (H, F, E, k, T): odd widths, k = 1 and k = 8, more experts than pairs (some get none).
SHAPES = [(24, 20, 5, 3, 6), (16, 12, 4, 1, 4), (18, 10, 11, 8, 2)]
PARTS = ("layer0", "layer1", "layer", "layer-bwd")


def _inputs(rank: int, world: int, shape, dtype, seed: int) -> types.SimpleNamespace:
    """The fields ``reference`` reads, as ``tileweave.bench.moe.Inputs`` holds them; the last expert is
    never in the imposed ids (an empty expert)."""
    h, f, e, k, t = shape
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(e - 1, generator=gen)[:k] for _ in range(t)])
    rows = slice(rank * t // world, (rank + 1) * t // world)
    f_loc = f // world
    full_w0 = torch.randn(e, 2 * f, h, generator=gen) / h ** 0.5
    own = torch.arange(rank * f_loc, (rank + 1) * f_loc)
    cols = torch.cat([own, f + own])  # this rank's gate rows, then its up rows
    return types.SimpleNamespace(
        h=h, f=f, e=e, k=k, t=t, f_loc=f_loc,
        x_shard=torch.randn(t, h, generator=gen)[rows].to(dtype),
        ids_shard=ids[rows],
        weights_shard=torch.softmax(torch.randn(t, k, generator=gen), -1)[rows],
        router=torch.randn(e, h, generator=gen),
        dout_shard=torch.randn(t, h, generator=gen)[rows].to(dtype),
        w0=full_w0[:, cols].to(dtype),
        w1=(torch.randn(e, h, f, generator=gen) / f ** 0.5)[:, :, rank * f_loc:(rank + 1) * f_loc].to(dtype),
        h_rows=torch.randn(t * k, f, generator=gen)[:, rank * f_loc:(rank + 1) * f_loc].to(dtype))


def _pairs_gemm(a, w, ids):
    out = a.new_zeros((a.shape[0], w.shape[1]))
    for e in range(w.shape[0]):
        rows = ids == e
        out[rows] = a[rows] @ w[e].t()
    return out


def _whole_graph_reference(part, variant, inp, group, device):
    """The form the benchmark used before: every expert in float64 at once, float64 autograd."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    t, k = inp.t, inp.k
    rows = slice(rank * t // world, (rank + 1) * t // world)
    ids = gather_rows(inp.ids_shard, group).reshape(-1)
    x = gather_rows(inp.x_shard, group).double()
    token = torch.arange(t, device=device).repeat_interleave(k)
    w0, w1 = inp.w0.double(), inp.w1.double()
    if part == "layer0":
        return [_pairs_gemm(x[token], w0, ids)]
    if part == "layer1":
        z = _pairs_gemm(inp.h_rows.double(), w1, ids)
        if variant == "floor":
            return [z]
        out = (z.view(t, k, -1) * gather_rows(inp.weights_shard, group).double()[..., None]).sum(1)
        dist.all_reduce(out, group=group)
        return [out[rows]]
    if variant == "floor":
        gate, up = _pairs_gemm(x[token], w0, ids).split(inp.f_loc, dim=1)
        return [_pairs_gemm(F.silu(gate) * up, w1, ids)]
    for tensor in (w0, w1, x):
        tensor.requires_grad_(part == "layer-bwd")
    probs = torch.softmax(x @ inp.router.double().t(), dim=1)
    coeff, chosen = probs.topk(k, dim=1)
    coeff = coeff / coeff.sum(dim=1, keepdim=True)
    gate, up = _pairs_gemm(x[token], w0, chosen.reshape(-1)).split(inp.f_loc, dim=1)
    z = _pairs_gemm(F.silu(gate) * up, w1, chosen.reshape(-1))
    partial = (z.view(t, k, -1) * coeff[..., None]).sum(1)
    out = partial.detach().clone()
    dist.all_reduce(out, group=group)
    if part == "layer":
        return [out[rows]]
    (partial * gather_rows(inp.dout_shard, group).double()).sum().backward()
    dx = x.grad.clone()
    dist.all_reduce(dx, group=group)
    return [out[rows], dx[rows], w0.grad, w1.grad]


def compare_rank(rank: int, world: int, dtype_name: str) -> list[str]:
    """Every part and shape on this rank: a line per result that differs from the whole-graph form."""
    group, device, dtype = dist.group.WORLD, torch.device("cpu"), getattr(torch, dtype_name)
    problems = []
    for i, shape in enumerate(SHAPES):
        inp = _inputs(rank, world, shape, dtype, seed=10 + i)
        for part in PARTS:
            for variant in ("ours", "floor"):
                new = reference(part, variant, inp, group, device)
                old = _whole_graph_reference(part, variant, inp, group, device)
                if len(new) != len(old):
                    problems.append(f"{shape} {part} {variant}: {len(new)} results, expected {len(old)}")
                for j, (a, b) in enumerate(zip(new, old)):
                    if a.shape != b.shape or a.dtype != torch.float64 or not torch.allclose(a, b, rtol=1e-10,
                                                                                           atol=1e-12):
                        problems.append(f"{shape} {part} {variant} result {j}: {a.dtype} {tuple(a.shape)} vs "
                                        f"{tuple(b.shape)}, max diff {(a - b).abs().max().item():.3g}")
        problems += _check_route(rank, world, inp, group, device, shape)
    return problems


def _check_route(rank, world, inp, group, device, shape) -> list[str]:
    """``route``'s reference picks what fp32 ``route`` picks; ``route_err`` accepts that plan and names
    a plan whose pair goes to another expert."""
    w_ref, ids_ref, probs = reference("route", "ours", inp, group, device)
    weights, ids = route(F.linear(inp.x_shard.float(), inp.router), inp.k, normalize=True)
    plan = build_plan(gather_rows(ids, group), num_experts=inp.e, world_size=1)
    got = [weights, plan.pair_row, plan.row_token, plan.row_expert]
    problems = []
    if not torch.equal(gather_rows(ids, group), ids_ref):
        problems.append(f"{shape} route: reference ids differ from fp32 route's")
    if route_err(got, [w_ref, ids_ref, probs]) > 1e-5:
        problems.append(f"{shape} route: weights differ")
    bad = plan.row_expert.clone()
    bad[plan.pair_row[0, 0]] = (bad[plan.pair_row[0, 0]] + 1) % inp.e
    try:
        route_err([weights, plan.pair_row, plan.row_token, bad], [w_ref, ids_ref, probs])
        problems.append(f"{shape} route: a misrouted pair passed")
    except ValueError as exc:
        if "(token 0, slot 0)" not in str(exc):
            problems.append(f"{shape} route: {exc}")
    return problems


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_per_expert_reference_matches_whole_graph_autograd(world, dtype):
    for rank, problems in enumerate(run_ranks(world, compare_rank, dtype)):
        assert problems == [], (rank, problems)


def test_rel_err_in_blocks_matches_the_whole_norm():
    gen = torch.Generator().manual_seed(0)
    ref = [torch.randn(7, 5, generator=gen, dtype=torch.float64), torch.randn(3, generator=gen, dtype=torch.float64)]
    got = [(r + 1e-3 * torch.randn(r.shape, generator=gen, dtype=torch.float64)).float() for r in ref]
    whole = max(((g.double() - r).norm() / r.norm()).item() for g, r in zip(got, ref))
    assert rel_err(got, ref, block=4) == pytest.approx(whole, rel=1e-9)
    assert rel_err([got[0][:6]], [ref[0]]) == math.inf
    assert rel_err([torch.full((7, 5), math.nan)], [ref[0]], block=4) == math.inf


def test_errors_give_each_result_its_error_and_gain():
    gen = torch.Generator().manual_seed(1)
    ref = [torch.randn(7, 5, generator=gen, dtype=torch.float64), torch.randn(3, generator=gen, dtype=torch.float64)]
    noise = torch.randn(7, 5, generator=gen, dtype=torch.float64)
    noise -= (noise * ref[0]).sum() / ref[0].square().sum() * ref[0]  # orthogonal to ref: the gain stays 1
    (err0, gain0), (err1, gain1) = errors([(1.1 * ref[0] + 0.05 * noise).float(), 2 * ref[1]], ref, block=4)
    assert gain0 == pytest.approx(1.1, rel=1e-6) and gain1 == pytest.approx(2.0)
    assert err0 == pytest.approx(math.hypot(0.1, 0.05 * (noise.norm() / ref[0].norm()).item()), rel=1e-6)
    assert err1 == pytest.approx(1.0)
    assert errors([torch.full((3,), math.inf)], [ref[1]]) == [(math.inf, math.inf)]
