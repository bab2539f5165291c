"""The ``tileweave`` command: ``tileweave bench``, ``tileweave demo``, ``tileweave generate`` and
``tileweave tune``.

Each subcommand has its own options (``tileweave SUBCOMMAND --help``). With no subcommand it runs the
main job: the benchmark when two or more CUDA GPUs are visible, otherwise the CPU demo; options given
without a subcommand go to that job.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

import tileweave

SUBCOMMANDS: dict[str, str] = {
    "bench": "benchmark the fused ops against NCCL + cuBLAS and PyTorch async-TP (two or more GPUs)",
    "demo": "run the fused ops on emulated ranks on the CPU and check them against a reference",
    "generate": "generate tokens from a Hugging Face checkpoint split over TP ranks (GPUs or emulated CPU ranks)",
    "tune": "tune the local GEMMs of the benchmark suite on GPU 0",
}

USAGE = "usage: tileweave [-h] [--version] [SUBCOMMAND] [OPTIONS ...]"


def help_text() -> str:
    """The top-level help, plain text."""
    width = max(map(len, SUBCOMMANDS))
    lines = [USAGE, "",
             "Tensor-parallel GEMMs with their communication fused in: AllGather+GEMM, GEMM+ReduceScatter, the MoE pair, GEMM+AllReduce.", "",
             "subcommands:"]
    lines += [f"  {name:{width}}  {summary}" for name, summary in SUBCOMMANDS.items()]
    lines += ["", "With no subcommand: bench when two or more CUDA GPUs are visible, otherwise demo; options",
              "given without a subcommand go to that one. 'tileweave SUBCOMMAND --help' lists its options.", "",
              "options:",
              "  -h, --help  show this help and exit",
              "  --version   print the version and exit",
              "  --debug     after the subcommand: an error's whole traceback instead of one line"]
    return "\n".join(lines)


def _runner(command: str) -> Callable[[list[str]], int]:
    if command == "bench":
        from tileweave.bench import main as run
    elif command == "demo":
        from tileweave.demo import main as run
    elif command == "generate":
        from tileweave.generate import main as run
    else:
        from tileweave.bench.tune import main as run
    return run


def _default_command() -> str:
    import torch

    return "bench" if torch.cuda.is_available() and torch.cuda.device_count() >= 2 else "demo"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default ``sys.argv[1:]``); return the exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    first = args[0] if args else None
    if first in ("-h", "--help", "help"):
        print(help_text())
        return 0
    if first in ("-V", "--version"):
        print(f"tileweave {tileweave.__version__}")
        return 0
    if first is None or first.startswith("-"):
        command = _default_command()
    else:
        command = args.pop(0)
    if command not in SUBCOMMANDS:
        print(f"{USAGE}\ntileweave: unknown subcommand {command!r}; choose from {', '.join(SUBCOMMANDS)}",
              file=sys.stderr)
        return 2
    debug = "--debug" in args
    if debug:
        args.remove("--debug")
    try:
        return _runner(command)(args)
    except Exception as exc:  # noqa: BLE001 - one line for a user; --debug for the traceback
        if debug:
            raise
        # A failure of the ranks carries every rank's traceback; its summary is each one's last line.
        message = getattr(exc, "summary", None) or " ".join(str(exc).split()) or type(exc).__name__
        print(f"tileweave {command}: {type(exc).__name__}: {message} (--debug shows the traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
