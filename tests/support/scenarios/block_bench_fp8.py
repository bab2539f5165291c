"""The block section's FP8 rows (``tileweave.bench.block_fp8``) on a small fp32 block: what the section
records per variant, each variant verified as the runner verifies it, and a wrong FP8 variant caught."""

from __future__ import annotations

import dataclasses
import os

import torch

from tileweave.bench import block as B
from tileweave.bench import block_fp8
from tileweave.nn.block import BlockConfig, TPTransformerBlock
from support.scenarios.common import device_name
from support.scenarios.layers import hf_block_state, small_block_data


def _verify(v, key: dict) -> dict:
    """What ``runner.run_variant`` decides before it times a variant: unavailable (n/a), or one call
    checked against the variant's tolerance (ok or FAILED)."""
    row = dict(key, variant=v.name, tolerance=v.tolerance)
    if v.call is None:
        return dict(row, status="n/a", note=v.note)
    err = v.check(v.call(0)) if v.check is not None else None
    return dict(row, status="ok" if err is None or err < v.tolerance else "FAILED", rel_err=err)


def block_fp8_rows_check(rank: int, world: int, widths: dict, m: int, scalings: tuple[str, ...]) -> dict:
    """``block.measure_row`` as the runner calls it, in its two phases (``torch`` first, then ``base`` and
    ``ours``), with ``scalings``; each variant verified (``_verify``). Also the error the FP8 check gives
    a block whose weight-gradient GEMM doubles its result, and an output perturbed by 10%."""
    os.environ["TILEWEAVE_POLICY"] = "fused"
    device = device_name()
    c = BlockConfig(**widths, rope_theta=10000.0)
    state, x_full, g_full = small_block_data(c, m, "bb-fp8", device)
    rows = slice(rank * m // world, (rank + 1) * m // world)
    block = TPTransformerBlock(c, device=device)
    block.load_full_state_dict(hf_block_state(state, c))
    row = B.BlockRow("llama3-8b", m)  # its label and M key the rows; the block's widths are the small ones
    x = B.BlockInputs(row=row, block=block, x=x_full[rows].clone().requires_grad_(True), dy=g_full[rows])
    recorded = [*B.measure_row(x, ("torch",), rank=rank, world_size=world, run=_verify, scalings=scalings),
                *B.measure_row(x, ("base", "ours"), rank=rank, world_size=world, run=_verify, scalings=scalings)]

    # The check of the first scaling on a correct step, on its output perturbed by 10%, and on a step whose
    # weight-gradient GEMM doubles its result (a scale applied twice; the float32 reference's ops otherwise).
    f = block_fp8.fp8_inputs(x, scalings[0])
    y, dx = f.inputs.step(None)(0)
    good = f.check((y, dx))
    perturbed = f.check((y * (1 + 0.1 * torch.randn_like(y)), dx))
    ref_ops = block_fp8.fp8_ops(block_fp8.dequantized_matmul)
    wrong = dataclasses.replace(ref_ops, matmul=lambda a, b, **kw: 2 * block_fp8.dequantized_matmul(a, b, **kw))
    wrong_wgrad = f.check(f.inputs.step(wrong)(0))
    return {"rows": recorded, "good": good, "perturbed": perturbed, "wrong_wgrad": wrong_wgrad,
            "tolerance": block_fp8.TOLERANCE}
