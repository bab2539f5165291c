"""tileweave's ParallelStyles under ``parallelize_module`` against the same modules unsharded in float64:
outputs, input gradients and every parameter gradient (gathered whole from the DTensors)."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import parallelize_module

import tileweave
from support.scenarios.common import device_name, randn, rel_err
from tileweave.parallel import ColwiseParallel, RowwiseParallel
from tileweave.testing.llama import Llama, LlamaConfig, llama_tp_plan


def _seeded(module: nn.Module, tag: str) -> nn.Module:
    """``module`` with every parameter drawn from ``tag`` (the same on every rank)."""
    with torch.no_grad():
        for name, param in module.named_parameters():
            scale = 1.0 if param.dim() == 1 else param.shape[-1] ** -0.5
            param.copy_(randn(param.shape, torch.float32, tag, name) * scale)
    return module


def _param_errors(model: nn.Module, ref: nn.Module) -> dict:
    """Each parameter's gradient against the reference's: a DTensor's local shard against the slice its
    placement on the 1-D mesh names (no gather: ranks sharing a GPU over gloo run it; a partial sum is all-reduced)."""
    refs = dict(ref.named_parameters())
    errors = {}
    for name, param in model.named_parameters():
        want, grad = refs[name].grad, param.grad
        if isinstance(grad, DTensor):
            (placement,), mesh = grad.placements, grad.device_mesh
            if isinstance(placement, Shard):
                want, grad = want.chunk(mesh.size(), dim=placement.dim)[mesh.get_local_rank()], grad.to_local()
            else:  # a replicated parameter's gradient may still be a partial sum (the norms'): reduce it
                grad = grad.full_tensor()
        errors[f"d_{name}"] = rel_err(grad, want)
    return errors


def _mesh(device: str, world: int):
    """The 1-D mesh of the ranks. Where they share GPUs (``tileweave.testing.shared_gpu``), its group
    gets the sharing backend too: the mesh makes a group of its own, which the world's backend does not
    cover."""
    mesh = init_device_mesh(device.split(":")[0], (world,))
    if device.startswith("cuda") and world > torch.cuda.device_count():
        from tileweave.testing import shared_gpu

        shared_gpu.install(torch.device(device), mesh.get_group())
    return mesh


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def styles_mlp_check(rank: int, world: int, batch: int, seq: int, layout: str, iters: int = 2) -> dict:
    """An MLP (colwise up, SiLU, rowwise down, with biases) of ``[batch, seq, 16]`` activations.
    ``layout``: "sequence" (``Shard(1)`` in and out, the fused AllGather+GEMM and GEMM+ReduceScatter,
    local tensors between), "dtensor" (the same with DTensors in and between), "replicate" (torch's
    default layouts: a replicated input, ``gemm_all_reduce`` for the output). ``iters`` calls with fresh
    inputs; the errors of the last."""
    torch.manual_seed(0)
    hidden, ffn, device = 16, 24, device_name()
    full = _seeded(nn.Sequential(nn.Linear(hidden, ffn), nn.SiLU(), nn.Linear(ffn, hidden)), "mlp").to(device)
    ref = copy.deepcopy(full).double()
    mesh = _mesh(device, world)
    sequence = layout != "replicate"
    plan = {"0": ColwiseParallel(input_layouts=Shard(1), use_local_output=layout != "dtensor"),
            "2": RowwiseParallel(output_layouts=Shard(1), use_local_output=layout != "dtensor")}
    model = parallelize_module(full, mesh, plan if sequence else {"0": ColwiseParallel(), "2": RowwiseParallel()})
    rows = slice(rank * seq // world, (rank + 1) * seq // world) if sequence else slice(None)
    for it in range(iters):
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        x_full = randn((batch, seq, hidden), torch.float32, "mlp-x", it, device=device)
        g_full = randn((batch, seq, hidden), torch.float32, "mlp-g", it, device=device)
        x = x_full[:, rows].clone().requires_grad_(True)
        given = DTensor.from_local(x, mesh, [Shard(1)], run_check=False) if layout == "dtensor" else x
        y = model(given)
        placements = y.placements if isinstance(y, DTensor) else None
        y = _local(y)
        (y * g_full[:, rows]).sum().backward()
        xr = x_full.double().requires_grad_(True)
        yr = ref(xr)
        (yr * g_full.double()).sum().backward()
    result = {"y": rel_err(y, yr.detach()[:, rows]), "dx": rel_err(x.grad, xr.grad[:, rows]), **_param_errors(model, ref)}
    result["placements"] = str(placements)
    result["paths"] = " ".join(str(tileweave.last_path(op)) for op in ("all_gather_gemm", "gemm_reduce_scatter",
                                                                        "gemm_all_reduce"))
    return result


def _llama_data(c: LlamaConfig, batch: int, seq: int, tag: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(map(ord, tag)))
    return torch.randint(0, c.vocab, (batch, seq), generator=g)


def styles_llama_check(rank: int, world: int, batch: int, seq: int) -> dict:
    """A two-block Llama (embedding, norms, attention, SwiGLU MLP, output) sharded by ``llama_tp_plan``
    with tileweave's styles: the logits and every parameter's gradient against the unsharded model in
    float64."""
    c, device = LlamaConfig(vocab=32, dim=16, layers=2, heads=4, kv_heads=2, ffn=24), device_name()
    torch.manual_seed(0)
    full = _seeded(Llama(c), "llama").to(device)
    ref = copy.deepcopy(full).double()
    mesh = _mesh(device, world)
    model = parallelize_module(full, mesh, llama_tp_plan(full))
    tokens = _llama_data(c, batch, seq, "tokens").to(device)
    g = randn((batch, seq, c.vocab), torch.float32, "llama-g", device=device)
    logits = model(tokens)
    (logits * g).sum().backward()
    ref_logits = ref(tokens)
    (ref_logits * g.double()).sum().backward()
    return {"logits": rel_err(logits, ref_logits.detach()), **_param_errors(model, ref),
            "paths": f"{tileweave.last_path('all_gather_gemm')} {tileweave.last_path('gemm_reduce_scatter')}"}


class _MyLinear(nn.Linear):
    def forward(self, x):
        return super().forward(x) * 2


def styles_refusals_check(rank: int, world: int) -> dict:
    """What the styles refuse, each error's message: a module that is not ``nn.Linear``, a subclass
    of it, features that do not split evenly, a 2-D mesh, a sequence that does not split evenly."""
    mesh = init_device_mesh("cpu", (world,))
    messages = {}
    cases = {
        "conv": (nn.Conv1d(4, 4, 1), ColwiseParallel(), mesh),
        "subclass": (_MyLinear(4, 4), RowwiseParallel(), mesh),
        "uneven": (nn.Linear(4, 3 * world + 1), ColwiseParallel(), mesh),
        "mesh_2d": (nn.Linear(4, 4), ColwiseParallel(), init_device_mesh("cpu", (1, world))),
    }
    for name, (module, style, where) in cases.items():
        try:
            parallelize_module(module, where, style)
            messages[name] = None
        except (TypeError, ValueError) as exc:
            messages[name] = str(exc)
    linear = parallelize_module(nn.Linear(4, 2 * world), mesh, ColwiseParallel(input_layouts=Shard(1)))
    x = DTensor.from_local(torch.randn(1, 3, 4), mesh, [Shard(1)], run_check=False)  # S = 3 * world
    try:
        linear(DTensor.from_local(torch.randn(1, 3, 4), mesh, [Replicate()], run_check=False).redistribute(
            mesh, [Shard(1)]))  # S = 3: uneven
        messages["sequence"] = None
    except ValueError as exc:
        messages["sequence"] = str(exc)
    messages["even_ok"] = tuple(linear(x).shape)
    dist.barrier()
    return messages


def uneven_local_shards(rank: int, world: int) -> str:
    """A colwise linear fed local sequence shards of different lengths (rank 0 one token more): the error
    every rank raises, as text."""
    mesh = init_device_mesh(device_name(), (world,))
    linear = nn.Linear(8, 16)
    parallelize_module(linear, mesh, ColwiseParallel(input_layouts=Shard(1)))
    x = randn((1, 3 if rank == 0 else 2, 8), torch.float32, "uneven", rank)
    try:
        linear(x)
    except Exception as exc:  # noqa: BLE001 - the test reads the error
        return f"{type(exc).__name__}: {exc}"
    return "no error"
