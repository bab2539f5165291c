"""The MoE section's report (``tileweave.bench.moe_report``): the markdown's ratios and smoke header,
the chart's two panels, no chart for smoke runs; the FP8 rows' speedup over the bf16 row."""

import dataclasses

import pytest

from tileweave.bench.moe_report import markdown, write_chart, write_report
from tileweave.bench.report import Measurement

META = {"world_size": 1, "gpu_name": "NVIDIA H200", "date": "2026-12-02", "git_commit": "abcdef0123",
        "timing": {"smoke": False}}


def _m(layer: str, variant: str, ms: float | None, status: str = "ok") -> Measurement:
    return Measurement(op="moe", layer=layer, world_size=1, m=4096, n=768, k=2048, variant=variant,
                       status=status, ms=ms, rel_err=1e-3 if ms is not None else None)


ROWS = [_m("qwen3 layer uniform", "ours", 2.0), _m("qwen3 layer uniform", "grouped", 3.0),
        _m("qwen3 layer uniform", "loop", 8.0), _m("qwen3 layer uniform", "floor", 1.5),
        _m("qwen3 route uniform", "ours", 0.4), _m("qwen3 route uniform", "grouped", 0.5),
        _m("qwen3 layer-bwd uniform", "ours", None, "FAILED"), _m("qwen3 layer-bwd uniform", "grouped", 9.0)]


def _line(text: str, row: str) -> list[str]:
    (line,) = [x for x in text.splitlines() if x.startswith(f"| {row} |")]
    return [c.strip() for c in line.strip("|").split("|")]


def test_markdown_shows_speedups_and_floor_share():
    text = markdown(ROWS, META)
    assert "mean nothing" not in text
    # row, T, ours, grouped, loop, floor, x grouped, x loop, floor/ours, err, mem
    assert _line(text, "qwen3 layer uniform")[2:9] == ["2.000", "3.000", "8.000", "1.500", "1.50", "4.00", "0.75"]
    assert _line(text, "qwen3 route uniform")[4:9] == ["-", "-", "1.25", "-", "-"]
    assert _line(text, "qwen3 layer-bwd uniform")[2:9] == ["FAILED", "9.000", "-", "-", "-", "-", "-"]


def test_smoke_markdown_says_times_mean_nothing_and_shows_no_ratio():
    text = markdown(ROWS, {**META, "timing": {"smoke": True}})
    assert "the times mean nothing" in text.splitlines()[0]
    assert _line(text, "qwen3 layer uniform")[2:9] == ["2.000", "3.000", "8.000", "1.500", "-", "-", "-"]


def test_chart_and_report_files(tmp_path):
    pytest.importorskip("matplotlib")
    assert write_chart(tmp_path / "c.png", ROWS, title="t")
    assert (tmp_path / "c.png").stat().st_size > 0
    names = sorted(p.suffix for p in write_report(tmp_path / "a", "x", ROWS, META))
    assert names == [".json", ".md", ".png"]
    smoke = sorted(p.suffix for p in write_report(tmp_path / "b", "x", ROWS, {**META, "timing": {"smoke": True}}))
    assert smoke == [".json", ".md"]


def test_fp8_rows_show_their_speedup_over_the_bf16_row():
    fp8 = [dataclasses.replace(_m(layer, variant, ms), dtype=dtype) for layer, variant, ms, dtype in (
        ("qwen3 layer uniform", "ours", 1.6, "fp8-rowwise"), ("qwen3 layer uniform", "ours", 2.5, "fp8-blockwise"),
        ("qwen3 layer-bwd uniform", "ours", 4.0, "fp8-rowwise"), ("qwen3 layer0 uniform", "ours", 1.0, "fp8-rowwise"),
        ("qwen3 layer0 uniform", "torch", 1.5, "fp8-rowwise"))]
    text = markdown(ROWS + fp8, META)
    # row, T, ours, torch, x torch, x bf16, err, mem
    assert _line(text, "qwen3 layer uniform fp8-rowwise")[2:6] == ["1.600", "-", "-", "1.25"]
    assert _line(text, "qwen3 layer uniform fp8-blockwise")[2:6] == ["2.500", "-", "-", "0.80"]
    assert _line(text, "qwen3 layer-bwd uniform fp8-rowwise")[5] == "-"  # the bf16 row failed
    assert _line(text, "qwen3 layer0 uniform fp8-rowwise")[2:6] == ["1.000", "1.500", "1.50", "-"]  # no bf16 row
    smoke = markdown(ROWS + fp8, {**META, "timing": {"smoke": True}})
    assert _line(smoke, "qwen3 layer uniform fp8-rowwise")[2:6] == ["1.600", "-", "-", "-"]
