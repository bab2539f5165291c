"""The ``grouped`` section's report: the summary of its rows (geomean and min of torch / ours per layer
selection, FP8 rows apart) and its markdown table."""

from __future__ import annotations

from tileweave.bench.report import geomean


def summary(rows: list[dict]) -> dict:
    """Geomean, min and count of torch / ours per layer selection; FP8 rows apart, prefixed by their dtype."""
    out = {}
    for dtype in dict.fromkeys(r.get("dtype", "") for r in rows):
        prefix = f"{dtype}_" if dtype.startswith("fp8") else ""
        for label, select in (("all", lambda r: True), ("layer0", lambda r: r["layer"] == 0),
                              ("layer1", lambda r: r["layer"] == 1)):
            for name in ("torch", "torch+gather"):
                vals = [r[f"vs_{name}"] for r in rows if r.get("dtype", "") == dtype and select(r) and f"vs_{name}" in r]
                if vals:
                    out[f"{prefix}{label}_vs_{name}_geomean"] = geomean(vals)
                    out[f"{prefix}{label}_vs_{name}_min"] = min(vals)
                    out[f"{prefix}{label}_vs_{name}_rows"] = len(vals)
    return out


def cell(result: dict) -> str:
    if "error" in result:
        return "FAIL"
    if "unavailable" in result:
        return "n/a"
    if "ms" in result:
        return f"{result['ms']:.3f}"
    return "ok" if "rel_err" in result else "-"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def markdown(rows: list[dict], meta: dict, stats: dict, tp: int) -> str:
    """The table of ``rows`` (``tp``: the TP size whose shards the shapes are)."""
    lines = ["# Grouped GEMM: tileweave vs torch._grouped_mm (one GPU)", "",
             f"GPU {meta.get('gpu_name')}, torch {meta.get('torch')}, triton {meta.get('triton')}, "
             f"commit {meta.get('git_commit')}, {meta.get('date')}; dtype {meta.get('dtype')}, "
             f"weights {meta.get('b_layout')}, TP={tp} shards. Times in ms (median of 5 x 20 calls); "
             "vs = torch time / ours (> 1: ours faster).", "",
             "| model | T | routing | layer | dtype | rows x N x K | max/mean rows | ours | torch | torch+gather | "
             "vs torch | vs torch+gather | config |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        res = r["results"]
        mean = r["rows"] / r["experts"]
        c = r.get("config", {})
        lines.append(
            f"| {r['model']} | {r['tokens']} | {r['routing']} | {r['layer']} | {r.get('dtype', '')} | "
            f"{r['rows']}x{r['n']}x{r['k']} | "
            f"{r.get('max_rows_per_expert', 0) / mean:.2f} | {cell(res.get('ours', {}))} | "
            f"{cell(res.get('torch', {}))} | {cell(res.get('torch+gather', {})) if r['layer'] == 0 else ''} | "
            f"{_ratio(r.get('vs_torch'))} | {_ratio(r.get('vs_torch+gather'))} | "
            f"{c.get('block_m')}x{c.get('block_n')}x{c.get('block_k')}/{c.get('num_stages')}s/{c.get('num_warps')}w |")
    if any(r.get("dtype", "").startswith("fp8") for r in rows):
        lines += ["", f"FP8 rows: e4m3 inputs, {meta.get('dtype')} output; torch is torch._scaled_grouped_mm "
                      "(rowwise only)."]
    lines += ["", "Summary (geomean and min of torch / ours):", ""]
    lines += [f"- {k}: {v:.3f}" if isinstance(v, float) else f"- {k}: {v}" for k, v in stats.items()]
    if not stats:
        lines += ["- none: no row was timed (a smoke run on the CPU checks the outputs only)"]
    errors = [(r, name, res["error"]) for r in rows for name, res in r["results"].items() if "error" in res]
    if errors:
        lines += ["", "Failures:", ""]
        lines += [f"- {r['model']} T={r['tokens']} {r['routing']} layer {r['layer']} {name}: {err}"
                  for r, name, err in errors]
    return "\n".join(lines) + "\n"
