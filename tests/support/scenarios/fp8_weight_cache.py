"""``Float8Recipe(cache_weights=True)`` on emulated ranks: a layer that keeps its weights' float8 casts
against the same layer casting them at every call, step by step (micro-batches of different sizes, then
the weights changed in place, replaced, and changed through ``.data`` with ``refresh_weight_casts``):
outputs and gradients bitwise equal, and the casts counted."""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import nn

from support.moe_layer_scenarios import ops_for
from tileweave.nn import ColumnParallelLinear, RowParallelLinear, TPMoE
from tileweave.nn import fp8
from tileweave.nn.fp8 import Float8Recipe, refresh_weight_casts


def _tokens(shape, seed: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 100 + rank)
    return torch.randn(*shape, generator=g)


def _step(layer: nn.Module, batches: list[torch.Tensor]) -> list[torch.Tensor]:
    """One optimizer step's micro-batches: the outputs and the gradients accumulated over them."""
    layer.zero_grad(set_to_none=True)
    outs = []
    for x in batches:
        x = x.clone().requires_grad_(True)
        out = layer(x)
        (out * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
        outs += [out.detach(), x.grad]
    return outs + [p.grad.clone() for p in layer.parameters() if p.grad is not None]


def weight_cache_check(rank: int, world: int, scaling: str, kind: str) -> dict:
    """``kind``: ``"moe"`` (``TPMoE``) or ``"dense"`` (a column then a row parallel linear). Returns, per
    phase, whether the cached layer's outputs and gradients equal the uncaching one's bit for bit, and the
    weight casts each made (``Float8Recipe.rhs`` and ``weights`` calls)."""
    base = getattr(Float8Recipe, scaling)()
    cached_recipe = dataclasses.replace(base, cache_weights=True)
    torch.manual_seed(1234)  # the same weights on both layers (every rank alike, then sliced by the layer)
    # Blockwise needs whole 128 x 128 blocks of every weight's shard; the others take small layers.
    h, f = (128, 128 * world) if scaling == "blockwise" else (32, 32 * world)
    if kind == "moe":
        make = lambda recipe: TPMoE(h, f, 3, 2, ops=ops_for("auto", dist.group.WORLD), fp8=recipe,  # noqa: E731
                                    dtype=torch.float32)
        shapes = [(3, h), (2, h)]  # this rank's tokens of each micro-batch
    else:
        make = lambda recipe: nn.Sequential(  # noqa: E731
            ColumnParallelLinear(h, f, bias=False, fp8=recipe, dtype=torch.float32),
            RowParallelLinear(f, h, bias=False, fp8=recipe, dtype=torch.float32))
        shapes = [(2, h), (1, h)]  # this rank's rows of each micro-batch
    plain = make(base)
    cached = make(cached_recipe)
    cached.load_state_dict(plain.state_dict())
    counts = {"plain": 0, "cached": 0}
    counting = {"on": None}
    params: set[int] = set()
    quantize = fp8.quantize

    def counted(x, *args, **kwargs):  # every cast of a parameter, by the layer it ran for
        if counting["on"] and id(x) in params:
            counts[counting["on"]] += 1
        return quantize(x, *args, **kwargs)

    def track() -> None:
        params.update(id(p) for layer in (plain, cached) for p in layer.parameters())

    track()
    fp8.quantize = counted
    phases = {}
    try:
        def run(name: str, seed: int) -> None:
            batches = [_tokens(shape, seed + i, rank) for i, shape in enumerate(shapes)]
            before = dict(counts)
            counting["on"] = "plain"
            want = _step(plain, batches)
            counting["on"] = "cached"
            got = _step(cached, batches)
            counting["on"] = None
            phases[name] = {"equal": len(want) == len(got) and all(torch.equal(a, b) for a, b in zip(want, got)),
                            "plain_casts": counts["plain"] - before["plain"],
                            "cached_casts": counts["cached"] - before["cached"]}

        run("first step", 1)
        run("same weights", 2)  # a later step's micro-batches with unchanged weights: nothing cast again
        with torch.no_grad():  # an optimizer's in-place update
            for layer in (plain, cached):
                for p in layer.parameters():
                    p.mul_(0.75).add_(0.01)
        run("changed in place", 3)
        for layer in (plain, cached):  # a weight replaced by a new tensor
            first = next(p for p in layer.parameters() if p.dim() >= 2)
            owner, name = _owner(layer, first)
            setattr(owner, name, nn.Parameter(first.detach() * -1.0))
        track()
        run("replaced", 4)
        for layer in (plain, cached):  # a change the version counter does not see, then the explicit refresh
            for p in layer.parameters():
                p.data.mul_(2.0)
        refresh_weight_casts(cached)
        run("changed through .data, refreshed", 5)
    finally:
        fp8.quantize = quantize
    return phases


def _owner(layer: nn.Module, param: torch.Tensor) -> tuple[nn.Module, str]:
    for module in layer.modules():
        for name, p in module.named_parameters(recurse=False):
            if p is param:
                return module, name
    raise LookupError("parameter not found")

