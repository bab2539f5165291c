"""The result schema, the derived numbers, and the files a benchmark run leaves behind.

Results are long format: one ``Measurement`` per (shape, variant), so a missing or failed variant is a
row with a status rather than a hole in a wide record. The wide view (one line per shape, with the
derived numbers of docs/design.md's "Measuring") is computed from them for the markdown table and
stored next to them in the JSON; the measurements are the source of truth.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

SCHEMA = "tileweave.bench/1"

COLLECTIVE_VARIANTS: tuple[str, ...] = ("gemm", "comm", "nccl", "base", "torch", "ours")
"""AG/RS variants: cuBLAS alone, copy-engine transport alone, the NCCL collective alone, NCCL then
cuBLAS, torch async-TP, ours."""
GEMM_VARIANTS: tuple[str, ...] = ("cublas", "torch", "ours")
"""``gemm`` section variants: ``torch.matmul`` (bf16 rows), torch's scaled matmul (FP8 rows) and
``tileweave.matmul``."""
BLOCK_VARIANTS: tuple[str, ...] = ("floor", "base", "torch", "ours")
"""``block`` section variants: compute floor, NCCL + cuBLAS, PyTorch async-TP, tileweave."""
BLOCK_FLOOR_MIN_M = 8192
"""Block rows with at least this many tokens enter the worst ours/floor ratio (issue bar: <= 1.08)."""
E_MIN_M = 4096
"""Rows with at least this many tokens enter the median E / eff: below it fixed per-call costs, not
overlap, decide the result (docs/design.md's measurements at M=2048)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Shape:
    """Where a row was measured: the section, the layer, the ranks and the dims."""

    op: str
    """Benchmark section: ``"ag"``, ``"rs"`` or ``"gemm"``."""
    layer: str
    """Suite layer name; for the ``gemm`` section, the label of the deduplicated local GEMM."""
    world_size: int
    """Ranks the variant ran on (1 for the ``gemm`` section)."""
    m: int
    k: int
    n: int
    """AG/RS: full model dims (M tokens over the group). ``gemm``: the local GEMM ``[m, k] @ [k, n]``."""
    dtype: str = "bf16"
    """The inputs: ``"bf16"``, or float8 e4m3 with its scaling (``"fp8-tensorwise"``, ``"fp8-rowwise"``,
    ``"fp8-blockwise"``; bf16 output)."""

    @property
    def shape_key(self) -> tuple[str, str, int, int, int, int, str]:
        return (self.op, self.layer, self.world_size, self.m, self.k, self.n, self.dtype)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Measurement(Shape):
    """One variant on one shape. Times are per call in ms, median over reps, max over ranks."""

    variant: str
    status: str
    """``"ok"``, ``"FAILED"`` (verification or run failed on some rank) or ``"n/a"`` (not available)."""
    ms: float | None = None
    rel_err: float | None = None
    """Relative Frobenius error against the fp32 reference, max over ranks."""
    warmup_calls: int | None = None
    clock_mhz: float | None = None
    mem_peak_mb: float | None = None
    mem_other_mb: float | None = None
    path: str | None = None
    """What ``tileweave.last_path`` reported for ours (e.g. ``"fused"``, ``"fallback"``)."""
    host_ms: float | None = None
    """The host's time to issue one call, max over ranks (``Timing.host_ms``)."""
    note: str = ""
    """Why a variant is FAILED or n/a."""


def speedup(t_ref: float | None, t: float | None) -> float | None:
    """``t_ref / t``: above 1 means ``t`` is faster."""
    if t_ref is None or t is None or t <= 0:
        return None
    return t_ref / t


def overlap_efficiency(*, t_fused: float | None, t_gemm: float | None, t_base: float | None) -> float | None:
    """Flux's E = 1 - (t_fused - t_gemm) / (t_base - t_gemm): the share of the exposed communication
    of NCCL-then-cuBLAS that the fused op hides. 1 is perfect, 0 no better than no overlap, negative
    worse. Undefined when the baseline exposes no communication (``t_base <= t_gemm``)."""
    if t_fused is None or t_gemm is None or t_base is None or t_base <= t_gemm:
        return None
    return 1.0 - (t_fused - t_gemm) / (t_base - t_gemm)


def ideal_time(t_gemm: float | None, t_comm: float | None) -> float | None:
    """A perfect overlap costs the longer of compute alone and communication alone."""
    if t_gemm is None or t_comm is None:
        return None
    return max(t_gemm, t_comm)


def tflops(flops: int, ms: float | None) -> float | None:
    return None if ms is None or ms <= 0 else flops / (ms * 1e-3) / 1e12


def geomean(values: Iterable[float | None]) -> float | None:
    vals = [v for v in values if v is not None and v > 0]
    return math.exp(sum(math.log(v) for v in vals) / len(vals)) if vals else None


def median_or_none(values: Iterable[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


@dataclasses.dataclass(frozen=True, kw_only=True)
class ShapeSummary(Shape):
    """The wide view of one shape: every variant's time and the derived numbers."""

    times: dict[str, float | None]
    """Variant -> ms; None unless the variant's status is ok."""
    status: dict[str, str]
    """Variant -> status, for variants that were measured at all."""
    path: str | None
    ideal: float | None = None
    x_base: float | None = None
    x_torch: float | None = None
    x_base_torch: float | None = None
    """torch async-TP's own speedup over NCCL + cuBLAS."""
    e: float | None = None
    e_torch: float | None = None
    eff: float | None = None
    eff_torch: float | None = None
    x_cublas: float | None = None
    tflops_cublas: float | None = None
    tflops_ours: float | None = None
    over_floor: float | None = None
    """``block``: ours' step time over the compute floor's (1.0 is no communication cost at all)."""
    tokens_per_s: float | None = None
    """``block``: tokens per second of ours (M tokens per step)."""
    x_bf16: float | None = None
    """``block`` FP8 rows: the bf16 ``ours`` step time of the same block and M over this row's ``ours``
    (above 1: the FP8 block is faster)."""


def summarize(measurements: Iterable[Measurement]) -> list[ShapeSummary]:
    """Group long rows by shape (first-seen order) and derive the reported numbers."""
    groups: dict[tuple, list[Measurement]] = {}
    for row in measurements:
        groups.setdefault(row.shape_key, []).append(row)
    bf16_ours = {(r.op, r.layer, r.world_size, r.m): r.ms for r in measurements
                 if r.dtype == "bf16" and r.variant == "ours" and r.status == "ok"}
    out: list[ShapeSummary] = []
    for rows in groups.values():
        first = rows[0]
        times = {r.variant: (r.ms if r.status == "ok" else None) for r in rows}
        status = {r.variant: r.status for r in rows}
        path = next((r.path for r in rows if r.variant == "ours" and r.path), None)
        common = dict(op=first.op, layer=first.layer, world_size=first.world_size,
                      m=first.m, k=first.k, n=first.n, dtype=first.dtype, times=times, status=status, path=path)
        t = times.get
        if first.op == "gemm":
            # The vendor baseline: cuBLAS's bf16 GEMM, or torch's scaled matmul (cuBLASLt) for FP8 rows.
            base = "cublas" if first.dtype == "bf16" else "torch"
            flops = 2 * first.m * first.n * first.k
            out.append(ShapeSummary(
                **common, x_cublas=speedup(t(base), t("ours")),
                tflops_cublas=tflops(flops, t(base)), tflops_ours=tflops(flops, t("ours")),
            ))
            continue
        if first.op == "block":
            ours = t("ours")
            out.append(ShapeSummary(
                **common, x_base=speedup(t("base"), ours), x_torch=speedup(t("torch"), ours),
                x_base_torch=speedup(t("base"), t("torch")), over_floor=speedup(ours, t("floor")),
                tokens_per_s=first.m / (ours * 1e-3) if ours else None,
                x_bf16=None if first.dtype == "bf16" else speedup(
                    bf16_ours.get((first.op, first.layer, first.world_size, first.m)), ours),
            ))
            continue
        ideal = ideal_time(t("gemm"), t("comm"))
        out.append(ShapeSummary(
            **common,
            ideal=ideal,
            x_base=speedup(t("base"), t("ours")),
            x_torch=speedup(t("torch"), t("ours")),
            x_base_torch=speedup(t("base"), t("torch")),
            e=overlap_efficiency(t_fused=t("ours"), t_gemm=t("gemm"), t_base=t("base")),
            e_torch=overlap_efficiency(t_fused=t("torch"), t_gemm=t("gemm"), t_base=t("base")),
            eff=speedup(ideal, t("ours")),
            eff_torch=speedup(ideal, t("torch")),
        ))
    return out


def _num(v: float | None, digits: int) -> str:
    return "n/a" if v is None else f"{v:.{digits}f}"


def _time_cell(s: ShapeSummary, variant: str) -> str:
    st = s.status.get(variant, "n/a")
    return _num(s.times.get(variant), 3) if st == "ok" else st


def _table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return lines


def markdown(op: str, measurements: Sequence[Measurement], meta: dict[str, Any]) -> str:
    """The wide table of one section, its summary lines, and peak memory per variant."""
    summaries = summarize(measurements)
    gpu = meta.get("gpu_name", "n/a")
    lines = [
        f"## tileweave bench: {op} ({meta.get('world_size', '?')}x {gpu}, {meta.get('date', '')})",
        "",
        f"commit {meta.get('git_commit', 'n/a')}{' (dirty)' if meta.get('git_dirty') else ''}; "
        f"torch {meta.get('torch', 'n/a')}, triton {meta.get('triton', 'n/a')}; "
        f"SM clock under load {_clock_text(meta.get('sm_clock_mhz'))}. "
        "Times in ms per call: steady state, median over reps, max over ranks."
        + (f" Merged from {len(meta['merged_from'])} reports, each run in its own processes."
           if meta.get("merged_from") else ""),
        "",
    ]
    if op == "gemm":
        header = ["shape", "dtype", "M", "K", "N", "t_cublas", "t_ours", "TF/s cublas", "TF/s ours", "x_cublas",
                  "path"]
        lines += _table(header, (
            [s.layer, s.dtype, str(s.m), str(s.k), str(s.n),
             _time_cell(s, "cublas" if s.dtype == "bf16" else "torch"), _time_cell(s, "ours"),
             _num(s.tflops_cublas, 0), _num(s.tflops_ours, 0), _num(s.x_cublas, 2), s.path or "n/a"]
            for s in summaries
        ))
        dtypes = list(dict.fromkeys(s.dtype for s in summaries))
        if dtypes != ["bf16"]:
            lines += ["", "FP8 rows (e4m3 inputs, bf16 output): t_cublas is torch's own scaled matmul, the variant "
                          "torch (torch._scaled_mm; torch.nn.functional.scaled_mm for blockwise)."]
        lines.append("")
        for dtype in dtypes:
            rows = [s for s in summaries if s.dtype == dtype]
            lines.append(f"geomean x_cublas {_num(geomean(s.x_cublas for s in rows), 3)} "
                         f"over {sum(s.x_cublas is not None for s in rows)} shapes"
                         + (f" ({dtype})" if dtypes != ["bf16"] else ""))
    elif op == "block":
        header = ["block", "dtype", "M", "hidden", "ffn", "t_floor", "t_base", "t_torch", "t_ours", "tokens/s ours",
                  "x_base", "x_torch", "ours/floor", "x_bf16", "path"]
        lines += _table(header, (
            [s.layer, s.dtype, str(s.m), str(s.k), str(s.n)] + [_time_cell(s, v) for v in BLOCK_VARIANTS]
            + [_num(s.tokens_per_s, 0), _num(s.x_base, 2), _num(s.x_torch, 2), _num(s.over_floor, 3),
               _num(s.x_bf16, 2), s.path or "n/a"]
            for s in summaries
        ))
        bf16 = [s for s in summaries if s.dtype == "bf16"]
        big = [s for s in bf16 if s.m >= BLOCK_FLOOR_MIN_M]
        beats = [s for s in bf16 if s.x_base is not None and s.x_torch is not None and s.x_base > 1 and s.x_torch > 1]
        worst = max((s.over_floor for s in big if s.over_floor is not None), default=None)
        lines += [
            "",
            "Times in ms per forward + backward step of one block.",
            f"ours faster than both NCCL and async-TP on {len(beats)} of {len(bf16)} bf16 rows; "
            f"geomean x_base {_num(geomean(s.x_base for s in bf16), 3)}, "
            f"x_torch {_num(geomean(s.x_torch for s in bf16), 3)}",
            f"worst ours/floor over M>={BLOCK_FLOOR_MIN_M} ({len(big)} rows): {_num(worst, 3)}",
        ]
        fp8_dtypes = list(dict.fromkeys(s.dtype for s in summaries if s.dtype != "bf16"))
        if fp8_dtypes:
            lines += ["", "FP8 rows: the block with that scaling's Float8Recipe; t_torch is the same FP8 block on NCCL "
                          "+ torch's scaled matmul; x_bf16 is the bf16 row's t_ours over the FP8 row's t_ours."]
        for dtype in fp8_dtypes:
            rows = [s for s in summaries if s.dtype == dtype]
            lines.append(f"{dtype}: geomean x_bf16 {_num(geomean(s.x_bf16 for s in rows), 3)} "
                         f"(over {sum(s.x_bf16 is not None for s in rows)} rows), "
                         f"x_torch {_num(geomean(s.x_torch for s in rows), 3)} "
                         f"(over {sum(s.x_torch is not None for s in rows)} rows)")
    else:
        header = ["layer", "M", "K", "N", "t_gemm", "t_comm", "t_nccl", "ideal", "t_base", "t_torch", "t_ours",
                  "x_base", "x_torch", "E", "eff", "path"]
        lines += _table(header, (
            [s.layer if s.dtype == "bf16" else f"{s.layer} {s.dtype}", str(s.m), str(s.k), str(s.n)]
            + [_time_cell(s, v) for v in ("gemm", "comm", "nccl")] + [_num(s.ideal, 3)]
            + [_time_cell(s, v) for v in ("base", "torch", "ours")]
            + [_num(s.x_base, 2), _num(s.x_torch, 2), _num(s.e, 2), _num(s.eff, 2), s.path or "n/a"]
            for s in summaries
        ))
        big = [s for s in summaries if s.m >= E_MIN_M and s.dtype == "bf16"]
        lines.append("")
        dtypes = list(dict.fromkeys(s.dtype for s in summaries))
        for dtype in dtypes:  # FP8 rows (tileweave.bench.fp8_comm) against their own baselines
            rows = [s for s in summaries if s.dtype == dtype]
            lines.append(
                f"geomean x_base {_num(geomean(s.x_base for s in rows), 3)} "
                f"(over {sum(s.x_base is not None for s in rows)} rows), "
                f"x_torch {_num(geomean(s.x_torch for s in rows), 3)} "
                f"(over {sum(s.x_torch is not None for s in rows)} rows)"
                + (f" ({dtype})" if dtypes != ["bf16"] else ""))
        lines += [
            f"median over M>={E_MIN_M} ({len(big)} rows): E {_num(median_or_none(s.e for s in big), 2)}, "
            f"eff {_num(median_or_none(s.eff for s in big), 2)}, "
            f"E_torch {_num(median_or_none(s.e_torch for s in big), 2)}",
        ]
    variants = GEMM_VARIANTS if op == "gemm" else BLOCK_VARIANTS if op == "block" else ("base", "torch", "ours")
    lines += _host_bound_lines(measurements, variants)
    mem = {(r.shape_key, r.variant): r for r in measurements}
    lines += ["", "Peak GPU memory per variant, MB (allocator peak + memory kept outside it), max over ranks:", ""]
    lines += _table(["layer", "M", *variants], (
        [s.layer if s.dtype == "bf16" else f"{s.layer} {s.dtype}", str(s.m)]
        + [_mem_cell(mem.get((s.shape_key, v))) for v in variants]
        for s in summaries
    ))
    return "\n".join(lines) + "\n"


HOST_BOUND = 0.9
"""A variant is host-bound on a row when issuing a call takes at least this share of the call's time."""


def host_bound(r: Measurement) -> bool:
    return r.status == "ok" and r.ms is not None and r.host_ms is not None and r.host_ms >= HOST_BOUND * r.ms


def _host_bound_lines(measurements: Sequence[Measurement], variants: Sequence[str]) -> list[str]:
    """Which variants the host paced, per row: their time says more about Python and the driver than
    about the GPU."""
    lines = []
    for v in variants:
        rows = [f"{r.layer} M={r.m}" for r in measurements if r.variant == v and host_bound(r)]
        if rows:
            lines.append(f"{v}: {', '.join(rows)}")
    if not lines:
        return []
    return ["", f"Host-bound (issuing a call took >= {HOST_BOUND:.0%} of its time), per variant:", ""] + \
        [f"- {line}" for line in lines]


def _mem_cell(r: Measurement | None) -> str:
    if r is None or r.status != "ok" or r.mem_peak_mb is None:
        return "n/a"
    return f"{r.mem_peak_mb:.0f} + {r.mem_other_mb or 0:.0f}"


def _clock_text(c: Any) -> str:
    if not isinstance(c, dict) or c.get("median") is None:
        return "n/a"
    return f"{c['min']:.0f}-{c['max']:.0f} MHz (median {c['median']:.0f})"


def clock_stats(measurements: Iterable[Measurement]) -> dict[str, float] | None:
    vals = [r.clock_mhz for r in measurements if r.clock_mhz is not None]
    if not vals:
        return None
    return {"min": min(vals), "median": statistics.median(vals), "max": max(vals)}


def write_chart(path: Path, op: str, measurements: Sequence[Measurement]) -> bool:
    """Bar chart of speedups over the baseline per row; False (no file) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        return False
    summaries = summarize(measurements)
    labels = [f"{s.layer}\nM={s.m}" + ("" if s.dtype == "bf16" else f" {s.dtype}") for s in summaries]
    if op == "gemm":
        series = {"ours / cuBLAS": [s.x_cublas for s in summaries]}
        ylabel = "speedup over torch.matmul (FP8: torch's scaled matmul)"
    else:
        series = {"tileweave": [s.x_base for s in summaries],
                  "torch async-TP": [s.x_base_torch for s in summaries]}
        ylabel = "speedup over NCCL + cuBLAS"
    width = 0.8 / len(series)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.45 * len(labels) + 2), 4.5))
    for i, (name, vals) in enumerate(series.items()):
        xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(labels))]
        ax.bar(xs, [v if v is not None else 0.0 for v in vals], width=width, label=name)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, rotation=90, fontsize=6)
    ax.set_ylabel(ylabel)
    ax.set_title(f"tileweave {op}" + (f", TP={summaries[0].world_size}" if summaries and op != "gemm" else ""))
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReportFiles:
    json: Path
    md: Path
    png: Path | None


def write_report(
    *,
    out_dir: Path,
    tag: str,
    op: str,
    date: str,
    meta: dict[str, Any],
    measurements: Sequence[Measurement],
) -> ReportFiles:
    """Write ``<tag>_<op>_<date>.{json,md,png}`` into ``out_dir`` (the PNG only with matplotlib)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / f"{tag}_{op}_{date}"
    meta = {**meta, "op": op, "tag": tag, "sm_clock_mhz": clock_stats(measurements)}
    doc = {
        "schema": SCHEMA,
        "meta": meta,
        "measurements": [_finite(dataclasses.asdict(r)) for r in measurements],
        "shapes": [_finite(dataclasses.asdict(s)) for s in summarize(measurements)],
    }
    json_path = stem.with_suffix(".json")
    json_path.write_text(json.dumps(doc, indent=1, allow_nan=False) + "\n")
    md_path = stem.with_suffix(".md")
    md_path.write_text(markdown(op, measurements, meta))
    png_path = stem.with_suffix(".png")
    return ReportFiles(json=json_path, md=md_path, png=png_path if write_chart(png_path, op, measurements) else None)


def _finite(obj: Any) -> Any:
    """Non-finite floats become None: JSON has no inf/NaN, and a failed variant carries its status."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def load_report(path: Path) -> tuple[dict[str, Any], list[Measurement]]:
    """Read a JSON written by ``write_report`` back into metadata and measurements."""
    doc = json.loads(Path(path).read_text())
    if doc.get("schema") != SCHEMA:
        raise ValueError(f"{path}: schema {doc.get('schema')!r}, expected {SCHEMA!r}")
    return doc["meta"], [Measurement(**r) for r in doc["measurements"]]


def merge_reports(paths: Sequence[Path]) -> tuple[str, dict[str, Any], list[Measurement]]:
    """``(op, meta, measurements)`` of several reports of one section at one commit (for example the
    block's variants, each timed in a fresh process), for ``write_report``. Rows keep the first file's
    order; a variant measured twice on one row, or reports of different sections or commits, are an
    error rather than a silent choice."""
    if not paths:
        raise ValueError("merge_reports needs at least one report")
    loaded = [(Path(p), *load_report(p)) for p in paths]
    first_path, meta, _ = loaded[0]
    op = meta.get("op")
    for path, m, _ in loaded[1:]:
        for key in ("op", "git_commit", "world_size", "gpu_name"):
            if m.get(key) != meta.get(key):
                raise ValueError(f"cannot merge {path} into {first_path}: {key} {m.get(key)!r} != {meta.get(key)!r}")
    merged: dict[tuple, dict[str, Measurement]] = {}
    for path, _, rows in loaded:
        for r in rows:
            per_shape = merged.setdefault(r.shape_key, {})
            if r.variant in per_shape:
                raise ValueError(f"{path}: variant {r.variant!r} of {r.layer} M={r.m} is already in another report")
            per_shape[r.variant] = r
    order = {v: i for i, v in enumerate((*COLLECTIVE_VARIANTS, *GEMM_VARIANTS, *BLOCK_VARIANTS))}
    measurements = [r for per_shape in merged.values()
                    for r in sorted(per_shape.values(), key=lambda r: order.get(r.variant, len(order)))]
    meta = {k: v for k, v in meta.items() if k not in ("op", "tag", "sm_clock_mhz")}
    meta["argv"] = [list(m.get("argv") or []) for _, m, _ in loaded]
    meta["merged_from"] = [p.name for p, _, _ in loaded]
    return op, meta, measurements
