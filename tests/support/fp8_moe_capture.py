"""Every GEMM of ``TPMoE(fp8=...)``'s forward and backward captured as the layer runs it, each checked on
its own against float64, with the SwiGLU's backward between them: the per-cast counterpart of the
comparison with float64 of the same quantized math end to end.

That end-to-end comparison holds only where every activation before a cast equals the reference's to
the last bit: on a GPU, layer 0's output differs from float64 of its operands in its last bits (the FP8
MMA keeps fewer bits than fp32 inside a K step), which moves some of ``h`` (and, in the backward, of
``dy``) across a float8 rounding boundary, a whole e4m3 step (6-12%) each. Checked one cast and one
GEMM at a time, each against its own inputs, nothing compounds:

* cast: each float8 activation or gradient and its scales (``x``; ``dO`` and ``dy`` in the recipe's
  gradient format) equal torch's cast of the high-precision tensor the layer handed over
  (``support.fp8_reference.quantize32``, the recipe as ``FORMS`` restates it), bit for bit; and that
  tensor is the one it must be: the layer's input shard, the output gradient's shard, the SwiGLU
  backward's ``dy``. ``h``, which layer 0's SwiGLU epilogue casts from float32 values it never writes:
  layer 1's operand is that cast, and it equals the reference cast of the SwiGLU of layer 0's captured
  pre-activations, bit for bit on the CPU, within the GPU's float32 room on a GPU
  (``support.fp8_moe_hcast``);
* weight: each GEMM's float8 expert stack and its scales, read as the grouped GEMM reads them, equal
  torch's quantization of the rank's slice of the checkpoint weight in that GEMM's orientation (the
  stack as ``[E * N, K]``: one tensorwise scale per stack, a scale per row, 128 x 128 blocks);
* GEMM: layer 0 (the gathered rows: every rank's cast) and layer 1 (a sum over the top-k slots and the
  ranks) against float64 of every rank's dequantized operands, each pair ``(t, j)`` through expert
  ``ids[t, j]`` of the router (not of the plan), elementwise within ``support.fp8_checks.bounds``
  (layer 0's forward: its pre-activations); the rows layer 0 returns gathered equal every rank's cast
  bit for bit;
* plan: the same on every rank; pair ``(t, j)`` on a row of token t and expert ``ids[t, j]``; every row
  in the group of its source rank and expert;
* SwiGLU backward: its inputs bit for bit layer 0's gradient output, the forward's pre-activations and
  the routing weights; ``dy``, the scaled ``h`` and the row dots against float64 of those inputs;
* weight gradients (``support.fp8_moe_wgrad``, from the layout ``tileweave.nn.moe_fp8`` documents): the
  arguments (no row indices, no row scale, the plan's offsets with each group padded to 16 rows, K-major
  operands, the output in the weights' dtype); each float8 operand and its scales equal, bit for bit
  with zero padding rows, torch's cast along the tokens (``fp8_reference.quantize_along_rows32``: one
  scale, one per expert and feature, or one per 128 rows of a group and feature) of the values the recipe
  names: the gathered float8 ``dO`` or ``x`` (every rank's cast, above) dequantized in float32 and taken
  by the plan's tokens, in the gradient format or e4m3; the SwiGLU backward's ``dy`` or scaled ``h`` as it
  returned them; each output against float64 of its own dequantized operands summed over each expert's
  rows, within ``support.fp8_checks.bounds``.

``Capture`` wraps, while its context is open in one rank's process (the library is unchanged): the
layer's ops (``TPMoE.ops``: ``plan``, ``layer0``, ``layer1``; a ``layer0`` call whose SwiGLU epilogue
casts records its result as the cast of ``h``, with its pre-activations), its recipe's activation casts
(``TPMoE.fp8.lhs``), and ``tileweave.nn.moe_fp8``'s ``swiglu_grad`` and ``grouped_wgrad`` (the one launch
of each weight gradient, which ``moe_fp8.expert_wgrad`` makes: its arguments as the kernel takes them).
"""

from __future__ import annotations

import dataclasses
import inspect

import torch

