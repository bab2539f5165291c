"""The TP linears in FP8 training on emulated ranks (or GPUs): each recipe's forward output and every
gradient against ``support.fp8_reference``'s float64 math of the same quantized operands, and the
layers' refusals."""

from __future__ import annotations

import torch

import tileweave
from support import fp8_reference
from support.scenarios.common import device_name, randn, rel_err
from tileweave.nn import ColumnParallelLinear, RowParallelLinear


def _inputs(tag: str, m: int, k: int, n: int, with_bias: bool, device):
    """Full float32 ``x [m, k]``, ``w [n, k]``, bias and output gradient ``dy [m, n]``: the same on every
    rank; rows of very different magnitudes, so that per-row and per-block scales matter."""
    x = randn((m, k), torch.float32, tag, "x") * torch.exp2(torch.randint(-3, 4, (m, 1), generator=torch.Generator()
                                                                        .manual_seed(m)).float())
    w = randn((n, k), torch.float32, tag, "w") / k ** 0.5
    bias = randn((n,), torch.float32, tag, "b") if with_bias else None
    dy = randn((m, n), torch.float32, tag, "dy") * 1e-3  # small gradients: scales far from the activations'
    return x, w, bias, dy


def fp8_linear_check(rank: int, world: int, cases: list[tuple]) -> list[dict]:
    """Per case ``(layer, recipe, m, k, n, bias, save_gathered, steps)`` (``layer`` "column" or "row";
    ``m`` tokens over the group; ``k``, ``n`` the layer's in and out features): ``steps`` steps with
    fresh inputs (a second one takes every op's and GEMM's kept plan, with new scales), each rank's
    largest relative errors of ``y``, ``dx``, ``dw`` (and ``db``) against the float64 reference, the
    dtypes of the outputs and gradients, and the paths taken."""
    device = device_name()
    rows = []
    for case in cases:
        layer_kind, recipe, m, k, n, with_bias, save_gathered, steps = case
        errs: dict[str, float] = {}
        for step in range(steps):
            x, w, bias, dy = _inputs(f"{case}-{step}", m, k, n, with_bias, "cpu")
            state = {"weight": w, **({"bias": bias} if with_bias else {})}
            if layer_kind == "column":
                layer = ColumnParallelLinear(k, n, bias=with_bias, save_gathered=save_gathered, device=device,
                                             fp8=recipe)
                mine = slice(rank * m // world, (rank + 1) * m // world)
                x_in, dy_in = x[mine], dy[:, rank * n // world:(rank + 1) * n // world]
                ref = fp8_reference.column_parallel(recipe, x, w, bias, dy, world, rank, save_gathered=save_gathered)
            else:
                layer = RowParallelLinear(k, n, bias=with_bias, device=device, fp8=recipe)
                x_in = x[:, rank * k // world:(rank + 1) * k // world]
                dy_in = dy[rank * m // world:(rank + 1) * m // world]
                ref = fp8_reference.row_parallel(recipe, x, w, bias, dy, world, rank)
            layer.load_full_state_dict(state)
            xin = x_in.to(device).clone().requires_grad_(True)
            y = layer(xin)
            y.backward(dy_in.to(device))
            got = {"y": y, "dx": xin.grad, "dw": layer.weight.grad}
            if with_bias:
                got["db"] = layer.bias.grad
            for name, value in got.items():
                errs[name] = max(errs.get(name, 0.0), rel_err(value.detach().cpu(), ref[name]))
        rows.append({"case": case, **errs, "dtypes": sorted({str(t.dtype) for t in got.values()}),
                     "paths": (tileweave.last_path("all_gather_gemm"), tileweave.last_path("gemm_reduce_scatter"))})
    return rows


def fp8_refusals_check(rank: int, world: int) -> dict[str, str]:
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
