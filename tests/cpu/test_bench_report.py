"""Derived numbers and the report files, on synthetic measurements."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from tileweave.bench import metadata, report
from tileweave.bench.report import (
    Measurement,
    geomean,
    ideal_time,
    load_report,
    markdown,
    overlap_efficiency,
    speedup,
    summarize,
    write_report,
)

META = {"world_size": 2, "gpu_name": "NVIDIA H200", "date": "2026-01-01T00:00:00", "git_commit": "abc"}


def rows_for(layer: str, m: int, times: dict[str, float | None], *, status: dict[str, str] | None = None,
             op: str = "ag", clock: float | None = 1500.0) -> list[Measurement]:
    status = status or {}
    out = []
    for variant, ms in times.items():
        st = status.get(variant, "ok" if ms is not None else "n/a")
        out.append(Measurement(
            op=op, layer=layer, world_size=2 if op != "gemm" else 1, m=m, k=4096, n=6144, variant=variant,
            status=st, ms=ms if st == "ok" else None, rel_err=0.004 if st == "ok" else None,
            warmup_calls=100, clock_mhz=clock, mem_peak_mb=10.0, mem_other_mb=0.0,
            path="fused" if variant == "ours" else None,
        ))
    return out


def test_formulas_from_their_definitions():
    t_gemm, t_comm, t_base, t_ours = 0.8, 0.3, 1.1, 0.9
    exposed_base = t_base - t_gemm  # communication NCCL-then-cuBLAS leaves exposed
    exposed_ours = t_ours - t_gemm
    assert overlap_efficiency(t_fused=t_ours, t_gemm=t_gemm, t_base=t_base) == pytest.approx(
        (exposed_base - exposed_ours) / exposed_base)
    # Perfect overlap hides everything; no overlap hides nothing.
    assert overlap_efficiency(t_fused=t_gemm, t_gemm=t_gemm, t_base=t_base) == pytest.approx(1.0)
    assert overlap_efficiency(t_fused=t_base, t_gemm=t_gemm, t_base=t_base) == pytest.approx(0.0)
    assert overlap_efficiency(t_fused=t_base + exposed_base, t_gemm=t_gemm, t_base=t_base) == pytest.approx(-1.0)
    # Undefined when the baseline exposes no communication, or a time is missing.
    assert overlap_efficiency(t_fused=t_ours, t_gemm=t_base, t_base=t_base) is None
    assert overlap_efficiency(t_fused=None, t_gemm=t_gemm, t_base=t_base) is None
    assert ideal_time(t_gemm, t_comm) == max(t_gemm, t_comm)
    assert ideal_time(t_gemm, None) is None
    assert speedup(t_base, t_ours) * t_ours == pytest.approx(t_base)
    assert speedup(None, t_ours) is None and speedup(t_base, 0.0) is None
    values = [1.5, 0.5, 2.0]
    assert geomean(values) == pytest.approx(math.prod(values) ** (1 / len(values)))
    assert geomean([None, 2.0]) == pytest.approx(2.0) and geomean([]) is None


def test_summary_derives_every_number():
    t = {"gemm": 0.8, "comm": 0.3, "base": 1.1, "torch": 1.0, "ours": 0.9}
    (s,) = summarize(rows_for("llama3-8b qkv", 8192, t))
    assert s.ideal == pytest.approx(max(t["gemm"], t["comm"]))
    assert s.x_base == pytest.approx(t["base"] / t["ours"])
    assert s.x_torch == pytest.approx(t["torch"] / t["ours"])
    assert s.x_base_torch == pytest.approx(t["base"] / t["torch"])
    assert s.e == pytest.approx(1 - (t["ours"] - t["gemm"]) / (t["base"] - t["gemm"]))
    assert s.e_torch == pytest.approx(1 - (t["torch"] - t["gemm"]) / (t["base"] - t["gemm"]))
    assert s.eff == pytest.approx(max(t["gemm"], t["comm"]) / t["ours"])
    assert s.path == "fused"


def test_failed_and_missing_variants_leave_holes_not_numbers():
    t = {"gemm": 0.8, "comm": 0.3, "base": 1.1, "torch": 1.0, "ours": 0.7}
    (s,) = summarize(rows_for("llama3-8b qkv", 8192, t, status={"ours": "FAILED", "torch": "n/a"}))
    assert s.times["ours"] is None and s.status["ours"] == "FAILED"
    assert s.x_base is None and s.e is None and s.eff is None and s.x_torch is None
    assert s.e_torch is None and s.ideal == pytest.approx(0.8)


def synthetic() -> list[Measurement]:
    rows = []
    for layer, m, ours in [("llama3-8b qkv", 2048, 0.40), ("llama3-8b qkv", 8192, 0.95),
                           ("llama3-70b qkv", 16384, 2.1)]:
        rows += rows_for(layer, m, {"gemm": ours * 0.9, "comm": ours * 0.3, "nccl": ours * 0.4, "base": ours * 1.2,
                                    "torch": ours * 1.1, "ours": ours})
    rows += rows_for("llama3-70b qkv", 4096, {"gemm": 0.5, "comm": 0.2, "base": 0.7, "torch": 0.6, "ours": None},
                     status={"ours": "FAILED"})
    return rows


def test_markdown_is_the_wide_view():
    rows = synthetic()
    text = markdown("ag", rows, META)
    header = ("| layer | M | K | N | t_gemm | t_comm | t_nccl | ideal | t_base | t_torch | t_ours | x_base "
              "| x_torch | E | eff | path |")
    assert header in text
    assert "| llama3-8b qkv | 8192 | 4096 | 6144 | 0.855 | 0.285 | 0.380 | 0.855 | 1.140 | 1.045 | 0.950 | 1.20 " in text
    # A row without the NCCL-alone variant (older results) shows a hole there.
    assert "| llama3-70b qkv | 4096 | 4096 | 6144 | 0.500 | 0.200 | n/a | 0.500 |" in text
    assert "FAILED" in text
    assert "Peak GPU memory" in text


def test_markdown_summary_lines_from_the_raw_times():
    # Rows whose ratios differ, the expectations written from the times by the definitions
    # (x_base = t_base / t_ours; E = 1 - (t_ours - t_gemm) / (t_base - t_gemm), median over M >= 4096).
    rows = (rows_for("llama3-8b qkv", 2048, {"gemm": 0.5, "comm": 0.2, "base": 1.0, "torch": 0.9, "ours": 0.8})
            + rows_for("llama3-8b qkv", 8192, {"gemm": 1.0, "comm": 0.4, "base": 2.0, "torch": 1.8, "ours": 1.25})
            + rows_for("llama3-70b qkv", 16384, {"gemm": 2.0, "comm": 1.0, "base": 3.0, "torch": 2.9, "ours": 2.15})
            + rows_for("llama3-70b qkv", 4096, {"gemm": 0.5, "comm": 0.2, "base": 0.7, "ours": None},
                       status={"ours": "FAILED"}))
    text = markdown("ag", rows, META)
    assert "geomean x_base 1.408 " in text  # (1.0/0.8 * 2.0/1.25 * 3.0/2.15) ** (1/3) = 1.4079
    # median(0.75, 0.85) over the rows with M >= 4096: the failed row is counted but has no E
    assert "median over M>=4096 (3 rows): E 0.80," in text


def test_gemm_markdown_has_tflops_and_ratio():
    rows = rows_for("llama3-8b qkv AG tp2", 4096, {"cublas": 0.2, "ours": 0.25}, op="gemm")
    text = markdown("gemm", rows, META)
    (s,) = summarize(rows)
    assert s.x_cublas == pytest.approx(0.2 / 0.25)
    assert s.tflops_ours == pytest.approx(2 * 4096 * 6144 * 4096 / 0.25e-3 / 1e12)
    assert f"{s.tflops_cublas:.0f}" in text and "x_cublas" in text and "0.80" in text


def test_report_round_trip(tmp_path):
    rows = synthetic()
    rows.append(Measurement(op="ag", layer="gpt3-175b fc1", world_size=2, m=1024, k=12288, n=49152,
                            variant="ours", status="FAILED", rel_err=math.inf, note="non-finite output"))
    files = write_report(out_dir=tmp_path / "res", tag="t1", op="ag", date="20260101-000000",
                         meta=META, measurements=rows)
    assert files.json.name == "t1_ag_20260101-000000.json"
    assert files.md.read_text() == markdown("ag", rows, json.loads(files.json.read_text())["meta"])
    meta, back = load_report(files.json)
    # JSON has no inf: the failed row's error comes back as None, everything else unchanged.
    assert back[:-1] == rows[:-1]
    assert back[-1].rel_err is None and back[-1].status == "FAILED"
    assert meta["sm_clock_mhz"] == {"min": 1500.0, "median": 1500.0, "max": 1500.0}
    doc = json.loads(files.json.read_text())
    assert len(doc["shapes"]) == len({r.shape_key for r in rows})


def test_chart_is_optional(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    files = write_report(out_dir=tmp_path, tag="c", op="ag", date="d", meta=META, measurements=synthetic())
    assert files.png is not None and files.png.stat().st_size > 0
    monkeypatch.setattr(report, "write_chart", lambda *a, **k: False)
    files = write_report(out_dir=tmp_path, tag="c2", op="ag", date="d", meta=META, measurements=synthetic())
    assert files.png is None and files.json.exists()


def test_metadata_without_cuda():
    meta = metadata.collect_metadata(world_size=2, timing={"iters": 20}, argv=["--quick"])
    for key in ("gpu_name", "torch", "triton", "numpy", "python", "cuda", "git_commit", "hostname", "date"):
        assert key in meta
    assert meta["timing"] == {"iters": 20}


def test_commit_given_in_the_environment_wins_over_git(monkeypatch):
    monkeypatch.setattr(metadata, "_run", lambda cmd, cwd: "0123abc" if "rev-parse" in cmd else "")
    monkeypatch.setenv(metadata.COMMIT_ENV, "feedf00d")
    meta = metadata.collect_metadata(world_size=2, timing={}, argv=[])
    assert (meta["git_commit"], meta["git_commit_source"]) == ("feedf00d", "env")
    monkeypatch.delenv(metadata.COMMIT_ENV)
    meta = metadata.collect_metadata(world_size=2, timing={}, argv=[])
    assert (meta["git_commit"], meta["git_commit_source"], meta["git_dirty"]) == ("0123abc", "git", False)


def test_commit_can_be_given_when_git_is_absent(monkeypatch):
    monkeypatch.setattr(metadata, "_run", lambda cmd, cwd: None)
    monkeypatch.setenv(metadata.COMMIT_ENV, "deadbeef")
    meta = metadata.collect_metadata(world_size=2, timing={}, argv=[])
    assert (meta["git_commit"], meta["git_commit_source"], meta["git_dirty"]) == ("deadbeef", "env", None)


def test_block_section_summary_and_table():
    import random

    rng = random.Random(11)
    rows, expect = [], []
    for m in (4096, 8192, 16384):
        floor = rng.uniform(20, 80) * m / 4096
        t = {"floor": floor, "base": floor * rng.uniform(1.05, 1.3), "torch": floor * rng.uniform(1.02, 1.3),
             "ours": floor * rng.uniform(1.0, 1.2)}
        rows += rows_for("llama3-8b block", m, t, op="block")
        expect.append((m, t))
    summaries = summarize(rows)
    assert [s.m for s in summaries] == [4096, 8192, 16384]
    for s, (m, t) in zip(summaries, expect):
        assert s.x_base == pytest.approx(t["base"] / t["ours"])
        assert s.x_torch == pytest.approx(t["torch"] / t["ours"])
        assert s.over_floor == pytest.approx(t["ours"] / t["floor"])
        assert s.tokens_per_s == pytest.approx(m / (t["ours"] / 1e3))
    text = markdown("block", rows, META)
    assert "| block | dtype | M | hidden | ffn | t_floor | t_base | t_torch | t_ours |" in text
    beats = sum(t["ours"] < min(t["base"], t["torch"]) for _, t in expect)
    assert f"ours faster than both NCCL and async-TP on {beats} of 3 bf16 rows" in text
    worst = max(t["ours"] / t["floor"] for m, t in expect if m >= 8192)
    assert f"worst ours/floor over M>=8192 (2 rows): {worst:.3f}" in text
    assert "FP8 rows" not in text and all(s.x_bf16 is None for s in summaries)


def test_block_fp8_rows_sit_beside_the_bf16_rows_with_their_ratio():
    # Each FP8 row (dtype fp8-<scaling>) reports its time against the bf16 ours of the same block and M;
    # the bf16 summary lines leave the FP8 rows out.
    rows = []
    for m, bf16, fp8 in ((8192, 30.0, 20.0), (16384, 60.0, 37.5)):
        rows += rows_for("llama3-70b block", m, {"floor": bf16 * 0.95, "base": bf16 * 1.1, "torch": bf16 * 1.05,
                                                 "ours": bf16}, op="block")
        for label, factor in (("fp8-rowwise", 1.0), ("fp8-blockwise", 1.2)):
            rows += [dataclasses.replace(r, dtype=label) for r in
                     rows_for("llama3-70b block", m, {"torch": fp8 * factor * 1.1, "ours": fp8 * factor}, op="block")]
    summaries = summarize(rows)
    assert [(s.m, s.dtype) for s in summaries] == [(m, d) for m in (8192, 16384)
                                                   for d in ("bf16", "fp8-rowwise", "fp8-blockwise")]
    by = {(s.m, s.dtype): s for s in summaries}
    assert by[8192, "fp8-rowwise"].x_bf16 == pytest.approx(1.5)
    assert by[16384, "fp8-blockwise"].x_bf16 == pytest.approx(60.0 / 45.0)
    assert by[8192, "fp8-rowwise"].x_torch == pytest.approx(1.1) and by[8192, "bf16"].x_bf16 is None
    text = markdown("block", rows, META)
    assert "| llama3-70b block | fp8-rowwise | 8192 |" in text
    assert "ours faster than both NCCL and async-TP on 2 of 2 bf16 rows" in text
    assert "fp8-rowwise: geomean x_bf16 1.549 (over 2 rows), x_torch 1.100 (over 2 rows)" in text
    assert "fp8-blockwise: geomean x_bf16 1.291 (over 2 rows)" in text


def test_a_transport_section_reads_like_its_op():
    rows = rows_for("llama3-8b o", 4096, {"gemm": 0.10, "comm": 0.05, "base": 0.19, "torch": 0.27, "ours": 0.12},
                    op="rs-chunked")
    text = markdown("rs-chunked", rows, META)
    assert text.startswith("## tileweave bench: rs-chunked")
    assert "| layer | M | K | N | t_gemm | t_comm | t_nccl | ideal | t_base | t_torch | t_ours |" in text
    (s,) = summarize(rows)
    assert s.x_base == pytest.approx(0.19 / 0.12) and s.e == pytest.approx(1 - (0.12 - 0.10) / (0.19 - 0.10))


def test_host_bound_variants_are_named_per_row():
    import random

    rng = random.Random()
    rows = rows_for("llama3-8b o", 1024, {"gemm": 0.03, "comm": 0.03, "base": 0.06, "torch": 0.2, "ours": 0.14},
                    op="rs") + rows_for("llama3-70b o", 8192, {"gemm": 0.8, "comm": 0.2, "base": 1.0, "torch": 0.9,
                                                               "ours": 0.9}, op="rs")
    paced = {("llama3-8b o", "ours"), ("llama3-8b o", "torch")}
    # Random host times on either side of the threshold, by construction.
    timed = [dataclasses.replace(r, host_ms=r.ms * (rng.uniform(report.HOST_BOUND, 1.2) if (r.layer, r.variant) in paced
                                                    else rng.uniform(0.0, report.HOST_BOUND - 0.01))) for r in rows]
    text = markdown("rs", timed, META)
    assert "- ours: llama3-8b o M=1024\n" in text and "- torch: llama3-8b o M=1024\n" in text
    assert "base:" not in text and "llama3-70b o M=8192" not in text.split("Host-bound")[1].split("Peak")[0]
    assert "Host-bound" not in markdown("rs", rows, META)  # not measured (older results): no section


def _block_rows(variants, m=8192):
    import random

    rng = random.Random()
    return [dataclasses.replace(r, ms=rng.uniform(5.0, 40.0))
            for r in rows_for("llama3-8b block", m, {v: 1.0 for v in variants}, op="block")]


def test_reports_of_one_section_merge_into_one(tmp_path):
    # The block's variants timed each in its own process: the merged report is the report of all rows.
    from tileweave.bench.report import merge_reports

    parts = {"torch": _block_rows(["torch"]) + _block_rows(["torch"], m=16384),
             "ours": _block_rows(["ours"]) + _block_rows(["ours"], m=16384),
             "floor": _block_rows(["floor", "base"]) + _block_rows(["floor", "base"], m=16384)}
    paths = []
    for name, rows in parts.items():
        files = write_report(out_dir=tmp_path, tag=f"block-{name}", op="block", date="d", meta=META, measurements=rows)
        paths.append(files.json)
    op, meta, merged = merge_reports(paths)
    assert op == "block" and meta["merged_from"] == [p.name for p in paths]
    every = [r for rows in parts.values() for r in rows]
    assert sorted((r.m, r.variant, r.ms) for r in merged) == sorted((r.m, r.variant, r.ms) for r in every)
    # Rows in the first report's order, variants in the report's order within a row.
    assert [(r.m, r.variant) for r in merged] == [(m, v) for m in (8192, 16384) for v in ("floor", "base", "torch", "ours")]
    text = write_report(out_dir=tmp_path, tag="block", op=op, date="d", meta=meta, measurements=merged).md.read_text()
    (s8,) = [s for s in summarize(merged) if s.m == 8192]
    by = {r.variant: r.ms for r in merged if r.m == 8192}
    assert s8.x_torch == pytest.approx(by["torch"] / by["ours"]) and s8.over_floor == pytest.approx(by["ours"] / by["floor"])
    assert "llama3-8b block | 8192" in text and "Merged from 3 reports" in text


def test_merging_refuses_duplicates_and_mixed_commits(tmp_path):
    from tileweave.bench.report import merge_reports

    a = write_report(out_dir=tmp_path, tag="a", op="block", date="d", meta=META, measurements=_block_rows(["ours"])).json
    b = write_report(out_dir=tmp_path, tag="b", op="block", date="d", meta=META, measurements=_block_rows(["ours"])).json
    with pytest.raises(ValueError, match="'ours' of llama3-8b block M=8192 is already"):
        merge_reports([a, b])
    c = write_report(out_dir=tmp_path, tag="c", op="block", date="d", meta={**META, "git_commit": "def"},
                     measurements=_block_rows(["torch"])).json
    with pytest.raises(ValueError, match="git_commit"):
        merge_reports([a, c])
    d = write_report(out_dir=tmp_path, tag="d", op="ag", date="d", meta=META, measurements=rows_for("x", 1024, {"ours": 1.0})).json
    with pytest.raises(ValueError, match="op"):
        merge_reports([a, d])


def test_ag_fp8_rows_stand_beside_the_bf16_rows_with_their_own_geomeans():
    bf16 = rows_for("l1", 4096, {"gemm": 1.0, "comm": 0.5, "nccl": 0.6, "base": 1.6, "torch": 1.5, "ours": 1.2})
    fp8 = [dataclasses.replace(r, dtype="fp8-rowwise") for r in
           rows_for("l1", 4096, {"base": 1.0, "torch": 0.9, "ours": 0.8})]
    fp8 += [dataclasses.replace(r, dtype="fp8-rowwise") for r in
            rows_for("l2", 8192, {"base": 2.0, "torch": None, "ours": 1.0})]
    text = markdown("ag", bf16 + fp8, META)
    assert "| l1 fp8-rowwise | 4096 |" in text and "| l1 | 4096 |" in text
    assert f"geomean x_base {1.6 / 1.2:.3f} (over 1 rows), x_torch {1.5 / 1.2:.3f} (over 1 rows) (bf16)" in text
    x_base = math.sqrt((1.0 / 0.8) * (2.0 / 1.0))
    assert f"geomean x_base {x_base:.3f} (over 2 rows), x_torch {0.9 / 0.8:.3f} (over 1 rows) (fp8-rowwise)" in text
