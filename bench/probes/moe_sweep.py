"""Config sweep of the MoE layer's fused kernels on one GPU (world size 1, bf16, uniform routing):
layer 0 with the SwiGLU epilogue (with and without saving the pre-activations) against the plain grouped
GEMM of the same FLOPs, the SwiGLU's gradient pass next to the G GEMM; the weight-gradient kernel against
``torch._grouped_mm`` on expert-ordered copies. Every config is checked against a torch result first.
Prints a table; writes sweep.json to argv[1]. ``PYTHONPATH=src python3 bench/probes/moe_sweep.py OUT``."""
import json
import sys
import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F

from moe_profile import _time  # noqa: E402  (a probe beside this one; run from this folder's path)
from tileweave.bench.moe import MODELS, Inputs, Row
from tileweave.nn.moe_autograd import TILEWEAVE_OPS
from tileweave.ops.compute.grouped_gemm import SwiGLU, grouped_gemm
from tileweave.ops.compute.grouped_wgrad import grouped_wgrad
from tileweave.ops.compute.swiglu import swiglu_grad
from tileweave.testing.emulated import run_ranks
from tileweave.tune.grouped import GroupedConfig as GC, WgradConfig as WC

SWIGLU = [GC(block_m=128, block_n=128, block_k=64, num_stages=3, num_warps=8, flatten=True),
          GC(block_m=128, block_n=128, block_k=64, num_stages=3, num_warps=8),
          GC(block_m=128, block_n=128, block_k=64, num_stages=4, num_warps=8, flatten=True),
          GC(block_m=64, block_n=128, block_k=64, num_stages=4, num_warps=4)]
WGRAD = [WC(block_n=128, block_k=128, block_r=64, num_stages=3, num_warps=8),
         WC(block_n=128, block_k=128, block_r=64, num_stages=4, num_warps=8),
         WC(block_n=128, block_k=128, block_r=32, num_stages=5, num_warps=8),
         WC(block_n=128, block_k=256, block_r=64, num_stages=3, num_warps=8),
         WC(block_n=128, block_k=128, block_r=64, num_stages=4, num_warps=4),
         WC(block_n=256, block_k=128, block_r=64, num_stages=3, num_warps=8)]


def _err(got, ref):
    return ((got.float() - ref.float()).norm() / ref.float().norm()).item()


def _try(rows, key, fn, ref):
    try:
        out = fn()
        err = _err(out, ref)
        ms = _time(fn) if err < 2e-2 else None
        rows.append({**key, "ms": ms, "err": err})
        print(f"  {key['what']:10s} {key.get('config', '-')!s:90.90s} {ms if ms is None else round(ms, 3)} "
              f"err {err:.1e}", flush=True)
    except Exception:
        rows.append({**key, "error": traceback.format_exc()[-400:]})
        print(f"  {key['what']} {key.get('config')} FAILED {traceback.format_exc()[-300:]}", flush=True)


