"""The things we time, per suite row: inputs, fp32 references, and one callable per variant.

Every variant is a ``call(i)`` that enqueues one call on input set ``i % n_sets`` and a ``check(out)``
that returns the relative Frobenius error of ``call(0)``'s result against an fp32 reference. Builders
run on every rank and issue the same collectives in the same order (reference collectives included).

Inputs are ``torch.randn`` with rank-specific seeds; weights are scaled by ``1/sqrt(K)`` (full K, also
for RS shards) so outputs, and RS sums over ranks, are O(1) and a relative error means something.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

import tileweave

from tileweave.bench import fp8
from tileweave.bench.suite import LocalShapes, SuiteRow, local_shapes
from tileweave.bench.timing import rotation_sets

DTYPE = torch.bfloat16
TOLERANCE = 1e-2
"""bf16 relative Frobenius error bound (docs/design.md, "Measuring")."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Variant:
    """One way of computing a row, ready to verify and time."""

    name: str
    call: Callable[[int], object] | None
    """Enqueues one call on input set ``i``; None when the implementation is not available."""
    check: Callable[[object], float] | None = None
    """Relative error of ``call(0)``'s result."""
    fence: Callable[[], None] | None = None
    """Runs around the timed batches (never inside)."""
    path: Callable[[], str | None] | None = None
    """Which code path ours took, asked after verification."""
    note: str = ""
    """Why ``call`` is None."""
    tolerance: float = TOLERANCE
    """The largest relative error ``check`` may return for the variant to pass."""


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref||_F / ||ref||_F`` in fp32; a shape mismatch is an error, NaN stays NaN."""
    if tuple(out.shape) != tuple(ref.shape):
        raise ValueError(f"output shape {tuple(out.shape)} != reference shape {tuple(ref.shape)}")
    num = torch.linalg.vector_norm(out.float() - ref)
    return float(num / torch.linalg.vector_norm(ref).clamp_min(1e-30))


def seed_for(*parts: object) -> int:
    """A seed that is stable across processes and runs (``hash`` of a str is salted per process)."""
    return zlib.crc32("/".join(map(str, parts)).encode()) & 0x7FFF_FFFF


def randn(shape: Sequence[int], *, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator(device="cuda")
    g.manual_seed(seed)
    t = torch.randn(tuple(shape), generator=g, device="cuda", dtype=DTYPE)
    return t.mul_(scale) if scale != 1.0 else t


def lookup_ours(name: str) -> tuple[Callable | None, str]:
    """``tileweave.<name>`` or ``(None, reason)``: a missing op makes its column n/a, not a crash."""
    try:
        return getattr(tileweave, name), ""
    except Exception as e:
        return None, f"tileweave.{name} unavailable: {type(e).__name__}: {e}"


def path_probe(op_name: str) -> Callable[[], str | None]:
    def probe() -> str | None:
        try:
            return str(tileweave.last_path(op_name))
        except Exception:
            return None

    return probe


def torch_async_tp(name: str) -> tuple[Callable | None, str]:
    """``torch.ops.symm_mem.<name>`` or ``(None, reason)``."""
    try:
        import torch.distributed._symmetric_memory  # noqa: F401  (registers the symm_mem ops)

        return getattr(torch.ops.symm_mem, name), ""
    except Exception as e:
        return None, f"torch.ops.symm_mem.{name} unavailable: {type(e).__name__}: {e}"


@dataclasses.dataclass(kw_only=True)
class RowInputs:
    """One rank's inputs for one suite row, ``n_sets`` of them, plus the fp32 references of set 0."""

    row: SuiteRow
    shapes: LocalShapes
    a: list[torch.Tensor]
    w: list[torch.Tensor]
    ref: torch.Tensor
    """The op's per-rank output for set 0, fp32."""
    local_ref: torch.Tensor
    """The local GEMM's output for set 0, fp32 (AG: gathered ``a`` @ ``w.t()``; RS: the partial)."""
    gathered: list[torch.Tensor] | None = None
    """AG only: NCCL all-gather of each set's shard, so the cuBLAS-only variant finds them in place."""
    partial0: torch.Tensor | None = None
    """RS only: set 0's bf16 partial ``a @ w.t()``, the data the copy-engine transport moves."""

    @property
    def n_sets(self) -> int:
        return len(self.a)


