"""The ``moe`` section's report: a markdown table (ours against each baseline and the compute floor), one
of the FP8 rows (ours against torch and against the bf16 row's ours), a chart of the speedups and of the
share of the floor reached, and the JSON of the measurements (``tileweave.bench.report``'s schema).

Smoke reports (``meta["timing"]["smoke"]``: emulated ranks on the CPU, Triton's interpreter) say in
their header that their times mean nothing, show no ratios and draw no chart."""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path

from tileweave.bench.report import SCHEMA, Measurement

BASELINES = ("grouped", "loop")
"""The variants ours is compared with (speedup columns and bars); ``floor`` is the compute floor."""


def is_smoke(meta: dict) -> bool:
    """Whether ``meta`` is a smoke run's (its times are the interpreter's and mean nothing)."""
    return bool((meta.get("timing") or {}).get("smoke"))


def _rows(measurements: list[Measurement]) -> dict[tuple, dict[str, Measurement]]:
    """The measurements per (row, T), by variant, in report order; an FP8 row's name ends in its
    ``dtype`` (``fp8-rowwise``)."""
    by_row: dict[tuple, dict[str, Measurement]] = {}
    for r in measurements:
        layer = r.layer if r.dtype == "bf16" else f"{r.layer} {r.dtype}"
        by_row.setdefault((layer, r.m), {})[r.variant] = r
    return by_row


def _ratio(num: Measurement | None, den: Measurement | None) -> float | None:
    """``num.ms / den.ms`` where both ran and verified, else None."""
    if num is None or den is None or num.status != "ok" or den.status != "ok":
        return None
    if num.ms is None or den.ms is None or den.ms <= 0:
        return None
    return num.ms / den.ms


