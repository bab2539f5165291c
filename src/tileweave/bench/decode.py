"""Decode benchmark: the row-parallel GEMM + all-reduce (+ residual + RMSNorm) of Llama-3 8B and 70B,
and one decoder layer's decode step, tileweave against cuBLAS + NCCL and cuBLAS + PyTorch's
symmetric-memory all-reduces, all under CUDA graphs.

    python -m tileweave.bench.decode --out DIR            # one process per visible GPU
    torchrun --nproc-per-node 2 -m tileweave.bench.decode --out DIR
    python -m tileweave.bench.decode --out DIR --smoke    # 2 emulated ranks on the CPU, tiny shapes

Sections (M: tokens of the decode batch, the same on every rank; K split over the W ranks):

* ``gemm_ar``: ``(rmsnorm(r + sum_ranks a @ w.T) * g, r + sum)`` with ``a [M, K/W]``, ``w [N, K/W]``,
  ``r [M, N]``: o_proj (K = hidden) and down_proj (K = ffn) of each model.
* ``layer``: one ``TPDecoderLayer.forward_replicated`` step (QKV, attention over a ``--context``-token
  KV cache, o, MLP) with its two row-parallel calls on each variant's ops.

``--dtype fp8 --scaling rowwise,blockwise``: the bf16 rows, and beside them each case with float8
weights and per-token float8 activations (``tileweave.bench.decode_fp8``) on ``tileweave`` and
``torch`` (torch's scaled matmul, NCCL, torch's epilogue); every row names its ``dtype`` (``bf16``,
``fp8-rowwise``, ``fp8-blockwise``).

Variants: ``tileweave`` (``GemmAllReduce(graphable=True)`` with the residual + RMSNorm fused),
``nccl`` (cuBLAS, ``dist.all_reduce``, residual + RMSNorm in torch), ``symm_one_shot`` /
``symm_two_shot`` (cuBLAS into a symmetric buffer, ``torch.ops.symm_mem.one_shot_all_reduce`` /
``two_shot_all_reduce_``, residual + RMSNorm in torch). Method (docs/design.md, "Measuring"): every
variant's output is checked against a reference first (eager, then a graph replay); then a CUDA graph
of one call is captured after the warm-up and its replays are timed in steady state
(``tileweave.bench.timing.measure``: n replays between CUDA events, the median of the batches, the max
over ranks); every rank runs the same calls. ``--smoke`` runs eager calls on emulated CPU ranks (no
graphs, no symmetric-memory baselines; tileweave's op still on its graphable flag protocol), checks
them and times them with the host clock.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem

from tileweave.bench import decode_fp8, output_dir
from tileweave.bench.cli import ensure_env
from tileweave.bench.decode_report import markdown
from tileweave.bench.metadata import collect_metadata
from tileweave.bench.timing import ClockReader, DistAgreement, TimingConfig, measure
from tileweave.nn.decoder import DecoderConfig, DecoderOps, KVCache, Step, TPDecoderLayer, rms_norm
from tileweave.nn.decoder_layer import rope_tables
from tileweave.nn.fp8_weights import gemm_operands
from tileweave.ops.all_reduce import GemmAllReduce
from tileweave.ops.common import last_path
from tileweave.testing.emulated import run_ranks

M_VALUES = (1, 8, 32, 64, 128, 256, 512)
MODELS = {  # hidden, heads, kv_heads, ffn
    "llama3-8b": (4096, 32, 8, 14336),
    "llama3-70b": (8192, 64, 8, 28672),
}
SMOKE_MODELS = {"tiny": (32, 4, 2, 48), "tiny-fp8": (256, 2, 2, 256)}
"""A smoke run takes both (two widths), or ``tiny-fp8`` alone with ``--dtype fp8``: at two ranks each rank's
part of each of its weights is whole 128 x 128 blocks, as blockwise FP8 needs."""
SMOKE_M = (1, 5)
EPS = 1e-5
TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3, torch.float32: 1e-4}
"""Relative Frobenius error allowed against the fp32 reference; above the per-dtype bounds of docs/design.md
because the RMSNorm output is rounded after a sum that was itself rounded (two roundings)."""
LABELS = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Options:
    out: Path
    smoke: bool = False
    models: tuple[str, ...] = tuple(MODELS)
    m_values: tuple[int, ...] = M_VALUES
    sections: tuple[str, ...] = ("gemm_ar", "layer")
    context: int = 512
    """Tokens in the KV cache before the timed decode step (layer section)."""
    max_seq: int = 0
    """Slots of the layer section's KV cache, all of them in the step's keys (as a step replayed from a CUDA
    graph over a preallocated cache has them); 0: ``context + 1``, the filled slots and the step's own."""
    dtype: str = "bfloat16"
    """The model's dtype (bfloat16 under ``--dtype fp8``; float32 in a smoke run)."""
    scalings: tuple[str, ...] = ()
    """FP8 scalings run beside the model's dtype (``--dtype fp8``)."""
    iters: int = 20
    reps: int = 5