def make_inputs(row: SuiteRow, *, rank: int, world_size: int, group: dist.ProcessGroup) -> RowInputs:
    """Fresh random inputs and references for ``row``. Collective: every rank must call it."""
    s = local_shapes(row.layer, m=row.m, world_size=world_size)
    set_bytes = 2 * (s.a[0] * s.a[1] + s.w[0] * s.w[1])
    n = rotation_sets(set_bytes)
    base = seed_for(row.layer.name, row.m, world_size, rank)
    a = [randn(s.a, seed=base + 2 * i) for i in range(n)]
    w = [randn(s.w, seed=base + 2 * i + 1, scale=row.layer.k ** -0.5) for i in range(n)]
    if row.layer.kind == "AG":
        gathered = []
        for shard in a:
            g = torch.empty((row.m, s.a[1]), dtype=DTYPE, device="cuda")
            dist.all_gather_into_tensor(g, shard, group=group)
            gathered.append(g)
        local_ref = gathered[0].float() @ w[0].float().t()
        return RowInputs(row=row, shapes=s, a=a, w=w, ref=local_ref, local_ref=local_ref, gathered=gathered)
    local_ref = a[0].float() @ w[0].float().t()
    ref = torch.empty(s.out, dtype=torch.float32, device="cuda")
    dist.reduce_scatter_tensor(ref, local_ref, group=group)
    partial0 = a[0] @ w[0].t()
    return RowInputs(row=row, shapes=s, a=a, w=w, ref=ref, local_ref=local_ref, partial0=partial0)


def _checker(ref: torch.Tensor) -> Callable[[object], float]:
    return lambda out: rel_err(out, ref)  # type: ignore[arg-type]


def gemm_variant(x: RowInputs) -> Variant:
    """cuBLAS on the local GEMM with its inputs already in place: the compute floor."""
    lhs = x.gathered if x.gathered is not None else x.a
    return Variant(
        name="gemm",
        call=lambda i: torch.matmul(lhs[i % x.n_sets], x.w[i % x.n_sets].t()),
        check=_checker(x.local_ref),
    )


def base_variant(x: RowInputs, *, group: dist.ProcessGroup) -> Variant:
    """NCCL collective, then cuBLAS (or the reverse for RS): Megatron without overlap."""
    m, n = x.row.m, x.n_sets
    if x.row.layer.kind == "AG":
        k = x.shapes.a[1]

        def ag(i: int) -> torch.Tensor:
            g = torch.empty((m, k), dtype=DTYPE, device="cuda")
            dist.all_gather_into_tensor(g, x.a[i % n], group=group)
            return torch.matmul(g, x.w[i % n].t())

        return Variant(name="base", call=ag, check=_checker(x.ref))

    def rs(i: int) -> torch.Tensor:
        partial = torch.matmul(x.a[i % n], x.w[i % n].t())
        out = torch.empty(x.shapes.out, dtype=DTYPE, device="cuda")
        dist.reduce_scatter_tensor(out, partial, group=group)
        return out

    return Variant(name="base", call=rs, check=_checker(x.ref))


def nccl_variant(x: RowInputs, *, group: dist.ProcessGroup) -> Variant:
    """The NCCL collective alone (docs/design.md's "AG NCCL" and "RS NCCL" columns): the all-gather of the
    shard, or the reduce-scatter of the bf16 partial, into a fresh output."""
    m, n = x.row.m, x.n_sets
    if x.row.layer.kind == "AG":
        k = x.shapes.a[1]
        assert x.gathered is not None

        def ag(i: int) -> torch.Tensor:
            g = torch.empty((m, k), dtype=DTYPE, device="cuda")
            dist.all_gather_into_tensor(g, x.a[i % n], group=group)
            return g

        return Variant(name="nccl", call=ag, check=_checker(x.gathered[0]))
    assert x.partial0 is not None

    def rs(i: int) -> torch.Tensor:
        out = torch.empty(x.shapes.out, dtype=DTYPE, device="cuda")
        dist.reduce_scatter_tensor(out, x.partial0, group=group)
        return out

    return Variant(name="nccl", call=rs, check=_checker(x.ref))


def ours_object(op: str, transport: str, *, group: dist.ProcessGroup):
    """A tileweave op object with ``transport`` (its policy from TILEWEAVE_POLICY, its options from their
    environment variables, as the shared op takes them), for timing one transport next to others
    in one run."""
    cls = tileweave.AllGatherGemm if op == "ag" else tileweave.GemmReduceScatter
    return cls(group, transport=transport, **cls.env_options())


