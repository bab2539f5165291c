"""``python -m tileweave.bench.moe --smoke``: every part and variant of the MoE section runs on two
emulated ranks, each checked against the float32 computation, and the report files are written; the FP8
rows, and the check of the FP8 layer rows against a perturbed result."""

import json
import math

import pytest
import torch

from tileweave.bench import moe, moe_fp8


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


def test_bench_moe_fp8_layer_rows_are_verified_against_the_unquantized_layer(tmp_path):
    # --dtype fp8 --parts layer-bwd: TPMoE(fp8=recipe) beside the bf16 (here fp32) layer, ours only, checked
    # (output and gradients) against float64 of the unquantized layer before it is timed. One scaling (about
    # 13 s of interpreter per scaling): the rows' code does not depend on it (moe_fp8.rows), the layer's
    # recipes are tested in test_tp_moe_fp8.py, and the forward-only part takes the same rows' code.
    assert moe.main(["--smoke", "--dtype", "fp8", "--scaling", "blockwise", "--parts", "layer-bwd", "--routing",
                     "uniform", "--variants", "ours", "--out", str(tmp_path), "--tag", "f"]) == 0
    (report,) = tmp_path.glob("f_moe_*.json")
    rows = json.loads(report.read_text())["measurements"]
    assert sorted((r["layer"], r["dtype"]) for r in rows) == sorted(
        ("smoke-fp8 layer-bwd uniform", dtype) for dtype in ("bf16", "fp8-blockwise"))
    for r in rows:
        assert r["status"] == "ok" and r["variant"] == "ours", r
        if r["dtype"] == "bf16":
            assert r["rel_err"] < moe.TOLERANCE[torch.float32], r
        else:  # float8 ran: a few percent off the unquantized layer, within the bounds
            assert 0.03 < r["rel_err"] < moe_fp8.LAYER_GRAD_TOLERANCE, r
    text = (tmp_path / report.name.replace(".json", ".md")).read_text()
    assert "| smoke-fp8 layer-bwd uniform fp8-blockwise | 8 |" in text and "x bf16" in text


def _float8_like(ref: list[torch.Tensor], rel: tuple[float, ...], gen: torch.Generator) -> list[torch.Tensor]:
    """``ref`` plus noise of relative Frobenius norm ``rel`` per result (what float8 rounding adds)."""
    out = []
    for r, e in zip(ref, rel, strict=True):
        noise = torch.randn(r.shape, generator=gen, dtype=torch.float64)
        out.append(r + e * r.norm() / noise.norm() * noise)
    return out


def test_fp8_layer_check_passes_float8_noise_and_rejects_a_wrong_result():
    gen = torch.Generator().manual_seed(0)
    # a layer-bwd row's results on the smoke shapes: out, x.grad [T/W, H], w0.grad [E, 2*F_loc, H], w1.grad
    ref = [torch.randn(s, generator=gen, dtype=torch.float64) for s in ((4, 128), (4, 128), (4, 256, 128),
                                                                        (4, 128, 128))]
    good = _float8_like(ref, (0.07, 0.105, 0.105, 0.105), gen)  # above a correct FP8 layer's worst errors
    check = moe_fp8.layer_check(ref)
    err, why = check(good)
    assert why == "" and err == pytest.approx(0.105), (err, why)
    assert moe_fp8.layer_check(ref[:1])(good[:1]) == (pytest.approx(0.07), "")  # the forward's one result

    def swap(i: int, wrong: torch.Tensor) -> list[torch.Tensor]:
        return [wrong if j == i else g for j, g in enumerate(good)]

    scaled = check(swap(0, 1.1 * good[0]))  # within the Frobenius bound, caught by its gain
    assert scaled[0] < moe_fp8.LAYER_TOLERANCE and scaled[1].startswith("out gain 1.1"), scaled
    assert scaled[1].endswith("off 1 by more than 0.04"), scaled
    for i, name in enumerate(moe_fp8.LAYER_RESULTS[1:], 1):
        for factor in (1.25, 0.8):
            why = check(swap(i, factor * good[i]))[1]
            assert why.startswith(f"{name} gain ") and why.endswith("off 1 by more than 0.1"), (name, why)
    for i in (2, 3):  # the gradient of the next expert in each expert's place
        err, why = check(swap(i, good[i].roll(1, 0)))
        assert err > 4 * moe_fp8.LAYER_GRAD_TOLERANCE and why.startswith(f"{moe_fp8.LAYER_RESULTS[i]} rel_err"), why
    err, why = check(swap(1, good[1].clone().fill_(math.nan)))
    assert err == math.inf and why == "x.grad rel_err inf > 0.3", why
