"""The MoE routing plan (``tileweave.ops.moe.build_plan``) against the reference order written out in
``support.moe_reference``: a single process, no ranks."""

import pytest
import torch

from tileweave.ops.moe import build_plan, choose_path
from support.moe_reference import reference_plan


def _as_lists(plan):
    return {"offsets": plan.offsets.tolist(), "row_token": plan.row_token.tolist(),
            "row_expert": plan.row_expert.tolist(), "pair_row": plan.pair_row.tolist(),
            "splits": plan.splits.tolist()}


def test_worked_example():
    # The example of tileweave.ops.moe.plan's docstring.
    plan = build_plan(torch.tensor([[2, 0], [0, 1], [1, 2], [2, 2]]), num_experts=3, world_size=2)
    assert _as_lists(plan) == {"offsets": [0, 2, 3, 4, 4, 5, 8], "row_token": [0, 1, 1, 0, 2, 2, 3, 3],
                               "row_expert": [0, 0, 1, 2, 1, 2, 2, 2], "pair_row": [[3, 0], [1, 2], [4, 5], [6, 7]],
                               "splits": [2, 2, 4]}
    assert plan.offsets.dtype == plan.row_token.dtype == plan.pair_row.dtype == torch.int32
    assert (plan.rows, plan.groups) == (8, 6)
    assert [int(v) for v in plan.source_rows(1)] == [4, 8]
    again = type(plan).from_tensors(*plan.tensors())
    assert again.signature() == plan.signature() == (2, 4, 2, 3) and _as_lists(again) == _as_lists(plan)


@pytest.mark.parametrize("tokens,topk,experts,world,dtype", [
    (24, 2, 8, 2, torch.int64), (21, 6, 64, 3, torch.int32), (16, 1, 1, 4, torch.int64),
    (12, 8, 8, 4, torch.int32), (40, 4, 256, 4, torch.int64), (9, 3, 5, 1, torch.int32),
    # many blocks of pairs for the counting sort: the groups' counts carried across blocks
    (600, 2, 3, 2, torch.int64), (1000, 8, 128, 1, torch.int32)])
def test_plan_matches_reference(tokens, topk, experts, world, dtype):
    g = torch.Generator().manual_seed(tokens * 1000 + topk * 10 + world)
    for trial in range(3):
        ids = torch.randint(0, experts, (tokens, topk), generator=g)
        if trial == 1:
            ids[:] = experts - 1  # every pair to one expert: all other groups empty
        if trial == 2 and experts > 1:
            ids[ids == 0] = 1  # an expert with no tokens
        plan = build_plan(ids.to(dtype), num_experts=experts, world_size=world)
        assert _as_lists(plan) == reference_plan(ids.tolist(), experts, world)
        # Both maps are each other's inverse.
        rows = plan.pair_row.reshape(-1).long()
        assert torch.equal(plan.row_token[rows].long(), torch.arange(tokens).repeat_interleave(topk))
        assert torch.equal(plan.row_expert[rows].long(), ids.reshape(-1))
        assert rows.sort().values.tolist() == list(range(tokens * topk))


def test_plan_errors():
    ids = torch.zeros(6, 2, dtype=torch.int64)
    with pytest.raises(TypeError, match="topk_ids"):
        build_plan(ids.float(), num_experts=4, world_size=2)
    with pytest.raises(ValueError, match="topk_ids must be"):
        build_plan(ids[:, 0], num_experts=4, world_size=2)
    with pytest.raises(ValueError, match="divisible"):
        build_plan(ids, num_experts=4, world_size=4)
    with pytest.raises(ValueError, match="num_experts"):
        build_plan(ids, num_experts=0, world_size=2)
    with pytest.raises(ValueError, match="world_size"):
        build_plan(ids, num_experts=4, world_size=0)
    bad = ids.clone()
    bad[3, 1] = 4
    with pytest.raises(ValueError, match="expert id 4"):
        build_plan(bad, num_experts=4, world_size=2)
    bad[3, 1] = -1
    with pytest.raises(ValueError, match="expert id -1"):
        build_plan(bad, num_experts=4, world_size=2)


def test_unchecked_bad_ids_are_clamped_and_counted():
    # Unvalidated, a bad id is clamped into [0, E) (every pair in a group, every index in range) and
    # counted on the device, where the MoE ops find it.
    ids = torch.tensor([[0, 9], [1, 1], [-3, 0], [1, 0]])
    plan = build_plan(ids, num_experts=2, world_size=2, validate=False)
    assert plan.offsets.tolist() == [0, 1, 4, 7, 8]  # as the ids [[0, 1], [1, 1], [0, 0], [1, 0]]
    assert plan.row_token.min() >= 0 and plan.row_token.max() < 4
    assert plan.row_expert.min() >= 0 and plan.row_expert.max() < 2
    assert plan.splits.tolist() == [4, 4]
    assert plan.invalid.tolist() == [2]
    again = type(plan).from_tensors(*plan.tensors())
    assert again.invalid.tolist() == [2]
    assert build_plan(ids.clamp(0, 1), num_experts=2, world_size=2).invalid.tolist() == [0]


@pytest.mark.parametrize("dtype", [torch.int16, torch.uint8, torch.int8])
def test_ids_other_than_int32_or_int64_are_refused_by_name(dtype):
    ids = torch.zeros(4, 2, dtype=dtype)
    with pytest.raises(TypeError, match=f"topk_ids has dtype {dtype}; expert ids must be int32 or int64"):
        build_plan(ids, num_experts=2, world_size=2)


def test_path_rule_worked_example():
    # The examples of tileweave.ops.moe.rule.choose_path's docstring.
    bf16 = torch.bfloat16
    mixtral = dict(hidden=4096, f_loc=14336 // 2, topk=2, world=2, dtype=bf16)
    qwen = dict(hidden=2048, f_loc=768 // 2, topk=8, world=2, dtype=bf16)
    assert choose_path(tokens=4096, **mixtral) == "fused"
    assert choose_path(tokens=256, **mixtral) == "fallback"
    assert choose_path(tokens=8192, **qwen) == "fused"
    assert choose_path(tokens=2048, **qwen) == "fallback"
    assert choose_path(tokens=256, **{**mixtral, "world": 1}) == "local"
    assert choose_path(tokens=8, **mixtral, interpreter=True) == "fused"
