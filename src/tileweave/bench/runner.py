"""Runs the suite on one rank: verify each variant, then time it, in an order every rank shares.

Phases, in order:

1. ``gemm`` section on rank 0's GPU only; the other ranks wait at a barrier.
2. PyTorch async-TP for every AG and RS row, then for every block row (with the block's FP8 rows on
   NCCL + torch's scaled matmul), before any other symmetric memory exists in the process: that op hung
   once next to other symmetric buffers (docs/design.md), so it gets a phase alone.
3. For every AG row, then every RS row: cuBLAS alone, the copy-engine transport alone (our own
   symmetric buffer), the NCCL collective alone, NCCL + cuBLAS, and tileweave's op.
4. For every block row: the compute floor, NCCL + cuBLAS, and tileweave's ops (bf16, then FP8).

Deadlock safety: every decision that changes which collectives a rank issues (is a variant there, did
it verify, how long to warm up) is agreed with an all-reduce first, so all ranks take the same branch.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import sys
import warnings
from typing import Callable

import torch
import torch.distributed as dist

from tileweave.bench import variants as V
from tileweave.bench import fp8_comm
from tileweave.bench.fp8 import dtype_label as fp8_label
from tileweave.bench.report import BLOCK_VARIANTS, Measurement
from tileweave.bench.suite import OpName, SuiteRow, gemm_shapes, select_rows
from tileweave.bench.timing import (
    Agreement,
    ClockReader,
    DistAgreement,
    LocalAgreement,
    MemoryWatch,
    TimingConfig,
    measure,
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class BenchConfig:
    """What one ``tileweave bench`` run measures."""

    ops: tuple[OpName, ...]
    """Sections to run, from ``gemm``, ``ag``, ``rs``, ``block``."""
    layers: tuple[str, ...] = ()
    """Layer filters (see ``suite.match_layers``); empty means all."""
    m_values: tuple[int, ...] = ()
    """Token counts; empty means the suite's."""
    timing: TimingConfig = TimingConfig()
    include_torch: bool = True
    """Measure PyTorch async-TP (off only to work around a hang in that peer)."""
    transports: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    """``{"ag": (...), "rs": (...)}``: with two or more transports for an op, "ours" runs once per
    transport next to one set of baselines, reported as ``<op>-<transport>``; otherwise "ours" is the
    functional op with the transport of its environment variable."""
    ours_first: bool = False
    """Time "ours" before the baselines in each row of the ag and rs sections (by default after them).
    A GEMM at the power cap runs 2-4% slower later in a sustained run, so
    the order within a row can favour whichever variant runs first; this option measures how much."""
    rounds: int = 1
    """Rounds of each ag and rs row: from 2, the row's variants are timed again with the order mirrored
    each round (baselines then ours, ours then baselines, ...), and each variant reports its median over
    the rounds, so that no variant always runs last. PyTorch async-TP keeps its own phase."""
    dtype: str = "bf16"
    """``"bf16"``, or ``"fp8"``: the ``gemm``, ``ag`` and ``rs`` sections also run each of ``scalings`` in
    FP8 (e4m3 inputs, bf16 output) beside their bf16 rows, against torch's own scaled matmul and
    PyTorch's scaled async-TP ops (variant ``torch``; ``tileweave.bench.fp8_comm``); the ``block`` section
    runs the block with each scaling's FP8 recipe, ours and on NCCL + torch's scaled matmul
    (``tileweave.bench.block_fp8``)."""
    scalings: tuple[str, ...] = ()
    """FP8 scalings (``tileweave.bench.fp8.SCALINGS``, ``FAST``), with ``dtype="fp8"``."""
    block_variants: tuple[str, ...] = BLOCK_VARIANTS
    """The block section's variants to run in this process. One at a time, each in a fresh process, and
    the reports merged (``scripts/merge_results.py``): within one process a block variant ran 2-4%
    slower after another variant than before it."""

    def __post_init__(self) -> None:
        if not self.ops:
            raise ValueError("ops must name at least one of gemm, ag, rs, block")
        if self.rounds < 1:
            raise ValueError(f"rounds must be >= 1, got {self.rounds}")
        if self.dtype not in ("bf16", "fp8"):
            raise ValueError(f"dtype must be bf16 or fp8, got {self.dtype!r}")
        if self.dtype == "fp8" and (not self.scalings or set(self.ops) - {"gemm", "ag", "rs", "block"}):
            raise ValueError("dtype fp8 needs at least one scaling and runs the gemm, ag, rs and block sections "
                             f"(here; the grouped section has its own --dtype), got sections {', '.join(self.ops)} "
                             f"and scalings {', '.join(self.scalings) or 'none'}")
        bad = [v for v in self.block_variants if v not in BLOCK_VARIANTS]
        if bad or not self.block_variants or len(set(self.block_variants)) != len(self.block_variants):
            raise ValueError(f"block variants must be distinct names from {', '.join(BLOCK_VARIANTS)}; "
                             f"got {', '.join(self.block_variants) or 'none'}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RankContext:
    """This process's place in the run."""

    rank: int
    world_size: int
    group: dist.ProcessGroup | None
    """The TP group (WORLD); None when the run is a single process."""
    agree: Agreement
    """Agreement over ``group``, or a local one for single-GPU work."""
    clocks: ClockReader
    timing: TimingConfig


class Progress:
    """A tqdm bar on rank 0 (plain lines without tqdm); silent elsewhere. Writes to stderr so the
    tables on stdout stay clean."""

    def __init__(self, *, total: int, enabled: bool) -> None:
        self.total, self.enabled, self.done = total, enabled, 0
        self._bar = None
        if enabled:
            try:
                from tqdm import tqdm

                self._bar = tqdm(total=total, desc="bench", unit="row", file=sys.stderr, dynamic_ncols=True)
            except Exception:
                self._bar = None

    def step(self, label: str) -> None:
        self.done += 1
        if self._bar is not None:
            self._bar.set_postfix_str(label, refresh=False)
            self._bar.update(1)
        elif self.enabled:
            print(f"[{self.done}/{self.total}] {label}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def run_variant(ctx: RankContext, v: V.Variant, *, key: dict[str, object]) -> Measurement:
    """Verify ``v`` against its reference, then time it; never raises for a failed check.

    Collectives, identical on every rank: agree on availability; if available, agree on the
    verification (max error, any failure); if it passed, ``measure``, one memory reduction, and the
    agreed verification of one more call after the timed ones (the route they took: a repeat of a
    signature, which may not be the first call's).
    """
    (unavailable,) = ctx.agree.max_floats([float(v.call is None)])
    if unavailable:
        return Measurement(**key, variant=v.name, status="n/a", note=v.note or "unavailable on some rank")
    assert v.call is not None
    watch = MemoryWatch()
    err, note = _verify_once(v)
    failed = not err < v.tolerance
    fail_any, err_max = ctx.agree.max_floats([float(failed), err if math.isfinite(err) else 1e300])
    err_out = err_max if err_max < 1e300 and v.check is not None else None
    if fail_any:
        torch.cuda.empty_cache()
        if not note:
            note = f"rel_err {err_max:.3g} >= {v.tolerance}" if failed else "failed on another rank"
        return Measurement(**key, variant=v.name, status="FAILED", rel_err=err_out, note=note)
    watch.rearm()
    try:
        t = measure(v.call, cfg=ctx.timing, agree=ctx.agree, clocks=ctx.clocks, fence=v.fence)
    except Exception as e:
        # Alone on its GPU a rank can record the failure and go on; in a group the peers are
        # already inside the same collectives, so the run cannot continue in step and must stop.
        if not isinstance(ctx.agree, LocalAgreement):
            raise
        torch.cuda.empty_cache()
        return Measurement(**key, variant=v.name, status="FAILED", rel_err=err_out,
                           note=f"while timing: {type(e).__name__}: {e}"[:300])
    peak, other = ctx.agree.max_floats(list(watch.read()))
    # The path of the timed calls (the last one's), not the first call's: a call may take another path
    # once its shape has been seen.
    path = v.path() if v.path is not None else None
    # The timed calls repeated a signature already seen, so they took its repeat route (a cached plan, a
    # replayed graph), not the first call's: verify that route's output as well, agreed like the first.
    err, note = _verify_once(v)
    failed = not err < v.tolerance
    fail_any, repeat_max = ctx.agree.max_floats([float(failed), err if math.isfinite(err) else 1e300])
    if v.check is not None:
        err_out = max(err_out, repeat_max) if repeat_max < 1e300 else None
    if fail_any:
        torch.cuda.empty_cache()
        if not note:
            note = f"rel_err {repeat_max:.3g} >= {v.tolerance}" if failed else "failed on another rank"
        return Measurement(**key, variant=v.name, status="FAILED", rel_err=err_out, path=path,
                           note=f"after timing, on the route the timed calls took: {note}"[:300])
    return Measurement(
        **key, variant=v.name, status="ok", ms=t.ms, rel_err=err_out, warmup_calls=t.warmup_calls,
        clock_mhz=t.clock_mhz, mem_peak_mb=peak / 2**20, mem_other_mb=other / 2**20, path=path,
        host_ms=t.host_ms,
    )


def _verify_once(v: V.Variant) -> tuple[float, str]:
    """One call of ``v`` on input set 0, checked: its relative error (inf when it raised) and why it
    failed, if it visibly did. Collective only as far as the call itself is."""
    try:
        out = v.call(0)
        err = v.check(out) if v.check is not None else 0.0  # no check: runs, but its numbers are not a model's
        del out
    except Exception as e:
        return math.inf, f"{type(e).__name__}: {e}"[:300]
    return err, "" if math.isfinite(err) else "non-finite output"


def _row_key(row: SuiteRow, *, op: str, world_size: int) -> dict[str, object]:
    return dict(op=op, layer=row.layer.name, world_size=world_size, m=row.m, k=row.layer.k, n=row.layer.n)


def run_gemm_section(cfg: BenchConfig, ctx: RankContext, progress: Progress) -> list[Measurement]:
    """``torch.matmul`` vs ``tileweave.matmul`` on every local GEMM of the suite; single GPU. With
    ``cfg.dtype == "fp8"`` each shape also runs in FP8 per scaling (rows ``dtype="fp8-<scaling>"``),
    torch's scaled matmul against ours, beside the bf16 rows."""
    out: list[Measurement] = []
    for shape in gemm_shapes(layers=cfg.layers or None, m_values=cfg.m_values or None):
        n_sets = V.rotation_sets(2 * (shape.m * shape.k + shape.n * shape.k))
        seed = V.seed_for("gemm", shape.m, shape.n, shape.k)
        a = [V.randn((shape.m, shape.k), seed=seed + 2 * i) for i in range(n_sets)]
        w = [V.randn((shape.n, shape.k), seed=seed + 2 * i + 1, scale=shape.k ** -0.5) for i in range(n_sets)]
        ref = a[0].float() @ w[0].float().t()
        key = dict(op="gemm", layer=shape.label, world_size=1, m=shape.m, k=shape.k, n=shape.n)
        for v in V.gemm_section_variants(a, w, ref):
            out.append(run_variant(ctx, v, key=key))
        del ref
        for scaling in cfg.scalings if cfg.dtype == "fp8" else ():
            for v in V.gemm_fp8_variants(a, w, scaling):
                out.append(run_variant(ctx, v, key=dict(key, dtype=fp8_label(scaling))))
            torch.cuda.empty_cache()
        del a, w
        torch.cuda.empty_cache()
        progress.step(f"gemm {shape.m}x{shape.n}x{shape.k}")
    return out


def enable_torch_symm_mem(group: dist.ProcessGroup) -> None:
    """Older torch needs the group registered for symmetric memory; newer torch deprecates the call
    but still accepts it."""
    import torch.distributed._symmetric_memory as symm_mem

    enabled = getattr(symm_mem, "is_symm_mem_enabled_for_group", None)
    enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
    if enable is not None and not (enabled is not None and enabled(group.group_name)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            enable(group.group_name)


def run_torch_phase(
    rows: dict[str, list[SuiteRow]], ctx: RankContext, progress: Progress, scalings: tuple[str, ...] = ()
) -> dict[tuple, Measurement]:
    """PyTorch async-TP on every row, keyed by ``(op, layer, M)``; with ``scalings`` also its scaled ops
    on the row's FP8 inputs, keyed by ``(op, layer, M, dtype)``."""
    assert ctx.group is not None
    enable_torch_symm_mem(ctx.group)
    out: dict[tuple[str, str, int], Measurement] = {}
    for op, op_rows in rows.items():
        for row in op_rows:
            x = V.make_inputs(row, rank=ctx.rank, world_size=ctx.world_size, group=ctx.group)
            key = _row_key(row, op=op, world_size=ctx.world_size)
            out[(op, row.layer.name, row.m)] = run_variant(ctx, V.torch_variant(x, group=ctx.group), key=key)
            for scaling in scalings:
                f = fp8_comm.make_fp8_inputs(x, scaling, group=ctx.group)
                label = fp8_label(scaling)
                out[(op, row.layer.name, row.m, label)] = run_variant(
                    ctx, fp8_comm.torch_variant(f, group=ctx.group), key=dict(key, dtype=label))
                del f
            del x
            torch.cuda.empty_cache()
            progress.step(f"torch {op} {row.layer.name} M={row.m}")
    return out


def run_main_phase(
    rows: dict[str, list[SuiteRow]],
    torch_rows: dict[tuple[str, str, int], Measurement],
    ctx: RankContext,
    progress: Progress,
    transports: dict[str, tuple[str, ...]] | None = None,
    ours_first: bool = False,
    rounds: int = 1,
    scalings: tuple[str, ...] = (),
) -> dict[str, list[Measurement]]:
    """cuBLAS, transport, NCCL alone, NCCL + cuBLAS and ours on every row (ours first with
    ``ours_first``; ``rounds`` times with the order mirrored each round, medians reported); merges in
    the torch phase's rows. With several ``transports`` for an op, ours runs once per transport (one
    op object each) and each gets its own section ``<op>-<transport>`` holding the shared baseline rows."""
    transports = transports or {}
    assert ctx.group is not None
    numel = max(
        (V.comm_source_numel(r, world_size=ctx.world_size) for op_rows in rows.values() for r in op_rows),
        default=0,
    )
    if not numel:
        return {}
    comm = V.CopyEngineComm(numel=numel, group=ctx.group, rank=ctx.rank, world_size=ctx.world_size)
    results: dict[str, list[Measurement]] = {}
    try:
        for op, op_rows in rows.items():
            several = len(transports.get(op, ())) > 1
            sections = [f"{op}-{t}" for t in transports[op]] if several else [op]
            ops = [V.ours_object(op, t, group=ctx.group) for t in transports[op]] if several else [None]
            for row in op_rows:
                x = V.make_inputs(row, rank=ctx.rank, world_size=ctx.world_size, group=ctx.group)
                key = _row_key(row, op=op, world_size=ctx.world_size)
                by_round = [in_row_order(
                    lambda: [run_variant(ctx, v, key=key) for v in (
                        V.gemm_variant(x),
                        comm.variant(x),
                        V.nccl_variant(x, group=ctx.group),
                        V.base_variant(x, group=ctx.group),
                    )],
                    lambda: [run_variant(ctx, V.ours_variant(x, group=ctx.group, op=obj), key=key) for obj in ops],
                    ours_first=ours_first_in_round(r, ours_first)) for r in range(rounds)]
                shared = [combine_rounds(list(per_variant)) for per_variant in zip(*(b for b, _ in by_round))]
                ours = [combine_rounds(list(per_variant)) for per_variant in zip(*(o for _, o in by_round))]
                if (op, row.layer.name, row.m) in torch_rows:
                    shared.append(torch_rows[(op, row.layer.name, row.m)])
                else:
                    shared.append(Measurement(**key, variant="torch", status="n/a", note="not run (--no-torch)"))
                for section, mine in zip(sections, ours):
                    results.setdefault(section, []).extend(
                        dataclasses.replace(r, op=section) for r in shared + [mine])
                for scaling in scalings:
                    fp8_rows = _fp8_row(x, scaling, torch_rows, ctx, key, op)
                    for section in sections:
                        results[section].extend(dataclasses.replace(r, op=section) for r in fp8_rows)
                x = None  # the row's inputs, freed before the next row's are made
                torch.cuda.empty_cache()
                progress.step(f"{op} {row.layer.name} M={row.m}")
    finally:
        comm.close()
    return results


def _fp8_row(x: V.RowInputs, scaling: str, torch_rows: dict, ctx: RankContext, key: dict, op: str) -> list[Measurement]:
    """One row's FP8 measurements in ``scaling``: base, torch (from the torch phase), ours."""
    f = fp8_comm.make_fp8_inputs(x, scaling, group=ctx.group)
    label = fp8_label(scaling)
    fkey = dict(key, dtype=label)
    base, _, ours = fp8_comm.variants(f, group=ctx.group)
    measured = [run_variant(ctx, base, key=fkey)]
    theirs = torch_rows.get((op, x.row.layer.name, x.row.m, label))
    measured.append(theirs if theirs is not None else
                    Measurement(**fkey, variant="torch", status="n/a", note="not run (--no-torch)"))
    measured.append(run_variant(ctx, ours, key=fkey))
    del f
    torch.cuda.empty_cache()
    return measured


def in_row_order(baselines: Callable[[], list], ours: Callable[[], list], *, ours_first: bool) -> tuple[list, list]:
    """``(baselines(), ours())``, called in the row's order: the baselines first unless ``ours_first``."""
    if ours_first:
        mine = ours()
        return baselines(), mine
    shared = baselines()
    return shared, ours()


def ours_first_in_round(r: int, ours_first: bool) -> bool:
    """Whether round ``r`` of a row times ours first: ``ours_first`` in even rounds, mirrored in odd ones."""
    return ours_first != (r % 2 == 1)


def combine_rounds(rounds: list[Measurement]) -> Measurement:
    """One variant's measurements of one row over several rounds as one: the median time (and host
    time and clock), the largest error and memory, the warm-up calls summed, each round's time in the
    note. A round that did not run ("FAILED", "n/a") stands for the variant."""
    if len(rounds) == 1:
        return rounds[0]
    failed = next((r for r in rounds if r.status != "ok"), None)
    if failed is not None:
        return failed

    def median(values):
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else None

    def largest(values):
        values = [v for v in values if v is not None]
        return max(values) if values else None

    return dataclasses.replace(
        rounds[-1], ms=median(r.ms for r in rounds), host_ms=median(r.host_ms for r in rounds),
        clock_mhz=median(r.clock_mhz for r in rounds), rel_err=largest(r.rel_err for r in rounds),
        mem_peak_mb=largest(r.mem_peak_mb for r in rounds), mem_other_mb=largest(r.mem_other_mb for r in rounds),
        warmup_calls=sum(r.warmup_calls or 0 for r in rounds),
        note="rounds: " + ", ".join(f"{r.ms:.4f}" for r in rounds) + " ms")


def run_block_phase(
    block_rows: list, names: tuple[str, ...], ctx: RankContext, progress: Progress, scalings: tuple[str, ...] = ()
) -> dict[tuple[str, int], list[Measurement]]:
    """The block variants ``names`` on every block row, keyed by ``(layer, M)``, and with ``scalings`` their
    FP8 forms (``tileweave.bench.block.measure_row``)."""
    from tileweave.bench import block as B

    assert ctx.group is not None
    if "torch" in names:
        enable_torch_symm_mem(ctx.group)
    out: dict[tuple[str, int], list[Measurement]] = {}
    for row in block_rows:
        x = B.make_block_inputs(row, rank=ctx.rank, world_size=ctx.world_size, group=ctx.group)
        out[(row.label, row.m)] = B.measure_row(x, names, rank=ctx.rank, world_size=ctx.world_size, scalings=scalings,
                                                run=lambda v, key: run_variant(ctx, v, key=key))
        del x
        torch.cuda.empty_cache()
        progress.step(f"block {'/'.join(names)} {row.label} M={row.m}")
    return out


def run_rank(
    cfg: BenchConfig, *, rank: int, world_size: int, group: dist.ProcessGroup | None
) -> dict[str, list[Measurement]]:
    """Everything one rank does; returns the measurements by section (complete on rank 0)."""
    clocks = ClockReader()
    dist_ctx = RankContext(
        rank=rank, world_size=world_size, group=group, clocks=clocks, timing=cfg.timing,
        agree=DistAgreement(group, torch.device("cuda", torch.cuda.current_device()))
        if group is not None else LocalAgreement(),
    )
    local_ctx = dataclasses.replace(dist_ctx, agree=LocalAgreement())

    coll_ops = [op for op in ("ag", "rs") if op in cfg.ops]
    rows = {
        op: select_rows(kind="AG" if op == "ag" else "RS", layers=cfg.layers or None,
                        m_values=cfg.m_values or None, world_size=world_size)
        for op in coll_ops
    }
    block_rows = []
    if "block" in cfg.ops:
        from tileweave.bench.block import select_block_rows

        block_rows = select_block_rows(layers=cfg.layers or None, m_values=cfg.m_values or None,
                                       world_size=world_size)
    n_gemm = len(gemm_shapes(layers=cfg.layers or None, m_values=cfg.m_values or None)) if "gemm" in cfg.ops else 0
    n_rows = sum(len(r) for r in rows.values()) + len(block_rows)
    progress = Progress(total=n_gemm + n_rows * (2 if cfg.include_torch else 1), enabled=rank == 0)
    results: dict[str, list[Measurement]] = {}
    try:
        if "gemm" in cfg.ops:
            if rank == 0:
                results["gemm"] = run_gemm_section(cfg, local_ctx, progress)
            if group is not None:
                dist.barrier(group=group, device_ids=[torch.cuda.current_device()])
        if coll_ops and (group is None or world_size < 2):
            raise RuntimeError(f"sections {', '.join(coll_ops)} need >= 2 ranks, got world_size={world_size}")
        if block_rows and group is None:
            raise RuntimeError("the block section needs a process group (of one rank or more)")
        if coll_ops or block_rows:
            scalings = cfg.scalings if cfg.dtype == "fp8" else ()
            torch_rows = (run_torch_phase(rows, dist_ctx, progress, scalings)
                          if cfg.include_torch and coll_ops else {})
            torch_blocks = (run_block_phase(block_rows, ("torch",), dist_ctx, progress, scalings)
                            if cfg.include_torch and block_rows and "torch" in cfg.block_variants else {})
            torch.cuda.synchronize()
            dist.barrier(group=group, device_ids=[torch.cuda.current_device()])
            results.update(run_main_phase(rows, torch_rows, dist_ctx, progress, cfg.transports, cfg.ours_first,
                                          cfg.rounds, scalings))
            names = tuple(v for v in ("floor", "base", "ours") if v in cfg.block_variants)
            if block_rows:
                ours = run_block_phase(block_rows, names, dist_ctx, progress, scalings) if names else {}
                dtypes = ["bf16", *map(fp8_label, scalings)]  # each row's bf16 variants, then its FP8 rows
                results["block"] = [
                    r for key in dict.fromkeys([*ours, *torch_blocks])
                    for r in sorted(ours.get(key, []) + torch_blocks.get(key, []),
                                    key=lambda r: (dtypes.index(r.dtype), BLOCK_VARIANTS.index(r.variant)))
                ]
    finally:
        progress.close()
    return results
