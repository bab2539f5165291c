"""The routing plan of the MoE pair: which rows of the grouped GEMMs come from which (token, slot).

Built on the device from the gathered ``topk_ids [T, k]`` by a stable counting sort in two kernels and a
prefix sum (``tileweave.kernels.moe_plan``), so that building it never waits for the GPU (the one host
sync is the optional value check of ``validate``) and it can be built inside a CUDA graph.

Order. The T*k (token, slot) pairs are grouped by (source rank s, expert e), group ``g = s*E + e``,
and within a group kept in (token, slot) order. Source s holds tokens ``[s*T/W, (s+1)*T/W)`` of the
gathered input, so every group's rows come from one rank's shard: layer 0's tiles of group g wait
for exactly one shard (source ``g // E``), and the rows layer 1 reduces for owner q are exactly the
groups ``[q*E, (q+1)*E)``. The cost is up to W*E partly filled row tiles instead of E.

Worked example: W = 2, E = 3, k = 2, T = 4 (two tokens per rank), ``topk_ids = [[2, 0], [0, 1],
[1, 2], [2, 2]]``. Pairs (t, j) -> key s*E + e: (0,0) -> 2, (0,1) -> 0, (1,0) -> 0, (1,1) -> 1,
(2,0) -> 4, (2,1) -> 5, (3,0) -> 5, (3,1) -> 5. Sorted stably by key: plan rows 0..7 are (0,1),
(1,0), (1,1), (0,0), (2,0), (2,1), (3,0), (3,1); ``offsets = [0, 2, 3, 4, 4, 5, 8]``,
``row_token = [0, 1, 1, 0, 2, 2, 3, 3]``, ``row_expert = [0, 0, 1, 2, 1, 2, 2, 2]``,
``pair_row = [[3, 0], [1, 2], [4, 5], [6, 7]]``, ``splits = [2, 2, 4]``.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.distributed as dist
import triton

from tileweave.kernels.moe_plan import plan_count_kernel, plan_place_kernel
from tileweave.ops import common
from tileweave.ops.skeleton import first_call
from tileweave.ops.workspace import agree
from tileweave.runtime.backend import _group_size, get_backend

ID_DTYPES = (torch.int32, torch.int64)


@dataclasses.dataclass(frozen=True)
class MoEPlan:
    """The routing of one MoE layer call over a TP group (module docstring: order and an example).

    Every rank holds the same plan (``moe_plan`` builds it from the gathered ids). Device tensors are
    int32 on the ids' device; building it reads none of them on the host."""

    world_size: int
    """W: ranks of the TP group the plan was built for."""
    tokens: int
    """T: tokens over the group (T / W per rank)."""
    topk: int
    """k: experts per token."""
    num_experts: int
    """E."""
    offsets: torch.Tensor
    """``[W*E + 1]``: group g = s*E + e is plan rows ``[offsets[g], offsets[g+1])``; offsets[W*E] = T*k."""
    row_token: torch.Tensor
    """``[T*k]``: the gathered-token index of each plan row."""
    row_expert: torch.Tensor
    """``[T*k]``: the expert of each plan row."""
    pair_row: torch.Tensor
    """``[T, k]``: the plan row of pair (t, j), the inverse of (row_token, slot)."""
    splits: torch.Tensor
    """``[E]``: rows per expert over all sources."""
    invalid: torch.Tensor | None = None
    """``[1]``: how many ids lay outside ``[0, E)`` (counted on the device; such ids were clamped into
    range, so the plan reads nothing out of bounds). The MoE ops raise when it is not 0. None: 0."""

    @property
    def rows(self) -> int:
        """T*k: rows of the grouped GEMMs."""
        return self.tokens * self.topk

    @property
    def groups(self) -> int:
        """W*E."""
        return self.world_size * self.num_experts

    @property
    def device(self) -> torch.device:
        return self.offsets.device

    def source_rows(self, source: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(row_lo, row_hi)``: the plan rows of source rank ``source``'s tokens, as device scalars."""
        e = self.num_experts
        return self.offsets[source * e], self.offsets[(source + 1) * e]

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """``(offsets, row_token, row_expert, pair_row, splits[, invalid])``: the plan as tensors alone
        (a custom op's arguments); ``from_tensors`` rebuilds it."""
        head = (self.offsets, self.row_token, self.row_expert, self.pair_row, self.splits)
        return head if self.invalid is None else (*head, self.invalid)

    @classmethod
    def from_tensors(cls, offsets: torch.Tensor, row_token: torch.Tensor, row_expert: torch.Tensor,
                     pair_row: torch.Tensor, splits: torch.Tensor, invalid: torch.Tensor | None = None) -> "MoEPlan":
        """The plan of ``tensors()`` (W, T, k and E follow from their shapes)."""
        tokens, topk = pair_row.shape
        experts = splits.shape[0]
        return cls(world_size=(offsets.shape[0] - 1) // experts, tokens=tokens, topk=topk, num_experts=experts,
                   offsets=offsets, row_token=row_token, row_expert=row_expert, pair_row=pair_row, splits=splits,
                   invalid=invalid)

    def signature(self) -> tuple[int, int, int, int]:
        """(W, T, k, E): what two calls' plans must share to be interchangeable."""
        return (self.world_size, self.tokens, self.topk, self.num_experts)


def plan_signature(plan: object) -> object:
    """What the ranks compare of a plan: its (W, T, k, E), or the type's name of something else."""
    return plan.signature() if isinstance(plan, MoEPlan) else type(plan).__name__


def check_plan(plan: MoEPlan, *, world: int, tokens: int | None, experts: int, device: torch.device) -> None:
    """The plan was built for this group, these tokens (None: any) and these experts, on this device."""
    if not isinstance(plan, MoEPlan):
        raise TypeError(f"plan must be a tileweave MoEPlan (from moe_plan or build_plan), got {type(plan).__name__}")
    if plan.world_size != world:
        raise ValueError(f"plan was built for world_size={plan.world_size} but the group has {world} ranks: "
                         "build it with moe_plan on this group")
    if tokens is not None and plan.tokens != tokens:
        raise ValueError(f"plan was built for T={plan.tokens} tokens but the inputs hold T={tokens} "
                         f"({tokens // world} per rank): build the plan from this batch's topk_ids")
    if plan.num_experts != experts:
        raise ValueError(f"plan was built for E={plan.num_experts} experts but the weights have {experts}")
    if plan.offsets.device != device:
        raise ValueError(f"plan is on {plan.offsets.device} but the inputs are on {device}")


def check_ids(topk_ids: torch.Tensor, num_experts: int, *, name: str = "topk_ids") -> None:
    """Shape, dtype and expert-count checks of routing ids (no value check: that reads them)."""
    if not isinstance(topk_ids, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of expert ids, got {type(topk_ids).__name__}")
    if topk_ids.dim() != 2 or topk_ids.shape[1] < 1:
        raise ValueError(f"{name} must be [tokens, k] with k >= 1, got shape {tuple(topk_ids.shape)}")
    if topk_ids.dtype not in ID_DTYPES:
        raise TypeError(f"{name} has dtype {topk_ids.dtype}; expert ids must be int32 or int64 (other "
                        f"integer types cannot be gathered by every backend): pass {name}.long()")
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts must be an int >= 1, got {num_experts!r}")


def check_id_values(topk_ids: torch.Tensor, num_experts: int, *, name: str = "topk_ids",
                    rows_per_rank: int | None = None) -> None:
    """Raise if any id lies outside ``[0, num_experts)``: one host sync (two scalars). ``rows_per_rank``:
    the ids are a group's gathered shards of that many rows each; the message names the rank."""
    if topk_ids.numel() == 0:
        return
    lo, hi = torch.stack([topk_ids.min().long(), topk_ids.max().long()]).tolist()
    if lo < 0 or hi >= num_experts:
        bad = lo if lo < 0 else hi
        where = ""
        if rows_per_rank:
            row = int((topk_ids == bad).any(dim=1).nonzero()[0, 0])
            where = f" of rank {row // rows_per_rank}"
        raise ValueError(f"{name}{where} holds expert id {bad}, outside [0, num_experts={num_experts}); "
                         f"ids must index the experts of the weights")


def build_plan(topk_ids: torch.Tensor, *, num_experts: int, world_size: int,
               validate: bool = True) -> MoEPlan:
    """The plan of the gathered ``topk_ids [T, k]`` (every token of the group, in rank order) for
    ``num_experts`` experts over ``world_size`` ranks. Pure: no collective, no allocation beyond the
    plan's own tensors, no host read of the ids' values except the optional check.

    ``validate`` (default True): check that every id lies in ``[0, num_experts)``, the one host sync
    (skipped while a CUDA graph is being captured). Unchecked, an out-of-range id is clamped into
    ``[0, num_experts)``, so that nothing reads out of bounds, and counted in the plan's ``invalid``
    (on the device): the MoE ops raise ``ValueError`` for such a plan, on the CPU and with
    ``TILEWEAVE_DEBUG=1`` at that call, otherwise at the next.

    Errors: ``TypeError``/``ValueError`` naming ``topk_ids`` (not 2-D, not integer, k < 1, values out
    of range), ``num_experts`` (< 1) or ``world_size`` (< 1, or T not divisible by it)."""
    check_ids(topk_ids, num_experts)
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    tokens, topk = topk_ids.shape
    if tokens % world_size:
        raise ValueError(f"topk_ids has T={tokens} tokens, which do not split over world_size={world_size} "
                         f"ranks: T must be divisible by W (pad the batch to {-(-tokens // world_size) * world_size})")
    capturing = topk_ids.is_cuda and torch.cuda.is_current_stream_capturing()
    if validate and not capturing:
        check_id_values(topk_ids, num_experts)
    device = topk_ids.device
    rows = tokens * topk
    groups = world_size * num_experts
    if device.type == "cpu" and not common.interpreting():
        raise RuntimeError("build_plan on CPU tensors needs Triton's interpreter (TRITON_INTERPRET=1)")
    g_block = triton.next_power_of_2(groups)
    # A block's one-hot matrix is BLOCK x G_BLOCK: about 16k lanes whatever the group count.
    block = max(16, min(1024, 16384 // g_block))
    nb = max(1, triton.cdiv(rows, block))
    ids = topk_ids.contiguous()
    counts = torch.empty((nb, groups + 1), dtype=torch.int32, device=device)  # column G: ids out of range
    # One allocation for the plan's tensors.
    buf = torch.empty(groups + 1 + 3 * rows + num_experts + 1, dtype=torch.int32, device=device)
    offsets, row_token, row_expert, pair_row, splits, invalid = buf.split(
        [groups + 1, rows, rows, rows, num_experts, 1])
    per_source = max(1, rows // world_size)
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        plan_count_kernel[(nb,)](ids, counts, rows, num_experts, groups, per_source, BLOCK=block, G_BLOCK=g_block)
        cum = torch.cumsum(counts, dim=0, dtype=torch.int32)
        plan_place_kernel[(nb,)](ids, cum, offsets, row_token, row_expert, pair_row, splits, invalid, rows,
                                 num_experts, groups, nb, per_source, topk, world_size, BLOCK=block,
                                 G_BLOCK=g_block, E_BLOCK=triton.next_power_of_2(num_experts))
    return MoEPlan(world_size=world_size, tokens=tokens, topk=topk, num_experts=num_experts, offsets=offsets,
                   row_token=row_token, row_expert=row_expert, pair_row=pair_row.view(tokens, topk), splits=splits,
                   invalid=invalid)


_built: set[tuple] = set()
"""The signatures of ``moe_plan`` built before, per group."""


def moe_plan(topk_ids_shard: torch.Tensor, *, num_experts: int, group: dist.ProcessGroup | None = None,
             validate: bool = True) -> MoEPlan:
    """Collective: gather every rank's ``topk_ids_shard [T/W, k]`` (NCCL all-gather on GPUs, gloo on
    the CPU) and build the group's plan (``build_plan``). Every rank of ``group`` must call it with
    the same T/W, k, dtype and ``num_experts`` in the same order; they then hold identical plans.

    The ranks first exchange their arguments (shapes, dtypes, expert counts and the outcome of the
    checks), then judge them, so that a bad argument on one rank raises the same error on every rank;
    ``validate`` checks the values of the gathered ids, the same on every rank. A rank that does not
    come within the backend's bound (``TILEWEAVE_TIMEOUT_S``; ``TILEWEAVE_EMULATED_TIMEOUT_S`` on the
    CPU) makes the others raise ``CollectiveTimeout`` naming it.

    Errors: as ``build_plan``, naming ``topk_ids_shard`` (and the rank whose ids are out of range);
    ``TileweaveError`` if the ranks passed different shapes, dtypes or expert counts."""
    group, rank, world = _group_size(group)
    if world == 1 or not isinstance(topk_ids_shard, torch.Tensor):
        check_ids(topk_ids_shard, num_experts, name="topk_ids_shard")
    capturing = topk_ids_shard.is_cuda and torch.cuda.is_current_stream_capturing()
    if world > 1:
        backend = get_backend(group, topk_ids_shard.device)
        signature = {"topk_ids_shard": common.signature_of(topk_ids_shard),
                     "num_experts": common.signature_of(num_experts)}
        agree(backend, "moe_plan", signature,
              lambda: check_ids(topk_ids_shard, num_experts, name="topk_ids_shard"),
              hint="; every rank must route the same number of tokens with the same k over the same experts")
    ids = topk_ids_shard.contiguous()
    gathered = ids if world == 1 else common.all_gather_rows(ids, backend)
    if (validate or common.debug_mode()) and not capturing:
        check_id_values(gathered, num_experts, name="topk_ids_shard", rows_per_rank=ids.shape[0])
    if world == 1:
        return build_plan(gathered, num_experts=num_experts, world_size=world, validate=False)
    key = (group.group_name, topk_ids_shard.device, *signature.items())
    # A signature's first build compiles the plan's kernels (skeleton.first_call).
    with contextlib.nullcontext() if key in _built else first_call(backend):
        _built.add(key)
        return build_plan(gathered, num_experts=num_experts, world_size=world, validate=False)
