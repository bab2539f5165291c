"""The ``block`` section: one Llama-style TP transformer block, forward + backward, four ways.

Variants, all on the same block (same weights, same inputs), differing only in what runs the TP GEMMs
with their communication (``tileweave.nn.linear``'s ``all_gather_gemm`` / ``gemm_reduce_scatter``):

* ``ours``: tileweave's ops (policy and transport from the command line);
* ``base``: NCCL all-gather / reduce-scatter around cuBLAS GEMMs (Megatron-LM without overlap);
* ``torch``: PyTorch async-TP, ``torch.ops.symm_mem.fused_all_gather_matmul`` /
  ``fused_matmul_reduce_scatter``;
* ``floor``: the compute floor: the same GEMMs on the same shapes with the communication replaced by
  local copies of the same size. Its numbers are not a model's; it is not verified.

A step is ``y = block(x)`` then ``y.backward(dy)`` (weight and input gradients, no optimizer). Each
variant is verified against ``base`` on its first step (output and input gradient), then timed like
every other section: steady state, back-to-back steps, median over reps, max over ranks.

With ``--dtype fp8`` each row also runs the block in float8, one row per ``--scaling`` (``dtype``
``fp8-<scaling>``), as ``ours`` and ``torch`` (NCCL + torch's scaled matmul): ``tileweave.bench.block_fp8``.

World size 1 runs too, every variant on a group of one rank: tileweave's ops, NCCL's collectives (then
copies) and PyTorch async-TP's fused ops all take it. A variant that cannot run (PyTorch async-TP off
CUDA devices, say) is reported unavailable, with the reason.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.distributed as dist

from tileweave.bench import block_fp8
from tileweave.bench import variants as V
from tileweave.bench.fp8 import dtype_label
from tileweave.bench.suite import norm_name
from tileweave.nn.block import BlockConfig, TPTransformerBlock
from tileweave.nn.linear import TILEWEAVE_OPS, TPOps

SEQ = 4096
"""Longest sequence; a row of M tokens is ``ceil(M / SEQ)`` sequences of equal length."""

BLOCK_MODELS: dict[str, BlockConfig] = {
    "llama3-8b": BlockConfig(hidden=4096, heads=32, kv_heads=8, ffn=14336),
    "llama3-70b": BlockConfig(hidden=8192, heads=64, kv_heads=8, ffn=28672),
}
BLOCK_M_VALUES: tuple[int, ...] = (4096, 8192, 16384)

Ops = TPOps
"""The communication GEMMs a variant runs the block's layers on."""