from support import fp8_moe_wgrad as wgrad
from support.fp8_checks import (FLOAT8, GROUPS, OUT_UNIT, U32, Worst, bounds, dequantize_a, dequantize_b,
                                exchange, ratio, same_scale, snapshot, to_cpu)
from support.fp8_moe_hcast import ELEMENTWISE_UNITS, h_cast_difference
from support.fp8_reference import E4M3, FORMS, expand_scale, quantize32
from tileweave.nn import moe_fp8
from tileweave.ops.compute.quantize import Quantized

NAMES = ("plan", "x @ w0", "h @ w1", "dO @ w1", "swiglu grad", "w1 grad", "dy @ w0", "w0 grad")
"""What one forward and backward runs, each once: the plan, the four float8 GEMMs (layer 0, layer 1,
layer 0 and layer 1 of the input gradient), the SwiGLU's backward and the two weight gradients."""
LAYER0 = ("x @ w0", "dO @ w1")
GRADS = ("dO @ w1", "dy @ w0")
"""The GEMMs whose first operand is a gradient (the recipe's gradient format)."""


@dataclasses.dataclass
class GemmCall:
    """One float8 GEMM of the MoE pair: what was cast (``x``; where ``fused``, the cast of ``h`` by layer
    0's epilogue: the pre-activations ``[P, 2F]`` whose SwiGLU it cast), the operands as the op received
    them (``a [rows, K]``, ``b [E, K, N]``, their scales), its output (layer 0: ``[P, N]`` in plan order,
    the float8 ``h`` where its epilogue casts; layer 1: this rank's ``[T/W, N]``), the device type it ran
    on, and where given: layer 0's pre-activations and gathered rows, layer 1's routing weights."""

    phase: str
    name: str
    x: torch.Tensor
    a: torch.Tensor
    scale_a: torch.Tensor
    b: torch.Tensor
    scale_b: torch.Tensor
    out: torch.Tensor
    fast: bool
    fused: bool = False
    device: str = "cpu"
    pre: torch.Tensor | None = None
    gathered: torch.Tensor | None = None
    gathered_scales: torch.Tensor | None = None
    weights: torch.Tensor | None = None

    def label(self) -> str:
        return f"{self.phase} {self.name}"


@dataclasses.dataclass
class Routing:
    """One call's ids ``[T/W, k]`` and the plan built from them."""

    phase: str
    ids: torch.Tensor
    pair_row: torch.Tensor
    row_token: torch.Tensor
    row_expert: torch.Tensor
    offsets: torch.Tensor


@dataclasses.dataclass
class SwiGLUGradCall:
    phase: str
    g: torch.Tensor
    pre: torch.Tensor
    row_scale: torch.Tensor
    dy: torch.Tensor
    h_scaled: torch.Tensor
    row_dot: torch.Tensor


@dataclasses.dataclass
class WgradCall:
    """One weight-gradient GEMM: its arguments by name (``grouped_wgrad``'s), its output, and whether both
    operands were K-major (``[P16, C]`` views of ``[C, P16]``: the plan rows contiguous)."""

    phase: str
    name: str
    args: dict
    out: torch.Tensor
    k_major: bool

    def label(self) -> str:
        return f"{self.phase} {self.name}"


class _Recorded:
    """The layer's recipe with every ``lhs`` cast handed to ``record(x, q)``; all else the recipe's."""

    def __init__(self, recipe, record) -> None:
        self._recipe, self._record = recipe, record

    def __getattr__(self, name):
        return getattr(self._recipe, name)

    def lhs(self, x, **kw):
        q = self._recipe.lhs(x, **kw)
        self._record(x, q)
        return q