def markdown(measurements: list[Measurement], meta: dict) -> str:
    """The report's table: per row the time of each variant, ours' speedups over the baselines, the share
    of the compute floor ours reaches (floor/ours), ours' error and peak memory; then the FP8 rows' table:
    ours, torch, ours' speedup over torch and over the bf16 row's ours (x bf16), ours' error and memory.
    "-": not run (a part without that variant) or, in a smoke report, not meaningful."""
    smoke = is_smoke(meta)

    def cell(r: Measurement | None) -> str:
        if r is None:
            return "-"
        return f"{r.ms:.3f}" if r.status == "ok" and r.ms is not None else r.status

    def ratio(num: Measurement | None, den: Measurement | None) -> str:
        value = None if smoke else _ratio(num, den)
        return "-" if value is None else f"{value:.2f}"

    title = f"# moe: TP={meta.get('world_size')}, {meta.get('gpu_name')}, {meta.get('date')}"
    if smoke:
        title += (" (smoke: emulated ranks on the CPU, Triton's interpreter; the times mean nothing and no "
                  "ratios are shown)")
    lines = [title, "",
             "ms per call, max over ranks (median of reps). x grouped / x loop: speedup of ours over the "
             "baselines; floor/ours: share of the compute floor reached. mem: peak MB (ours).", "",
             "| row | T | ours | grouped | loop | floor | x grouped | x loop | floor/ours | err ours | mem ours |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    fp8_rows = [r for r in measurements if r.dtype != "bf16"]
    for (layer, m), v in _rows([r for r in measurements if r.dtype == "bf16"]).items():
        ours = v.get("ours")
        err = f"{ours.rel_err:.1e}" if ours is not None and ours.rel_err is not None else "-"
        mem = f"{ours.mem_peak_mb:.0f}" if ours is not None and ours.mem_peak_mb is not None else "-"
        lines.append(f"| {layer} | {m} | {cell(ours)} | {cell(v.get('grouped'))} | {cell(v.get('loop'))} | "
                     f"{cell(v.get('floor'))} | {ratio(v.get('grouped'), ours)} | {ratio(v.get('loop'), ours)} | "
                     f"{ratio(v.get('floor'), ours)} | {err} | {mem} |")
    if fp8_rows:
        bf16_ours = {(r.layer, r.m): r for r in measurements if r.dtype == "bf16" and r.variant == "ours"}
        lines += ["", "FP8 (each row's scaling after its name; layer0 and layer1: e4m3 inputs, torch: "
                  "torch._scaled_grouped_mm + NCCL, rowwise scales, tensorwise ones broadcast to them, no blockwise "
                  "grouped GEMM in torch; layer and layer-bwd: TPMoE(fp8=recipe), no FP8 MoE layer in torch). "
                  "x bf16: the bf16 row's ours time over the FP8 row's ours time (the speedup FP8 gives). err: "
                  "layer0 and layer1 against float64 of the dequantized operands, layer and layer-bwd against the "
                  "unquantized layer.", "",
                  "| row | T | ours | torch | x torch | x bf16 | err ours | mem ours |",
                  "|---|---|---|---|---|---|---|---|"]
        for (layer, m), v in _rows(fp8_rows).items():
            ours = v.get("ours")
            bf16 = bf16_ours.get((next(iter(v.values())).layer, m))
            err = f"{ours.rel_err:.1e}" if ours is not None and ours.rel_err is not None else "-"
            mem = f"{ours.mem_peak_mb:.0f}" if ours is not None and ours.mem_peak_mb is not None else "-"
            lines.append(f"| {layer} | {m} | {cell(ours)} | {cell(v.get('torch'))} | {ratio(v.get('torch'), ours)} | "
                         f"{ratio(bf16, ours)} | {err} | {mem} |")
    failed = [r for r in measurements if r.status != "ok"]
    if failed:
        lines += ["", "Failed:"] + [f"- {r.layer} T={r.m} {r.variant}: {r.note}" for r in failed]
    return "\n".join(lines) + "\n"


def write_chart(path: Path, measurements: list[Measurement], *, title: str = "") -> bool:
    """A PNG at ``path``, one group of bars per row: on top ours' speedup over each baseline, below the
    share of the compute floor ours reaches (floor/ours), both against a line at 1. A variant not run or
    not verified leaves a gap. False if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        return False
    rows = _rows([r for r in measurements if r.dtype == "bf16"])  # the FP8 rows have no baselines charted
    labels = [f"{layer}\nT={m}" for layer, m in rows]

    def values(num: str) -> list[float]:
        out = []
        for v in rows.values():
            value = _ratio(v.get(num), v.get("ours"))
            out.append(math.nan if value is None else value)
        return out

    x = range(len(labels))
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(max(6.0, 0.45 * len(labels) + 2), 7.0),
                                      height_ratios=(3, 2))
    width = 0.8 / len(BASELINES)
    for i, base in enumerate(BASELINES):
        top.bar([j + (i - (len(BASELINES) - 1) / 2) * width for j in x], values(base), width=width,
                label=f"ours over {base}")
    top.set_ylabel("speedup")
    top.legend()
    bottom.bar(list(x), values("floor"), width=0.5, color="tab:green", label="floor / ours")
    bottom.set_ylabel("floor / ours")
    bottom.legend()
    for ax in (top, bottom):
        ax.axhline(1.0, color="black", linewidth=0.8)
    bottom.set_xticks(list(x))
    bottom.set_xticklabels(labels, rotation=90, fontsize=6)
    if title:
        top.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def write_report(out_dir: Path, tag: str, measurements: list[Measurement], meta: dict) -> list[Path]:
    """``<tag>_moe_<time>.json`` and ``.md`` in ``out_dir`` (and ``.png``, except for smoke reports or
    without matplotlib); returns the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / f"{tag}_moe_{time.strftime('%Y%m%d-%H%M%S')}"
    doc = {"schema": SCHEMA, "meta": {**meta, "op": "moe", "tag": tag},
           "measurements": [dataclasses.asdict(r) for r in measurements]}
    stem.with_suffix(".json").write_text(json.dumps(doc, indent=1, default=lambda o: None) + "\n")
    stem.with_suffix(".md").write_text(markdown(measurements, meta))
    paths = [stem.with_suffix(".json"), stem.with_suffix(".md")]
    title = f"moe: TP={meta.get('world_size')}, {meta.get('gpu_name')}, {str(meta.get('git_commit') or '')[:7]}"
    if not is_smoke(meta) and write_chart(stem.with_suffix(".png"), measurements, title=title):
        paths.append(stem.with_suffix(".png"))
    return paths
