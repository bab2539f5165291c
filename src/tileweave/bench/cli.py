"""``tileweave bench``: start the ranks, run the suite, write the reports, print the tables.

Usage::

    tileweave bench [--op gemm,ag,rs,block] [--layer NAME ...] [--m 1024,2048,...] [--world-size N]
                    [--out bench/results] [--tag STR] [--quick] [--warmup-s 0.5] [--iters 20]
                    [--reps 5] [--no-torch] [--dtype fp8 --scaling tensorwise,rowwise,blockwise]

Started plainly, it spawns one process per GPU (or ``--world-size`` of them). Under ``torchrun``
(RANK, WORLD_SIZE and LOCAL_RANK set) it runs in place as that rank; there, write ``--tokens`` for
``--m``, which torchrun's parser mistakes for one of its own options. ``main`` returns the exit code.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import socket
import sys
import time
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path

from tileweave.bench.fp8 import FAST as FP8_FAST, SCALINGS as FP8_SCALINGS, parse_scalings
from tileweave.bench.report import BLOCK_VARIANTS
from tileweave.bench.runner import BenchConfig
from tileweave.bench.suite import (
    DEFAULT_OPS,
    QUICK_LAYERS,
    QUICK_M_VALUES,
    parse_ints,
    parse_ops,
    select_rows,
)
from tileweave.bench.timing import TimingConfig
from tileweave.ops.all_gather.op import TRANSPORTS as AG_TRANSPORTS
from tileweave.ops.reduce_scatter.op import TRANSPORTS as RS_TRANSPORTS
from tileweave.runtime import settings

REQUIRED_ENV: dict[str, str] = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
"""Multicast (NVLS) stays off on the machines we share: set before any rank initialises NCCL or
symmetric memory, and inherited by spawned ranks."""

QUICK_WARMUP_S = 0.2
"""``--quick`` warm-up: clocks are not fully settled, which is acceptable for a smoke run."""

NCCL_TIMEOUT = timedelta(minutes=60)
"""Generous: non-zero ranks wait in a barrier while rank 0 runs the whole single-GPU section."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class CliOptions:
    """Parsed command line."""

    bench: BenchConfig
    world_size: int | None
    """Ranks to spawn; None means one per visible GPU (one in all for a ``gemm``-only run)."""
    out_dir: Path
    tag: str | None
    """File name prefix; None means ``<gpu>-tp<W>``."""
    argv: tuple[str, ...]
    policy: str = "auto"
    """tileweave's path choice for "ours" (exported as TILEWEAVE_POLICY)."""
    rs_transport: str = "chunked"
    """GEMM+ReduceScatter transport for the functional op, the first of --rs-transport (exported as
    TILEWEAVE_RS_TRANSPORT; the block section uses it)."""
    ag_transport: str = "auto"
    """AllGather+GEMM transport for the functional op, the first of --ag-transport (exported as
    TILEWEAVE_AG_TRANSPORT)."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tileweave bench",
        description="Steady-state benchmark of tileweave's fused TP GEMMs against NCCL + cuBLAS and "
                    "PyTorch async-TP (verified before timed; median over reps, max over ranks).",
    )
    p.add_argument("--op", default=",".join(DEFAULT_OPS),
                   help="comma list of sections: gemm, ag, rs, block (default: gemm,ag,rs; block is the TP "
                        "transformer block, forward + backward, also on one GPU); also moe, decode, grouped, "
                        "sections with options of their own (tileweave bench --op moe --help), which run in turn "
                        "with the other arguments (--smoke: tiny shapes on the CPU, every variant checked)")
    p.add_argument("--layer", nargs="+", action="extend", default=None, metavar="NAME",
                   help='layer filters: full name ("llama3-8b qkv"), model (llama3-70b) or part (qkv)')
    # --tokens: torchrun's own parser takes "--m" for an abbreviation of its options and stops.
    p.add_argument("--m", "--tokens", dest="m", default=None,
                   help="comma list of token counts M (default 1024..16384); spell it --tokens under torchrun")
    p.add_argument("--world-size", type=int, default=None, help="ranks to spawn (default: all GPUs)")
    p.add_argument("--out", default="bench/results", help="output folder (default: bench/results)")
    p.add_argument("--tag", default=None, help="file name prefix (default: <gpu>-tp<W>)")
    p.add_argument("--quick", action="store_true",
                   help=f"smoke run: layers {', '.join(QUICK_LAYERS)}; M {QUICK_M_VALUES}; "
                        f"warm-up {QUICK_WARMUP_S} s (explicit --layer/--m/--warmup-s win)")
    p.add_argument("--warmup-s", type=float, default=None, help="warm-up seconds per variant (default 0.5)")
    p.add_argument("--iters", type=int, default=20, help="back-to-back calls per timed batch (>= 20)")
    p.add_argument("--reps", type=int, default=5, help="timed batches, median reported (>= 5)")
    p.add_argument("--no-torch", action="store_true",
                   help="skip PyTorch async-TP (only to work around a hang in that peer)")
    p.add_argument("--policy", choices=("auto", "fused", "oneshot", "fallback"), default="auto",
                   help="tileweave's path choice for 'ours' (default auto: what users get; oneshot: the "
                        "one-shot paths, opt-in)")
    p.add_argument("--ag-transport", default="auto",
                   help="AllGather+GEMM transport(s) for 'ours', from auto, mesh, ring, chunked; a comma list "
                        "times each next to one set of baselines (default auto: chunked or mesh per shape)")
    p.add_argument("--block-variants", default=",".join(BLOCK_VARIANTS),
                   help="block section: which of floor, base, torch, ours to run in this process (default all; "
                        "scripts/gpu_check.sh runs each in its own process and merges the reports)")
    p.add_argument("--ours-first", action="store_true",
                   help="ag and rs sections: time ours before the baselines in each row (default after them), "
                        "to measure what the order costs on rows that run at the power cap")
    p.add_argument("--rounds", type=int, default=1,
                   help="ag and rs sections: time each row's variants this many times, the order mirrored each "
                        "round, and report medians (default 1)")
    p.add_argument("--dtype", choices=("bf16", "fp8"), default="bf16",
                   help="gemm, ag, rs and block sections: fp8 also runs each --scaling in FP8 (e4m3, bf16 output) "
                        "against torch's scaled matmul (and PyTorch's scaled async-TP ops), beside the bf16 rows; "
                        "the block trains with Float8Recipe.<scaling>() (default bf16)")
    p.add_argument("--scaling", default=None,
                   help="with --dtype fp8: comma list from " + ", ".join(FP8_SCALINGS + FP8_FAST)
                   + " (default the first three; '-fast': ours and torch's with use_fast_accum=True; in the block, "
                     "the recipe's backward GEMMs too, its forward GEMM accumulating fast already)")
    p.add_argument("--rs-transport", default="chunked",
                   help="GEMM+ReduceScatter transport(s) for 'ours', from " + ", ".join(RS_TRANSPORTS) + "; a comma "
                        "list times each next to one set of baselines (default chunked)")
    return p


def parse_args(argv: Sequence[str] | None = None) -> CliOptions:
    """Parse and validate; a bad value exits with status 2 and names the option."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    ns = parser.parse_args(argv)
    try:
        ops = parse_ops(ns.op)
        layers = tuple(ns.layer) if ns.layer else (QUICK_LAYERS if ns.quick else ())
        m_values = parse_ints(ns.m, name="--m") if ns.m else (QUICK_M_VALUES if ns.quick else ())
        warmup = ns.warmup_s if ns.warmup_s is not None else (QUICK_WARMUP_S if ns.quick else 0.5)
        timing = TimingConfig(warmup_s=warmup, iters=ns.iters, reps=ns.reps)
        if ns.world_size is not None and ns.world_size < 1:
            raise ValueError(f"--world-size must be >= 1, got {ns.world_size}")
        if ns.tag is not None and not re.fullmatch(r"[A-Za-z0-9._-]+", ns.tag):
            raise ValueError(f"--tag may use letters, digits, '.', '_' and '-' only; got {ns.tag!r}")
        # Filters are checked here, before any process starts, so a typo costs nothing.
        _check_filters(ops, layers, m_values, world_size=1)
        transports = {"ag": _transports(ns.ag_transport, AG_TRANSPORTS, "--ag-transport"),
                      "rs": _transports(ns.rs_transport, RS_TRANSPORTS, "--rs-transport")}
        if ns.scaling is not None and ns.dtype != "fp8":
            raise ValueError(f"--scaling {ns.scaling} applies to FP8 rows: add --dtype fp8")
        block_variants = tuple(v.strip() for v in ns.block_variants.split(",") if v.strip())
        bench = BenchConfig(ops=ops, layers=layers, m_values=m_values, timing=timing,
                            include_torch=not ns.no_torch, transports=transports, block_variants=block_variants,
                            ours_first=ns.ours_first, rounds=ns.rounds, dtype=ns.dtype,
                            scalings=parse_scalings(ns.scaling or ",".join(FP8_SCALINGS)) if ns.dtype == "fp8" else ())
    except ValueError as e:
        parser.error(str(e))
    return CliOptions(bench=bench, world_size=ns.world_size, out_dir=Path(ns.out), tag=ns.tag, argv=tuple(argv),
                      policy=ns.policy, rs_transport=transports["rs"][0], ag_transport=transports["ag"][0])


