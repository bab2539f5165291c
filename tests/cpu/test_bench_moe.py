"""``python -m tileweave.bench.moe --smoke``: every part and variant of the MoE section runs on two
emulated ranks, each checked against the float32 computation, and the report files are written."""

import json

import torch

from tileweave.bench import moe


def test_bench_moe_smoke_checks_every_variant(tmp_path, capsys):
    assert moe.main(["--smoke", "--out", str(tmp_path), "--tag", "t"]) == 0
    (report,) = tmp_path.glob("t_moe_*.json")
    rows = json.loads(report.read_text())["measurements"]
    seen = {(r["layer"], r["variant"]) for r in rows}
    expected = {(f"smoke {part} {routing}", variant) for part in moe.PARTS for routing in moe.ROUTINGS
                for variant in moe.part_variants(part)}
    assert seen == expected, seen ^ expected
    for r in rows:
        assert r["status"] == "ok", r
        assert r["rel_err"] is not None and r["rel_err"] < moe.TOLERANCE[torch.float32], r
    paths = {r["path"] for r in rows if r["variant"] == "ours" and r["path"]}
    assert paths == {"fused", "chunked"}, paths
    text = (tmp_path / report.name.replace(".json", ".md")).read_text()
    assert "| smoke layer-bwd zipf | 8 |" in text and "the times mean nothing" in text.splitlines()[0]
    assert "smoke layer0 uniform" in capsys.readouterr().out


def test_bench_moe_help_and_bad_tokens(capsys):
    try:
        moe.main(["--help"])
    except SystemExit as exc:
        assert exc.code == 0
    assert "--smoke" in capsys.readouterr().out
    assert moe.main(["--smoke", "--nproc", "3", "--out", "/nonexistent"]) == 2


def test_bench_moe_fp8_rows_name_their_scaling_and_are_verified(tmp_path):
    # --dtype fp8: layer0 and layer1 in FP8 beside the bf16 (here fp32) rows, each checked against float64
    # of the dequantized operands before it is timed; torch's _scaled_grouped_mm runs on GPUs only.
    assert moe.main(["--smoke", "--dtype", "fp8", "--scaling", "rowwise", "--parts", "layer0,layer1",
                     "--routing", "uniform", "--variants", "ours", "--out", str(tmp_path), "--tag", "f"]) == 0
    (report,) = tmp_path.glob("f_moe_*.json")
    rows = json.loads(report.read_text())["measurements"]
    assert sorted((r["layer"], r["dtype"]) for r in rows) == sorted(
        (f"smoke-fp8 {part} uniform", dtype) for part in ("layer0", "layer1") for dtype in ("bf16", "fp8-rowwise"))
    for r in rows:
        assert r["status"] == "ok" and r["variant"] == "ours", r
        assert r["rel_err"] < moe.TOLERANCE[torch.float32], r
    text = (tmp_path / report.name.replace(".json", ".md")).read_text()
    assert "| smoke-fp8 layer1 uniform fp8-rowwise | 8 |" in text