class Capture:
    """``with Capture(layer) as cap:`` records the calls made inside (forward and backward), labelled
    with ``cap.phase`` (set it before each step); module docstring."""

    def __init__(self, layer) -> None:
        self.layer = layer
        self.phase = ""
        self.gemms: list[GemmCall] = []
        self.routing: list[Routing] = []
        self.swiglu: list[SwiGLUGradCall] = []
        self.wgrads: list[WgradCall] = []
        self.calls: list[tuple[str, str]] = []
        self._pending: tuple | None = None
        self._saved: list[tuple] = []

    def __enter__(self) -> "Capture":
        m = self.layer
        if m.fp8 is None:
            raise ValueError("Capture needs a TPMoE with fp8")
        self._saved = [(m, "ops", m.ops), (m, "fp8", m.fp8), (moe_fp8, "swiglu_grad", moe_fp8.swiglu_grad),
                       (moe_fp8, "grouped_wgrad", moe_fp8.grouped_wgrad)]
        m.ops = dataclasses.replace(m.ops, plan=self._plan(m.ops.plan), layer0=self._gemm(0, m.ops.layer0),
                                    layer1=self._gemm(1, m.ops.layer1))
        m.fp8 = _Recorded(m.fp8, self._cast)
        moe_fp8.swiglu_grad = self._swiglu_grad(moe_fp8.swiglu_grad)
        moe_fp8.grouped_wgrad = self._wgrad(moe_fp8.grouped_wgrad)
        return self

    def __exit__(self, kind, value, tb) -> None:
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        if kind is None and self._pending is not None:
            raise AssertionError(f"{self.phase}: a cast whose operands reached no GEMM")

    def outputs(self, phase: str) -> dict[str, torch.Tensor]:
        """The output of each GEMM and weight gradient of ``phase``, by name."""
        return {c.name: c.out for c in self.gemms + self.wgrads if c.phase == phase}

    def _cast(self, x, q) -> None:
        if self._pending is not None:
            raise AssertionError(f"{self.phase}: cast again before its GEMM ran")
        self._pending = (snapshot(x), q, False)  # (what was cast, the cast, made by layer 0's epilogue)

    def _name(self, layer: int, w: torch.Tensor) -> str:
        fl = self.layer.ffn_local
        found = {(0, 2 * fl): "x @ w0", (0, fl): "dO @ w1", (1, fl): "h @ w1", (1, 2 * fl): "dy @ w0"}
        key = (layer, w.shape[2] if layer == 0 else w.shape[1])
        if key not in found:
            raise AssertionError(f"layer {layer}: an expert stack of shape {tuple(w.shape)}, not the layer's")
        return found[key]

    def _plan(self, plan_fn):
        def wrapped(ids, num_experts, group):
            plan = plan_fn(ids, num_experts, group)
            self.routing.append(Routing(self.phase, snapshot(ids), snapshot(plan.pair_row), snapshot(plan.row_token),
                                        snapshot(plan.row_expert), snapshot(plan.offsets)))
            self.calls.append((self.phase, "plan"))
            return plan
        return wrapped

    def _gemm(self, layer: int, gemm):
        def wrapped(a, w, plan, *args, **kw):
            if a.dtype not in FLOAT8:
                return gemm(a, w, plan, *args, **kw)
            name = self._name(layer, w)
            if self._pending is None:
                raise AssertionError(f"{self.phase} {name}: float8 operands that no cast of the layer produced")
            x, q, fused = self._pending
            self._pending = None
            if not (a is q.data and kw.get("scale_a") is q.scale):
                raise AssertionError(f"{self.phase} {name}: operands other than those the cast produced")
            result = gemm(a, w, plan, *args, **kw)
            kept = isinstance(result, tuple) and not isinstance(result, Quantized)
            y, gathered, scales = result if kept else (result, None, None)
            pre = snapshot(getattr(kw.get("epilogue"), "pre", None))
            self.gemms.append(GemmCall(
                self.phase, name, x, *map(snapshot, (a, q.scale, w, kw.get("scale_b"))),
                snapshot(y.data if isinstance(y, Quantized) else y), bool(kw.get("use_fast_accum")), fused,
                a.device.type, pre=pre, gathered=snapshot(gathered), gathered_scales=snapshot(scales),
                weights=snapshot(args[0]) if layer == 1 else None))
            self.calls.append((self.phase, name))
            if isinstance(y, Quantized):  # the epilogue's cast of h: the next GEMM's operand
                self._pending = (pre, y, True)
            return result
        return wrapped

    def _swiglu_grad(self, fn):
        def wrapped(g, pre, row_scale):
            dy, h_scaled, row_dot = fn(g, pre, row_scale)
            self.swiglu.append(SwiGLUGradCall(self.phase, *map(snapshot, (g, pre, row_scale, dy, h_scaled, row_dot))))
            self.calls.append((self.phase, "swiglu grad"))
            return dy, h_scaled, row_dot
        return wrapped

    def _wgrad(self, fn):
        signature = inspect.signature(fn)

        def wrapped(*args, **kw):
            out = fn(*args, **kw)
            bound = signature.bind(*args, **kw)
            bound.apply_defaults()
            e, fl, hidden = out.shape[0], self.layer.ffn_local, self.layer.hidden
            names = {(2 * fl, hidden): "w0 grad", (hidden, fl): "w1 grad"}
            if tuple(out.shape[1:]) not in names:
                raise AssertionError(f"{self.phase}: a weight gradient of shape {tuple(out.shape)}, not the layer's")
            name = names[tuple(out.shape[1:])]
            args_ = {k: snapshot(v) for k, v in bound.arguments.items() if k not in ("out", "config")}
            k_major = all(bound.arguments[side].stride(0) == 1 for side in ("lhs", "rhs"))
            self.wgrads.append(WgradCall(self.phase, name, args_, snapshot(out), k_major))
            self.calls.append((self.phase, name))
            return out
        return wrapped


