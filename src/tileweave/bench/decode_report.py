"""The decode benchmark's markdown report (``tileweave.bench.decode``): one row per section, shape, M
and dtype, a column per variant's time, the baselines' times over tileweave's."""

from __future__ import annotations

VARIANTS = ("tileweave", "nccl", "symm_one_shot", "symm_two_shot", "torch")
"""The variants in the report's column order."""


def markdown(records: list[dict], meta: dict) -> str:
    """The report of ``records`` (``tileweave.bench.decode.run_case``'s) with ``meta``'s header: a baseline
    that did not run shows ``n/a``, a failed check ``FAILED``."""
    by_key: dict[tuple, dict[str, dict]] = {}
    for r in records:
        by_key.setdefault((r["section"], r["name"], r["m"], r.get("dtype", meta["dtype"])), {})[r["variant"]] = r
    present = [v for v in VARIANTS if any(v in row for row in by_key.values())]
    smoke = "smoke" in meta["timed"]
    # A smoke run's times are the interpreter's on emulated ranks: no ratios, which would read as speeds.
    baselines = [] if smoke else [v for v in present if v != "tileweave"]
    lines = [f"# Decode: row-parallel GEMM + all-reduce + residual + RMSNorm, TP={meta['world_size']}", "",
             f"{meta['gpu_name']}, torch {meta['torch']}, triton {meta['triton']}, {meta['dtype']}, commit "
             f"{meta['git_commit'][:12]}, {meta['date']}. Times in ms ({meta['timed']}), max over ranks; "
             + ("Smoke run: emulated CPU ranks and Triton's interpreter, outputs checked; the times mean nothing "
                "about speed, so no ratios are shown." if smoke else
                "x: baseline time / tileweave time (> 1: tileweave faster)."), ""]
    header = ["section", "shape", "M", "dtype", *present, *(f"x {b}" for b in baselines), "tileweave path"]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]

    def cell(r):
        if r is None:
            return "-"
        if r.get("unsupported"):
            return "n/a" if r["variant"] != "tileweave" else "FAILED (raised)"
        return f"{r['ms']:.4f}" if r.get("ms") is not None else f"FAILED (err {r['err']:.2e})"

    for (section, name, m, dtype), row in by_key.items():
        ours = row.get("tileweave", {}).get("ms")
        ratios = []
        for b in baselines:
            t = row.get(b, {}).get("ms")
            ratios.append(f"{t / ours:.2f}" if t and ours else "-")
        path = row.get("tileweave", {}).get("path") or "-"
        lines.append("| " + " | ".join([section, name, str(m), dtype, *(cell(row.get(v)) for v in present), *ratios,
                                        path])
                     + " |")
    return "\n".join(lines) + "\n"
