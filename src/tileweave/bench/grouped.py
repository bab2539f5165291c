"""Single-GPU benchmark of the grouped GEMM core against ``torch._grouped_mm``.

``python -m tileweave.bench.grouped --out DIR [--quick | --smoke]``

For each MoE shape (per rank at TP=2: ``F_loc = F / 2``), token count T, routing (uniform or
Zipf-skewed top-k) and layer:

* layer 0: ``[T*k, H] x [E, H, F_loc]``, A rows gathered from the tokens ``x [T, H]`` by the plan:
  ``ours`` gathers inside the kernel; ``torch`` is ``torch._grouped_mm`` on A already permuted (the
  permutation not timed); ``torch+gather`` times ``index_select`` and ``torch._grouped_mm`` together.
* layer 1: ``[T*k, F_loc] x [E, F_loc, H]``, A in plan order: ``ours`` against ``torch``.

Weights are stacked ``nn.Linear`` weights ``[E, N, K]`` read through their transpose view (both
implementations read that layout in place); ``--b-layout kn`` uses row-major ``[E, K, N]`` instead.
Every variant is checked against a float32 reference before it is timed. Timing is steady state
(``tileweave.bench.timing.measure``: ~0.5 s warm-up, 5 batches of 20 back-to-back calls between CUDA
events, the median batch). A variant that fails is recorded with its error and the run goes on.
Writes ``grouped.json`` and ``grouped.md`` to ``--out`` and prints the table.

``--dtype fp8 --scaling tensorwise,rowwise,blockwise``: each case also in FP8 (e4m3 tokens and weights
quantised with each scaling by ``tileweave.bench.fp8``, bf16 output), beside the bf16 case, each row
naming its scaling in ``dtype``; ``torch`` is then ``torch._scaled_grouped_mm`` on the permuted rows and
their scales (rowwise only: other scalings mark it n/a), and the reference is float32 of the
dequantised inputs. Blockwise needs K a multiple of 128: a layer whose K is not is marked n/a.

``--smoke``: tiny shapes, outputs checked, no timing on the CPU (there the kernel runs in Triton's
interpreter: set ``TRITON_INTERPRET=1``; ``torch._grouped_mm`` on the CPU, or a per-expert loop where
this torch lacks it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from tileweave.bench import fp8, output_dir
from tileweave.bench.metadata import collect_metadata
from tileweave.bench.grouped_report import cell, markdown, summary
from tileweave.bench.timing import ClockReader, LocalAgreement, TimingConfig, measure, rotation_sets
from tileweave.ops import common
from tileweave.ops.compute.grouped_gemm import grouped_config, grouped_gemm
from tileweave.tune.grouped import GroupedConfig


@dataclasses.dataclass(frozen=True)
class Model:
    name: str
    hidden: int
    ffn: int
    experts: int
    topk: int


MODELS = (
    Model("mixtral-8x7b", 4096, 14336, 8, 2),
    Model("qwen3-30b-a3b", 2048, 768, 128, 8),
    Model("deepseek-v2-lite", 2048, 1408, 64, 6),
    Model("flux", 8192, 8192, 32, 4),
)
SMOKE_MODELS = (Model("tiny-a", 64, 96, 4, 2), Model("tiny-b", 48, 80, 8, 3))
FP8_SMOKE_MODELS = (Model("tiny-fp8", 128, 256, 4, 2),)
"""``--smoke --dtype fp8``: dims that are multiples of 128, as blockwise scaling needs."""
TOKENS = (4096, 8192, 16384)
QUICK_TOKENS = (8192,)
SMOKE_TOKENS = (24,)
TP = 2
ROUTINGS = ("uniform", "zipf")
ZIPF_S = 1.2
"""Expert e's routing weight is proportional to ``1 / (e + 1) ** ZIPF_S``."""
TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}


@dataclasses.dataclass
class Case:
    model: Model
    tokens: int
    routing: str
    layer: int
    dtype: torch.dtype
    """The output's dtype (and the inputs' where ``scaling`` is None)."""
    scaling: str | None = None
    """FP8: e4m3 inputs quantised with this scaling (``tileweave.bench.fp8.SCALINGS``); None: ``dtype``."""

    @property
    def k_n(self) -> tuple[int, int]:
        f_loc = self.model.ffn // TP
        return (self.model.hidden, f_loc) if self.layer == 0 else (f_loc, self.model.hidden)

    def key(self) -> dict:
        k, n = self.k_n
        return {"model": self.model.name, "tokens": self.tokens, "routing": self.routing, "layer": self.layer,
                "dtype": fp8.dtype_label(self.scaling) if self.scaling else str(self.dtype).removeprefix("torch."),
                "rows": self.tokens * self.model.topk, "n": n, "k": k, "experts": self.model.experts,
                "topk": self.model.topk}