# -- the checks ------------------------------------------------------------------------------------------

def local_weights(state: dict, scaling: str, world: int, rank: int) -> dict[str, torch.Tensor]:
    """float64 of torch's quantization of ``rank``'s slice of each expert stack, per GEMM in its operand
    layout ``[E, K, N]``: ``w0 [E, 2F/W, H]`` (its gate rows, then its up rows) and ``w1 [E, H, F/W]``
    quantized as ``[E * N, K]`` for the forward, and transposed for the input gradient."""
    groups, pow2 = GROUPS[scaling][1], FORMS[scaling][3]
    gate, up, down = (state[n].float() for n in ("experts.gate", "experts.up", "experts.down"))
    fl = gate.shape[1] // world
    cols = slice(rank * fl, (rank + 1) * fl)
    w0, w1 = torch.cat([gate[:, cols], up[:, cols]], dim=1), down[:, :, cols]
    out = {}
    for name, w in (("x @ w0", w0), ("h @ w1", w1), ("dO @ w1", w1.transpose(1, 2)), ("dy @ w0", w0.transpose(1, 2))):
        e, n, k = w.shape
        q, scale = quantize32(w.reshape(e * n, k).contiguous(), groups, E4M3, pow2)
        deq = q.double() * expand_scale(scale, groups, e * n, k).double()
        out[name] = deq.view(e, n, k).transpose(1, 2)
    return out


def _stack(b: torch.Tensor, scale_b: torch.Tensor, scaling: str) -> torch.Tensor:
    """float64 ``[E, K, N]`` of a grouped GEMM's float8 ``b`` and per-expert ``scale_b``."""
    return torch.stack([dequantize_b(b[e], scale_b[e], scaling) for e in range(b.shape[0])])


