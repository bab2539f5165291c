"""The benchmark suite of docs/design.md as data: layers, token counts, filters and per-rank shapes.

Shapes are per rank. A row names the full model dims (K, N) and the token count M over the TP group;
``local_shapes`` turns it into what one of W ranks holds:

=====  ====================  ==================  ===============  ===========================
kind   ``a`` (activation)    ``w`` (weight)      output           local GEMM (m x k) @ (k x n)
=====  ====================  ==================  ===============  ===========================
AG     ``a_shard [M/W, K]``  ``w [N/W, K]``      ``[M, N/W]``     ``[M, K] @ [K, N/W]``
RS     ``a [M, K/W]``        ``w [N, K/W]``      ``[M/W, N]``     ``[M, K/W] @ [K/W, N]``
=====  ====================  ==================  ===============  ===========================

Weights are kept ``[N, K]`` (``nn.Linear`` layout) and handed to every variant as ``w.t()``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Literal

Kind = Literal["AG", "RS"]
OpName = Literal["gemm", "ag", "rs", "block"]

OPS: tuple[OpName, ...] = ("gemm", "ag", "rs", "block")
"""Benchmark sections, in the order the CLI runs them."""
DEFAULT_OPS: tuple[OpName, ...] = ("gemm", "ag", "rs")
"""Sections run when ``--op`` is not given: docs/design.md's suite (the block section is asked for by name)."""

M_VALUES: tuple[int, ...] = (1024, 2048, 4096, 8192, 16384)
"""Token counts over the TP group (docs/design.md, "Measuring")."""

GEMM_TP_SIZES: tuple[int, ...] = (2, 8)
"""Shard sizes whose local GEMMs make up the single-GPU ``gemm`` section: the two ends of one node."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Layer:
    """One linear layer of a TP transformer, with its full (unsharded) dims."""

    name: str
    """``"<model> <part>"``, e.g. ``"llama3-8b qkv"``."""
    kind: Kind
    """AG for column-parallel layers (input gathered), RS for row-parallel ones (output scattered)."""
    k: int
    """Input features."""
    n: int
    """Output features."""

    @property
    def model(self) -> str:
        return self.name.split(" ", 1)[0]

    @property
    def part(self) -> str:
        return self.name.split(" ", 1)[1]


SUITE_LAYERS: tuple[Layer, ...] = (
    Layer(name="llama3-8b qkv", kind="AG", k=4096, n=6144),
    Layer(name="llama3-8b gate_up", kind="AG", k=4096, n=28672),
    Layer(name="llama3-70b qkv", kind="AG", k=8192, n=10240),
    Layer(name="llama3-70b gate_up", kind="AG", k=8192, n=57344),
    Layer(name="gpt3-175b fc1", kind="AG", k=12288, n=49152),
    Layer(name="llama3-8b o", kind="RS", k=4096, n=4096),
    Layer(name="llama3-8b down", kind="RS", k=14336, n=4096),
    Layer(name="llama3-70b o", kind="RS", k=8192, n=8192),
    Layer(name="llama3-70b down", kind="RS", k=28672, n=8192),
    Layer(name="gpt3-175b fc2", kind="RS", k=49152, n=12288),
)

BASELINE_LAYERS: tuple[Layer, ...] = tuple(
    Layer(name=f"design-table {kind.lower()}-k{k}-n{n}", kind=kind, k=k, n=n)
    for kind in ("AG", "RS")
    for k, n in ((12288, 49152), (8192, 28672), (8192, 8192), (4096, 14336))
)
"""The (K, N) pairs of docs/design.md's measured baseline table (its M values 2048..8192 come from --m),
for checking that this harness reproduces those baselines. Not in the default suite: select them
with ``--layer design-table``."""

QUICK_LAYERS: tuple[str, ...] = ("llama3-8b qkv", "llama3-70b gate_up", "llama3-8b o", "llama3-70b down")
"""``--quick``: one small and one large layer of each kind."""
QUICK_M_VALUES: tuple[int, ...] = (2048, 8192)
"""``--quick``: one launch-bound and one compute-bound token count."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class SuiteRow:
    """One (layer, M) point of the suite."""

    layer: Layer
    m: int
    """Tokens over the whole TP group."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class LocalShapes:
    """What one rank of a W-way TP group holds for one suite row (see the module table)."""

    a: tuple[int, int]
    """The rank's activation input (``a_shard`` for AG, ``a`` for RS)."""
    w: tuple[int, int]
    """The rank's weight, ``[N_loc, K_loc]``; passed to ops as ``w.t()``."""
    out: tuple[int, int]
    """The op's per-rank output."""
    gemm_m: int
    gemm_n: int
    gemm_k: int
    """The local GEMM, ``[gemm_m, gemm_k] @ [gemm_k, gemm_n]``."""

    @property
    def gemm_flops(self) -> int:
        return 2 * self.gemm_m * self.gemm_n * self.gemm_k


@dataclasses.dataclass(frozen=True, kw_only=True)
class GemmShape:
    """A single-GPU GEMM of the ``gemm`` section: ``[m, k] @ [k, n]``, deduplicated over sources."""

    m: int
    n: int
    k: int
    sources: tuple[str, ...]
    """Every suite row and TP size that produces this local GEMM, e.g. ``"llama3-8b qkv AG tp2"``."""

    @property
    def label(self) -> str:
        extra = f" (+{len(self.sources) - 1})" if len(self.sources) > 1 else ""
        return self.sources[0] + extra

    @property
    def flops(self) -> int:
        return 2 * self.m * self.n * self.k