def route(tokens: int, experts: int, topk: int, routing: str, gen: torch.Generator) -> torch.Tensor:
    """Top-k expert ids ``[T, k]`` (distinct per token) on ``gen``'s device: Gumbel top-k over uniform
    or Zipf weights."""
    device = gen.device
    if routing == "uniform":
        logits = torch.zeros(experts, device=device)
    else:
        logits = -ZIPF_S * torch.log(torch.arange(1, experts + 1, dtype=torch.float32, device=device))
    u = torch.rand(tokens, experts, generator=gen, device=device).clamp_(1e-9, 1 - 1e-9)
    gumbel = -torch.log(-torch.log(u))
    return (logits + gumbel).topk(topk, dim=1).indices


def plan(ids: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(offsets [E + 1], row_token [T*k], ends [E])`` (int32) for pairs sorted by expert, in
    (token, slot) order within an expert; ``ends`` are the cumulative ends ``torch._grouped_mm`` takes."""
    flat = ids.reshape(-1)
    order = torch.sort(flat, stable=True).indices
    row_token = (order // ids.shape[1]).to(torch.int32)
    counts = torch.bincount(flat, minlength=experts)
    ends = torch.cumsum(counts, 0).to(torch.int32)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int32, device=ids.device), ends])
    return offsets, row_token, ends


def _grouped_mm_or_loop(a: torch.Tensor, b: torch.Tensor, ends: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """``torch._grouped_mm`` where this torch and device have it, else a per-expert loop (CPU only)."""
    if hasattr(torch, "_grouped_mm"):
        try:
            return torch._grouped_mm(a, b, offs=ends)
        except RuntimeError:
            if a.is_cuda:
                raise
    return _expert_loop(a, b, counts)


def _expert_loop(a: torch.Tensor, b: torch.Tensor, counts: list[int]) -> torch.Tensor:
    out = torch.empty(a.shape[0], b.shape[2], dtype=a.dtype, device=a.device)
    start = 0
    for e, count in enumerate(counts):
        torch.matmul(a[start:start + count], b[e], out=out[start:start + count])
        start += count
    return out


def _reference(a_perm: torch.Tensor, b: torch.Tensor, counts: list[int]) -> torch.Tensor:
    out = torch.empty(a_perm.shape[0], b.shape[2], dtype=torch.float32, device=a_perm.device)
    start = 0
    for e, count in enumerate(counts):
        if count:
            out[start:start + count] = a_perm[start:start + count].float() @ b[e].float()
        start += count
    return out


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    if not torch.isfinite(out).all():
        return math.inf
    return float((out.float() - ref).norm() / ref.norm().clamp_min(1e-30))


def build_inputs(case: Case, *, seed: int, device: torch.device, b_layout: str) -> dict:
    """Tensors of one case: A (tokens for layer 0, plan-ordered activations for layer 1), B, the plan."""
    m = case.model
    k, n = case.k_n
    gen = torch.Generator(device=device).manual_seed(seed)
    ids = route(case.tokens, m.experts, m.topk, case.routing, gen)
    offsets, row_token, ends = plan(ids, m.experts)
    counts = torch.diff(offsets).tolist()
    rows = case.tokens * m.topk

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(case.dtype)

    if b_layout == "linear":
        b = randn(m.experts, n, k, scale=1 / math.sqrt(k)).transpose(1, 2)
    else:
        b = randn(m.experts, k, n, scale=1 / math.sqrt(k))
    if case.layer == 0:
        a = randn(case.tokens, k)
        a_perm = a.index_select(0, row_token)
    else:
        a = randn(rows, k)
        a_perm = a
    inputs = {"a": a, "a_perm": a_perm, "b": b, "offsets": offsets, "row_token": row_token, "ends": ends,
              "counts": counts, "ref_a": a_perm, "ref_b": b}
    if case.scaling is None:
        return inputs
    # FP8: the same data quantised (tokens once, before the gather), weights per expert from [E, N, K].
    base, _ = fp8.split(case.scaling)
    a8, scale_a, a_deq = fp8.quantize_rows(a, base)
    w8, scale_b, w_deq = fp8.quantize_experts(b.transpose(1, 2), base)
    gather = (lambda t: t.index_select(0, row_token)) if case.layer == 0 else (lambda t: t)
    inputs.update(a=a8, a_perm=gather(a8), b=w8.transpose(1, 2), scale_a=scale_a, scale_b=scale_b,
                  ref_a=gather(a_deq), ref_b=w_deq.transpose(1, 2))
    if base == "rowwise":  # torch._scaled_grouped_mm's [P] scales of the permuted rows
        inputs["scale_a_perm"] = gather(scale_a).reshape(-1)
    return inputs


def parse_config(text: str) -> GroupedConfig:
    """``BMxBNxBK/stages/warps[/group_m][/f]``, e.g. ``128x256x64/3/8`` (``f``: flattened loops)."""
    try:
        tile, *rest = text.split("/")
        flatten = rest[-1:] == ["f"]
        if flatten:
            rest = rest[:-1]
        bm, bn, bk = (int(v) for v in tile.split("x"))
        stages, warps, *group = (int(v) for v in rest)
        return GroupedConfig(block_m=bm, block_n=bn, block_k=bk, num_stages=stages, num_warps=warps,
                             group_m=group[0] if group else 8, flatten=flatten)
    except (ValueError, TypeError) as exc:
        raise argparse.ArgumentTypeError(f"config {text!r}: expected BMxBNxBK/stages/warps[/group_m] ({exc})")


def _ours(case: Case, config: GroupedConfig | None) -> Callable[[dict], torch.Tensor]:
    rows = (lambda s: s["row_token"]) if case.layer == 0 else (lambda s: None)
    if case.scaling is None:
        return lambda s: grouped_gemm(s["a"], s["b"], s["offsets"], a_rows=rows(s), config=config)
    fast = fp8.split(case.scaling)[1]
    return lambda s: grouped_gemm(s["a"], s["b"], s["offsets"], a_rows=rows(s), config=config,
                                  scale_a=s["scale_a"], scale_b=s["scale_b"], out_dtype=case.dtype,
                                  use_fast_accum=fast)


class Unavailable(Exception):
    """A variant this torch or device does not have: recorded as n/a, not as a failure."""


def _torch_fp8(case: Case) -> dict[str, Callable[[dict], torch.Tensor]]:
    fn, note = fp8.torch_scaled_grouped_mm(case.scaling)

    def unavailable(s: dict) -> torch.Tensor:
        raise Unavailable(note)

    if fn is None:
        calls = {"torch": unavailable}
        if case.layer == 0:
            calls["torch+gather"] = unavailable
        return calls

    def call(a8: torch.Tensor, scale: torch.Tensor, s: dict) -> torch.Tensor:
        try:
            return fn(a8, s["b"], scale, s["scale_b"], s["ends"])
        except RuntimeError as exc:
            if a8.is_cuda:
                raise
            raise Unavailable(f"torch._scaled_grouped_mm on the CPU: {exc}"[:200]) from exc

    calls = {"torch": lambda s: call(s["a_perm"], s["scale_a_perm"], s)}
    if case.layer == 0:
        calls["torch+gather"] = lambda s: call(s["a"].index_select(0, s["row_token"]),
                                               s["scale_a"].index_select(0, s["row_token"]).reshape(-1), s)
    return calls


def variants(case: Case, t: dict, configs: Sequence[GroupedConfig] = ()) -> dict[str, Callable[[dict], torch.Tensor]]:
    """name -> call(inputs) for the case's layer; ``configs`` add ``ours@config`` variants."""
    counts = t["counts"]
    calls = {"ours": _ours(case, None)}
    for c in configs:
        calls[f"ours@{c.block_m}x{c.block_n}x{c.block_k}/{c.num_stages}/{c.num_warps}/{c.group_m}"
              + ("/f" if c.flatten else "")] = \
            _ours(case, c)
    if case.scaling is not None:
        return {**calls, **_torch_fp8(case)}
    calls["torch"] = lambda s: _grouped_mm_or_loop(s["a_perm"], s["b"], s["ends"], counts)
    if case.layer == 0:
        calls["torch+gather"] = lambda s: _grouped_mm_or_loop(s["a"].index_select(0, s["row_token"]), s["b"],
                                                              s["ends"], counts)
    return calls


def _set_bytes(t: dict) -> int:
    n = t["b"].shape[2]
    rows = t["a_perm"].shape[0]
    return (t["a"].numel() + t["b"].numel() + rows * n) * t["a"].element_size() + 8 * rows


def run_case(case: Case, *, seed: int, device: torch.device, b_layout: str, timing: TimingConfig | None,
             clocks: ClockReader | None, loop: bool, configs: Sequence[GroupedConfig] = ()) -> dict:
    row = dict(case.key())
    row["results"] = {}
    k, n = case.k_n
    if case.scaling == "blockwise" and k % fp8.BLOCK:
        row["results"]["ours"] = {"unavailable": f"blockwise scaling needs K a multiple of {fp8.BLOCK}, K = {k}"}
        return row
    t = build_inputs(case, seed=seed, device=device, b_layout=b_layout)
    counts = t["counts"]
    row["max_rows_per_expert"] = max(counts)
    row["empty_experts"] = sum(1 for c in counts if c == 0)
    cfg = grouped_config(row["rows"], n, k, case.model.experts, t["a"].dtype, device)
    row["config"] = dataclasses.asdict(cfg)
    calls = variants(case, t, configs)
    if loop:
        calls["loop"] = lambda s: _expert_loop(s["a_perm"], s["b"], counts)
    ref = _reference(t["ref_a"], t["ref_b"], counts)
    del t["ref_a"], t["ref_b"]
    sets = [t]
    if timing is not None:
        copies = rotation_sets(_set_bytes(t)) - 1
        sets += [{**t, "a": t["a"].clone(), "a_perm": t["a_perm"].clone(), "b": t["b"].clone()}
                 for _ in range(copies)]
    flops = 2 * row["rows"] * n * k
    for name, call in calls.items():
        result: dict = {}
        row["results"][name] = result
        try:
            out = call(t)
            result["rel_err"] = _rel_err(out, ref)
            del out
            if not result["rel_err"] < TOLERANCE[case.dtype]:
                result["error"] = f"wrong result: relative error {result['rel_err']:.3g}"
                continue
            if timing is None:
                continue
            timed = measure(lambda i: call(sets[i % len(sets)]), cfg=timing, agree=LocalAgreement(), clocks=clocks)
            result["ms"] = timed.ms
            result["rep_ms"] = list(timed.rep_ms)
            result["clock_mhz"] = timed.clock_mhz
            result["host_ms"] = timed.host_ms
            result["tflops"] = flops / (timed.ms * 1e-3) / 1e12
        except Unavailable as exc:
            result["unavailable"] = str(exc)
        except Exception as exc:  # recorded; the run goes on
            result["error"] = f"{type(exc).__name__}: {exc}"
            result["traceback"] = traceback.format_exc(limit=4)
    ours = row["results"].get("ours", {}).get("ms")
    for name in ("torch", "torch+gather"):
        other = row["results"].get(name, {}).get("ms")
        if ours and other:
            row[f"vs_{name}"] = other / ours
    return row


def cases(models: Sequence[Model], tokens: Sequence[int], routings: Sequence[str], layers: Sequence[int],
          dtype: torch.dtype, scalings: Sequence[str | None] = (None,)) -> list[Case]:
    """Every combination; ``scalings`` (None: ``dtype`` inputs) next to each other per shape."""
    return [Case(m, t, r, layer, dtype, s) for t in tokens for m in models for r in routings for layer in layers
            for s in scalings]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m tileweave.bench.grouped", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None,
                        help="directory for grouped.json and grouped.md (default: bench/results; a temporary "
                             "folder with --smoke)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help=f"T in {QUICK_TOKENS} only")
    mode.add_argument("--smoke", action="store_true", help="tiny shapes; on the CPU outputs only, no timing")
    parser.add_argument("--models", default="", help="comma-separated subset of " + ",".join(m.name for m in MODELS))
    parser.add_argument("--tokens", default="", help="comma-separated token counts (default 4096,8192,16384)")
    parser.add_argument("--b-layout", choices=("linear", "kn"), default="linear",
                        help="weights as stacked nn.Linear [E, N, K] read transposed (default) or row-major [E, K, N]")
    parser.add_argument("--loop", action="store_true", help="also time a per-expert torch.matmul loop")
    parser.add_argument("--budget-s", type=float, default=210.0,
                        help="stop starting new shapes after this many seconds (default 210)")
    parser.add_argument("--configs", type=parse_config, nargs="*", default=[],
                        help="also time ours with these configs (BMxBNxBK/stages/warps[/group_m])")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--dtype", choices=("bf16", "fp8"), default="bf16",
                        help="fp8: each case also in FP8 for every --scaling, beside the bf16 case (default bf16)")
    parser.add_argument("--scaling", default=",".join(fp8.SCALINGS),
                        help="with --dtype fp8: comma list from " + ", ".join(fp8.SCALINGS + fp8.FAST)
                        + " (default the first three; '-fast': ours and torch's with use_fast_accum=True)")
    return parser