def parse_args(argv=None, *, resolve_out: bool = True) -> Options:
    """The options, checked (a bad one exits with a usage error); ``resolve_out`` False leaves ``out``
    as given (no temporary folder made): ``check_args``."""
    p = argparse.ArgumentParser(prog="python -m tileweave.bench.decode", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None,
                   help="directory for decode.json and decode.md (default: bench/results; a temporary "
                        "folder with --smoke)")
    p.add_argument("--smoke", action="store_true", help="emulated CPU ranks, tiny shapes, eager calls")
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    # --tokens: under torchrun, spell it so (torchrun's parser takes "--m" for one of its own options)
    p.add_argument("--m", "--tokens", dest="m", default=",".join(map(str, M_VALUES)), help="decode batch sizes")
    p.add_argument("--sections", default="gemm_ar,layer", help="gemm_ar, layer or both")
    p.add_argument("--context", type=int, default=512, help="KV-cache tokens for the layer step")
    p.add_argument("--max-seq", type=int, default=0,
                   help="slots of the layer step's KV cache, all in its keys (default: context + 1)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32", "fp8"),
                   help="the model's dtype; fp8: the bfloat16 rows and beside them each --scaling with float8 "
                        "weights and activations")
    p.add_argument("--scaling", default=",".join(decode_fp8.SCALINGS),
                   help="with --dtype fp8: comma list from " + ", ".join(decode_fp8.SCALINGS))
    p.add_argument("--iters", type=int, default=20, help="graph replays per timed batch (>= 20)")
    p.add_argument("--reps", type=int, default=5, help="timed batches, median reported (>= 5)")
    a = p.parse_args(argv)
    models = tuple(x for x in a.models.split(",") if x)
    sections = tuple(x for x in a.sections.split(",") if x)
    for name in models:
        if name not in MODELS:
            p.error(f"--models: unknown model {name!r}; known: {', '.join(MODELS)}")
    for name in sections:
        if name not in ("gemm_ar", "layer"):
            p.error(f"--sections: unknown section {name!r}; known: gemm_ar, layer")
    try:
        m_values = tuple(int(x) for x in a.m.split(",") if x)
    except ValueError:
        p.error(f"--m: give comma-separated integers, got {a.m!r}")
    if not m_values or min(m_values) < 1 or a.context < 0:
        p.error("--m values must be >= 1 and --context >= 0")
    try:
        TimingConfig(iters=a.iters, reps=a.reps)  # refuses counts below the method's minimum
    except ValueError as exc:
        p.error(f"--iters/--reps: {exc}")
    scalings = ()
    if a.dtype == "fp8":
        try:
            scalings = decode_fp8.parse_scalings(a.scaling)
        except ValueError as exc:
            p.error(str(exc))
    if a.smoke:
        # two widths unless float8 (whose weight blocks the tiny one cannot fill): a case must not see
        # another model's tensors
        models = ("tiny-fp8",) if scalings else ("tiny", "tiny-fp8")
        m_values, context, dtype = SMOKE_M, 6, "float32"
        max_seq = 16 if a.max_seq else 0
    else:
        context, dtype, max_seq = a.context, "bfloat16" if a.dtype == "fp8" else a.dtype, a.max_seq
        if max_seq and max_seq <= context:
            p.error(f"--max-seq must exceed --context ({context}), got {max_seq}")
    return Options(out=output_dir(a.out, a.smoke) if resolve_out else a.out, smoke=a.smoke, models=models, m_values=m_values,
                   sections=sections, context=context, max_seq=max_seq, dtype=dtype, scalings=scalings,
                   iters=a.iters, reps=a.reps)



