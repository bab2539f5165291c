"""The CPU demo: the fused ops on emulated ranks, checked against a float64 reference.

Runs where there is no GPU: W CPU processes share a symmetric heap, and each runs the real Triton
kernels in the interpreter while a producer thread moves the shards and writes the flags, exactly as
the copy engines do on GPUs. It proves the ops and their flag protocol, not their speed.
"""

from __future__ import annotations

import argparse
import time

from tileweave.testing import scenarios
from tileweave.testing.emulated import RankFailed, run_ranks

MAX_WORLD_SIZE = 16
"""Emulated ranks are CPU processes running the interpreter: beyond this many a demo takes hours."""


def _world_size(text: str) -> int:
    """``--world-size``: an int in [1, MAX_WORLD_SIZE], or an argparse error that says so."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number of ranks, got {text!r}") from None
    if not 1 <= value <= MAX_WORLD_SIZE:
        raise argparse.ArgumentTypeError(f"expected between 1 and {MAX_WORLD_SIZE} ranks, got {value}")
    return value


def main(argv=None) -> int:
    """``tileweave demo [--world-size W]``; returns the exit code (0: every check passed; 1: a check
    failed or a rank failed; 2: bad options, reported by argparse)."""
    parser = argparse.ArgumentParser(prog="tileweave demo", description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=_world_size, default=2,
                        help=f"emulated ranks, 1 to {MAX_WORLD_SIZE} (default 2)")
    args = parser.parse_args(argv)
    w = args.world_size
    C = scenarios.Case
    cases = [C(m_chunk=48, k=64, n=80, bias=True, iters=2), C(m_chunk=17, k=40, n=24, dtype="float32")]
    tol = {"float16": 2e-3, "float32": 1e-5}
    print(f"tileweave demo: {w} emulated ranks on the CPU, Triton kernels in the interpreter")
    failures = 0
    for title, fn, key in (("all_gather_gemm", scenarios.all_gather_gemm_check, "gathered_exact"),
                           ("gemm_reduce_scatter", scenarios.gemm_reduce_scatter_check, "deterministic")):
        start = time.monotonic()
        try:
            rows = [row for per_rank in run_ranks(w, fn, cases) for row in per_rank]
        except RankFailed as exc:
            print(f"  {title:20s} FAILED: {exc}")
            failures += 1
            continue
        worst = max(row["err"] / tol[row["case"]["dtype"]] for row in rows)
        ok = worst < 1 and all(row[key] for row in rows)
        failures += not ok
        print(f"  {title:20s} {len(rows):2d} calls  worst error {worst:.2f} of tolerance  "
              f"{key}={all(row[key] for row in rows)}  {'OK' if ok else 'FAILED'}  ({time.monotonic() - start:.1f} s)")
    print("Speed figures need two or more NVIDIA GPUs with peer access: there, `tileweave bench` (or this "
          "same command) runs the benchmark against NCCL+cuBLAS and PyTorch async-TP.")
    return 1 if failures else 0