def parse_args(argv: Sequence[str] | None = None) -> tuple[argparse.Namespace, tuple]:
    """``(args, scalings)``, checked: a bad option exits with a usage error."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        scalings = (None, *fp8.parse_scalings(args.scaling)) if args.dtype == "fp8" else (None,)
    except ValueError as exc:
        parser.error(str(exc))
    if args.dtype == "fp8" and args.b_layout != "linear":
        parser.error("--dtype fp8 reads the weights as stacked nn.Linear [E, N, K] (K-major, as FP8 MMAs and "
                     "torch._scaled_grouped_mm want them): leave --b-layout at linear")
    return args, scalings


def check_args(argv) -> None:
    """Exit with a usage error if ``argv`` is not a valid command line of this section (nothing runs)."""
    parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args, scalings = parse_args(argv)

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    if not cuda and not args.smoke:
        print("no CUDA device: only --smoke runs on the CPU", file=sys.stderr)
        return 2
    if not cuda and not common.interpreting():
        # Triton fixes the interpreter mode when the kernels are imported: run again in a process with it.
        argv = list(sys.argv[1:] if argv is None else argv)
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        return subprocess.run([sys.executable, "-m", "tileweave.bench.grouped", *argv], env=env).returncode
    args.out = output_dir(args.out, args.smoke)
    dtype = torch.bfloat16 if cuda else torch.float32
    models = (FP8_SMOKE_MODELS if args.dtype == "fp8" else SMOKE_MODELS) if args.smoke else MODELS
    if args.models:
        wanted = args.models.split(",")
        unknown = [w for w in wanted if w not in {m.name for m in models}]
        if unknown:
            build_parser().error(f"unknown models {unknown}; known: {[m.name for m in models]}")
        models = tuple(m for m in models if m.name in wanted)
    tokens = SMOKE_TOKENS if args.smoke else QUICK_TOKENS if args.quick else TOKENS
    if args.tokens:
        tokens = tuple(int(v) for v in args.tokens.split(","))
    timing = TimingConfig() if cuda else None
    clocks = ClockReader() if cuda else None
    todo = cases(models, tokens, ROUTINGS, (0, 1), dtype, scalings)
    meta = collect_metadata(world_size=1, timing=dataclasses.asdict(timing) if timing else {}, argv=sys.argv[1:])
    meta.update(dtype=str(dtype).removeprefix("torch."), b_layout=args.b_layout, tp=TP, zipf_s=ZIPF_S,
                has_grouped_mm=hasattr(torch, "_grouped_mm"), scalings=[s for s in scalings if s],
                has_scaled_grouped_mm=hasattr(torch, "_scaled_grouped_mm"))
    if cuda:
        meta["sm_count"] = torch.cuda.get_device_properties(0).multi_processor_count
        meta["sm_clock_mhz_idle"] = clocks.read(0)
        meta["allow_tf32"] = torch.backends.cuda.matmul.allow_tf32

    start = time.monotonic()
    rows = []
    args.out.mkdir(parents=True, exist_ok=True)
    for i, case in enumerate(todo):
        if time.monotonic() - start > args.budget_s:
            row = dict(case.key(), results={}, skipped="time budget spent")
            rows.append(row)
            continue
        # One seed per shape: its bf16 and FP8 rows share the routing and the data.
        row = run_case(case, seed=args.seed + i // len(scalings), device=device, b_layout=args.b_layout,
                       timing=timing, clocks=clocks, loop=args.loop, configs=args.configs)
        rows.append(row)
        res = row["results"]
        print(f"[{time.monotonic() - start:6.1f}s] {case.model.name} T={case.tokens} {case.routing} "
              f"layer {case.layer}: " + ", ".join(f"{k}={cell(v)}" for k, v in res.items()), flush=True)
        if cuda:
            torch.cuda.empty_cache()
    meta["elapsed_s"] = time.monotonic() - start
    stats = summary(rows)
    (args.out / "grouped.json").write_text(json.dumps({"meta": meta, "summary": stats, "rows": rows}, indent=1,
                                                      default=str))
    table = markdown(rows, meta, stats, TP)
    (args.out / "grouped.md").write_text(table)
    print(table)
    failed = [r for r in rows if any("error" in v for v in r["results"].values())]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