def check_args(argv) -> None:
    """Exit with a usage error if ``argv`` is not a valid command line of this section (nothing runs)."""
    parse_args(argv, resolve_out=False)

def _dims(opts: Options, model: str) -> tuple[int, int, int, int]:
    return (SMOKE_MODELS if opts.smoke else MODELS)[model]


def _randn(shape, seed: int, device, dtype, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed)
    return (torch.randn(shape, generator=g, device=device, dtype=torch.float32) * scale).to(dtype)


# ---- the row-parallel call of each variant: (x, weight, residual, norm_weight, eps, group) -> (normed, h)

_torch_tail = decode_fp8.torch_tail


def nccl_row(x, weight, residual, norm_weight, eps, group):
    y = x @ weight.t()
    dist.all_reduce(y, group=group)
    return _torch_tail(y, residual, norm_weight, eps)


class SymmRow:
    """cuBLAS into a symmetric buffer (one per output shape, allocated and rendezvoused once), then
    PyTorch's one-shot (out of place) or two-shot (in place) all-reduce over it."""

    def __init__(self, group: dist.ProcessGroup, two_shot: bool) -> None:
        self.group, self.two_shot = group, two_shot
        self.buffers: dict[tuple, torch.Tensor] = {}
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is not None:  # older torch needs the group registered; newer accepts and ignores it
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                enable(group.group_name)

    def buffer(self, shape: tuple[int, int], like: torch.Tensor) -> torch.Tensor:
        key = (shape, like.dtype)
        buf = self.buffers.get(key)
        if buf is None:
            buf = symm_mem.empty(shape, dtype=like.dtype, device=like.device)
            symm_mem.rendezvous(buf, self.group.group_name)
            self.buffers[key] = buf
        return buf

    def __call__(self, x, weight, residual, norm_weight, eps, group):
        buf = self.buffer((x.shape[0], weight.shape[0]), x)
        torch.mm(x, weight.t(), out=buf)
        if self.two_shot:
            y = torch.ops.symm_mem.two_shot_all_reduce_(buf, "sum", self.group.group_name)
        else:
            y = torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", self.group.group_name)
        return _torch_tail(y, residual, norm_weight, eps)


def tileweave_row(group: dist.ProcessGroup, graphable: bool) -> Callable:
    op = GemmAllReduce(group, graphable=graphable)

    def row(x, weight, residual, norm_weight, eps, group_):
        a, b, fp8 = gemm_operands(x, weight)  # a Float8Weight: x quantized per token
        return op(a, b, residual=residual, norm_weight=norm_weight, eps=eps, **fp8)

    return row


def variant_rows(opts: Options, group: dist.ProcessGroup, scaling: str | None = None) -> dict[str, Callable]:
    """The variants of the rows of ``scaling`` (None: the model's dtype)."""
    rows = {"tileweave": tileweave_row(group, graphable=True)}
    if scaling is not None:
        row, _ = decode_fp8.torch_row(scaling)
        if row is not None and not opts.smoke:  # torch's scaled matmuls do not run on emulated CPU ranks
            rows["torch"] = row
        return rows
    rows["nccl"] = nccl_row
    if not opts.smoke:
        rows["symm_one_shot"] = SymmRow(group, two_shot=False)
        rows["symm_two_shot"] = SymmRow(group, two_shot=True)
    return rows


# ---- the cases: a callable that runs one step, and a check of its outputs


