"""The TP linears in FP8 training on emulated ranks (or GPUs): each recipe's forward output and every
gradient against ``support.fp8_reference``'s float64 math of the same quantized operands, and the
layers' refusals."""

from __future__ import annotations

import torch
import torch.distributed as dist

import tileweave
from support import fp8_reference
from support.scenarios.common import device_name, randn, rel_err
from tileweave.nn import ColumnParallelLinear, Float8Recipe, RowParallelLinear


def _inputs(tag: str, m: int, k: int, n: int, with_bias: bool, device):
    """Full float32 ``x [m, k]``, ``w [n, k]``, bias and output gradient ``dy [m, n]``: the same on every
    rank; rows of very different magnitudes, so that per-row and per-block scales matter."""
    x = randn((m, k), torch.float32, tag, "x") * torch.exp2(torch.randint(-3, 4, (m, 1), generator=torch.Generator()
                                                                        .manual_seed(m)).float())
    w = randn((n, k), torch.float32, tag, "w") / k ** 0.5
    bias = randn((n,), torch.float32, tag, "b") if with_bias else None
    dy = randn((m, n), torch.float32, tag, "dy") * 1e-3  # small gradients: scales far from the activations'
    return x, w, bias, dy


def fp8_linear_check(rank: int, world: int, cases: list[tuple], dtype: str = "float32") -> list[dict]:
    """Per case ``(layer, recipe, m, k, n, bias, save_gathered, steps[, producer])`` (``layer`` "column" or
    "row"; ``m`` tokens over the group; ``k``, ``n`` the layer's in and out features; ``producer``
    "norm": the column layer takes an RMSNorm's input, ``layer(x, norm=...)``, and the gradient of its
    weight is ``dnorm``; "swiglu": the row layer takes gate | up): ``steps`` steps with
    fresh inputs (a second one takes every op's and GEMM's kept plan, with new scales), each rank's
    largest relative errors of ``y``, ``dx``, ``dw`` (and ``db``) against the float64 reference, the
    dtypes of the outputs and gradients, and the paths taken. ``dtype``: of the inputs, parameters and
    outputs (the reference quantizes the same values)."""
    device, dtype = device_name(), getattr(torch, dtype)
    rows = []
    for case in cases:
        layer_kind, recipe, m, k, n, with_bias, save_gathered, steps = case[:8]
        producer = case[8] if len(case) > 8 else None
        # "blockwise-recast": the layer casts the weight again in backward (the reference is the same)
        layer_recipe = Float8Recipe(scaling="blockwise", keep_weight_transpose=False) \
            if recipe == "blockwise-recast" else recipe
        recipe = recipe.removesuffix("-recast")
        errs: dict[str, float] = {}
        for step in range(steps):
            x, w, bias, dy = (None if t is None else t.to(dtype).float()
                              for t in _inputs(f"{case}-{step}", m, k, n, with_bias, "cpu"))
            state = {"weight": w, **({"bias": bias} if with_bias else {})}
            kwargs = {}
            if layer_kind == "column":
                layer = ColumnParallelLinear(k, n, bias=with_bias, save_gathered=save_gathered, device=device,
                                             dtype=dtype, fp8=layer_recipe)
                mine = slice(rank * m // world, (rank + 1) * m // world)
                x_in, dy_in = x[mine], dy[:, rank * n // world:(rank + 1) * n // world]
                if producer == "norm":
                    norm = kwargs["norm"] = torch.nn.RMSNorm(k, eps=1e-5, device=device, dtype=dtype)
                    norm_w = (1 + 0.1 * randn((k,), torch.float32, f"{case}-{step}", "norm")).to(dtype).float()
                    with torch.no_grad():
                        norm.weight.copy_(norm_w)
                    x_norm = fp8_reference.rms_norm32(x, norm_w, 1e-5)
                    ref = fp8_reference.column_parallel(recipe, x_norm, w, bias, dy, world, rank,
                                                        save_gathered=save_gathered, fused_norm=True)
                    ref["dx"], ref["dnorm"] = fp8_reference.rms_norm_backward64(x[mine], norm_w, 1e-5, ref["dx"])
                else:
                    ref = fp8_reference.column_parallel(recipe, x, w, bias, dy, world, rank,
                                                        save_gathered=save_gathered)
            else:
                layer = RowParallelLinear(k, n, bias=with_bias, device=device, dtype=dtype, fp8=layer_recipe)
                ks = slice(rank * k // world, (rank + 1) * k // world)
                x_in = x[:, ks]
                dy_in = dy[rank * m // world:(rank + 1) * m // world]
                if producer == "swiglu":  # x is the gate; the up projection's output is another input
                    up = randn((m, k), torch.float32, f"{case}-{step}", "up").to(dtype).float()
                    kwargs["swiglu"] = True
                    x_in = torch.cat([x[:, ks], up[:, ks]], dim=1)
                    ref = fp8_reference.row_parallel(recipe, fp8_reference.swiglu32(x, up), w, bias, dy, world, rank)
                    ref["dx"] = fp8_reference.swiglu_backward64(x[:, ks], up[:, ks], ref["dx"])
                else:
                    ref = fp8_reference.row_parallel(recipe, x, w, bias, dy, world, rank)
            layer.load_full_state_dict(state)
            xin = x_in.to(device, dtype).clone().requires_grad_(True)
            y = layer(xin, **kwargs)
            y.backward(dy_in.to(device, dtype))
            got = {"y": y, "dx": xin.grad, "dw": layer.weight.grad}
            if producer == "norm":
                got["dnorm"] = kwargs["norm"].weight.grad
            if with_bias:
                got["db"] = layer.bias.grad
            for name, value in got.items():
                errs[name] = max(errs.get(name, 0.0), rel_err(value.detach().cpu(), ref[name]))
        rows.append({"case": case, **errs, "dtypes": sorted({str(t.dtype) for t in got.values()}),
                     "paths": (tileweave.last_path("all_gather_gemm"), tileweave.last_path("gemm_reduce_scatter"))})
    return rows


def fp8_options_check(rank: int, world: int) -> dict:
    """``"refusals"``: the error's type and message of each bad FP8 configuration; ``"scalings"``: per
    recipe, the GEMM kernel's ``SCALING`` of each launch of a row-parallel layer's forward and backward
    (forward, input gradient, weight gradient), by default and with ``backward_fast_accum``."""
    import dataclasses

    from support.launches import recording
    from tileweave.nn import Float8Recipe

    scalings = {}
    for label, recipe in (("rowwise", Float8Recipe.rowwise()),
                          ("rowwise, backward_fast_accum", dataclasses.replace(Float8Recipe.rowwise(),
                                                                              backward_fast_accum=True)),
                          ("blockwise", Float8Recipe.blockwise())):
        layer = RowParallelLinear(128 * world, 128, bias=False, device=device_name(), fp8=recipe)
        x = torch.randn(8 * world, 128, device=device_name(), requires_grad=True)
        with recording() as launches:
            layer(x).sum().backward()
        scalings[label] = [dict(launch.kwargs).get("SCALING") for launch in launches
                           if launch.kernel.endswith(":fused_gemm_kernel")]
    return {"refusals": _refusals(world), "scalings": scalings}


def _refusals(world: int) -> dict[str, str]:
    """The layers' refusals of FP8 configurations: the error's type and message per case."""
    cases = {
        "blockwise column out_features/W": lambda: ColumnParallelLinear(256, 200 * world, fp8="blockwise"),
        "blockwise column in_features": lambda: ColumnParallelLinear(200, 128 * world, fp8="blockwise"),
        "blockwise row in_features/W": lambda: RowParallelLinear(96 * world, 128, fp8="blockwise"),
        "blockwise row out_features": lambda: RowParallelLinear(128 * world, 100, fp8="blockwise"),
        "unknown recipe": lambda: ColumnParallelLinear(128, 128 * world, fp8="columnwise"),
        "not sequence parallel": lambda: RowParallelLinear(128 * world, 128, fp8="rowwise", sequence_parallel=False),
        "recipe field": lambda: tileweave.nn.Float8Recipe(scaling="rowwise", grad_dtype=torch.float16),
    }
    out = {}
    for name, make in cases.items():
        try:
            make()
            out[name] = "no error"
        except (TypeError, ValueError) as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
    return out


def fp8_block_check(rank: int, world: int, cases: list[tuple], dtype: str = "float32") -> list[dict]:
    """Per case ``(recipe, hidden, batch, seq)``: ``TPTransformerBlock(fp8=recipe)`` (heads of 16 features,
    ffn = hidden) on ``batch`` sequences of ``seq`` tokens, one forward and backward. Each of its four
    linears is checked against ``support.fp8_reference`` on the inputs and output gradients it actually
    received (gathered from every rank): its output, input gradient and weight gradient (``<layer>_y``,
    ``<layer>_dx``, ``<layer>_dw``); the column layers receive the RMSNorm's input and the down
    projection the gate | up projection, and the reference quantizes the norm's and the SwiGLU's
    values (``rms_norm32``, ``swiglu32``) and takes the gradients back through them in float64, the norm
    weights' too (``<layer>_dnorm``). Then the block's output and input gradient against float64 of the
    unquantized block (``y_exact``, ``dx_exact``). ``dtype``: of the block's parameters and activations."""
    from support import references
    from support.scenarios.layers import hf_block_state, small_block_data
    from tileweave.nn.block import BlockConfig, TPTransformerBlock

    device, dtype = device_name(), getattr(torch, dtype)
    rows_out = []
    for recipe, hidden, batch, seq in cases:
        c = BlockConfig(hidden=hidden, heads=hidden // 16, kv_heads=hidden // 32, ffn=hidden, rope_theta=10000.0)
        m = batch * seq
        state, x_full, g_full = (t.to(dtype).float() if isinstance(t, torch.Tensor) else
                                 {k: v.to(dtype).float() for k, v in t.items()}
                                 for t in small_block_data(c, m, f"fp8-{recipe}", device))
        mine = slice(rank * m // world, (rank + 1) * m // world)
        block = TPTransformerBlock(c, device=device, dtype=dtype, fp8=recipe)
        block.load_full_state_dict(hf_block_state(state, c))
        seen: dict[str, dict] = {}
        for name in ("qkv", "o", "gate_up", "down"):
            layer = getattr(block, name)
            layer.register_forward_hook(lambda mod, args, y, name=name: seen.setdefault(name, {}).update(
                x=args[0].detach().clone(), y=y.detach().clone()))
            layer.register_full_backward_hook(lambda mod, dx, dy, name=name: seen[name].update(
                dy=dy[0].detach().clone(), dx=dx[0].detach().clone()))
        x = x_full[mine].to(dtype).clone().requires_grad_(True)
        y = block(x, batch)
        (y.float() * g_full[mine]).sum().backward()
        out = {"case": (recipe, hidden, batch, seq), "fp8": block.fp8.scaling}
        norms = {"qkv": block.attn_norm, "gate_up": block.mlp_norm}
        for name, got in seen.items():
            column = name in ("qkv", "gate_up")
            weight = getattr(block, name).weight
            # The layer's full operands, from every rank's pieces (rank-major rows or column blocks).
            full_x = _gathered(got["x"], 0 if column else 1, world).float().cpu()
            full_dy = _gathered(got["dy"], 1 if column else 0, world).float().cpu()
            full_w = _gathered(weight.detach(), 0 if column else 1, world).float().cpu()
            if column:  # the layer's input is the norm's output
                norm = norms[name]
                norm_w = norm.weight.detach().float().cpu()
                ref = fp8_reference.column_parallel(recipe, fp8_reference.rms_norm32(full_x, norm_w, norm.eps), full_w,
                                                    None, full_dy, world, rank, fused_norm=True)
                ref["dx"], ref["dnorm"] = fp8_reference.rms_norm_backward64(full_x[mine], norm_w, norm.eps, ref["dx"])
                out[f"{name}_dnorm"] = rel_err(norm.weight.grad.cpu(), ref["dnorm"])
            elif name == "down":  # the layer's input is silu(gate) * up of each rank's gate | up
                parts = [part.chunk(2, dim=1) for part in full_x.chunk(world, dim=1)]
                full_h = torch.cat([fp8_reference.swiglu32(gate, up) for gate, up in parts], dim=1)
                ref = fp8_reference.row_parallel(recipe, full_h, full_w, None, full_dy, world, rank)
                ref["dx"] = fp8_reference.swiglu_backward64(*parts[rank], ref["dx"])
            else:
                ref = fp8_reference.row_parallel(recipe, full_x, full_w, None, full_dy, world, rank)
            for key, value in (("y", got["y"]), ("dx", got["dx"]), ("dw", weight.grad)):
                out[f"{name}_{key}"] = rel_err(value.cpu(), ref[key])
        xr = x_full.double().requires_grad_(True)
        yr = references.transformer_block(xr, {k: v.double() for k, v in state.items()}, heads=c.heads,
                                          kv_heads=c.kv_heads, rope_theta=c.rope_theta, norm_eps=c.norm_eps,
                                          batch=batch)
        yr.backward(g_full.double())
        out["y_exact"], out["dx_exact"] = rel_err(y, yr.detach()[mine]), rel_err(x.grad, xr.grad[mine])
        rows_out.append(out)
    return rows_out


def _gathered(t: torch.Tensor, dim: int, world: int) -> torch.Tensor:
    """Every rank's ``t`` concatenated along ``dim``, in rank order."""
    if world == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts, dim)
