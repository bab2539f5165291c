"""The fused ops as torch custom ops: schema, fake (meta) shapes, and torch.compile keeping each op
whole as one graph node, on emulated ranks."""

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import tileweave  # noqa: F401  (registers torch.ops.tileweave.*)
from support import moe_scenarios, scenarios
from tileweave.testing.emulated import run_ranks
from support.scenarios import all_reduce


def test_schemas():
    assert "Tensor? bias, str group_name" in str(torch.ops.tileweave.all_gather_gemm.default._schema)
    assert "-> (Tensor, Tensor)" in str(torch.ops.tileweave.all_gather_gemm_gathered.default._schema)
    assert "Tensor? residual, str group_name) -> Tensor" in str(torch.ops.tileweave.gemm_all_reduce.default._schema)
    assert "float eps, str group_name) -> (Tensor, Tensor)" in str(
        torch.ops.tileweave.gemm_all_reduce_norm.default._schema)
    assert "Tensor[] plan, str group_name) -> (Tensor, Tensor)" in str(
        torch.ops.tileweave.moe_all_gather_gemm_gathered.default._schema)
    assert "Tensor[] plan, Tensor? topk_weights_shard, str group_name) -> Tensor" in str(
        torch.ops.tileweave.moe_gemm_reduce_scatter.default._schema)


def _fake_shapes(rank, world):
    import torch.distributed as dist

    name = dist.group.WORLD.group_name
    with FakeTensorMode():
        a = torch.empty(6, 8)
        out = torch.ops.tileweave.all_gather_gemm(a, torch.empty(8, 5), None, name)
        out2, gathered = torch.ops.tileweave.all_gather_gemm_gathered(a, torch.empty(8, 5), None, name)
        rs = torch.ops.tileweave.gemm_reduce_scatter(torch.empty(6 * world, 8), torch.empty(8, 5), None, name)
        ar = torch.ops.tileweave.gemm_all_reduce(torch.empty(3, 8), torch.empty(8, 5), None, None, name)
        normed, resid = torch.ops.tileweave.gemm_all_reduce_norm(torch.empty(3, 8), torch.empty(8, 5), None,
                                                                 torch.empty(3, 5), torch.empty(5), 1e-6, name)
        # A plan of T = 6 * world tokens, k = 2, E = 4: (offsets, row_token, row_expert, pair_row, splits).
        t = 6 * world
        plan = [torch.empty(world * 4 + 1, dtype=torch.int32), torch.empty(t * 2, dtype=torch.int32),
                torch.empty(t * 2, dtype=torch.int32), torch.empty(t, 2, dtype=torch.int32),
                torch.empty(4, dtype=torch.int32)]
        y, x = torch.ops.tileweave.moe_all_gather_gemm_gathered(a, torch.empty(4, 8, 7), plan, name)
        down = torch.ops.tileweave.moe_gemm_reduce_scatter(torch.empty(t * 2, 7), torch.empty(4, 7, 8), plan,
                                                          torch.empty(6, 2), name)
    return [tuple(r.shape) for r in (out, out2, gathered, rs, ar, normed, resid, y, x, down)]


def test_fake_shapes_follow_the_group_size():
    for shapes in run_ranks(2, _fake_shapes):
        assert shapes == [(12, 5), (12, 5), (12, 8), (6, 5), (3, 5), (3, 5), (3, 5), (24, 7), (12, 8), (6, 8)]


def test_torch_compile_keeps_each_op_whole():
    for result in run_ranks(2, scenarios.compile_check):
        assert result["graphs"] == 1, result
        assert result["shape"] == (16, 40) and result["err"] < 1e-5, result  # against float64, fp32 inputs
        assert result["ops"] == ["tileweave.all_gather_gemm.default", "tileweave.gemm_reduce_scatter.default"], result


def test_torch_compile_keeps_gemm_all_reduce_whole():
    for result in run_ranks(2, all_reduce.compile_check):
        assert result["graphs"] == 1, result
        assert result["ops"] == ["tileweave.gemm_all_reduce.default", "tileweave.gemm_all_reduce_norm.default"], result
        assert result["err"] < 1e-5, result


def test_torch_compile_keeps_the_moe_pair_whole():
    for result in run_ranks(2, moe_scenarios.compile_check):
        assert result["graphs"] == 1, result
        assert result["ops"] == ["tileweave.moe_all_gather_gemm_gathered.default",
                                 "tileweave.moe_gemm_reduce_scatter.default"], result
        assert result["err0"] < 1e-5 and result["err1"] < 1e-5 and result["gathered_exact"], result
