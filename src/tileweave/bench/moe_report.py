"""The ``moe`` section's report: a markdown table (ours against each baseline and the compute floor),
a chart of the speedups, and the JSON of the measurements (``tileweave.bench.report``'s schema)."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

from tileweave.bench.report import SCHEMA, Measurement


def markdown(measurements: list[Measurement], meta: dict) -> str:
    by_row: dict[tuple, dict[str, Measurement]] = {}
    for r in measurements:
        by_row.setdefault((r.layer, r.m), {})[r.variant] = r

    def cell(r: Measurement | None) -> str:
        if r is None:
            return "-"
        return f"{r.ms:.3f}" if r.status == "ok" and r.ms is not None else r.status

    def ratio(a: Measurement | None, b: Measurement | None) -> str:
        if a is None or b is None or a.ms is None or b.ms is None or a.ms <= 0:
            return "-"
        return f"{b.ms / a.ms:.2f}"

    lines = [f"# moe: TP={meta.get('world_size')}, {meta.get('gpu_name')}, {meta.get('date')}", "",
             "ms per call, max over ranks (median of reps). x grouped / x loop: speedup of ours over the "
             "baselines; floor/ours: share of the compute floor reached. mem: peak MB (ours).", "",
             "| row | T | ours | grouped | loop | floor | x grouped | x loop | floor/ours | err ours | mem ours |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for (layer, m), v in by_row.items():
        ours = v.get("ours")
        err = f"{ours.rel_err:.1e}" if ours is not None and ours.rel_err is not None else "-"
        mem = f"{ours.mem_peak_mb:.0f}" if ours is not None and ours.mem_peak_mb is not None else "-"
        lines.append(f"| {layer} | {m} | {cell(ours)} | {cell(v.get('grouped'))} | {cell(v.get('loop'))} | "
                     f"{cell(v.get('floor'))} | {ratio(ours, v.get('grouped'))} | {ratio(ours, v.get('loop'))} | "
                     f"{ratio(ours, v.get('floor'))} | {err} | {mem} |")
    failed = [r for r in measurements if r.status != "ok"]
    if failed:
        lines += ["", "Failed:"] + [f"- {r.layer} T={r.m} {r.variant}: {r.note}" for r in failed]
    return "\n".join(lines) + "\n"


def write_chart(path: Path, measurements: list[Measurement]) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        return False
    rows: dict[tuple, dict[str, float]] = {}
    for r in measurements:
        if r.ms is not None:
            rows.setdefault((r.layer, r.m), {})[r.variant] = r.ms
    labels = [f"{layer}\nT={m}" for layer, m in rows]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.45 * len(labels) + 2), 4.5))
    for i, base in enumerate(("grouped", "loop")):
        vals = [v[base] / v["ours"] if "ours" in v and base in v else 0.0 for v in rows.values()]
        ax.bar([j + (i - 0.5) * 0.4 for j in range(len(labels))], vals, width=0.4, label=f"ours over {base}")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, rotation=90, fontsize=6)
    ax.set_ylabel("speedup")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def write_report(out_dir: Path, tag: str, measurements: list[Measurement], meta: dict) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / f"{tag}_moe_{time.strftime('%Y%m%d-%H%M%S')}"
    doc = {"schema": SCHEMA, "meta": {**meta, "op": "moe", "tag": tag},
           "measurements": [dataclasses.asdict(r) for r in measurements]}
    stem.with_suffix(".json").write_text(json.dumps(doc, indent=1, default=lambda o: None) + "\n")
    stem.with_suffix(".md").write_text(markdown(measurements, meta))
    paths = [stem.with_suffix(".json"), stem.with_suffix(".md")]
    if write_chart(stem.with_suffix(".png"), measurements):
        paths.append(stem.with_suffix(".png"))
    return paths