@dataclasses.dataclass(frozen=True)
class BlockRow:
    model: str
    m: int

    @property
    def config(self) -> BlockConfig:
        return BLOCK_MODELS[self.model]

    @property
    def batch(self) -> int:
        return -(-self.m // SEQ)

    @property
    def label(self) -> str:
        return f"{self.model} block"


def select_block_rows(*, layers: tuple[str, ...] | None, m_values: tuple[int, ...] | None,
                      world_size: int) -> list[BlockRow]:
    """Rows of the block section. ``layers`` filters by model (``llama3-8b``), a layer's full name
    (``llama3-8b qkv``, as ``--quick`` chooses for the other sections) naming its model; ``block`` or no
    filter takes both models. M must split into whole sequences and over the group."""
    keys = {norm_name(f) for f in layers or ()}
    keys |= {key.split()[0] for key in keys if " " in key}
    models = [name for name in BLOCK_MODELS if not keys or keys & {norm_name(name), norm_name("block")}]
    if not models:
        raise ValueError(f"--layer {' '.join(layers or ())} selects no block model; the block section has "
                         f"{', '.join(BLOCK_MODELS)} (or 'block' for both)")
    rows = []
    for m in m_values or BLOCK_M_VALUES:
        batch = -(-m // SEQ) if m > 0 else 1
        if m <= 0 or m % batch or m % world_size:
            raise ValueError(f"block rows need M > 0 split into whole sequences of at most {SEQ} tokens and "
                             f"divisible by the group size {world_size}; got M={m}")
        rows += [BlockRow(model, m) for model in models]
    return rows


def base_ops(world: int) -> Ops:
    """NCCL collectives around cuBLAS GEMMs."""

    def all_gather_gemm(a_shard, b, group, *, bias=None, out=None, return_gathered=False):
        a_shard = a_shard.contiguous()
        gathered = a_shard.new_empty((a_shard.shape[0] * world, a_shard.shape[1]))
        dist.all_gather_into_tensor(gathered, a_shard, group=group)
        y = torch.addmm(bias, gathered, b) if bias is not None else gathered @ b
        return (y, gathered) if return_gathered else y

    def gemm_reduce_scatter(a, b, group, *, bias=None, out=None):
        partial = a @ b
        y = partial.new_empty((partial.shape[0] // world, partial.shape[1]))
        dist.reduce_scatter_tensor(y, partial, group=group)
        return y + bias if bias is not None else y

    return TPOps(all_gather_gemm=all_gather_gemm, gemm_reduce_scatter=gemm_reduce_scatter)


def torch_ops() -> tuple[Ops | None, str]:
    """PyTorch async-TP's fused ops, or None and why not."""
    ag, note = V.torch_async_tp("fused_all_gather_matmul")
    rs, note_rs = V.torch_async_tp("fused_matmul_reduce_scatter")
    if ag is None or rs is None:
        return None, note or note_rs

    def all_gather_gemm(a_shard, b, group, *, bias=None, out=None, return_gathered=False):
        gathered, (y,) = ag(a_shard.contiguous(), [b], 0, group.group_name)
        y = y + bias if bias is not None else y
        return (y, gathered) if return_gathered else y

    def gemm_reduce_scatter(a, b, group, *, bias=None, out=None):
        y = rs(a, b, "sum", 0, group.group_name)
        return y + bias if bias is not None else y

    return TPOps(all_gather_gemm=all_gather_gemm, gemm_reduce_scatter=gemm_reduce_scatter), ""


def floor_ops(rank: int, world: int) -> Ops:
    """The same GEMMs and the same bytes moved within one GPU: the block's time without communication."""

    def all_gather_gemm(a_shard, b, group, *, bias=None, out=None, return_gathered=False):
        gathered = a_shard.repeat(world, 1)
        y = torch.addmm(bias, gathered, b) if bias is not None else gathered @ b
        return (y, gathered) if return_gathered else y

    def gemm_reduce_scatter(a, b, group, *, bias=None, out=None):
        rows = a.shape[0] // world
        y = (a @ b)[rank * rows:(rank + 1) * rows].clone()
        return y + bias if bias is not None else y

    return TPOps(all_gather_gemm=all_gather_gemm, gemm_reduce_scatter=gemm_reduce_scatter)


@dataclasses.dataclass
class BlockInputs:
    """One rank's block, input shard and output gradient for one row."""

    row: BlockRow
    block: torch.nn.Module
    x: torch.Tensor
    dy: torch.Tensor

    def step(self, ops: Ops | None) -> Callable[[int], tuple[torch.Tensor, torch.Tensor]]:
        """One forward and backward of the block on ``ops`` (None: tileweave's own)."""
        params = list(self.block.parameters())
        ops = ops or TILEWEAVE_OPS

        def call(i: int) -> tuple[torch.Tensor, torch.Tensor]:
            for p in params:
                p.grad = None
            self.x.grad = None
            self.block.ops = ops  # variants share the block: each step runs on its own ops
            y = self.block(self.x, self.row.batch)
            y.backward(self.dy)
            return y.detach(), self.x.grad

        return call


def make_block_inputs(row: BlockRow, *, rank: int, world_size: int, group: dist.ProcessGroup,
                      dtype: torch.dtype = V.DTYPE) -> BlockInputs:
    torch.manual_seed(V.seed_for("block", row.model, rank))  # each rank initialises its own shards
    block = TPTransformerBlock(row.config, group=group, device="cuda", dtype=dtype)
    local = row.m // world_size
    seed = V.seed_for("block-data", row.model, row.m, rank)
    x = V.randn((local, row.config.hidden), seed=seed).requires_grad_(True)
    dy = V.randn((local, row.config.hidden), seed=seed + 1, scale=local ** -0.5)
    return BlockInputs(row=row, block=block, x=x, dy=dy)


def block_variant(name: str, x: BlockInputs, *, rank: int, world_size: int,
                  reference: tuple[torch.Tensor, torch.Tensor] | None) -> V.Variant:
    """The ``name`` variant of ``x``'s block; checked against ``reference`` (base's output and input
    gradient) where one is given."""
    if name == "torch":
        ops, note = torch_ops() if x.x.is_cuda else (None, "PyTorch async-TP runs on CUDA devices only")
        if ops is None:
            return V.Variant(name="torch", call=None, note=note)
    elif name == "base":
        ops = base_ops(world_size)
    elif name == "floor":
        ops = floor_ops(rank, world_size)
    elif name == "ours":
        ops = None
    else:
        raise ValueError(f"unknown block variant {name!r}")

    def check(out) -> float:
        y, dx = out
        return max(V.rel_err(y, reference[0].float()), V.rel_err(dx, reference[1].float()))

    # The floor computes no model, so it has nothing to be checked against (its rel_err stays empty).
    return V.Variant(name=name, call=x.step(ops), check=check if reference is not None else None,
                     path=block_fp8.ours_paths if name == "ours" else None)


def measure_row(x: BlockInputs, names: tuple[str, ...], *, rank: int, world_size: int,
                run: Callable[[V.Variant, dict], object], scalings: tuple[str, ...] = ()) -> list:
    """``run(variant, key)`` for each variant of ``names`` on ``x`` (those but the floor checked against
    one NCCL step, ``base_ops``), then for each of ``scalings`` the FP8 variants of ``names`` (``torch``,
    ``ours``; ``block_fp8``), keyed with their ``dtype``; returns what ``run`` returned, in that order.
    Collective: every rank calls it with the same arguments."""
    c = x.block.config
    key = dict(op="block", layer=x.row.label, world_size=world_size, m=x.row.m, k=c.hidden, n=c.ffn)
    y, dx = x.step(base_ops(world_size))(0)
    reference = (y.clone(), dx.clone())
    del y, dx
    out = [run(block_variant(name, x, rank=rank, world_size=world_size,
                             reference=None if name == "floor" else reference), key) for name in names]
    del reference
    for scaling in scalings:
        out += [run(v, dict(key, dtype=dtype_label(scaling))) for v in block_fp8.fp8_variants(x, scaling, names)]
        torch.cuda.empty_cache()
    return out