def sweep(rank, world, models, tokens):
    group = dist.group.WORLD
    device = torch.device("cuda", torch.cuda.current_device())
    dtype = torch.bfloat16
    rows = []
    for model in models:
        inp = Inputs(Row(model, tokens, "uniform", "layer-bwd"), rank=rank, world=world, smoke=False, dtype=dtype,
                     device=device)
        e, f = inp.e, inp.f_loc
        plan = TILEWEAVE_OPS.plan(inp.ids_shard, e, group)
        x, b0, b1 = inp.x_shard, inp.w0.transpose(1, 2), inp.w1  # b1: [E, H, F] as [E, K, N] of dO @ w1
        dout = inp.dout_shard
        wrow = torch.rand(plan.rows, device=device)
        print(f"{model} T={tokens}", flush=True)
        plain = grouped_gemm(x, b0, plan.offsets, a_rows=plan.row_token, experts=e)
        ref_h = F.silu(plain[:, :f].float()) * plain[:, f:].float()
        _try(rows, {"model": model, "what": "plain0"}, lambda: grouped_gemm(x, b0, plan.offsets, a_rows=plan.row_token,
                                                                         experts=e), plain)
        pre = torch.empty(plan.rows, 2 * f, device=device, dtype=dtype)
        for cfg in SWIGLU:
            for save in (False, True):
                ep = SwiGLU(pre=pre if save else None)
                _try(rows, {"model": model, "what": "swiglu+pre" if save else "swiglu", "config": repr(cfg)},
                     lambda: grouped_gemm(x, b0, plan.offsets, a_rows=plan.row_token, experts=e, epilogue=ep,
                                          config=cfg), ref_h)
        g_plain = grouped_gemm(dout, b1, plan.offsets, a_rows=plan.row_token, experts=e)
        _try(rows, {"model": model, "what": "plainG"}, lambda: grouped_gemm(dout, b1, plan.offsets, a_rows=plan.row_token,
                                                                         experts=e), g_plain)
        pre.copy_(torch.stack([plain[:, :f], plain[:, f:]], 2).reshape(plan.rows, 2 * f))  # interleaved
        gate, up = plain[:, :f].float(), plain[:, f:].float()
        dh = g_plain.float() * wrow[:, None]
        sig = torch.sigmoid(gate)
        ref_dy = torch.cat([dh * up * sig * (1 + gate * (1 - sig)), dh * gate * sig], 1)
        # The SwiGLU's gradient as the layer runs it: one pass after the plain G GEMM.
        _try(rows, {"model": model, "what": "swiglu_grad"}, lambda: swiglu_grad(g_plain, pre, wrow)[0], ref_dy)
        dy = ref_dy.to(dtype)
        order = torch.argsort(plan.row_expert, stable=True)
        ends = torch.cumsum(plan.splits, 0, dtype=torch.int32)
        lhs, rhs = dy[order], x[plan.row_token.long()][order]
        ref_w = torch._grouped_mm(lhs.t(), rhs, offs=ends)
        _try(rows, {"model": model, "what": "wgrad_mm"}, lambda: torch._grouped_mm(lhs.t(), rhs, offs=ends), ref_w)
        for cfg in WGRAD:
            _try(rows, {"model": model, "what": "wgrad", "config": repr(cfg)},
                 lambda: grouped_wgrad(dy, x, plan.offsets, experts=e, rhs_rows=plan.row_token, config=cfg), ref_w)
        # The layer-1 form: the gathered dO scaled by the routing weights against h [P, F].
        hrows = ref_h.to(dtype)
        lhs1 = (dout[plan.row_token.long()].float() * wrow[:, None]).to(dtype)[order]
        ref_w1 = torch._grouped_mm(lhs1.t(), hrows[order], offs=ends)
        rhs1 = hrows[order]
        _try(rows, {"model": model, "what": "wgrad1_mm"}, lambda: torch._grouped_mm(lhs1.t(), rhs1, offs=ends), ref_w1)
        for cfg in WGRAD[:3]:
            _try(rows, {"model": model, "what": "wgrad1", "config": repr(cfg)},
                 lambda: grouped_wgrad(dout, hrows, plan.offsets, experts=e, lhs_rows=plan.row_token, scale=wrow,
                                       config=cfg), ref_w1)
        del inp, plain, pre, g_plain, dy, lhs, rhs, ref_w, ref_dy, lhs1, rhs1, ref_w1, hrows
        torch.cuda.empty_cache()
    return rows


if __name__ == "__main__":
    models = sys.argv[2].split(",") if len(sys.argv) > 2 else ["mixtral-8x7b", "qwen3-30b-a3b"]
    tokens = int(sys.argv[3]) if len(sys.argv) > 3 else 16384
    result = run_ranks(1, sweep, models, tokens, gpus=True, heap_bytes=64 << 20)[0]
    with open(f"{sys.argv[1]}/sweep.json", "w") as f:
        json.dump(result, f, indent=1)