def _transports(text: str, allowed: tuple[str, ...], option: str) -> tuple[str, ...]:
    chosen = tuple(t.strip() for t in text.split(",") if t.strip())
    bad = [t for t in chosen if t not in allowed]
    if bad or not chosen or len(set(chosen)) != len(chosen):
        raise ValueError(f"{option} expects distinct names from {', '.join(allowed)}; got {text!r}")
    return chosen


def _check_filters(ops: Sequence[str], layers: Sequence[str], m_values: Sequence[int], *, world_size: int) -> None:
    """Raise ValueError when the filters select nothing valid for a requested section."""
    from tileweave.bench.block import select_block_rows

    for op, kind in (("ag", "AG"), ("rs", "RS"), ("gemm", "AG")):
        if op in ops:
            select_rows(kind=kind, layers=layers or None, m_values=m_values or None, world_size=world_size)
    if "block" in ops:
        select_block_rows(layers=tuple(layers) or None, m_values=tuple(m_values) or None, world_size=world_size)


def ensure_env() -> list[str]:
    """Force the no-multicast settings into the environment (``settings.export``: NCCL and torch read them,
    in this process and the ranks it starts); returns a note for each value that had to change."""
    return [f"{note}: multicast must stay off" for note in settings.export(REQUIRED_ENV)]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _default_tag(world_size: int) -> str:
    import torch

    name = torch.cuda.get_device_name(0).split()[-1].lower() if torch.cuda.is_available() else "cpu"
    return f"{re.sub(r'[^a-z0-9.-]+', '', name) or 'gpu'}-tp{world_size}"


