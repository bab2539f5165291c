"""The decode benchmark's smoke run on two emulated CPU ranks: every variant checked against the
fp32 reference, JSON and markdown written; its options and report."""

import json

import pytest
import torch

from tileweave.bench import decode, decode_report
from tileweave.bench.fp8 import m_major
from tileweave.testing.emulated import run_ranks

from support.scenarios import decode_bench as scenarios


def test_decode_bench_smoke(tmp_path, capsys):
    assert decode.main(["--out", str(tmp_path), "--smoke"]) == 0
    report = json.loads((tmp_path / "decode.json").read_text())
    records = report["results"]
    cases = {(r["section"], r["name"], r["m"]) for r in records}
    assert {s for s, _, _ in cases} == {"gemm_ar", "layer"}
    assert {m for _, _, m in cases} == set(decode.SMOKE_M)
    # o, down, the layer step of each of two models of different widths
    assert len(cases) == 2 * 3 * len(decode.SMOKE_M)
    for case in cases:
        variants = {r["variant"]: r for r in records if (r["section"], r["name"], r["m"]) == case}
        assert set(variants) == {"tileweave", "nccl"}, case  # no symmetric-memory baselines on the CPU
        for r in variants.values():
            assert r["ok"] and r["err"] < decode.TOL[decode.torch.float32] and r["ms"] > 0, r
        assert variants["tileweave"]["path"] in {"oneshot", "twoshot", "fallback"}, variants
    md = (tmp_path / "decode.md").read_text()
    # Interpreter times on emulated ranks: the report says they mean nothing and shows no ratios.
    assert "| section | shape | M | dtype | tileweave | nccl | tileweave path |" in md, md
    assert {r["dtype"] for r in records} == {"fp32"}
    assert "the times mean nothing" in md and "x nccl" not in md, md
    assert report["meta"]["world_size"] == 2 and report["meta"]["timed"].startswith("eager")


def test_decode_bench_fp8_smoke(tmp_path, capsys):
    # --dtype fp8: the model dtype's rows and beside them the float8 ones, each verified before timed
    assert decode.main(["--out", str(tmp_path), "--smoke", "--sections", "gemm_ar", "--dtype", "fp8",
                        "--scaling", "blockwise"]) == 0
    records = json.loads((tmp_path / "decode.json").read_text())["results"]
    assert {r["dtype"] for r in records} == {"fp32", "fp8-blockwise"}
    fp8 = [r for r in records if r["dtype"] == "fp8-blockwise"]
    assert {(r["name"], r["m"]) for r in fp8} == {(f"tiny-fp8 {n}", m) for n in ("o", "down") for m in decode.SMOKE_M}
    # torch's scaled matmuls do not run on emulated CPU ranks: tileweave's rows only, each checked
    assert {r["variant"] for r in fp8} == {"tileweave"}
    for r in fp8:
        assert r["ok"] and r["err"] < decode.TOL[decode.torch.float32] and r["path"] in {"oneshot", "twoshot"}, r
    md = (tmp_path / "decode.md").read_text()
    assert "| gemm_ar | tiny-fp8 o | 1 | fp8-blockwise |" in md, md


def test_smoke_runs_write_outside_the_checkout_by_default(capsys):
    # Without --out a smoke run writes to a fresh temporary folder (never bench/results), and says where.
    opts = decode.parse_args(["--smoke"])
    assert "bench/results" not in str(opts.out) and opts.out.is_dir() and not any(opts.out.iterdir())
    assert str(opts.out) in capsys.readouterr().err
    assert str(decode.parse_args([]).out) == "bench/results"


def test_decode_bench_options():
    with pytest.raises(SystemExit):
        decode.parse_args(["--out", "x", "--iters", "5"])  # fewer than the method's 20 replays
    with pytest.raises(SystemExit):
        decode.parse_args(["--out", "x", "--models", "llama3-9b"])
    opts = decode.parse_args(["--out", "x", "--models", "llama3-70b", "--m", "1,64", "--sections", "gemm_ar"])
    assert opts.models == ("llama3-70b",) and opts.m_values == (1, 64) and opts.sections == ("gemm_ar",)
    assert decode.parse_args(["--out", "x"]).m_values == (1, 8, 32, 64, 128, 256, 512)
    opts = decode.parse_args(["--out", "x", "--dtype", "fp8"])
    assert opts.dtype == "bfloat16" and opts.scalings == ("rowwise", "blockwise")  # bf16 rows beside the FP8 ones
    with pytest.raises(SystemExit):
        decode.parse_args(["--out", "x", "--dtype", "fp8", "--scaling", "tensorwise"])


def test_decode_report_marks_failed_checks_and_ratios():
    base = {"section": "gemm_ar", "name": "llama3-8b o", "m": 8, "dtype": "bf16", "path": None}
    records = [{**base, "variant": "tileweave", "ms": 0.010, "err": 1e-3, "path": "oneshot"},
               {**base, "variant": "nccl", "ms": 0.025, "err": 1e-3},
               {**base, "variant": "symm_one_shot", "ms": None, "err": 0.5}]
    meta = {"world_size": 2, "gpu_name": "g", "torch": "t", "triton": "tr", "dtype": "bfloat16",
            "git_commit": "abc", "date": "d", "timed": "CUDA graph replays"}
    md = decode_report.markdown(records, meta)
    row = [line for line in md.splitlines() if line.startswith("| gemm_ar")][0]
    assert "| bf16 | 0.0100 | 0.0250 | FAILED (err 5.00e-01) | 2.50 | - | oneshot |" in row, row


@pytest.mark.parametrize("m", [1, 5])
def test_blockwise_activation_scales_go_to_torch_m_major(m):
    # torch's blockwise scaled matmul wants 1 x 128 scales [M, K/128] with strides (1, M), one row too
    # (a decode step's): the values kept.
    scale = torch.rand(m, 32)
    got = m_major(scale)
    assert got.stride() == (1, m) and torch.equal(got, scale)


def test_a_baseline_that_refuses_a_shape_is_recorded_not_run_on_every_rank():
    # torch's blockwise scaled matmul refuses some decode shapes (cuBLAS: not supported): that row is
    # recorded as not run with the error, on every rank alike, and the section goes on; a baseline that
    # runs is checked; tileweave raising is a failed check.
    for records in run_ranks(2, scenarios.refused_baseline_check):
        by = {r["variant"]: r for r in records}
        assert "CUBLAS_STATUS_NOT_SUPPORTED" in by["torch"]["unsupported"] and by["torch"]["ok"], by["torch"]
        assert by["torch"]["ms"] is None and by["torch"]["err"] is None, by["torch"]
        assert by["nccl"]["ok"] and by["nccl"]["err"] < 1e-6 and "unsupported" not in by["nccl"], by["nccl"]
        assert not by["tileweave"]["ok"] and by["tileweave"]["unsupported"], by["tileweave"]
    meta = {"world_size": 2, "gpu_name": "cpu", "torch": "-", "triton": "-", "dtype": "bfloat16", "git_commit": "0" * 12,
            "date": "-", "timed": "CUDA graph replays"}
    text = decode_report.markdown(records, meta)
    assert "| n/a |" in text and "FAILED (raised)" in text, text
