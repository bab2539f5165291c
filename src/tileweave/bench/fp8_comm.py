"""FP8 rows of the ``ag`` and ``rs`` sections: each rank's shard and weight quantised to e4m3 with one
scaling (``tileweave.bench.fp8``), bf16 output, every variant checked against float32 of the
dequantised inputs gathered (AG) or reduce-scattered (RS) in float32.

Variants, like the bf16 rows':

* ``base``: NCCL and torch's scaled matmul without overlap. AG gathers the float8 bytes and the row
  scales (rowwise, blockwise) and runs ``torch._scaled_mm`` / ``nn.functional.scaled_mm`` on the
  gathered rows; RS runs the scaled matmul to a bf16 partial and reduce-scatters it.
* ``torch``: PyTorch's async-TP, ``torch.ops.symm_mem.fused_all_gather_scaled_matmul`` and
  ``fused_scaled_matmul_reduce_scatter`` (tensorwise and rowwise; they take no blockwise scales).
* ``ours``: ``tileweave.all_gather_gemm`` / ``gemm_reduce_scatter`` with ``scale_a``, ``scale_b``.

A tensorwise scale is the group's: the amax of every rank's shard (torch's fused AllGather takes one
scale for the gathered rows), so every variant sees the same float8 data.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from tileweave.bench import fp8
from tileweave.bench import variants as V


@dataclasses.dataclass(kw_only=True)
class Fp8RowInputs:
    """One rank's float8 inputs for one row and scaling: ``a`` the shard (AG) or the K slice (RS) with
    its scales ``sa``, the weight ``w`` ``[N_loc, K]`` (AG) or ``[N, K_loc]`` (RS) with ``sb`` (of
    ``w.t()``), and the fp32 reference of this rank's output."""

    x: V.RowInputs
    scaling: str
    a: list[torch.Tensor]
    sa: list[torch.Tensor]
    w: list[torch.Tensor]
    sb: list[torch.Tensor]
    ref: torch.Tensor


def _quantize_shard(a: torch.Tensor, base: str, group: dist.ProcessGroup) -> tuple[torch.Tensor, torch.Tensor,
                                                                                   torch.Tensor]:
    if base != "tensorwise":
        return fp8.quantize_rows(a, base)
    amax = a.abs().amax().float()
    dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    scale = (amax / fp8.E4M3_MAX).clamp_min(1e-12)
    a8 = (a.float() / scale).clamp(-fp8.E4M3_MAX, fp8.E4M3_MAX).to(torch.float8_e4m3fn)
    return a8, scale, a8.float() * scale


def make_fp8_inputs(x: V.RowInputs, scaling: str, *, group: dist.ProcessGroup) -> Fp8RowInputs:
    """Quantise ``x``'s sets with ``scaling`` and build the reference. Collective: every rank calls it."""
    base, _ = fp8.split(scaling)
    qa = [_quantize_shard(a, base, group) for a in x.a]
    qw = [fp8.quantize_weight(w, base) for w in x.w]
    a_deq, w_deq = qa[0][2], qw[0][2]
    if x.row.layer.kind == "AG":
        gathered = torch.empty((x.row.m, a_deq.shape[1]), dtype=torch.float32, device=a_deq.device)
        dist.all_gather_into_tensor(gathered, a_deq.contiguous(), group=group)
        ref = gathered @ w_deq.t()
    else:
        ref = torch.empty(x.shapes.out, dtype=torch.float32, device=a_deq.device)
        dist.reduce_scatter_tensor(ref, a_deq @ w_deq.t(), group=group)
    return Fp8RowInputs(x=x, scaling=scaling, a=[q[0] for q in qa], sa=[q[1] for q in qa], w=[q[0] for q in qw],
                        sb=[q[1] for q in qw], ref=ref)


def _checker(ref: torch.Tensor):
    return lambda out: V.rel_err(out, ref)


def all_gather_rows(a8: torch.Tensor, *, group: dist.ProcessGroup) -> torch.Tensor:
    """Every rank's float8 rows ``[M/W, K]`` gathered to ``[M, K]`` over NCCL, as bytes."""
    world = dist.get_world_size(group)
    g = torch.empty((a8.shape[0] * world, a8.shape[1]), dtype=torch.uint8, device=a8.device)
    dist.all_gather_into_tensor(g, a8.contiguous().view(torch.uint8), group=group)
    return g.view(a8.dtype)