@dataclasses.dataclass
class Case:
    section: str
    name: str
    m: int
    run: Callable[[Callable], tuple[torch.Tensor, ...]]
    """Given a variant's row-parallel call, one step; returns its outputs."""
    reference: tuple[torch.Tensor, ...]
    """fp32 reference outputs."""
    dtype: str = "bf16"
    """The row's ``dtype`` field: the model's dtype, or ``fp8-<scaling>``."""
    tol: float | None = None
    """The check's tolerance (None: the model dtype's ``TOL``)."""


def gemm_ar_cases(opts: Options, rank: int, world: int, device, dtype, scaling: str | None = None) -> list[Case]:
    """The ``gemm_ar`` cases in the model's dtype, or with ``scaling``'s float8 weights (quantized once)
    and activations (quantized in each call; the reference from the same quantization in plain torch)."""
    cases = []
    label = LABELS[opts.dtype] if scaling is None else decode_fp8.label(scaling)
    for model in opts.models:
        hidden, _, _, ffn = _dims(opts, model)
        for layer, k in (("o", hidden), ("down", ffn)):
            kl = k // world
            # every rank's K slice, from per-rank seeds: the reference sums them in fp32 without a collective
            ws = [_randn((hidden, kl), 1000 * r + 1, device, dtype, k ** -0.5) for r in range(world)]
            ws_ref = [w.float() for w in ws]
            if scaling is not None:
                ws, ws_ref = decode_fp8.quantized_weights(ws, scaling)
            g = 1 + _randn((hidden,), 7, device, dtype, 0.1)
            for m in opts.m_values:
                xs = [_randn((m, kl), 1000 * r + 2 + m, device, dtype) for r in range(world)]
                resid = _randn((m, hidden), 3 + m, device, dtype)
                xs_ref = [x.float() if scaling is None else decode_fp8.dequantized_rows(x, scaling) for x in xs]
                y = sum(x @ w.t() for x, w in zip(xs_ref, ws_ref))
                h = resid.float() + y
                ref = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS) * g.float(), h)
                x, w = xs[rank], ws[rank]

                def run(row, x=x, w=w, resid=resid, g=g):
                    return row(x, w, resid, g, EPS, None)

                cases.append(Case("gemm_ar", f"{model} {layer}", m, run, ref, dtype=label))
            del ws
    return cases



def _context_cache(c: DecoderConfig, batch: int, kv_heads: int, context: int, device, dtype) -> KVCache:
    """A one-layer cache whose first ``context`` slots count as filled."""
    cache = KVCache(layers=1, batch=batch, kv_heads=kv_heads, max_seq=c.max_seq, head_dim=c.head_dim,
                    device=device, dtype=dtype)
    cache.valid[:, :context] = True
    cache.slot.fill_(context)
    cache.next_pos.fill_(context)
    cache.length = context
    return cache


