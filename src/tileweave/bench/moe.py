"""The ``moe`` section: the MoE pair and the TP MoE layer against what users run today.

    python -m tileweave.bench.moe                   # one process per GPU, every model, T and routing
    python -m tileweave.bench.moe --smoke           # the CPU: tiny shapes on 2 emulated ranks, verified
    torchrun --nproc-per-node 8 -m tileweave.bench.moe --models flux --tokens 8192   # or under torchrun

Parts (``--parts``): ``layer0`` (AllGather + grouped GEMM), ``layer1`` (grouped GEMM + top-k reduce +
ReduceScatter), ``layer`` (``TPMoE`` forward under ``torch.no_grad``: router, plan, both layers,
SwiGLU), ``layer-bwd`` (forward + backward, no optimizer) and ``route`` (the layer's routing on the
device as one call: router GEMM in fp32, softmax + top-k, the plan). Variants, on the same inputs:

* ``ours``: tileweave's MoE pair (``tileweave.ops.moe``), the layer on its default ops;
* ``grouped``: NCCL all-gather + index gather + ``torch._grouped_mm`` + weighted ``index_add`` + NCCL
  reduce-scatter, rows in expert order (a Megatron-style layer with grouped GEMM);
* ``loop``: the same with one cuBLAS GEMM per expert (the counts read on the host);
* ``floor``: the grouped GEMMs alone (``torch._grouped_mm``), inputs already gathered and permuted:
  the compute floor (layer0: 1 GEMM, layer1: 1, layer: 2 and the SwiGLU, layer-bwd: those and the 4
  backward GEMMs).

``--dtype fp8 --scaling tensorwise,rowwise,blockwise``: FP8 rows beside the bf16 ones, each row's
``dtype`` naming its scaling (``fp8-rowwise``; ``tileweave.bench.moe_fp8``): ``layer0`` and ``layer1`` on
the same inputs quantized to e4m3, with torch's ``torch._scaled_grouped_mm`` + NCCL as the variant
``torch``; ``layer`` and ``layer-bwd`` as ``ours`` only, the same calls on ``TPMoE(..., fp8=recipe)``.

``route`` runs ``ours`` (the layer's plan, ``tileweave.nn.moe_autograd.TILEWEAVE_OPS``) and ``grouped``
(all-gather of the ids + ``build_plan``) only; it is verified by routing: every (token, slot) pair's
plan row must hold that token and the expert a float64 top-k of the same logits picks, and the top-k
weights are checked against float64.

The layer parts run one ``TPMoE`` whose ``ops`` are swapped (``tileweave.nn.moe_autograd.MoEOps``), so
the backward of ``grouped`` and ``loop`` runs their own collectives and GEMMs. Routing is imposed
through the router (the first E features of a token score the experts, read by a near-identity
router): ``uniform`` or ``zipf`` (expert e drawn with weight ``1/(e+1)**1.2``).

Method (docs/design.md, "Measuring"): every variant is verified against float64 computed from the
definitions (``tileweave.bench.moe_reference``: a mask per expert, no plan, one expert at a time)
before it is timed; steady state (``tileweave.bench.timing.measure``: warm-up, back-to-back calls
between CUDA events, median over reps, max over ranks, the SM clock); the same calls on every
rank; peak memory per variant. JSON + markdown (+ a chart with matplotlib: ours' speedups over the
baselines, and floor/ours) into ``--out`` (``tileweave.bench.moe_report``). With ``--smoke`` the ranks
are emulated on the CPU, each variant runs and is checked once; its times are the interpreter's and
mean nothing: the report says so and shows no ratios and no chart.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tileweave.bench import fp8, moe_fp8, output_dir
from tileweave.bench.moe_reference import bounded, reference, rel_err, route_err
from tileweave.bench.moe_report import markdown, write_report
from tileweave.bench.metadata import collect_metadata
from tileweave.bench.report import Measurement
from tileweave.bench.timing import ClockReader, DistAgreement, MemoryWatch, TimingConfig, measure
from tileweave.nn.moe import TPMoE, route
from tileweave.nn.moe_autograd import TILEWEAVE_OPS, MoEOps, gather_rows, reduce_scatter_rows, row_weights
from tileweave.ops.common import last_path
from tileweave.ops.functional import moe_all_gather_gemm, moe_gemm_reduce_scatter
from tileweave.ops.moe import build_plan
from tileweave.testing.emulated import run_ranks

MODELS: dict[str, tuple[int, int, int, int]] = {
    "mixtral-8x7b": (4096, 14336, 8, 2),
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "deepseek-v2-lite": (2048, 1408, 64, 6),
    "flux": (8192, 8192, 32, 4),
}
"""(hidden H, expert width F, experts E, top-k k)."""
SMOKE_MODELS: dict[str, tuple[int, int, int, int]] = {"smoke": (16, 32, 4, 2)}
FP8_SMOKE_MODELS: dict[str, tuple[int, int, int, int]] = {"smoke-fp8": (128, 256, 4, 2)}
"""``--smoke --dtype fp8``: H and F/2 multiples of 128, as blockwise scaling needs."""
TOKENS = (2048, 4096, 8192, 16384)
ROUTINGS = ("uniform", "zipf")
PARTS = ("layer0", "layer1", "layer", "layer-bwd", "route")
VARIANTS = ("ours", "grouped", "loop", "floor")
PART_VARIANTS = {"route": ("ours", "grouped")}
"""The variants a part has where not all of ``VARIANTS`` (the others are not run, and reported "-")."""
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 4e-3, torch.float32: 1e-5}
"""Relative Frobenius error against float64 (bf16 and fp16: the layer rounds at each of its steps, the
router's weights included, so twice the single-op bound)."""


def part_variants(part: str, variants: tuple[str, ...] = VARIANTS) -> tuple[str, ...]:
    """Those of ``variants`` that ``part`` runs, in their order."""
    return tuple(v for v in variants if v in PART_VARIANTS.get(part, VARIANTS))


# ---------------------------------------------------------------------------------------------------
# The baselines as MoEOps: expert-major rows (the plan of one source), torch GEMMs, NCCL collectives.

def _baseline_plan(topk_ids_shard, num_experts, group):
    return build_plan(gather_rows(topk_ids_shard, group), num_experts=num_experts, world_size=1, validate=False)


def _grouped_mm(a: torch.Tensor, b: torch.Tensor, plan) -> torch.Tensor:
    return torch._grouped_mm(a, b, offs=plan.offsets[1:])


def _expert_loop(a: torch.Tensor, b: torch.Tensor, plan) -> torch.Tensor:
    out = a.new_empty((a.shape[0], b.shape[2]))
    bounds = plan.offsets.tolist()
    for e in range(plan.num_experts):
        lo, hi = bounds[e], bounds[e + 1]
        if hi > lo:
            torch.matmul(a[lo:hi], b[e], out=out[lo:hi])
    return out


def baseline_ops(gemm: Callable) -> MoEOps:
    """The NCCL + torch layer with ``gemm(a [P, K], b [E, K, N], plan)`` as its expert GEMM."""

    def layer0(x_shard, w, plan, group, return_gathered):
        x = gather_rows(x_shard, group)
        y = gemm(x[plan.row_token.long()], w, plan)
        return (y, x) if return_gathered else y

    def layer1(h, w, plan, weights_shard, group):
        z = gemm(h, w, plan)
        if weights_shard is not None:
            z = z * row_weights(plan, gather_rows(weights_shard, group))[:, None].to(z.dtype)
        out = torch.zeros((plan.tokens, w.shape[2]), dtype=torch.float32, device=h.device)
        out.index_add_(0, plan.row_token.long(), z.float())
        return reduce_scatter_rows(out.to(h.dtype), group)

    return MoEOps(plan=_baseline_plan, layer0=layer0, layer1=layer1)


def _ours_layer0(x_shard, w, plan, group):
    return moe_all_gather_gemm(x_shard, w, plan, group)


# ---------------------------------------------------------------------------------------------------
# Inputs.

@dataclasses.dataclass(frozen=True)
class Row:
    model: str
    tokens: int
    routing: str
    part: str

    def dims(self, smoke: bool) -> tuple[int, int, int, int]:
        return {**SMOKE_MODELS, **FP8_SMOKE_MODELS}[self.model] if smoke else MODELS[self.model]


def _routing_ids(t: int, e: int, k: int, routing: str, gen: torch.Generator) -> torch.Tensor:
    weights = torch.ones(e) if routing == "uniform" else 1.0 / torch.arange(1, e + 1, dtype=torch.float32) ** 1.2
    return torch.multinomial(weights.expand(t, e), k, replacement=False, generator=gen)


def _routed_tokens(ids: torch.Tensor, h: int, e: int, gen: torch.Generator) -> torch.Tensor:
    """Tokens whose first E features score the experts of ``ids`` far above the rest."""
    x = 0.5 * torch.randn(ids.shape[0], h, generator=gen)
    scores = -0.5 * torch.rand(ids.shape[0], e, generator=gen)
    scores.scatter_(1, ids, 1.0 + 0.5 * torch.rand(ids.shape, generator=gen))
    x[:, :e] = scores
    return x


class Inputs:
    """One row's data on this rank: the tokens, routing and router from one seed shared by every rank
    (each takes its rows), the expert weights from a seed of its own (its F_loc features), made on the
    device (the unsharded expert weights of the largest rows would not fit in a rank's host memory)."""

    def __init__(self, row: Row, *, rank: int, world: int, smoke: bool, dtype, device) -> None:
        h, f, e, k = row.dims(smoke)
        t = row.tokens
        self.h, self.f, self.e, self.k, self.t, self.f_loc = h, f, e, k, t, f // world
        seed = 1000 + t + 7 * e + (0 if row.routing == "uniform" else 1)
        gen = torch.Generator().manual_seed(seed)
        ids = _routing_ids(t, e, k, row.routing, gen)
        rows = slice(rank * t // world, (rank + 1) * t // world)
        cast = dict(dtype=dtype, device=device)
        self.x_shard = _routed_tokens(ids, h, e, gen)[rows].to(**cast)
        self.ids_shard = ids[rows].to(device)
        self.weights_shard = torch.softmax(torch.randn(t, k, generator=gen), -1)[rows].to(device)
        self.router = 0.02 * torch.randn(e, h, generator=gen)
        self.router[:, :e] += 2.0 * torch.eye(e)
        self.router = self.router.to(device)
        self.dout_shard = torch.randn(t, h, generator=gen)[rows].to(**cast)
        if row.part == "route":  # the router alone
            return
        own = torch.Generator(device=device).manual_seed(seed * 64 + rank)
        self.w0 = (torch.randn(e, 2 * self.f_loc, h, generator=own, device=device) / h ** 0.5).to(dtype)
        self.w1 = (torch.randn(e, h, self.f_loc, generator=own, device=device) / f ** 0.5).to(dtype)
        self.h_rows = (torch.randn(t * k, self.f_loc, generator=own, device=device) / 2).to(dtype)


# ---------------------------------------------------------------------------------------------------
# One part's calls, per variant: call() -> the tensor(s) to verify.

def _layer_module(inp: Inputs, ops: MoEOps, group, dtype, device, fp8=None) -> TPMoE:
    layer = TPMoE(inp.h, inp.f, inp.e, inp.k, group=group, ops=ops, fp8=fp8, device=device, dtype=dtype)
    with torch.no_grad():
        layer.router.weight.copy_(inp.router)
        layer.w0.copy_(inp.w0)
        layer.w1.copy_(inp.w1)
    return layer


def make_call(part: str, variant: str, inp: Inputs, group, dtype, device, fp8=None) -> Callable[[], list[torch.Tensor]]:
    """A closure running ``part`` once on ``variant``; its results in a form every variant shares (rows in
    plan order are returned per (token, slot) pair). ``fp8``: the layer parts' ``TPMoE(fp8=...)`` recipe."""
    if variant == "floor":
        return _floor_call(part, inp, group)
    ops = {"ours": TILEWEAVE_OPS, "grouped": baseline_ops(_grouped_mm), "loop": baseline_ops(_expert_loop)}[variant]
    if part == "route":
        return _route_call(ops, inp, group)
    if part in ("layer", "layer-bwd"):
        layer = _layer_module(inp, ops, group, dtype, device, fp8)
        x = inp.x_shard.clone().requires_grad_(part == "layer-bwd")

        def run_layer():
            if part == "layer":
                with torch.no_grad():
                    return [layer(x)]
            out = layer(x)
            x.grad = None
            layer.zero_grad(set_to_none=True)
            out.backward(inp.dout_shard)
            return [out, x.grad, layer.w0.grad, layer.w1.grad]
        return run_layer
    plan = ops.plan(inp.ids_shard, inp.e, group)
    if part == "layer0":
        w0 = inp.w0.transpose(1, 2)
        layer0 = _ours_layer0 if variant == "ours" else (lambda x, w, p, g: ops.layer0(x, w, p, g, False))
        return lambda: [layer0(inp.x_shard, w0, plan, group)[plan.pair_row.reshape(-1).long()]]
    # layer1's input is given per (token, slot) pair; each variant takes it in its own plan's order
    h = torch.empty_like(inp.h_rows)
    h[plan.pair_row.reshape(-1).long()] = inp.h_rows
    w1 = inp.w1.transpose(1, 2)
    if variant == "ours":
        return lambda: [moe_gemm_reduce_scatter(h, w1, plan, inp.weights_shard, group)]
    return lambda: [ops.layer1(h, w1, plan, inp.weights_shard, group)]


def _route_call(ops: MoEOps, inp: Inputs, group) -> Callable[[], list[torch.Tensor]]:
    """``route``: what the TP MoE layer runs before its experts, as ``TPMoE.forward`` does: the router
    GEMM (fp32), softmax + top-k (``tileweave.nn.moe.route``) and the plan (``ops.plan``, collective).
    Returns the top-k weights and the plan's ``pair_row``, ``row_token``, ``row_expert``."""

    def run():
        logits = F.linear(inp.x_shard.float(), inp.router)
        weights, ids = route(logits, inp.k, normalize=True)
        plan = ops.plan(ids, inp.e, group)
        return [weights, plan.pair_row, plan.row_token, plan.row_expert]
    return run


def _floor_call(part: str, inp: Inputs, group) -> Callable[[], list[torch.Tensor]]:
    plan = _baseline_plan(inp.ids_shard, inp.e, group)
    x = gather_rows(inp.x_shard, group)[plan.row_token.long()].contiguous()
    w0, w1 = inp.w0.transpose(1, 2), inp.w1.transpose(1, 2)
    h = torch.empty_like(inp.h_rows)
    h[plan.pair_row.reshape(-1).long()] = inp.h_rows
    dz = gather_rows(inp.dout_shard, group)[plan.row_token.long()].contiguous()

    def run():
        if part == "layer0":
            return [_grouped_mm(x, w0, plan)[plan.pair_row.reshape(-1).long()]]
        pairs = plan.pair_row.reshape(-1).long()
        if part == "layer1":
            return [_grouped_mm(h, w1, plan)[pairs]]
        y = _grouped_mm(x, w0, plan)
        gate, up = y.split(inp.f_loc, dim=1)
        a = F.silu(gate) * up
        z = _grouped_mm(a, w1, plan)
        if part == "layer-bwd":
            da = _grouped_mm(dz, inp.w1, plan)                              # dgrad of layer 1
            _grouped_mm(y, inp.w0, plan)                                    # dgrad of layer 0 (its shape)
            torch._grouped_mm(dz.t(), a, offs=plan.offsets[1:])             # wgrad of layer 1
            torch._grouped_mm(y.t(), x, offs=plan.offsets[1:])              # wgrad of layer 0
            del da
        return [z[pairs]]
    return run


# ---------------------------------------------------------------------------------------------------
# One rank's run: every row, every variant, verified then timed, in the same order on every rank.

@dataclasses.dataclass(frozen=True)
class MoEBenchConfig:
    models: tuple[str, ...]
    tokens: tuple[int, ...]
    routings: tuple[str, ...]
    parts: tuple[str, ...]
    variants: tuple[str, ...] = VARIANTS
    smoke: bool = False
    warmup_s: float = 0.5
    iters: int = 20
    reps: int = 5
    scalings: tuple[str, ...] = ()
    """FP8 rows for each of these scalings (``tileweave.bench.fp8``), of the parts in ``moe_fp8.PARTS``."""


def _agree_max(*values: float, group, device) -> tuple[float, ...]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return tuple(t.tolist())


def _time_variant(call: Callable, cfg: MoEBenchConfig, group, device) -> tuple[float, float | None, float | None,
                                                                               float | None]:
    """``(ms, clock_mhz, peak_mb, other_mb)``, max over ranks, on the GPU."""
    watch = MemoryWatch()
    timing = measure(lambda i: call(), cfg=TimingConfig(warmup_s=cfg.warmup_s, iters=cfg.iters, reps=cfg.reps),
                     agree=DistAgreement(group, device), clocks=ClockReader())
    peak, other = watch.read()
    peak_mb, other_mb = _agree_max(peak / 2**20, other / 2**20, group=group, device=device)
    return timing.ms, timing.clock_mhz, peak_mb, other_mb


def bench_rank(rank: int, world: int, cfg: MoEBenchConfig) -> list[dict]:
    """Every (model, T, routing, part) row's variants on this rank; rank 0's list is the report."""
    group = dist.group.WORLD
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    results = []
    for model in cfg.models:
        for t in cfg.tokens:
            for routing in cfg.routings:
                for part in cfg.parts:
                    results += _row(Row(model, t, routing, part), cfg, rank, world, group, dtype, device)
    return results


def _row(row: Row, cfg: MoEBenchConfig, rank: int, world: int, group, dtype, device) -> list[dict]:
    """One row's variants, then its FP8 rows in each of ``cfg.scalings``; what they hold goes on return."""
    inp = Inputs(row, rank=rank, world=world, smoke=cfg.smoke, dtype=dtype, device=device)
    tol, refs = TOLERANCE[dtype], {}

    def ref(floor: bool) -> list[torch.Tensor]:  # float64 results, made once per kind
        if floor not in refs:
            refs[floor] = reference(row.part, "floor" if floor else "ours", inp, group, device)
        return refs[floor]

    out = []
    for variant in part_variants(row.part, cfg.variants):
        check = bounded(route_err if row.part == "route" else rel_err, ref(variant == "floor"), tol)
        make = functools.partial(make_call, row.part, variant, inp, group, dtype, device)
        out.append(_one(row, variant, make, check, cfg, group, device, world))
    layer = functools.partial(make_call, row.part, "ours", inp, group, dtype, device)  # takes fp8=
    for scaling in cfg.scalings if row.part in moe_fp8.PARTS else ():
        out += [_one(row, variant, make, check, cfg, group, device, world, fp8.dtype_label(scaling))
                for variant, make, check in moe_fp8.rows(row.part, scaling, inp, cfg.variants, group, tol=tol,
                                                          layer=layer, layer_ref=functools.partial(ref, False))]
    return out


def _one(row: Row, variant: str, make: Callable, check: Callable, cfg: MoEBenchConfig, group, device, world: int,
         label: str = "bf16") -> dict:
    """One variant of a row, verified, then timed: ``make()`` gives its call, ``check(results)`` their
    error and why they fail ("" where they pass; ``moe_reference.bounded``), ``label`` the row's ``dtype``."""
    h, f, e, k = row.dims(cfg.smoke)
    entry = {"op": "moe", "layer": f"{row.model} {row.part} {row.routing}", "world_size": world, "m": row.tokens,
             "k": h, "n": f, "variant": variant, "status": "ok", "note": f"E={e} top-{k}", "dtype": label}
    why = ""
    try:
        call = make()
        start = time.perf_counter()
        err, why = check(call())
        host_ms = (time.perf_counter() - start) * 1e3
    except Exception as exc:  # the other ranks see it in the agreed error below
        err, entry["note"] = math.inf, f"{type(exc).__name__}: {exc}"[:300]
    err, failed = _agree_max(err if math.isfinite(err) else 1e300, float(bool(why)), group=group, device=device)
    entry["rel_err"] = err
    if failed or err >= 1e300:
        entry["status"] = "FAILED"
        entry["note"] += "; " + (why or ("did not run on some rank" if err >= 1e300 else "failed on another rank"))
        return entry
    if variant == "ours" and row.part in ("layer0", "layer1"):
        entry["path"] = last_path("moe_all_gather_gemm" if row.part == "layer0" else "moe_gemm_reduce_scatter")
    if device.type != "cuda":  # emulated ranks: the checked call's own time, which means nothing
        entry["ms"] = _agree_max(host_ms, group=group, device=device)[0]
        return entry
    ms, mhz, peak, other = _time_variant(call, cfg, group, device)
    entry.update(ms=ms, clock_mhz=mhz, mem_peak_mb=peak, mem_other_mb=other)
    return entry


# ---------------------------------------------------------------------------------------------------
# Command line.

def _csv(kind: type, allowed: tuple | None = None):
    def parse(text: str):
        values = tuple(kind(v) for v in text.split(",") if v)
        bad = [v for v in values if allowed is not None and v not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(f"{', '.join(map(str, bad))} not in {', '.join(map(str, allowed))}")
        return values
    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tileweave.bench.moe", description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny shapes on 2 emulated CPU ranks, every variant checked")
    p.add_argument("--models", type=_csv(str, tuple(MODELS)), default=tuple(MODELS))
    p.add_argument("--tokens", type=_csv(int), default=TOKENS, help="tokens T over the group")
    p.add_argument("--routing", type=_csv(str, ROUTINGS), default=ROUTINGS)
    p.add_argument("--parts", type=_csv(str, PARTS), default=PARTS)
    p.add_argument("--variants", type=_csv(str, VARIANTS), default=VARIANTS)
    p.add_argument("--dtype", choices=("bf16", "fp8"), default="bf16",
                   help="fp8: also FP8 rows for every --scaling, beside the bf16 rows")
    p.add_argument("--scaling", type=fp8.parse_scalings, default=fp8.SCALINGS,
                   help="with --dtype fp8: comma list from " + ", ".join(fp8.SCALINGS + fp8.FAST))
    p.add_argument("--nproc", type=int, default=0, help="ranks (default: every GPU; 2 with --smoke)")
    p.add_argument("--warmup-s", type=float, default=0.5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", type=Path, default=None,
                   help="output folder (default: bench/results; a temporary folder with --smoke)")
    p.add_argument("--tag", default="")
    return p


def _torchrun_rank(cfg: MoEBenchConfig) -> list[dict] | None:
    """This process's rank of a torchrun launch; rank 0's rows, None on the other ranks."""
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    try:
        rows = bench_rank(dist.get_rank(), dist.get_world_size(), cfg)
    finally:
        dist.destroy_process_group()
    return rows if int(os.environ["RANK"]) == 0 else None



def check_args(argv) -> None:
    """Exit with a usage error if ``argv`` is not a valid command line of this section (nothing runs)."""
    build_parser().parse_args(argv)

def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.smoke:
        cfg = MoEBenchConfig(models=tuple(FP8_SMOKE_MODELS if args.dtype == "fp8" else SMOKE_MODELS), tokens=(8,),
                             routings=args.routing, parts=args.parts, variants=args.variants, smoke=True,
                             scalings=args.scaling if args.dtype == "fp8" else ())
        world, gpus = args.nproc or 2, False
    else:
        if not torch.cuda.is_available():
            print("tileweave.bench.moe: no CUDA GPU; use --smoke on the CPU", file=sys.stderr)
            return 2
        cfg = MoEBenchConfig(models=args.models, tokens=args.tokens, routings=args.routing, parts=args.parts,
                             variants=args.variants, warmup_s=args.warmup_s, iters=args.iters, reps=args.reps,
                             scalings=args.scaling if args.dtype == "fp8" else ())
        world, gpus = args.nproc or torch.cuda.device_count(), True
    bad = [t for t in cfg.tokens if t % world]
    if bad:
        print(f"tileweave.bench.moe: --tokens {bad} not divisible by {world} ranks", file=sys.stderr)
        return 2
    if gpus and all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")):  # under torchrun
        world = int(os.environ["WORLD_SIZE"])
        rows = _torchrun_rank(cfg)
        if rows is None:
            return 0
    else:
        # The ranks import this module by name (under ``python -m`` it is ``__main__`` here).
        rank_fn = importlib.import_module("tileweave.bench.moe").bench_rank
        rows = run_ranks(world, rank_fn, cfg, gpus=gpus, heap_bytes=64 << 20)[0]
    measurements = [Measurement(**r) for r in rows]
    meta = collect_metadata(world_size=world, timing={"warmup_s": cfg.warmup_s, "iters": cfg.iters,
                                                      "reps": cfg.reps, "smoke": cfg.smoke},
                            argv=sys.argv if argv is None else ["tileweave.bench.moe", *argv])
    paths = write_report(output_dir(args.out, cfg.smoke), args.tag or ("smoke" if cfg.smoke else f"tp{world}"), measurements, meta)
    print(markdown(measurements, meta), flush=True)
    print("wrote " + ", ".join(map(str, paths)), file=sys.stderr)
    return 1 if any(m.status != "ok" for m in measurements) else 0


if __name__ == "__main__":
    sys.exit(main())
