"""Benchmark harness: ``tileweave bench`` (``main``), the suite, steady-state timing and reports.

Submodules: ``suite`` (what is measured), ``timing`` (how), ``variants`` (the implementations and
their references), ``runner`` (the per-rank order of work), ``report`` (schema and output files),
``cli`` (process launch and options) for the dense sections (``--op gemm,ag,rs,block``); ``moe``,
``decode`` and ``grouped`` are sections with options of their own (``tileweave bench --op moe
--help``). ``--op`` takes a comma list of both kinds: each section with options of its own runs in turn
with the other arguments, the dense sections together.
"""

from __future__ import annotations

import importlib
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

SECTIONS = ("moe", "decode", "grouped")
"""Sections with options of their own, each a module of this package with a ``main(argv)``."""


def output_dir(out: Path | None, smoke: bool) -> Path:
    """Where a section writes: ``--out``, else for a smoke run a fresh temporary directory (a smoke run's
    numbers mean nothing and must not land among the results), else ``bench/results``."""
    if out is not None:
        return out
    if smoke:
        path = Path(tempfile.mkdtemp(prefix="tileweave-smoke-"))
        print(f"smoke run: writing to {path}", file=sys.stderr)
        return path
    return Path("bench/results")


def main(argv: Sequence[str] | None = None) -> int:
    """``tileweave bench``; see ``tileweave.bench.cli``. Imported on call so that
    ``python -m tileweave.bench.cli`` does not find its module already loaded by the package."""
    args = list(sys.argv[1:] if argv is None else argv)
    if "--op" not in args or args.index("--op") + 1 >= len(args):
        from tileweave.bench.cli import main as cli_main

        return cli_main(argv)
    at = args.index("--op")
    ops = [op for op in args[at + 1].split(",") if op]
    rest = args[:at] + args[at + 2:]
    own = [op for op in ops if op in SECTIONS]
    dense = [op for op in ops if op not in SECTIONS]
    dense_args = args if not own else rest + ["--op", ",".join(dense)]
    # Every section's options are checked before any runs: a bad one must not cost the others' run.
    for op in own:
        importlib.import_module(f"tileweave.bench.{op}").check_args(rest)
    if dense or not own:
        from tileweave.bench.cli import parse_args

        parse_args(dense_args)
    status = 0
    for op in own:
        status = max(status, importlib.import_module(f"tileweave.bench.{op}").main(rest) or 0)
    if dense or not own:
        from tileweave.bench.cli import main as cli_main

        status = max(status, cli_main(dense_args) or 0)
    return status


__all__ = ["main"]