def all_gather_scales(sa: torch.Tensor, *, group: dist.ProcessGroup) -> torch.Tensor:
    """Every rank's row scales ``[M/W, KB]`` (float32: ``[M/W, 1]`` rowwise, ``[M/W, K/128]`` blockwise)
    gathered to ``[M, KB]``, row-major."""
    world = dist.get_world_size(group)
    gs = torch.empty((sa.shape[0] * world, sa.shape[1]), dtype=sa.dtype, device=sa.device)
    dist.all_gather_into_tensor(gs, sa.contiguous(), group=group)
    return gs


def reduce_scatter_rows(partial: torch.Tensor, *, group: dist.ProcessGroup) -> torch.Tensor:
    """``[M, N]`` partials summed over the ranks, this rank's ``[M/W, N]`` rows, over NCCL."""
    world = dist.get_world_size(group)
    out = torch.empty((partial.shape[0] // world, partial.shape[1]), dtype=partial.dtype, device=partial.device)
    dist.reduce_scatter_tensor(out, partial, group=group)
    return out


def base_variant(f: Fp8RowInputs, *, group: dist.ProcessGroup) -> V.Variant:
    """NCCL collective and torch's scaled matmul, one after the other."""
    fn, note = fp8.torch_scaled_mm(f.scaling)
    if fn is None:
        return V.Variant(name="base", call=None, note=note)
    n = len(f.a)
    base, _ = fp8.split(f.scaling)
    if f.x.row.layer.kind == "AG":
        def ag(i: int) -> torch.Tensor:
            a8, sa = f.a[i % n], f.sa[i % n]
            g = all_gather_rows(a8, group=group)
            if base != "tensorwise":  # row scales travel with their rows; blockwise's M-major, as torch wants
                gs = all_gather_scales(sa, group=group)
                sa = gs if base == "rowwise" else fp8.m_major(gs)
            return fn(g, f.w[i % n].t(), sa, f.sb[i % n])

        return V.Variant(name="base", call=ag, check=_checker(f.ref))

    def rs(i: int) -> torch.Tensor:
        return reduce_scatter_rows(fn(f.a[i % n], f.w[i % n].t(), f.sa[i % n], f.sb[i % n]), group=group)

    return V.Variant(name="base", call=rs, check=_checker(f.ref))


def torch_variant(f: Fp8RowInputs, *, group: dist.ProcessGroup) -> V.Variant:
    """PyTorch's scaled async-TP ops (tensorwise, rowwise)."""
    base, fast = fp8.split(f.scaling)
    if base == "blockwise":
        return V.Variant(name="torch", call=None, note="PyTorch's scaled async-TP ops take no blockwise scales")
    n, name = len(f.a), group.group_name
    if f.x.row.layer.kind == "AG":
        fn, note = V.torch_async_tp("fused_all_gather_scaled_matmul")
        if fn is None:
            return V.Variant(name="torch", call=None, note=note)
        return V.Variant(name="torch", check=_checker(f.ref), call=lambda i: fn(
            f.a[i % n], [f.w[i % n].t()], f.sa[i % n], [f.sb[i % n]], 0, name, [None], [None], [torch.bfloat16],
            [fast])[1][0])
    fn, note = V.torch_async_tp("fused_scaled_matmul_reduce_scatter")
    if fn is None:
        return V.Variant(name="torch", call=None, note=note)
    out_shape = [f.x.row.m, f.w[0].shape[0]]
    return V.Variant(name="torch", check=_checker(f.ref), call=lambda i: fn(
        f.a[i % n], f.w[i % n].t(), f.sa[i % n], f.sb[i % n], "sum", 0, 0, name, out_shape,
        out_dtype=torch.bfloat16, use_fast_accum=fast))


def ours_variant(f: Fp8RowInputs, *, group: dist.ProcessGroup) -> V.Variant:
    """tileweave's fused op in FP8."""
    _, fast = fp8.split(f.scaling)
    op_name = "all_gather_gemm" if f.x.row.layer.kind == "AG" else "gemm_reduce_scatter"
    fn, note = V.lookup_ours(op_name)
    if fn is None:
        return V.Variant(name="ours", call=None, note=note)
    n = len(f.a)
    return V.Variant(name="ours", check=_checker(f.ref), path=V.path_probe(op_name), call=lambda i: fn(
        f.a[i % n], f.w[i % n].t(), group, scale_a=f.sa[i % n], scale_b=f.sb[i % n], use_fast_accum=fast))


def variants(f: Fp8RowInputs, *, group: dist.ProcessGroup) -> list[V.Variant]:
    """The row's FP8 variants, baselines first."""
    return [base_variant(f, group=group), torch_variant(f, group=group), ours_variant(f, group=group)]