def local_shapes(layer: Layer, *, m: int, world_size: int) -> LocalShapes:
    """Per-rank shapes of ``layer`` at ``m`` tokens over ``world_size`` ranks.

    Raises ``ValueError`` when a sharded dim does not divide evenly: the ops shard by whole rows and
    columns, so an uneven split is a different benchmark, not a rounding detail.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    sharded = {"M": m, "N": layer.n} if layer.kind == "AG" else {"M": m, "K": layer.k}
    for dim, value in sharded.items():
        if value % world_size:
            raise ValueError(
                f"{layer.name}: {dim}={value} is not divisible by world_size={world_size}; "
                f"pick M values and a world size that divide the {layer.kind} shard dims"
            )
    w = world_size
    if layer.kind == "AG":
        return LocalShapes(
            a=(m // w, layer.k), w=(layer.n // w, layer.k), out=(m, layer.n // w),
            gemm_m=m, gemm_n=layer.n // w, gemm_k=layer.k,
        )
    return LocalShapes(
        a=(m, layer.k // w), w=(layer.n, layer.k // w), out=(m // w, layer.n),
        gemm_m=m, gemm_n=layer.n, gemm_k=layer.k // w,
    )


def norm_name(name: str) -> str:
    """``name`` as filters compare it: lower case, ``_`` and ``/`` as spaces, single spaces."""
    return " ".join(name.lower().replace("_", " ").replace("/", " ").split())


def match_layers(filters: Sequence[str] | None, layers: Iterable[Layer] = SUITE_LAYERS) -> list[Layer]:
    """Layers selected by ``filters`` (all when empty).

    A filter matches a full name (``"llama3-8b qkv"``), a model (``"llama3-8b"``) or a part shared by
    models (``"qkv"``); case, ``_`` and spaces are not significant, so ``gate-up`` is not a match but
    ``gate_up`` and ``GATE UP`` are. A filter that matches nothing is an error, so a typo does not
    silently benchmark an empty suite.
    """
    layers = list(layers)
    if not filters:
        return layers
    if layers == list(SUITE_LAYERS):
        layers += BASELINE_LAYERS  # selectable by name, never part of the default suite
    chosen: list[Layer] = []
    for f in filters:
        key = norm_name(f)
        hits = [ly for ly in layers if key in (norm_name(ly.name), norm_name(ly.model), norm_name(ly.part))]
        if not hits:
            names = ", ".join(repr(ly.name) for ly in layers)
            raise ValueError(f"--layer {f!r} matches no layer; choose a name, model or part of: {names}")
        chosen.extend(h for h in hits if h not in chosen)
    # Keep suite order whatever the filter order, so result files line up between runs.
    return [ly for ly in layers if ly in chosen]


def select_rows(
    *,
    kind: Kind,
    layers: Sequence[str] | None = None,
    m_values: Sequence[int] | None = None,
    world_size: int,
) -> list[SuiteRow]:
    """Suite rows of one kind, filtered, in suite order; every row validated for ``world_size``."""
    ms = tuple(m_values) if m_values else M_VALUES
    for m in ms:
        if m <= 0:
            raise ValueError(f"--m values must be positive, got {m}")
    rows = [
        SuiteRow(layer=ly, m=m)
        for ly in match_layers(layers)
        if ly.kind == kind
        for m in ms
    ]
    for row in rows:
        local_shapes(row.layer, m=row.m, world_size=world_size)
    return rows


def gemm_shapes(
    *,
    layers: Sequence[str] | None = None,
    m_values: Sequence[int] | None = None,
    tp_sizes: Sequence[int] = GEMM_TP_SIZES,
) -> list[GemmShape]:
    """Local GEMMs of every selected suite row at each TP size, deduplicated by ``(m, n, k)``.

    Both kinds contribute: the ``gemm`` section measures the GEMM core on exactly the problems the
    fused ops hand it.
    """
    ms = tuple(m_values) if m_values else M_VALUES
    found: dict[tuple[int, int, int], list[str]] = {}
    for ly in match_layers(layers):
        for tp in tp_sizes:
            for m in ms:
                try:
                    s = local_shapes(ly, m=m, world_size=tp)
                except ValueError:
                    continue  # this M does not shard at this TP size; other sizes still apply
                key = (s.gemm_m, s.gemm_n, s.gemm_k)
                found.setdefault(key, []).append(f"{ly.name} {ly.kind} tp{tp}")
    return [GemmShape(m=m, n=n, k=k, sources=tuple(src)) for (m, n, k), src in found.items()]


def parse_ops(text: str) -> tuple[OpName, ...]:
    """``"gemm,ag"`` -> ``("gemm", "ag")`` in canonical order; unknown names are an error."""
    wanted = {t.strip().lower() for t in text.split(",") if t.strip()}
    unknown = wanted - set(OPS)
    if unknown or not wanted:
        raise ValueError(f"--op expects a comma list from {', '.join(OPS)}; got {text!r}")
    return tuple(op for op in OPS if op in wanted)


def parse_ints(text: str, *, name: str) -> tuple[int, ...]:
    """``"1024,2048"`` -> ``(1024, 2048)``; the error names the option."""
    try:
        values = tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise ValueError(f"{name} expects a comma list of integers, got {text!r}") from None
    if not values:
        raise ValueError(f"{name} expects at least one integer, got {text!r}")
    return values
