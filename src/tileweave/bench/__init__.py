"""Benchmark harness: ``tileweave bench`` (``main``), the suite, steady-state timing and reports.

Submodules: ``suite`` (what is measured), ``timing`` (how), ``variants`` (the implementations and
their references), ``runner`` (the per-rank order of work), ``report`` (schema and output files),
``cli`` (process launch and options) for the dense sections (``--op gemm,ag,rs,block``); ``moe``,
``decode`` and ``grouped`` are sections with options of their own (``tileweave bench --op moe
--help``).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

SECTIONS = ("moe", "decode", "grouped")
"""Sections with options of their own, each a module of this package with a ``main(argv)``."""


def main(argv: Sequence[str] | None = None) -> int:
    """``tileweave bench``; see ``tileweave.bench.cli``. Imported on call so that
    ``python -m tileweave.bench.cli`` does not find its module already loaded by the package."""
    args = list(sys.argv[1:] if argv is None else argv)
    if "--op" in args and args.index("--op") + 1 < len(args) and args[args.index("--op") + 1] in SECTIONS:
        at = args.index("--op")
        module = importlib.import_module(f"tileweave.bench.{args[at + 1]}")
        return module.main(args[:at] + args[at + 2:])
    from tileweave.bench.cli import main as cli_main

    return cli_main(argv)


__all__ = ["main"]
