"""A tensor-parallel mixture-of-experts layer with sequence parallelism, on the MoE pair.

Every rank holds every expert, sharded along the expert FFN width F (rank r: features
``[r*F/W, (r+1)*F/W)``), and the tokens are sharded between layers like the dense TP block's:

    logits = x_shard @ router.T                         # [T/W, E], replicated router, fp32
    wt, ids = topk(softmax(logits), k)                   # [T/W, k]; wt / wt.sum() if normalize_topk
    plan = moe_plan(ids)                                 # collective: every rank's ids, grouped
    gate | up = AG(x_shard)[tok(p)] @ w0[e(p)].T         # layer 0: [T*k, 2*F_loc]
    h = silu(gate) * up                                  # [T*k, F_loc], in layer 0's epilogue
    out_shard = RS(sum_j wt[t, j] * h[p(t, j)] @ w1[e].T)  # layer 1: [T/W, H]

=======================  ======================  ==================================================
tensor                   shape (per rank)        meaning
=======================  ======================  ==================================================
``x_shard``              ``[T/W, H]``            this rank's tokens (rank r: ``[r*T/W, (r+1)*T/W)``)
``router.weight``        ``[E, H]``              replicated on every rank
``w0``                   ``[E, 2*F_loc, H]``     per expert an ``nn.Linear(H, 2*F_loc)`` weight:
                                                 rows ``[0, F_loc)`` this rank's gate rows, rows
                                                 ``[F_loc, 2*F_loc)`` its up rows
``w1``                   ``[E, H, F_loc]``       per expert an ``nn.Linear(F_loc, H)`` weight: this
                                                 rank's columns of the down projection
result                   ``[T/W, H]``            the layer's output for this rank's tokens
=======================  ======================  ==================================================

Routing: softmax over all E experts in fp32, then the top k; with ``normalize_topk`` (default, as in
Mixtral and Qwen3-MoE) the k weights are divided by their sum, without it (DeepSeek-V2) they are the
softmax probabilities themselves. Equal probabilities are ordered as ``torch.topk`` orders them. With
k = 1 and ``normalize_topk`` every weight is 1 and the router gets no gradient from this layer.

Backward runs on the same ops by duality (``tileweave.nn.moe_autograd``). The router is replicated:
like the dense block's norm weights, each rank's ``router.weight.grad`` covers its own tokens, and the
gradient of the replicated weight is their sum over the group (``all_reduce_replicated_grads``).

Kept for backward, per rank: the gathered input ``[T, H]`` (unless ``save_gathered=False``: gathered
again) and layer 0's pre-activations ``[T*k, 2*F_loc]`` (on ops without epilogues: layer 0's output
``[T*k, 2*F_loc]`` and the SwiGLU output ``[T*k, F_loc]``).

**Replicated mode** (``replicated``: decode, and prefill batches too small to shard), forward only: every
rank holds all T tokens ``x [T, H]`` (the same on every rank, as the decoder's replicated activations),
and the experts stay sharded on F:

    wt, ids = topk(softmax(x @ router.T), k)             # [T, k], the same on every rank
    plan = build_plan(ids, world_size=1)                  # local: every rank has the same ids
    h = silu(gate) * up, gate | up = x[tok(p)] @ w0[e(p)].T  # [T*k, F_loc], rows gathered by the plan
    partial[t] = sum_j wt[t, j] * (h @ w1[e].T)[p(t, j)]  # [T, H], this rank's F_loc share
    out = sum over ranks of partial                       # all-reduce, rank order

No collective builds the plan: the router is replicated, so every rank routes its identical tokens
alike. The sum over ranks is ``GemmAllReduce.all_reduce`` (``tileweave.ops.functional.all_reduce_sum``):
the one-shot or two-shot transport (partials summed in fp32 in rank order, bitwise the same on every
rank) or NCCL, by the op's rule; with ``TILEWEAVE_GRAPHABLE=1`` the call can be captured in a CUDA graph
(nothing in this mode reads a device value on the host), as the dense decoder's decode step is.

Every rank must call the layer, its backward and the state-dict methods in the same order, like any
collective. Neither pass reads expert counts on the host on tileweave's ops (the layer's plan skips
the host check of the ids: its router makes them); on other ops (``ops=``) the weight gradients read
them where ``torch._grouped_mm`` does not take the shapes (``tileweave.nn.moe_autograd``).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tileweave.nn.fp8 import resolve
from tileweave.nn.moe_autograd import TILEWEAVE_OPS, ExpertsDown, ExpertsUp, FusedExperts, MoEOps
from tileweave.nn.moe_fp8 import FusedExpertsFP8
from tileweave.nn.shards import gather_shards
from tileweave.ops.common import signature_of
from tileweave.ops.compute.grouped_gemm import SwiGLU, grouped_gemm
from tileweave.ops.compute.topk_reduce import topk_reduce
from tileweave.ops.functional import all_reduce_sum
from tileweave.ops.moe.plan import build_plan
from tileweave.ops.workspace import agree
from tileweave.runtime.backend import get_backend


def route(logits: torch.Tensor, top_k: int, *, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights fp32 [n, k], ids int64 [n, k])`` of router ``logits [n, E]``: top-k of the softmax
    (module docstring). Differentiable in ``logits``."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1, sorted=True)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class TPMoE(nn.Module):
    """A SwiGLU mixture-of-experts layer over a TP group: ``forward(x_shard [T/W, hidden])`` returns
    ``[T/W, hidden]`` (module docstring: shapes, routing, backward).

    ``ffn``: the expert FFN width F, divisible by the group size. ``top_k`` from 1 to ``num_experts``.
    ``save_gathered``: layer 0 keeps the gathered input ``[T, hidden]`` for its weight gradient (True)
    or gathers it again in backward (False). ``ops``: what runs the MoE pair (default: tileweave's;
    ``tileweave.nn.moe_autograd.MoEOps``). Parameters are created in ``dtype``; the router runs in fp32
    whatever the dtype.

    ``fp8``: None, a ``tileweave.nn.fp8.Float8Recipe`` or ``"tensorwise"``, ``"rowwise"``,
    ``"blockwise"``: both expert GEMMs, their input gradients and their weight gradients in float8 with
    that recipe (``tileweave.nn.moe_fp8`` has the table of which tensor is cast to which format with which
    scaling). Master weights and their gradients stay in the parameters' dtype. Blockwise needs
    ``hidden`` and ``ffn / W`` to be multiples of 128; the ops must take float8 (``MoEOps.fp8``).
    Training only: ``replicated`` and ``torch.compile`` run unquantized.
    """

    def __init__(self, hidden: int, ffn: int, num_experts: int, top_k: int, *,
                 group: dist.ProcessGroup | None = None, normalize_topk: bool = True, save_gathered: bool = True,
                 ops: MoEOps | None = None, fp8=None, device=None, dtype=None) -> None:
        super().__init__()
        self.group = group if group is not None else dist.group.WORLD
        self.rank, self.world = dist.get_rank(self.group), dist.get_world_size(self.group)
        for name, value in (("hidden", hidden), ("ffn", ffn), ("num_experts", num_experts)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"TPMoE: {name} must be a positive int, got {value!r}")
        if ffn % self.world:
            raise ValueError(f"TPMoE: ffn={ffn} must be divisible by the TP group size {self.world}")
        if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
            raise ValueError(f"TPMoE: top_k must be an int from 1 to num_experts={num_experts}, got {top_k!r}")
        self.hidden, self.ffn, self.num_experts, self.top_k = hidden, ffn, num_experts, top_k
        self.ffn_local = ffn // self.world
        self.normalize_topk, self.save_gathered = normalize_topk, save_gathered
        self.ops = ops if ops is not None else TILEWEAVE_OPS
        self.fp8 = resolve(fp8)
        if self.fp8 is not None:
            if not (self.ops.fp8 and self.ops.swiglu):
                raise ValueError("TPMoE: fp8 needs ops that take float8 arguments and the SwiGLU epilogue "
                                 "(MoEOps.fp8 and MoEOps.swiglu, as tileweave's MoE pair); got ops without them")
            self.fp8.check_features("TPMoE", {"hidden": hidden, "ffn/W": self.ffn_local})
        kw = dict(device=device, dtype=dtype)
        self.router = nn.Linear(hidden, num_experts, bias=False, **kw)
        self.w0 = nn.Parameter(torch.empty(num_experts, 2 * self.ffn_local, hidden, **kw))
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden, self.ffn_local, **kw))
        # Each expert as nn.Linear initialises its own weight (fan-in of the unsharded layer).
        nn.init.uniform_(self.w0, -1 / math.sqrt(hidden), 1 / math.sqrt(hidden))
        nn.init.uniform_(self.w1, -1 / math.sqrt(ffn), 1 / math.sqrt(ffn))

    def forward(self, x_shard: torch.Tensor) -> torch.Tensor:
        """``x_shard [T/W, hidden]`` -> ``[T/W, hidden]``; or ``[B, S/W, hidden]`` (sharded on the sequence)
        -> ``[B, S/W, hidden]``: the layer acts on each token alone, so any split of the tokens over the
        ranks serves."""
        if x_shard.dim() == 3 and x_shard.shape[2] == self.hidden:
            return self(x_shard.reshape(-1, self.hidden)).view(x_shard.shape)
        if x_shard.dim() != 2 or x_shard.shape[1] != self.hidden:
            raise ValueError(f"TPMoE: x_shard must be [T/W, hidden={self.hidden}] or [B, S/W, hidden], got "
                             f"{tuple(x_shard.shape)}")
        x_shard, w0, w1 = self._autocast(x_shard.contiguous())
        logits = F.linear(x_shard.float(), self.router.weight.float())
        weights, ids = route(logits, self.top_k, normalize=self.normalize_topk)
        with torch.autocast(x_shard.device.type, enabled=False):
            plan = self.ops.plan(ids, self.num_experts, self.group)
            if self.fp8 is not None and not torch.compiler.is_compiling():
                return FusedExpertsFP8.apply(x_shard, w0, w1, weights, plan, self.group, self.ops,
                                             self.save_gathered, self.fp8, torch.is_grad_enabled())
            if self.ops.swiglu and not torch.compiler.is_compiling():
                return FusedExperts.apply(x_shard, w0, w1, weights, plan, self.group, self.ops, self.save_gathered,
                                          torch.is_grad_enabled())
            # The gathered input serves only w0's gradient: not kept (nor copied out of the op) without one.
            keep = self.save_gathered and torch.is_grad_enabled() and w0.requires_grad
            y = ExpertsUp.apply(x_shard, w0, plan, self.group, self.ops, keep)
            gate, up = y.split(self.ffn_local, dim=1)
            h = (F.silu(gate) * up).contiguous()
            return ExpertsDown.apply(h, w1, weights, plan, self.group, self.ops)

    @torch.no_grad()
    def replicated(self, x: torch.Tensor, *, residual: torch.Tensor | None = None,
                   norm_weight: torch.Tensor | None = None, eps: float = 1e-6):
        """Replicated mode (module docstring), forward only: ``x [T, hidden]``, the same on every rank, ->
        the layer's output ``[T, hidden]``, bitwise the same on every rank. With ``residual [T, hidden]``
        the output plus it; with ``norm_weight [hidden]`` too, ``(rms_norm(resid) * norm_weight, resid)``
        with ``resid = residual + output`` (the norm of the next layer, fused into the all-reduce).
        ``x``, ``residual`` and ``norm_weight`` have the parameters' dtype. Collective; the ranks first
        exchange their arguments' shapes, so a bad argument raises the same error on every rank, before
        any kernel."""
        def check() -> None:
            if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != self.hidden:
                raise ValueError(f"TPMoE.replicated: x must be [T, hidden={self.hidden}], got "
                                 f"{signature_of(x)}")
            if x.dtype != self.w0.dtype or x.device != self.w0.device:
                raise ValueError(f"TPMoE.replicated: x is {x.dtype} on {x.device}, the experts are "
                                 f"{self.w0.dtype} on {self.w0.device}")

        if self.world > 1:
            device = x.device if isinstance(x, torch.Tensor) else self.w0.device
            agree(get_backend(self.group, device), "TPMoE.replicated", {"x": signature_of(x)}, check,
                  hint="; every rank must pass the same tokens")
        else:
            check()
        partial = self.replicated_partial(x)
        if residual is None and norm_weight is None:
            return all_reduce_sum(partial, self.group)
        return all_reduce_sum(partial, self.group, residual=residual, norm_weight=norm_weight, eps=eps)

    @torch.no_grad()
    def replicated_partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share ``[T, hidden]`` of the replicated mode's output (before the sum over ranks),
        in ``x``'s dtype: the routing, a local plan, both grouped GEMMs and the top-k sum over this rank's
        F_loc features. Local: no communication, no host read of a device value; no checks."""
        logits = F.linear(x.float(), self.router.weight.float())
        weights, ids = route(logits, self.top_k, normalize=self.normalize_topk)
        plan = build_plan(ids, num_experts=self.num_experts, world_size=1, validate=False)
        e = self.num_experts
        h = grouped_gemm(x, self.w0.transpose(1, 2), plan.offsets, a_rows=plan.row_token, experts=e,
                         epilogue=SwiGLU())                                   # [T*k, F_loc]
        z = grouped_gemm(h, self.w1.transpose(1, 2), plan.offsets, experts=e)  # [T*k, H]
        return topk_reduce(z, plan.pair_row, weights, out_dtype=x.dtype)

    def _autocast(self, x_shard: torch.Tensor):
        """Under autocast, the experts run in the autocast dtype (the ops take one dtype for all operands;
        the casts are autograd ops, so fp32 parameters get fp32 gradients)."""
        kind = x_shard.device.type
        if not torch.is_autocast_enabled(kind):
            return x_shard, self.w0, self.w1
        dtype = torch.get_autocast_dtype(kind)
        return x_shard.to(dtype), self.w0.to(dtype), self.w1.to(dtype)

    @torch.no_grad()
    def all_reduce_replicated_grads(self) -> None:
        """Sum the router's gradient over the group, in place (collective): afterwards every rank holds
        the gradient of the replicated router for all T tokens."""
        if self.router.weight.grad is not None:
            dist.all_reduce(self.router.weight.grad, group=self.group)

    @torch.no_grad()
    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Take this rank's shards from the unsharded weights: ``router.weight [E, H]``,
        ``experts.gate [E, F, H]``, ``experts.up [E, F, H]`` and ``experts.down [E, H, F]`` (per expert
        an ``nn.Linear`` weight, ``[out, in]``)."""
        self._check_state(state)
        cols = slice(self.rank * self.ffn_local, (self.rank + 1) * self.ffn_local)
        self.router.weight.copy_(state["router.weight"])
        self.w0.copy_(torch.cat([state["experts.gate"][:, cols], state["experts.up"][:, cols]], dim=1))
        self.w1.copy_(state["experts.down"][:, :, cols])

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The unsharded weights under ``load_full_state_dict``'s names (collective: every rank calls it)."""
        gate, up = self.w0.split(self.ffn_local, dim=1)
        return {"router.weight": self.router.weight.detach().clone(),
                "experts.gate": gather_shards(gate, 1, self.group),
                "experts.up": gather_shards(up, 1, self.group),
                "experts.down": gather_shards(self.w1, 2, self.group)}

    def _check_state(self, state: dict[str, torch.Tensor]) -> None:
        e, h, f = self.num_experts, self.hidden, self.ffn
        expected = {"router.weight": (e, h), "experts.gate": (e, f, h), "experts.up": (e, f, h),
                    "experts.down": (e, h, f)}
        for name, shape in expected.items():
            if name not in state:
                raise KeyError(f"TPMoE.load_full_state_dict: missing {name!r} (expected shape {list(shape)}); "
                               f"got keys {sorted(state)}")
            if tuple(state[name].shape) != shape:
                raise ValueError(f"TPMoE.load_full_state_dict: {name} must be {list(shape)}, "
                                 f"got {list(state[name].shape)}")

    def extra_repr(self) -> str:
        return (f"hidden={self.hidden}, ffn={self.ffn} (local {self.ffn_local}), num_experts={self.num_experts}, "
                f"top_k={self.top_k}, normalize_topk={self.normalize_topk}, tp={self.world}"
                + ("" if self.fp8 is None else f", fp8={self.fp8.scaling}"))
