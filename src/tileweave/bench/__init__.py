"""Benchmark harness: ``tileweave bench`` (``main``), the suite, steady-state timing and reports.

Submodules: ``suite`` (what is measured), ``timing`` (how), ``variants`` (the implementations and
their references), ``runner`` (the per-rank order of work), ``report`` (schema and output files),
``cli`` (process launch and options).
"""

from __future__ import annotations

from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """``tileweave bench``; see ``tileweave.bench.cli``. Imported on call so that
    ``python -m tileweave.bench.cli`` does not find its module already loaded by the package."""
    from tileweave.bench.cli import main as cli_main

    return cli_main(argv)


__all__ = ["main"]
