"""``tileweave`` command line: ``tileweave bench ...``, ``tileweave demo`` and ``tileweave tune``.

With no subcommand it runs the main job: the benchmark when two or more CUDA GPUs are visible,
otherwise the CPU demo (the fused ops on emulated ranks in Triton's interpreter, checked against a
reference).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    command = args.pop(0) if args and not args[0].startswith("-") else None
    if command in ("-h", "--help", "help"):
        print(__doc__)
        return 0
    if command is None:
        import torch

        command = "bench" if torch.cuda.is_available() and torch.cuda.device_count() >= 2 else "demo"
    if command == "bench":
        from tileweave.bench import main as bench_main

        return bench_main(args)
    if command == "demo":
        from tileweave.demo import main as demo_main

        return demo_main(args)
    if command == "tune":
        from tileweave.tune.autotune import main as tune_main

        return tune_main(args)
    print(f"tileweave: unknown command {command!r}; use 'bench', 'demo' or 'tune'", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