def layer_cases(opts: Options, rank: int, world: int, device, dtype, group, scaling: str | None = None) -> list[Case]:
    """The ``layer`` cases in the model's dtype, or with ``scaling``'s float8 weights (``to_fp8``)
    against the float32 layer on the dequantized weights (``decode_fp8.LAYER_TOL``)."""
    cases = []
    label, tol = (LABELS[opts.dtype], None) if scaling is None else (decode_fp8.label(scaling), decode_fp8.LAYER_TOL)
    for model in opts.models:
        hidden, heads, kv_heads, ffn = _dims(opts, model)
        c = DecoderConfig(vocab=world, hidden=hidden, layers=1, heads=heads, kv_heads=kv_heads, ffn=ffn,
                          norm_eps=EPS, max_seq=opts.max_seq or opts.context + 1)
        torch.manual_seed(11 + rank)  # this rank's weight shards
        layer = TPDecoderLayer(c, world, rank, group=group, device=device, dtype=dtype)
        ref_layer = TPDecoderLayer(c, world, rank, device=device, dtype=torch.float32)
        if scaling is not None:
            layer.to_fp8(scaling)  # collective (rowwise: each row's amax over the ranks)
            for name in ("qkv", "o", "gate_up", "down"):
                getattr(ref_layer, name).copy_(layer.full_weight(name))
            for name in ("attn_norm", "mlp_norm"):
                getattr(ref_layer, name).copy_(getattr(layer, name))
        else:
            ref_layer.load_state_dict({k: v.float() for k, v in layer.state_dict().items()})
        next_norm = 1 + _randn((hidden,), 5, device, dtype, 0.1)
        for m in opts.m_values:
            cache = _context_cache(c, m, kv_heads // world, opts.context, device, dtype)
            cache.k[:, :, :, :opts.context] = _randn(cache.k[:, :, :, :opts.context].shape, 20 + rank, device, dtype)
            cache.v[:, :, :, :opts.context] = _randn(cache.v[:, :, :, :opts.context].shape, 30 + rank, device, dtype)
            resid = _randn((m, hidden), 40 + m, device, dtype)  # replicated: the same seed on every rank
            normed = rms_norm(resid, layer.attn_norm, EPS)
            # one step at slot `context`, built once: every timed call rewrites that slot
            step = Step.begin(cache, rope_tables(c, c.max_seq, device, dtype), None, m, 1, c.max_seq)
            ref_cache = _context_cache(c, m, kv_heads // world, opts.context, device, torch.float32)
            ref_cache.k.copy_(cache.k)
            ref_cache.v.copy_(cache.v)
            ref_step = Step.begin(ref_cache, rope_tables(c, c.max_seq, device, torch.float32), None, m, 1, c.max_seq)
            ref = ref_layer.forward_replicated(normed.float(), resid.float(), next_norm.float(), ref_cache, 0,
                                               ref_step, DecoderOps(row_parallel_norm=nccl_row), group)

            def run(row, layer=layer, normed=normed, resid=resid, next_norm=next_norm, cache=cache, step=step):
                return layer.forward_replicated(normed, resid, next_norm, cache, 0, step,
                                                DecoderOps(row_parallel_norm=row), group)

            name = f"{model} layer (context {opts.context}{f', max_seq {c.max_seq}' if opts.max_seq else ''})"
            cases.append(Case("layer", name, m, run, ref, dtype=label, tol=tol))
    return cases


# ---- running: verify, capture, time


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    got, ref = got.detach().float(), ref.detach().float()
    if not torch.isfinite(got).all():
        return math.inf
    return ((got - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _error(outs: tuple[torch.Tensor, ...], ref: tuple[torch.Tensor, ...]) -> float:
    return max(_rel_err(o, r) for o, r in zip(outs, ref, strict=True))


def run_case(case: Case, variant: str, row: Callable, opts: Options, agree: DistAgreement,
             clocks: ClockReader | None, tol: float) -> dict:
    """Verify the variant on ``case`` (eager; on a GPU also a graph replay), then time it. The error
    is agreed over the ranks before deciding to time, so every rank makes the same calls. A baseline
    whose first call raises (torch's scaled matmul refuses some shapes) is recorded as not run, with
    the error (``unsupported``), on every rank; tileweave raising is a failed check."""
    record = {"section": case.section, "name": case.name, "m": case.m, "dtype": case.dtype, "variant": variant}
    tol = case.tol if case.tol is not None else tol
    try:
        outs, why = case.run(row), ""
    except Exception as exc:  # the same shapes on every rank: each raises before any collective
        outs, why = None, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]
    if agree.max_floats([float(bool(why))])[0]:
        record.update(err=None, ok=variant != "tileweave", ms=None, unsupported=why or "raised on another rank",
                      timed="not run: the first call raised")
        return record
    record["path"] = last_path("gemm_all_reduce") if variant == "tileweave" else None
    if opts.smoke:
        err = agree.max_floats([_error(outs, case.reference)])[0]
        calls, t0 = 2, time.perf_counter()
        for _ in range(calls):
            outs = case.run(row)
        host_ms = (time.perf_counter() - t0) / calls * 1e3
        record.update(err=err, ok=err < tol, ms=agree.max_floats([host_ms])[0], timed="eager, host clock")
        return record
    side = torch.cuda.Stream()  # warm-up off the capture stream, as graph capture asks
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            case.run(row)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = case.run(row)
    for t in outs:
        t.fill_(float("nan"))  # the replay must write every output
    graph.replay()
    torch.cuda.synchronize()
    err = agree.max_floats([_error(outs, case.reference)])[0]
    record.update(err=err, ok=err < tol)
    if record["ok"]:
        timing = measure(lambda i: graph.replay(), cfg=TimingConfig(iters=opts.iters, reps=opts.reps),
                         agree=agree, clocks=clocks)
        record.update(ms=timing.ms, rep_ms=list(timing.rep_ms), clock_mhz=timing.clock_mhz,
                      host_ms=timing.host_ms, timed="cuda graph replays")
    else:
        record.update(ms=None, timed="not timed: output check failed")
    del graph
    return record


@torch.no_grad()
def bench_rank(rank: int, world: int, opts: Options) -> list[dict]:
    """Every case on every variant, variant by variant (PyTorch's symmetric-memory ops and tileweave's
    each run their rows together rather than interleaved). Returns the records (the same on every
    rank: times and errors are agreed)."""
    device = torch.device("cuda", torch.cuda.current_device()) if not opts.smoke else torch.device("cpu")
    dtype = getattr(torch, opts.dtype)
    group = dist.group.WORLD
    agree = DistAgreement(group, device)
    clocks = None if opts.smoke else ClockReader()
    records = []
    for scaling in (None, *opts.scalings):
        cases = []
        if "gemm_ar" in opts.sections:
            cases += gemm_ar_cases(opts, rank, world, device, dtype, scaling)
        if "layer" in opts.sections:
            cases += layer_cases(opts, rank, world, device, dtype, group, scaling)
        for variant, row in variant_rows(opts, group, scaling).items():
            for case in cases:
                records.append(run_case(case, variant, row, opts, agree, clocks, TOL[dtype]))
                if not opts.smoke:
                    torch.cuda.empty_cache()
        del cases
    return records


# ---- report


def write_report(opts: Options, records: list[dict], world: int, argv) -> tuple[Path, Path]:
    meta = collect_metadata(world_size=world, timing={"iters": opts.iters, "reps": opts.reps}, argv=list(argv))
    meta.update(dtype=opts.dtype, scalings=list(opts.scalings), context=opts.context,
                timed="eager calls, host clock (smoke)" if opts.smoke else "CUDA graph replays")
    opts.out.mkdir(parents=True, exist_ok=True)
    js, md = opts.out / "decode.json", opts.out / "decode.md"
    js.write_text(json.dumps({"meta": meta, "results": records}, indent=1, default=str))
    md.write_text(markdown(records, meta))
    return js, md


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    opts = parse_args(argv)
    for note in ensure_env():  # NVLink multicast stays off, in this process and the ranks it starts
        print(f"tileweave.bench.decode: {note}", file=sys.stderr)
    if opts.smoke:
        world = 2
        records = run_ranks(world, bench_rank, opts)[0]
    elif "LOCAL_RANK" in os.environ:  # under torchrun: this process is one rank
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl", device_id=torch.device("cuda", int(os.environ["LOCAL_RANK"])))
        world = dist.get_world_size()
        records = bench_rank(dist.get_rank(), world, opts)
        rank = dist.get_rank()
        dist.destroy_process_group()
        if rank != 0:
            return 0
    else:
        world = torch.cuda.device_count()
        if world < 1:
            print("no CUDA GPU visible; --smoke runs on the CPU", file=sys.stderr)
            return 2
        if world == 1:
            print("one GPU: TP=1 has no communication to time (a check of the harness only)", file=sys.stderr)
        records = run_ranks(world, bench_rank, opts, gpus=True)[0]
    js, md = write_report(opts, records, world, argv)
    print(md.read_text())
    print(f"wrote {js} and {md}")
    for r in records:
        if r.get("unsupported"):
            print(f"not run: {r['variant']} {r['section']} {r['name']} M={r['m']} {r['dtype']}: {r['unsupported']}",
                  file=sys.stderr)
    failed = [r for r in records if not r["ok"]]
    for r in failed:
        err = "raised" if r["err"] is None else f"err {r['err']:.2e}"
        print(f"output check failed: {r['variant']} {r['section']} {r['name']} M={r['m']}: {err}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