def _worker(local_rank: int, world_size: int, opts: CliOptions, rank_offset: int = 0) -> None:
    """One rank: join the group (if any), run, and on rank 0 write the reports."""
    import torch
    import torch.distributed as dist

    from tileweave.bench.metadata import collect_metadata
    from tileweave.bench.report import write_report
    from tileweave.bench.runner import run_rank

    rank = rank_offset + local_rank
    # The shared ops read these when they are made (in this rank's process).
    settings.override(settings.POLICY, opts.policy)
    settings.override(settings.RS_TRANSPORT, opts.rs_transport)
    settings.override(settings.AG_TRANSPORT, opts.ag_transport)
    torch.cuda.set_device(local_rank)
    group = None
    if world_size > 1 or "block" in opts.bench.ops:  # the block's layers need a group, of one rank too
        dist.init_process_group(
            "nccl", rank=rank, world_size=world_size, timeout=NCCL_TIMEOUT,
            device_id=torch.device("cuda", local_rank), **({"store": dist.HashStore()} if world_size == 1 else {}),
        )
        group = dist.group.WORLD
    try:
        results = run_rank(opts.bench, rank=rank, world_size=world_size, group=group)
        if rank != 0:
            return
        meta = collect_metadata(world_size=world_size, timing=dataclasses.asdict(opts.bench.timing),
                                argv=opts.argv)
        date = time.strftime("%Y%m%d-%H%M%S")
        tag = opts.tag or _default_tag(world_size)
        tables = []
        for op in results:  # sections in the order they ran; "rs-chunked" etc. with several transports
            files = write_report(out_dir=opts.out_dir, tag=tag, op=op, date=date, meta=meta,
                                 measurements=results[op])
            print(f"wrote {files.json}, {files.md}" + (f", {files.png}" if files.png else " (no chart: "
                  "matplotlib missing)"), file=sys.stderr)
            tables.append(files.md.read_text())
        print("\n".join(tables), flush=True)
    finally:
        if group is not None:
            dist.destroy_process_group()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``tileweave bench``; returns the process exit code."""
    opts = parse_args(argv)
    for note in ensure_env():
        print(f"tileweave bench: {note}", file=sys.stderr)
    import torch

    needs_ranks = any(op in ("ag", "rs", "block") for op in opts.bench.ops)  # one per GPU by default
    if not torch.cuda.is_available():
        print("tileweave bench: no CUDA device visible; the benchmark needs NVIDIA GPUs.", file=sys.stderr)
        return 1
    n_gpu = torch.cuda.device_count()

    if all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")):
        world, rank, local = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
        problem = _check_world(opts, world=world, n_gpu=n_gpu, needs_ranks=needs_ranks)
        if opts.world_size not in (None, world):
            problem = f"--world-size {opts.world_size} disagrees with torchrun's WORLD_SIZE={world}"
        if local >= n_gpu:
            problem = f"LOCAL_RANK={local} but only {n_gpu} GPUs are visible"
        if problem:
            print(f"tileweave bench: {problem}", file=sys.stderr)
            return 1
        _worker(local, world, opts, rank_offset=rank - local)
        return 0

    world = opts.world_size or (n_gpu if needs_ranks else 1)
    problem = _check_world(opts, world=world, n_gpu=n_gpu, needs_ranks=needs_ranks)
    if problem:
        print(f"tileweave bench: {problem}", file=sys.stderr)
        return 1
    if world == 1:
        _worker(0, 1, opts)
        return 0
    import torch.multiprocessing as mp

    settings.export({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())})  # the ranks' rendezvous
    try:
        mp.spawn(_worker, args=(world, opts), nprocs=world, join=True)
    except Exception as e:
        print(f"tileweave bench: a rank failed: {e}", file=sys.stderr)
        return 1
    return 0


def _check_world(opts: CliOptions, *, world: int, n_gpu: int, needs_ranks: bool) -> str | None:
    """Why ``world`` ranks cannot run ``opts`` here, or None."""
    pairs = [op for op in opts.bench.ops if op in ("ag", "rs")]
    if pairs and world < 2:
        return (f"sections {'/'.join(pairs)} need at least 2 GPUs (world size {world}, {n_gpu} visible); "
                "run --op gemm or --op block on one GPU")
    if world > n_gpu:
        return f"--world-size {world} exceeds the {n_gpu} visible GPUs"
    try:
        _check_filters(opts.bench.ops, opts.bench.layers, opts.bench.m_values,
                       world_size=world if needs_ranks else 1)
    except ValueError as e:
        return str(e)
    return None


if __name__ == "__main__":
    raise SystemExit(main())