def ours_variant(x: RowInputs, *, group: dist.ProcessGroup, op: Callable | None = None) -> Variant:
    """tileweave's fused op (the functional one, or the op object ``op``), weights passed as ``w.t()``
    (a view; the op must not copy it)."""
    n = x.n_sets
    op_name = "all_gather_gemm" if x.row.layer.kind == "AG" else "gemm_reduce_scatter"
    if op is not None:
        return Variant(name="ours", call=lambda i: op(x.a[i % n], x.w[i % n].t()), check=_checker(x.ref),
                       path=path_probe(op_name))
    fn, note = lookup_ours(op_name)
    if fn is None:
        return Variant(name="ours", call=None, note=note)
    return Variant(
        name="ours",
        call=lambda i: fn(x.a[i % n], x.w[i % n].t(), group),
        check=_checker(x.ref),
        path=path_probe(op_name),
    )


def torch_variant(x: RowInputs, *, group: dist.ProcessGroup) -> Variant:
    """PyTorch async-TP. Run it in a phase of its own: it hung once in a process that also held
    other symmetric-memory buffers (docs/design.md)."""
    n, name = x.n_sets, group.group_name
    if x.row.layer.kind == "AG":
        fn, note = torch_async_tp("fused_all_gather_matmul")
        if fn is None:
            return Variant(name="torch", call=None, note=note)
        return Variant(
            name="torch",
            call=lambda i: fn(x.a[i % n], [x.w[i % n].t()], 0, name)[1][0],
            check=_checker(x.ref),
        )
    fn, note = torch_async_tp("fused_matmul_reduce_scatter")
    if fn is None:
        return Variant(name="torch", call=None, note=note)
    return Variant(
        name="torch",
        call=lambda i: fn(x.a[i % n], x.w[i % n].t(), "sum", 0, name),
        check=_checker(x.ref),
    )


def gemm_section_variants(a: list[torch.Tensor], w: list[torch.Tensor], ref: torch.Tensor) -> list[Variant]:
    """``torch.matmul`` against ``tileweave.matmul`` on one single-GPU GEMM."""
    n = len(a)
    fn, note = lookup_ours("matmul")
    cublas = Variant(name="cublas", call=lambda i: torch.matmul(a[i % n], w[i % n].t()), check=_checker(ref))
    if fn is None:
        return [cublas, Variant(name="ours", call=None, note=note)]
    ours = Variant(
        name="ours", call=lambda i: fn(a[i % n], w[i % n].t()), check=_checker(ref), path=path_probe("matmul")
    )
    return [cublas, ours]


def comm_source_numel(row: SuiteRow, *, world_size: int) -> int:
    """Elements one rank stages in the transport's symmetric buffer for ``row``, all sets included.

    AG: every set's own shard ``[M/W, K]``; RS: every set's full partial ``[M, N]`` (each peer pulls
    the rows it owns). Known before any row runs, so one buffer can be sized for the whole run.
    """
    s = local_shapes(row.layer, m=row.m, world_size=world_size)
    src = s.a[0] * s.a[1] if row.layer.kind == "AG" else row.m * row.layer.n
    return src * rotation_sets(2 * src)


