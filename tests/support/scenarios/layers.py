"""The TP layers and the transformer block against float64 references, and the block benchmark."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

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


def hf_block_state(state: dict, c) -> dict:
    """``small_block_data``'s state (short names, each head's query and key rows in interleaved pairs as
    ``references.transformer_block`` rotates them) as a Hugging Face Llama decoder layer names and lays it
    out: rotate-half rows, row ``2i + j`` of a head becoming row ``j * head_dim / 2 + i``."""
    hd = c.head_dim

    def rotate_half(w: torch.Tensor) -> torch.Tensor:
        return w.reshape(w.shape[0] // hd, hd // 2, 2, w.shape[1]).transpose(1, 2).reshape(w.shape)

    return {"input_layernorm.weight": state["attn_norm"], "self_attn.q_proj.weight": rotate_half(state["q"]),
            "self_attn.k_proj.weight": rotate_half(state["k"]), "self_attn.v_proj.weight": state["v"],
            "self_attn.o_proj.weight": state["o"], "post_attention_layernorm.weight": state["mlp_norm"],
            "mlp.gate_proj.weight": state["gate"], "mlp.up_proj.weight": state["up"],
            "mlp.down_proj.weight": state["down"]}


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
    hf_state = hf_block_state(state, c)
    block.load_full_state_dict(hf_state)
    saved = block.full_state_dict()
    round_trip = max(rel_err(saved[name], t) for name, t in hf_state.items()) if saved.keys() == hf_state.keys() \
        else float("inf")
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
    errors = {"y": rel_err(y, yr.detach()[rows]), "dx": rel_err(x.grad, xr.grad[rows]), "round_trip": round_trip}
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
    block.load_full_state_dict(hf_block_state(state, c))
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


def block_hf_layer_check(rank: int, world: int, batch: int, seq: int, heads: int, kv_heads: int) -> dict:
    """The block loaded from a ``transformers`` Llama decoder layer's state dict, against that layer in
    float64 on the whole batch (causal attention, its own RoPE); the errors of a wrong shape and of an
    unknown tensor; the full state dict's names and values against the layer's."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    hidden, ffn = 8 * heads, 48
    config = LlamaConfig(hidden_size=hidden, intermediate_size=ffn, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, rope_theta=10000.0, rms_norm_eps=1e-5, num_hidden_layers=1)
    config._attn_implementation = "eager"
    torch.manual_seed(5)  # the same layer on every rank
    layer = LlamaDecoderLayer(config, layer_idx=0).double().eval()
    with torch.no_grad():
        for t in layer.parameters():
            t.copy_(torch.randn(t.shape, dtype=torch.float64) / (t.shape[-1] ** 0.5 if t.dim() == 2 else 4) + (t.dim() == 1))
    hf_state = {name: t.float() for name, t in layer.state_dict().items()}
    c = BlockConfig(hidden=hidden, heads=heads, kv_heads=kv_heads, ffn=ffn, rope_theta=10000.0, norm_eps=1e-5)
    block = TPTransformerBlock(c)
    block.load_full_state_dict(hf_state)
    x = randn((batch, seq, hidden), torch.float32, "hf-block-x")
    m = batch * seq
    rows = slice(rank * m // world, (rank + 1) * m // world)
    with torch.no_grad():
        y = block(x.reshape(m, hidden)[rows].contiguous(), batch)
        xd = x.double()
        positions = torch.arange(seq)[None].expand(batch, seq)
        mask = torch.full((seq, seq), float("-inf"), dtype=torch.float64).triu(1)[None, None].expand(batch, 1, seq, seq)
        out = layer(xd, attention_mask=mask, position_ids=positions,
                    position_embeddings=LlamaRotaryEmbedding(config)(xd, positions))
        want = (out[0] if isinstance(out, tuple) else out).reshape(m, hidden)[rows]
    saved = block.full_state_dict()
    errors = {"y": rel_err(y, want), "names": sorted(saved) == sorted(hf_state),
              "round_trip": max(rel_err(saved[n], hf_state[n]) for n in hf_state if n in saved)}
    bad = dict(hf_state, **{"mlp.up_proj.weight": hf_state["mlp.up_proj.weight"][:, :-1]})
    extra = dict(hf_state, **{"mlp.bias": torch.zeros(hidden)})
    for key, state in (("bad_shape", bad), ("extra", extra)):
        try:
            TPTransformerBlock(c).load_full_state_dict(state)
            errors[key] = "no error"
        except ValueError as e:
            errors[key] = str(e)
    return errors


def seq_sharded_check(rank: int, world: int, batch: int, seq: int) -> dict:
    """Inputs ``[B, S/W, H]`` sharded on the sequence (every sequence's positions ``[r*S/W, (r+1)*S/W)``):
    a column- then row-parallel MLP (sequence-parallel, and replicated ``[B, S, H]``), and the TP block,
    against the unsharded float64 computation: outputs, input gradients, the weight gradients."""
    device = device_name()
    hidden, ffn = 16, 8 * world
    s_loc = seq // world
    cols = slice(rank * s_loc, (rank + 1) * s_loc)
    w_up = randn((ffn, hidden), torch.float32, "ss-up", device=device) / hidden ** 0.5
    w_down = randn((hidden, ffn), torch.float32, "ss-down", device=device) / ffn ** 0.5
    x_full = randn((batch, seq, hidden), torch.float32, "ss-x", device=device)
    g_full = randn((batch, seq, hidden), torch.float32, "ss-g", device=device)
    xr = x_full.double().requires_grad_(True)
    wr_up, wr_down = w_up.double().requires_grad_(True), w_down.double().requires_grad_(True)
    yr = F.silu(xr @ wr_up.t()) @ wr_down.t()
    (yr * g_full.double()).sum().backward()
    f = ffn // world
    errors = {}
    for parallel in (True, False):
        up = ColumnParallelLinear(hidden, ffn, bias=False, sequence_parallel=parallel, device=device)
        down = RowParallelLinear(ffn, hidden, bias=False, sequence_parallel=parallel, device=device)
        up.load_full_state_dict({"weight": w_up})
        down.load_full_state_dict({"weight": w_down})
        x = (x_full[:, cols] if parallel else x_full).clone().requires_grad_(True)
        y = down(F.silu(up(x)))
        g = g_full[:, cols] if parallel else g_full
        (y * g).sum().backward()
        tag = "sp" if parallel else "rep"
        errors[f"{tag}_shape"] = float(tuple(y.shape) != tuple(g.shape))
        errors[f"{tag}_y"] = rel_err(y, yr.detach()[:, cols] if parallel else yr.detach())
        errors[f"{tag}_dx"] = rel_err(x.grad, xr.grad[:, cols] if parallel else xr.grad)
        errors[f"{tag}_d_up"] = rel_err(up.weight.grad, wr_up.grad[rank * f:(rank + 1) * f])
        errors[f"{tag}_d_down"] = rel_err(down.weight.grad, wr_down.grad[:, rank * f:(rank + 1) * f])
    c = BlockConfig(hidden=8 * 2 * world, heads=2 * world, kv_heads=world, ffn=16 * world, rope_theta=10000.0)
    state, xb_flat, gb_flat = small_block_data(c, batch * seq, "ss-blk", device)
    xb, gb = xb_flat.view(batch, seq, c.hidden), gb_flat.view(batch, seq, c.hidden)
    block = TPTransformerBlock(c, device=device)
    block.load_full_state_dict(hf_block_state(state, c))
    x = xb[:, cols].clone().requires_grad_(True)
    y = block(x)
    (y * gb[:, cols]).sum().backward()
    ref_state = {k: v.double() for k, v in state.items()}
    xbr = xb_flat.double().requires_grad_(True)
    ybr = references.transformer_block(xbr, ref_state, heads=c.heads, kv_heads=c.kv_heads, rope_theta=c.rope_theta,
                                       norm_eps=c.norm_eps, batch=batch)
    (ybr * gb_flat.double()).sum().backward()
    errors["block_y"] = rel_err(y, ybr.detach().view(batch, seq, -1)[:, cols])
    errors["block_dx"] = rel_err(x.grad, xbr.grad.view(batch, seq, -1)[:, cols])
    return errors
