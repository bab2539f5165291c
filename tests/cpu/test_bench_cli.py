"""``tileweave bench`` options, environment guard and the no-GPU exit."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tileweave.bench import cli
from tileweave.bench.suite import DEFAULT_OPS, QUICK_LAYERS, QUICK_M_VALUES


def test_defaults():
    o = cli.parse_args([])
    assert o.bench.ops == DEFAULT_OPS == ("gemm", "ag", "rs")
    assert o.bench.layers == () and o.bench.m_values == ()
    assert (o.bench.timing.warmup_s, o.bench.timing.iters, o.bench.timing.reps) == (0.5, 20, 5)
    assert o.bench.include_torch and o.world_size is None and o.tag is None
    assert str(o.out_dir) == "bench/results"
    assert not o.bench.ours_first


def test_every_option():
    o = cli.parse_args([
        "--op", "rs,ag", "--layer", "llama3-8b qkv", "llama3-70b", "--layer", "down", "--m", "2048,8192",
        "--world-size", "4", "--out", "/tmp/x", "--tag", "h200-tp4", "--warmup-s", "1.5", "--iters", "40",
        "--reps", "7", "--no-torch", "--ours-first",
    ])
    assert o.bench.ops == ("ag", "rs")
    assert o.bench.layers == ("llama3-8b qkv", "llama3-70b", "down")
    assert o.bench.m_values == (2048, 8192)
    assert o.world_size == 4 and o.tag == "h200-tp4" and str(o.out_dir) == "/tmp/x"
    assert (o.bench.timing.warmup_s, o.bench.timing.iters, o.bench.timing.reps) == (1.5, 40, 7)
    assert not o.bench.include_torch and o.bench.ours_first


def test_rows_time_ours_after_the_baselines_unless_asked():
    from tileweave.bench.runner import in_row_order

    for ours_first in (False, True):
        calls = []
        shared, ours = in_row_order(lambda: calls.append("baselines") or ["b"], lambda: calls.append("ours") or ["o"],
                                    ours_first=ours_first)
        assert (shared, ours) == (["b"], ["o"])  # the same results whatever the order
        assert calls == (["ours", "baselines"] if ours_first else ["baselines", "ours"])


def test_rounds_mirror_the_order_and_report_medians():
    import random

    from tileweave.bench.report import Measurement
    from tileweave.bench.runner import combine_rounds, ours_first_in_round

    assert cli.parse_args(["--rounds", "3"]).bench.rounds == 3 and cli.parse_args([]).bench.rounds == 1
    assert [ours_first_in_round(r, False) for r in range(4)] == [False, True, False, True]
    assert [ours_first_in_round(r, True) for r in range(3)] == [True, False, True]
    key = dict(op="ag", layer="l", world_size=2, m=1024, k=8, n=8, variant="ours")
    times = [random.uniform(0.1, 1.0) for _ in range(3)]
    rounds = [Measurement(**key, status="ok", ms=t, rel_err=1e-3 * i, warmup_calls=10, clock_mhz=1400.0 + i,
                          host_ms=t / 2, path="fused") for i, t in enumerate(times)]
    one = combine_rounds(rounds)
    assert one.ms == sorted(times)[1] and one.host_ms == sorted(times)[1] / 2 and one.clock_mhz == 1401.0
    assert one.rel_err == 2e-3 and one.warmup_calls == 30 and one.status == "ok" and one.path == "fused"
    assert all(f"{t:.4f}" in one.note for t in times)
    assert combine_rounds(rounds[:1]) is rounds[0]
    failed = Measurement(**key, status="FAILED", note="rel_err 1")
    assert combine_rounds([rounds[0], failed, rounds[1]]) is failed


def test_block_section_filters():
    o = cli.parse_args(["--op", "block,ag", "--layer", "llama3-70b", "--m", "8192,16384"])
    assert o.bench.ops == ("ag", "block")
    from tileweave.bench.block import select_block_rows

    rows = select_block_rows(layers=o.bench.layers, m_values=o.bench.m_values, world_size=2)
    assert [(r.model, r.m, r.batch) for r in rows] == [("llama3-70b", 8192, 2), ("llama3-70b", 16384, 4)]
    assert len(select_block_rows(layers=("block",), m_values=None, world_size=8)) == 6
    for bad in (["--op", "block", "--layer", "qkv"], ["--op", "block", "--m", "4097"]):
        with pytest.raises(SystemExit):
            cli.parse_args(bad)


def test_block_fp8_options_and_their_errors(capsys):
    o = cli.parse_args(["--op", "block", "--dtype", "fp8", "--scaling", "tensorwise,rowwise-fast,blockwise"])
    assert o.bench.ops == ("block",) and o.bench.scalings == ("tensorwise", "rowwise-fast", "blockwise")
    from tileweave.bench.block_fp8 import recipe_of

    # -fast: the backward GEMMs accumulate fast too; the presets' forward GEMM does already.
    fast, plain = recipe_of("rowwise-fast"), recipe_of("rowwise")
    assert fast.backward_fast_accum and fast.forward_fast_accum and not plain.backward_fast_accum
    assert recipe_of("blockwise").scaling == "blockwise"
    for argv, words in ((["--op", "block", "--scaling", "rowwise"], "--scaling rowwise applies to FP8 rows"),
                        (["--op", "block", "--dtype", "fp8", "--scaling", "rowwise,rowwise"], "distinct names"),
                        (["--op", "block", "--dtype", "fp8", "--scaling", "blockwise-fast"], "distinct names")):
        with pytest.raises(SystemExit):
            cli.parse_args(argv)
        assert words in capsys.readouterr().err, argv
    with pytest.raises(ValueError, match="runs the gemm, ag, rs and block sections"):
        cli.BenchConfig(ops=("block",), dtype="fp8")


def test_block_variants_one_process_each():
    assert cli.parse_args(["--op", "block"]).bench.block_variants == ("floor", "base", "torch", "ours")
    assert cli.parse_args(["--op", "block", "--block-variants", "ours"]).bench.block_variants == ("ours",)
    assert cli.parse_args(["--block-variants", "torch,floor"]).bench.block_variants == ("torch", "floor")
    for bad in (["--block-variants", "fused"], ["--block-variants", "ours,ours"], ["--block-variants", ","]):
        with pytest.raises(SystemExit):
            cli.parse_args(bad)


def test_transports_for_ours():
    o = cli.parse_args(["--ag-transport", "chunked", "--rs-transport", "chunked"])
    assert (o.ag_transport, o.rs_transport) == ("chunked", "chunked")
    assert (cli.parse_args([]).ag_transport, cli.parse_args([]).rs_transport) == ("auto", "chunked")
    several = cli.parse_args(["--ag-transport", "ring,chunked,mesh"])
    assert several.bench.transports == {"ag": ("ring", "chunked", "mesh"), "rs": ("chunked",)}
    assert several.ag_transport == "ring"  # the functional op's (and the block section's) transport
    for bad in (["--ag-transport", "store"], ["--rs-transport", "store"], ["--ag-transport", "mesh,mesh"],
                ["--rs-transport", ","]):
        with pytest.raises(SystemExit):
            cli.parse_args(bad)


def test_policies_for_ours():
    assert cli.parse_args([]).policy == "auto"
    assert [cli.parse_args(["--policy", p]).policy for p in ("fused", "oneshot", "fallback")] == \
        ["fused", "oneshot", "fallback"]
    with pytest.raises(SystemExit):
        cli.parse_args(["--policy", "chunked"])


def test_tokens_is_m_for_torchrun():
    assert cli.parse_args(["--tokens", "4096"]).bench.m_values == (4096,)


def test_quick_sets_a_subset_that_explicit_options_override():
    q = cli.parse_args(["--quick"])
    assert q.bench.layers == QUICK_LAYERS and q.bench.m_values == QUICK_M_VALUES
    assert q.bench.timing.warmup_s == cli.QUICK_WARMUP_S
    o = cli.parse_args(["--quick", "--m", "4096", "--layer", "qkv", "--warmup-s", "0.5"])
    assert o.bench.m_values == (4096,) and o.bench.layers == ("qkv",) and o.bench.timing.warmup_s == 0.5


@pytest.mark.parametrize("argv", [
    ["--op", "allreduce"], ["--layer", "llama5"], ["--m", "lots"], ["--iters", "5"], ["--reps", "2"],
    ["--world-size", "0"], ["--tag", "a b"], ["--warmup-s", "-1"], ["--rounds", "0"],
])
def test_bad_values_exit_with_usage_error(argv, capsys):
    with pytest.raises(SystemExit) as e:
        cli.parse_args(argv)
    assert e.value.code == 2
    assert "error" in capsys.readouterr().err


def test_env_guard_forces_multicast_off(monkeypatch):
    import os

    for key in cli.REQUIRED_ENV:
        monkeypatch.delenv(key, raising=False)  # restored after the test
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")
    notes = cli.ensure_env()
    assert {k: os.environ[k] for k in cli.REQUIRED_ENV} == cli.REQUIRED_ENV
    assert len(notes) == 1 and "NCCL_NVLS_ENABLE" in notes[0]
    assert cli.ensure_env() == []


def test_world_checks_name_the_problem():
    o = cli.parse_args(["--op", "ag"])
    assert "sections ag need at least 2 GPUs" in cli._check_world(o, world=1, n_gpu=1, needs_ranks=True)
    # The block section runs on one GPU (a group of one rank); with ag or rs beside it, it needs two.
    block = cli.parse_args(["--op", "block", "--dtype", "fp8", "--scaling", "rowwise", "--m", "8192"])
    assert cli._check_world(block, world=1, n_gpu=1, needs_ranks=True) is None
    both = cli.parse_args(["--op", "block,rs"])
    assert "sections rs need at least 2 GPUs" in cli._check_world(both, world=1, n_gpu=1, needs_ranks=True)
    assert "exceeds" in cli._check_world(o, world=4, n_gpu=2, needs_ranks=True)
    assert "divisible" in cli._check_world(cli.parse_args(["--m", "1000"]), world=3, n_gpu=3, needs_ranks=True)
    assert cli._check_world(o, world=2, n_gpu=2, needs_ranks=True) is None
    gemm = cli.parse_args(["--op", "gemm"])
    assert cli._check_world(gemm, world=1, n_gpu=1, needs_ranks=False) is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU exit")
def test_main_without_cuda_exits_nonzero(monkeypatch, capsys):
    for key in cli.REQUIRED_ENV:
        monkeypatch.setenv(key, "unset")  # records the original value, restored after the test
        monkeypatch.delenv(key)
    assert cli.main(["--quick"]) == 1
    assert "no CUDA device" in capsys.readouterr().err
    import os

    assert all(os.environ[k] == v for k, v in cli.REQUIRED_ENV.items())


def test_op_takes_sections_of_both_kinds_in_one_list(monkeypatch):
    # Each section with options of its own runs in turn with the other arguments; the dense ones
    # together, through the dense CLI.
    import tileweave.bench as bench
    from tileweave.bench import cli as dense_cli
    from tileweave.bench import decode, moe

    calls = []
    monkeypatch.setattr(moe, "main", lambda argv: calls.append(("moe", argv)) or 0)
    monkeypatch.setattr(decode, "main", lambda argv: calls.append(("decode", argv)) or 1)
    monkeypatch.setattr(dense_cli, "main", lambda argv: calls.append(("dense", argv)) or 0)
    for section in (moe, decode):  # the dispatch alone (the options' checks: the test below)
        monkeypatch.setattr(section, "check_args", lambda argv: None)
    assert bench.main(["--op", "moe,decode", "--smoke"]) == 1  # the worst section's status
    assert calls == [("moe", ["--smoke"]), ("decode", ["--smoke"])]
    calls.clear()
    assert bench.main(["--quick", "--op", "ag,moe,rs"]) == 0
    assert calls == [("moe", ["--quick"]), ("dense", ["--quick", "--op", "ag,rs"])]
    calls.clear()
    assert bench.main(["--op", "gemm"]) == 0
    assert calls == [("dense", ["--op", "gemm"])]


def test_grouped_smoke_runs_from_a_plain_shell():
    # No TRITON_INTERPRET set by hand and no --out: the section runs itself in the interpreter, writes to a
    # temporary folder, and says that nothing was timed instead of printing ratios.
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(root / "src")
    done = subprocess.run([sys.executable, "-m", "tileweave", "bench", "--op", "grouped", "--smoke"], env=env,
                          capture_output=True, text=True, timeout=600, cwd=root)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "no row was timed" in done.stdout and "nan" not in done.stdout, done.stdout
    assert "smoke run: writing to" in done.stderr and not (root / "bench/results/grouped.json").exists()


def test_a_bad_option_for_one_section_stops_every_section_before_any_runs(monkeypatch):
    # --smoke is the moe section's option, not the dense sections': nothing may run (the moe section used
    # to run and write its files, then the dense CLI refused --smoke).
    import tileweave.bench as bench
    from tileweave.bench import moe

    calls = []
    monkeypatch.setattr(moe, "main", lambda argv: calls.append(argv) or 0)
    with pytest.raises(SystemExit) as e:
        bench.main(["--op", "gemm,moe", "--smoke"])
    assert e.value.code == 2 and calls == []


def test_quick_block_takes_the_models_of_the_quick_layers():
    from tileweave.bench.block import select_block_rows

    opts = cli.parse_args(["--op", "block", "--quick"])
    rows = select_block_rows(layers=opts.bench.layers, m_values=opts.bench.m_values, world_size=1)
    assert {row.model for row in rows} == {"llama3-8b", "llama3-70b"} and rows