class CopyEngineComm:
    """The communication alone on the copy engines: each rank pulls from peers' symmetric buffers.

    ``Tensor.copy_`` from a peer view runs on a copy engine (docs/design.md, "The flag protocol"), one side stream
    per peer so pulls from several peers proceed together. One buffer, sized once for every row of
    the run, is allocated and rendezvoused here (a collective), and freed by ``close``.
    """

    def __init__(self, *, numel: int, group: dist.ProcessGroup, rank: int, world_size: int) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        self.rank, self.world_size = rank, world_size
        self.buf = symm_mem.empty(numel, dtype=DTYPE, device="cuda")
        self.handle = symm_mem.rendezvous(self.buf, group.group_name)
        self.peers = [(rank + i) % world_size for i in range(1, world_size)]
        self.views = {p: self.handle.get_buffer(p, (numel,), DTYPE) for p in self.peers}
        self.streams = [torch.cuda.Stream() for _ in self.peers]

    def barrier(self) -> None:
        self.handle.barrier()

    def _quiesce(self) -> None:
        """No rank reads or writes the buffer past this point until every rank has reached it."""
        torch.cuda.synchronize()
        self.handle.barrier()
        torch.cuda.synchronize()

    def _pull(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        main = torch.cuda.current_stream()
        for stream, (dst, src) in zip(self.streams, pairs, strict=True):
            stream.wait_stream(main)
            with torch.cuda.stream(stream):
                dst.copy_(src)
        for stream in self.streams:
            main.wait_stream(stream)

    def variant(self, x: RowInputs) -> Variant:
        """Stage ``x``'s sources (collective: barriers on every rank) and return the ``comm`` variant."""
        r, w = self.rank, self.world_size
        m, s = x.row.m, x.shapes
        mw = m // w
        self._quiesce()  # peers may still be reading the previous row's data
        if x.row.layer.kind == "AG":
            k = s.a[1]
            n_sets = comm_source_numel(x.row, world_size=w) // (mw * k)
            for i in range(n_sets):
                self.buf[i * mw * k:(i + 1) * mw * k].view(mw, k).copy_(x.a[i % x.n_sets])
            dst = torch.empty((m, k), dtype=DTYPE, device="cuda")
            dst[r * mw:(r + 1) * mw].copy_(x.a[0])
            plans = [
                [(dst[p * mw:(p + 1) * mw], self.views[p][i * mw * k:(i + 1) * mw * k].view(mw, k))
                 for p in self.peers]
                for i in range(n_sets)
            ]
            assert x.gathered is not None
            gathered0 = x.gathered[0]

            def check(out: object) -> float:
                return rel_err(out, gathered0.float())  # type: ignore[arg-type]
        else:
            n = s.out[1]
            n_sets = comm_source_numel(x.row, world_size=w) // (m * n)
            for i in range(n_sets):
                part = x.partial0 if i == 0 else x.a[i % x.n_sets] @ x.w[i % x.n_sets].t()
                self.buf[i * m * n:(i + 1) * m * n].view(m, n).copy_(part)
            dst = torch.empty((len(self.peers), mw, n), dtype=DTYPE, device="cuda")
            plans = [
                [(dst[j], self.views[p][i * m * n:(i + 1) * m * n].view(m, n)[r * mw:(r + 1) * mw])
                 for j, p in enumerate(self.peers)]
                for i in range(n_sets)
            ]
            own = x.partial0[r * mw:(r + 1) * mw]

            def check(out: object) -> float:
                return rel_err(own.float() + out.float().sum(0), x.ref)  # type: ignore[union-attr]

        self._quiesce()  # every rank's sources are in place before anyone pulls

        def call(i: int) -> torch.Tensor:
            self._pull(plans[i % len(plans)])
            return dst

        return Variant(name="comm", call=call, check=check, fence=self.barrier)

    def close(self) -> None:
        self._quiesce()
        del self.views, self.handle, self.buf


def gemm_fp8_variants(a: list[torch.Tensor], w: list[torch.Tensor], scaling: str) -> list[Variant]:
    """torch's scaled matmul (``torch``) against ``tileweave.matmul`` (``ours``) on one single-GPU GEMM in
    FP8: ``a`` and the ``nn.Linear`` weights ``w`` quantised to e4m3 with ``scaling``'s scales
    (``tileweave.bench.fp8``), bf16 output, both checked against float32 of the dequantised inputs; a
    ``-fast`` scaling runs both with ``use_fast_accum=True``."""
    n = len(a)
    base, fast = fp8.split(scaling)
    qa = [fp8.quantize_rows(x, base) for x in a]
    qw = [fp8.quantize_weight(x, base) for x in w]
    ref = qa[0][2] @ qw[0][2].t()
    qa = [q[:2] for q in qa]  # the dequantised copies only make the reference
    qw = [q[:2] for q in qw]
    fn, note = fp8.torch_scaled_mm(scaling)
    if fn is None:
        theirs = Variant(name="torch", call=None, note=note)
    else:
        theirs = Variant(name="torch", check=_checker(ref),
                         call=lambda i: fn(qa[i % n][0], qw[i % n][0].t(), qa[i % n][1], qw[i % n][1]))
    ours_fn, note = lookup_ours("matmul")
    if ours_fn is None:
        return [theirs, Variant(name="ours", call=None, note=note)]
    ours = Variant(name="ours", check=_checker(ref), path=path_probe("matmul"),
                   call=lambda i: ours_fn(qa[i % n][0], qw[i % n][0].t(), scale_a=qa[i % n][1],
                                          scale_b=qw[i % n][1], use_fast_accum=fast))
    return [theirs, ours]
