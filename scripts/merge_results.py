"""Merge benchmark reports of one section at one commit into one report, for example the block's
variants when each was timed in its own process (``tileweave bench --op block --block-variants ours``):

    python3 scripts/merge_results.py --out bench/results --tag block a.json b.json ...

Writes ``<tag>_<op>_<date>.{json,md,png}`` like ``tileweave bench`` and prints the table.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from tileweave.bench.report import merge_reports, write_report  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--tag", required=True)
    parser.add_argument("reports", nargs="+", type=Path)
    args = parser.parse_args(argv)
    op, meta, measurements = merge_reports(args.reports)
    files = write_report(out_dir=Path(args.out), tag=args.tag, op=op, date=time.strftime("%Y%m%d-%H%M%S"),
                         meta=meta, measurements=measurements)
    print(files.md.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