def _routed(a: torch.Tensor, b: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 ``(ref, magnitude) [T, k, N]``: ``a[t, j] @ b[ids[t, j]]`` for ``a [T, k, K]``, ``b [E, K, N]``."""
    ref = torch.zeros(*ids.shape, b.shape[2], dtype=torch.float64)
    mag = torch.zeros_like(ref)
    for e in range(b.shape[0]):
        chosen = ids == e
        ref[chosen], mag[chosen] = a[chosen] @ b[e], a[chosen].abs() @ b[e].abs()
    return ref, mag


def _gathered_scales(scale: torch.Tensor, rows: int) -> torch.Tensor:
    """A cast's scales in the gathered form ``[rows, KB]`` (a tensorwise scale on every row)."""
    return scale.reshape(1, 1).expand(rows, 1) if scale.numel() == 1 and scale.dim() < 2 else scale


def _plan_ok(r: Routing, ids: torch.Tensor, world: int) -> bool:
    """Pair (t, j) on a row of token t and expert ``ids[t, j]``; every row in the group of its source
    rank and expert (group ``g = s * E + e``: rows ``[offsets[g], offsets[g + 1])``)."""
    t, k = ids.shape
    pr, off = r.pair_row.long(), r.offsets.long()
    experts = (off.numel() - 1) // world
    if not torch.equal(pr.reshape(-1).sort().values, torch.arange(t * k)):
        return False
    group = torch.searchsorted(off[1:], torch.arange(t * k), right=True)
    return (torch.equal(r.row_expert.long()[pr], ids)
            and torch.equal(r.row_token.long()[pr], torch.arange(t)[:, None].expand(t, k))
            and off[0] == 0 and off[-1] == t * k and bool((off[1:] >= off[:-1]).all())
            and torch.equal(r.row_expert.long(), group % experts)
            and torch.equal(r.row_token.long() // (t // world), group // experts))


def _swiglu_grad_ratio(c: SwiGLUGradCall) -> float:
    """The largest ratio of an error of ``dy``, ``h_scaled`` and ``row_dot`` to its bound: float64 of the
    call's own inputs, the output dtype's rounding of it, ``ELEMENTWISE_UNITS`` float32 units of its
    terms' magnitudes (and one per column summed for the row dots)."""
    g, gate, up = c.g.double(), c.pre[:, 0::2].double(), c.pre[:, 1::2].double()
    w = c.row_scale.double()[:, None]
    s = torch.sigmoid(gate)
    silu, dh = gate * s, w * g
    h = silu * up
    refs = {"dy": (torch.cat([dh * up * s * (1 + gate * (1 - s)), dh * silu], 1),
                   torch.cat([(dh * up).abs() * s * (1 + gate.abs() * (1 - s)), (dh * silu).abs()], 1)),
            "h_scaled": (w * h, (w * h).abs())}
    worst = 0.0
    for name, (ref, mag) in refs.items():
        got = getattr(c, name)
        bound = OUT_UNIT[got.dtype] * ref.abs() + ELEMENTWISE_UNITS * U32 * mag + 1e-300
        worst = max(worst, ratio((got.double() - ref).abs(), bound))
    dot_mag = (g * h).abs().sum(1)  # float32 sums of N products, rounded to float32
    bound = (g.shape[1] + ELEMENTWISE_UNITS + 1) * U32 * dot_mag + 1e-300
    return max(worst, ratio((c.row_dot.double() - (g * h).sum(1)).abs(), bound))


def _layer0(call: GemmCall, every: list, ids: torch.Tensor, pair_row: torch.Tensor, scaling: str, worst: Worst
            ) -> None:
    """Layer 0's output (the forward's: its pre-activations, where kept; its cast of ``h`` is checked
    from them) against float64 of every rank's cast rows and this rank's experts, added to ``worst``."""
    a_all = torch.cat([dequantize_a(a, sa, scaling) for a, sa, *_ in every])
    t, k = ids.shape
    ref, mag = _routed(a_all[:, None, :].expand(t, k, -1), _stack(call.b, call.scale_b, scaling), ids)
    kk = call.a.shape[1]
    fast = kk if call.fast else 0
    fl = ref.shape[2] // 2
    if call.name == "dO @ w1":
        got = call.out[pair_row]
        worst.add(call.label(), got, ref, (got.double() - ref).abs(),
                  *bounds(call.out.dtype, ref, mag, kk, fast_k=fast))
        return
    if call.pre is not None:  # kept for the backward
        pre_ref = torch.stack([ref[..., :fl], ref[..., fl:]], -1).reshape(t, k, 2 * fl)  # gate j, up j side by side
        pre_mag = torch.stack([mag[..., :fl], mag[..., fl:]], -1).reshape(t, k, 2 * fl)
        pre = call.pre[pair_row]
        worst.add(call.label() + " pre", pre, pre_ref, (pre.double() - pre_ref).abs(),
                  *bounds(call.pre.dtype, pre_ref, pre_mag, kk, fast_k=fast))


def _layer1(call: GemmCall, every: list, ids: torch.Tensor, pair_rows: list, weights, scaling: str, rank: int,
            worst: Worst) -> None:
    """Layer 1's rows of this rank against float64 of the sum over the ranks and the top-k slots of every
    rank's cast rows through its experts, weighted by ``weights [T, k]`` (None: 1), added to ``worst``."""
    t, k = ids.shape
    world = len(every)
    wt = torch.ones(t, k, dtype=torch.float64) if weights is None else weights.double()
    ref = torch.zeros(t, call.b.shape[2], dtype=torch.float64)
    mag = torch.zeros_like(ref)
    for (a, sa, b, sb, _), pr in zip(every, pair_rows):
        z, zm = _routed(dequantize_a(a, sa, scaling)[pr], _stack(b, sb, scaling), ids)
        ref += (wt[..., None] * z).sum(1)
        mag += (wt.abs()[..., None] * zm).sum(1)
    rows = slice(rank * t // world, (rank + 1) * t // world)
    ref, mag, kk = ref[rows], mag[rows], call.a.shape[1]
    # the K products, then the k slots and the W ranks added; Z and each rank's partial in the output dtype
    worst.add(call.label(), call.out, ref, (call.out.double() - ref).abs(),
              *bounds(call.out.dtype, ref, mag, kk + k + world, reduced=True, fast_k=kk if call.fast else 0))


def check(cap: Capture, state: dict, *, scaling: str, world: int, rank: int, dtype: torch.dtype,
          inputs: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> dict:
    """Every captured call checked (module docstring); ``state``: the unsharded float32 weights as the
    layer holds them (rounded to ``dtype``), ``inputs``: per phase the rank's ``(x_shard, dout_shard)``.
    Collective (the ranks exchange their operands). Returns lists of labels (empty when all hold):
    ``casts`` (a cast, the weight gradients' too, unequal to torch's bit for bit; ``h``'s not holding to
    ``fp8_moe_hcast``'s reference), ``weights`` (a weight operand unequal to torch's quantization of the
    checkpoint), ``operands`` (a cast's input, a gathered result or the SwiGLU backward's operand not the
    tensor it must be; ``h @ w1``'s operand not layer 0's epilogue cast, or another GEMM's that; a weight
    gradient's arguments or layout not the documented ones; a plan that routes wrongly or differs between
    ranks); ``gemm``, ``gemm_fp32``, ``gemm_mma``, ``worst`` (``fp8_checks.Worst``, over the four float8
    GEMMs and layer 0's pre-activations); ``swiglu_grad`` (the SwiGLU backward's worst ratio to its
    bound); ``wgrad``, ``wgrad_fp32``, ``wgrad_mma``, ``wgrad_worst`` (``Worst``'s keys over the two weight
    gradients); ``details`` (how ``h``'s cast and each weight-gradient cast, or a scale table outside the
    documented layout, differs); ``calls`` (``(phase, name)`` in order) and ``expected`` (each phase ran
    each of ``NAMES`` once)."""
    a_groups, (grad_dtype, pow2) = GROUPS[scaling][0], FORMS[scaling][2:]
    gemms, routing = [to_cpu(c) for c in cap.gemms], [to_cpu(r) for r in cap.routing]
    swiglu = {c.phase: to_cpu(c) for c in cap.swiglu}
    wgrads = [dataclasses.replace(c, args={k: v.cpu() if isinstance(v, torch.Tensor) else v
                                           for k, v in c.args.items()}, out=c.out.cpu()) for c in cap.wgrads]
    theirs = exchange([(c.a, c.scale_a, c.b, c.scale_b, c.weights) for c in gemms]
                      + [(r.ids, r.pair_row, r.row_token, r.row_expert, r.offsets) for r in routing])
    if len({len(t) for t in theirs}) != 1:
        raise AssertionError(f"the ranks captured different numbers of calls: {[len(t) for t in theirs]}")
    every = {(c.phase, c.name): [t[j] for t in theirs] for j, c in enumerate(gemms)}
    plans = {r.phase: [t[len(gemms) + i] for t in theirs] for i, r in enumerate(routing)}
    by = {(c.phase, c.name): c for c in gemms}
    weights = local_weights(state, scaling, world, rank)
    phases = sorted({p for p, _ in cap.calls})
    out = {"casts": [], "weights": [], "operands": [], "details": [], "swiglu_grad": 0.0, "calls": list(cap.calls),
           "expected": all(sorted(n for p, n in cap.calls if p == phase) == sorted(NAMES) for phase in phases)}

    def same(label: str, got, want) -> None:
        if got is None or want is None or got.dtype != want.dtype or not torch.equal(got, want):
            out["operands"].append(label)

    ids, routed = {}, {}
    for phase, plan in plans.items():
        ids[phase] = torch.cat([p[0] for p in plan]).long()
        if not (all(torch.equal(a, b) for p in plan for a, b in zip(p[1:], plan[rank][1:]))
                and _plan_ok(Routing(phase, *plan[rank]), ids[phase], world)):
            out["operands"].append(f"{phase} plan")
        if (phase, "h @ w1") in every:  # layer 1's routing weights: every rank's shard
            routed[phase] = torch.cat([o[4] for o in every[phase, "h @ w1"]])
    worst = Worst()
    for call in gemms:
        label, phase = call.label(), call.phase
        fmt = grad_dtype if call.name in GRADS else E4M3
        if call.fused:  # h, cast by layer 0's epilogue from the pre-activations call.x
            differ = None if call.x is None else h_cast_difference(label, call.a, call.scale_a, call.x, a_groups,
                                                                    pow2, exact=call.device == "cpu")
            if differ is not None:
                out["casts"].append(label)
                out["details"].append(differ)
        else:
            q, scale = quantize32(call.x.float(), a_groups, fmt, pow2)
            if not (call.a.dtype == fmt and torch.equal(call.a.view(torch.uint8), q.view(torch.uint8))
                    and same_scale(call.scale_a, scale)):
                out["casts"].append(label)
        if not torch.equal(_stack(call.b, call.scale_b, scaling), weights[call.name]):
            out["weights"].append(label)
        source = {"x @ w0": inputs[phase][0], "dO @ w1": inputs[phase][1],
                  "h @ w1": getattr(by.get((phase, "x @ w0")), "pre", None),
                  "dy @ w0": getattr(swiglu.get(phase), "dy", None)}[call.name]
        same(f"{label} cast input", call.x, source)
        if call.fused != (call.name == "h @ w1"):  # h only from layer 0's epilogue, the rest from lhs
            out["operands"].append(f"{label} cast")
        everyone, pair_rows = every[phase, call.name], [p[1].long() for p in plans[phase]]
        if call.name in LAYER0:
            _layer0(call, everyone, ids[phase], pair_rows[rank], scaling, worst)
            if call.gathered is not None:
                same(f"{label} gathered", call.gathered.view(torch.uint8),
                     torch.cat([a for a, *_ in everyone]).view(torch.uint8))
                same(f"{label} gathered scales", call.gathered_scales,
                     torch.cat([_gathered_scales(sa, a.shape[0]) for a, sa, *_ in everyone]))
        else:
            _layer1(call, everyone, ids[phase], pair_rows, routed.get(phase) if call.name == "h @ w1" else None,
                    scaling, rank, worst)
    for phase, c in swiglu.items():
        same(f"{phase} swiglu grad g", c.g, getattr(by.get((phase, "dO @ w1")), "out", None))
        same(f"{phase} swiglu grad pre", c.pre, getattr(by.get((phase, "x @ w0")), "pre", None))
        same(f"{phase} swiglu grad routing weights", c.row_scale[plans[phase][rank][1].long()], routed.get(phase))
        out["swiglu_grad"] = max(out["swiglu_grad"], _swiglu_grad_ratio(c))
    wg = Worst()
    for c in wgrads:
        wgrad.check_call(c, every, plans[c.phase][rank], swiglu.get(c.phase), scaling, world, dtype, out, wg)
    out.update(wgrad=wg.gemm, wgrad_fp32=wg.gemm_fp32, wgrad_mma=wg.gemm_mma, wgrad_worst=wg.worst)
    return {**out, **worst.keys()}
