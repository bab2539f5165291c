"""The TP layers and the transformer block against float64 references, and the block benchmark."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

import tileweave
from support import references
from tileweave.nn import ColumnParallelLinear, RowParallelLinear
from tileweave.nn.block import BlockConfig, TPTransformerBlock
from tileweave.bench import block as B
from tileweave.nn.linear import TILEWEAVE_OPS
from tileweave.bench.runner import enable_torch_symm_mem
from support.scenarios.common import device_name, randn, rel_err, shared_ops_graphable


def tp_mlp_check(rank: int, world: int, tokens: int, hidden: int, ffn: int, save_gathered: bool,
                 autocast: bool = False) -> dict:
    """A sequence-parallel MLP (column-parallel up, SiLU, row-parallel down) against the same MLP
    unsharded in float64: output, input gradient and every parameter gradient. (A smooth activation,
    so that low-precision runs are not compared across ReLU's kink.)"""
    device = device_name()
    full_up = {"weight": randn((ffn, hidden), torch.float32, "mlp-up", device=device) / hidden ** 0.5,
               "bias": randn((ffn,), torch.float32, "mlp-ub", device=device)}
    full_down = {"weight": randn((hidden, ffn), torch.float32, "mlp-dn", device=device) / ffn ** 0.5,
                 "bias": randn((hidden,), torch.float32, "mlp-db", device=device)}
    x_full = randn((tokens, hidden), torch.float32, "mlp-x", device=device)
    grad_full = randn((tokens, hidden), torch.float32, "mlp-g", device=device)
    rows = slice(rank * tokens // world, (rank + 1) * tokens // world)

    up = ColumnParallelLinear(hidden, ffn, save_gathered=save_gathered, device=device)
    down = RowParallelLinear(ffn, hidden, device=device)
    up.load_full_state_dict(full_up)
    down.load_full_state_dict(full_down)
    x = x_full[rows].clone().requires_grad_(True)
    # Interpreter runs use fp16 (its bf16 is unreliable); GPUs use bf16, as training does.
    low = torch.bfloat16 if x.is_cuda else torch.float16
    with torch.autocast(x.device.type, dtype=low, enabled=autocast):
        y = down(torch.nn.functional.silu(up(x)))
    (y.float() * grad_full[rows]).sum().backward()

    xr = x_full.double().requires_grad_(True)
    wu, bu = full_up["weight"].double().requires_grad_(True), full_up["bias"].double().requires_grad_(True)
    wd, bd = full_down["weight"].double().requires_grad_(True), full_down["bias"].double().requires_grad_(True)
    yr = torch.nn.functional.silu(xr @ wu.t() + bu) @ wd.t() + bd
    (yr * grad_full.double()).sum().backward()

    local = slice(rank * ffn // world, (rank + 1) * ffn // world)
    saved = {"up": up.full_state_dict(), "down": down.full_state_dict()}
    return {
        "y": rel_err(y, yr.detach()[rows]),
        "dx": rel_err(x.grad, xr.grad[rows]),
        "d_up_w": rel_err(up.weight.grad, wu.grad[local]),
        "d_up_b": rel_err(up.bias.grad, bu.grad[local]),
        "d_down_w": rel_err(down.weight.grad, wd.grad[:, local]),
        "d_down_b": rel_err(down.bias.grad, bd.grad),
        "grad_dtypes": str(up.weight.grad.dtype) + "," + str(down.weight.grad.dtype),
        "round_trip": bool(torch.equal(saved["up"]["weight"], full_up["weight"])
                           and torch.equal(saved["down"]["weight"], full_down["weight"])),
        "graphable": shared_ops_graphable(),
        "paths": f"{tileweave.last_path('all_gather_gemm')} {tileweave.last_path('gemm_reduce_scatter')}",
        "shared_options": sorted({f"{name}={getattr(op, name)}" for cls in (tileweave.AllGatherGemm,
                                                                             tileweave.GemmReduceScatter)
                                  for op in cls._shared.values() for name in cls.option_envs}),
    }


def small_block_data(c, m: int, tag: str, device) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """An unsharded fp32 block state (as ``TPTransformerBlock.load_full_state_dict`` takes it), and
    the full input and output gradient of ``m`` tokens; the same on every rank."""
    hd = c.head_dim
    shapes = {"q": (c.heads * hd, c.hidden), "k": (c.kv_heads * hd, c.hidden), "v": (c.kv_heads * hd, c.hidden),
              "o": (c.hidden, c.hidden), "gate": (c.ffn, c.hidden), "up": (c.ffn, c.hidden), "down": (c.hidden, c.ffn)}
    state = {name: randn(shape, torch.float32, tag, name, device=device) / shape[1] ** 0.5
             for name, shape in shapes.items()}
    state["attn_norm"] = 1 + 0.1 * randn((c.hidden,), torch.float32, f"{tag}-n1", device=device)
    state["mlp_norm"] = 1 + 0.1 * randn((c.hidden,), torch.float32, f"{tag}-n2", device=device)
    x_full = randn((m, c.hidden), torch.float32, f"{tag}-x", device=device)
    g_full = randn((m, c.hidden), torch.float32, f"{tag}-g", device=device)
    return state, x_full, g_full


def tp_block_check(rank: int, world: int, batch: int, seq: int, policy: str = "auto", heads: int = 4,
                   kv_heads: int = 2) -> dict:
    """The TP transformer block against the unsharded reference in float64: output, input gradient,
    and the gradient of every parameter (each rank's slice)."""
    device = device_name()
    c = BlockConfig(hidden=32, heads=heads, kv_heads=kv_heads, ffn=64, rope_theta=10000.0)
    state, x_full, g_full = small_block_data(c, batch * seq, "blk", device)
    m = batch * seq
    rows = slice(rank * m // world, (rank + 1) * m // world)

    os.environ["TILEWEAVE_POLICY"] = policy  # read by the ops the block's layers create
    block = TPTransformerBlock(c, device=device)
    block.load_full_state_dict(state)
    x = x_full[rows].clone().requires_grad_(True)
    y = block(x, batch)
    (y * g_full[rows]).sum().backward()

    ref_state = {k: v.double().requires_grad_(True) for k, v in state.items()}
    xr = x_full.double().requires_grad_(True)
    yr = references.transformer_block(xr, ref_state, heads=c.heads, kv_heads=c.kv_heads,
                                      rope_theta=c.rope_theta, norm_eps=c.norm_eps, batch=batch)
    (yr * g_full.double()).sum().backward()

    def local_rows(t):
        n = t.shape[0] // world
        return t[rank * n:(rank + 1) * n]

    d = {k: v.grad for k, v in ref_state.items()}
    expect = {
        "qkv": torch.cat([local_rows(d["q"]), local_rows(d["k"]), local_rows(d["v"])]),
        "gate_up": torch.cat([local_rows(d["gate"]), local_rows(d["up"])]),
        "o": d["o"][:, rank * c.hidden // world:(rank + 1) * c.hidden // world],
        "down": d["down"][:, rank * c.ffn // world:(rank + 1) * c.ffn // world],
    }
    errors = {"y": rel_err(y, yr.detach()[rows]), "dx": rel_err(x.grad, xr.grad[rows])}
    for name, ref in expect.items():
        errors[f"d_{name}"] = rel_err(getattr(block, name).weight.grad, ref)
    # Norm weights are replicated: each rank's gradient covers its tokens only; summed over ranks they
    # must give the full gradient.
    for name in ("attn_norm", "mlp_norm"):
        grad = getattr(block, name).weight.grad.clone()
        dist.all_reduce(grad)
        errors[f"d_{name}"] = rel_err(grad, d[name])
    errors["paths"] = tileweave.last_path("all_gather_gemm") + "," + tileweave.last_path("gemm_reduce_scatter")
    return errors


def block_bench_variants_check(rank: int, world: int, batch: int, seq: int) -> dict:
    """The block section's step under each of its variants (tileweave's ops, NCCL-style ops, the
    compute floor) on one small fp32 block: output and input gradient of ours and of the NCCL-style
    ops against the float64 unsharded reference, the variant check's own error, and that the layers'
    ops are restored afterwards."""
    device = device_name()
    c = BlockConfig(hidden=32, heads=4, kv_heads=2, ffn=64, rope_theta=10000.0)
    m = batch * seq
    state, x_full, g_full = small_block_data(c, m, "bb", device)
    rows = slice(rank * m // world, (rank + 1) * m // world)

    os.environ["TILEWEAVE_POLICY"] = "fused"
    block = TPTransformerBlock(c, device=device)
    block.load_full_state_dict(state)
    row = B.BlockRow("llama3-8b", m)  # only its batch (M tokens as one sequence here) is used
    assert row.batch == batch
    inputs = B.BlockInputs(row=row, block=block, x=x_full[rows].clone().requires_grad_(True), dy=g_full[rows])
    base = [t.clone() for t in inputs.step(B.base_ops(world))(0)]
    ours = B.block_variant("ours", inputs, rank=rank, world_size=world, reference=tuple(base))
    y_ours, dx_ours = ours.call(0)
    floor_y, _ = inputs.step(B.floor_ops(rank, world))(0)

    xr = x_full.double().requires_grad_(True)
    ref_state = {k: v.double() for k, v in state.items()}
    yr = references.transformer_block(xr, ref_state, heads=c.heads, kv_heads=c.kv_heads,
                                      rope_theta=c.rope_theta, norm_eps=c.norm_eps, batch=batch)
    yr.backward(g_full.double())

    def err(got, ref):
        return ((got.double() - ref).norm() / ref.norm()).item()

    return {"base_y": err(base[0], yr[rows]), "base_dx": err(base[1], xr.grad[rows]),
            "ours_y": err(y_ours, yr[rows]), "ours_dx": err(dx_ours, xr.grad[rows]),
            "ours_check": ours.check((y_ours, dx_ours)), "ours_path": ours.path(),
            "floor_shape": tuple(floor_y.shape) == tuple(y_ours.shape),
            # Each variant passes its ops to the block: tileweave's layers elsewhere keep theirs.
            "restored": TPTransformerBlock(c, device=device).ops is TILEWEAVE_OPS}


def block_bench_gpu_check(rank: int, world: int, m: int) -> dict:
    """On GPUs: the block section's PyTorch async-TP and tileweave variants of the llama3-8b block at
    M tokens, each checked against its NCCL reference (bf16; the benchmark's own check)."""
    enable_torch_symm_mem(dist.group.WORLD)
    row = B.BlockRow("llama3-8b", m)
    x = B.make_block_inputs(row, rank=rank, world_size=world, group=dist.group.WORLD)
    reference = tuple(t.clone() for t in x.step(B.base_ops(world))(0))
    out = {}
    for name in ("torch", "ours"):
        v = B.block_variant(name, x, rank=rank, world_size=world, reference=reference)
        out[name] = v.check(v.call(0)) if v.call is not None else v.note
    return out
