"""The fused ops as torch custom ops: schema, fake (meta) shapes, and torch.compile keeping each op
whole as one graph node, on emulated ranks."""

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import tileweave  # noqa: F401  (registers torch.ops.tileweave.*)
from tileweave.testing import scenarios
from tileweave.testing.emulated import run_ranks


def test_schemas():
    assert "Tensor? bias, str group_name" in str(torch.ops.tileweave.all_gather_gemm.default._schema)
    assert "-> (Tensor, Tensor)" in str(torch.ops.tileweave.all_gather_gemm_gathered.default._schema)


def _fake_shapes(rank, world):
    import torch.distributed as dist

    name = dist.group.WORLD.group_name
    with FakeTensorMode():
        a = torch.empty(6, 8)
        out = torch.ops.tileweave.all_gather_gemm(a, torch.empty(8, 5), None, name)
        out2, gathered = torch.ops.tileweave.all_gather_gemm_gathered(a, torch.empty(8, 5), None, name)
        rs = torch.ops.tileweave.gemm_reduce_scatter(torch.empty(6 * world, 8), torch.empty(8, 5), None, name)
    return [tuple(out.shape), tuple(out2.shape), tuple(gathered.shape), tuple(rs.shape)]


def test_fake_shapes_follow_the_group_size():
    for shapes in run_ranks(2, _fake_shapes):
        assert shapes == [(12, 5), (12, 5), (12, 8), (6, 5)]


def test_torch_compile_keeps_each_op_whole():
    for result in run_ranks(2, scenarios.compile_check):
        assert result["graphs"] == 1, result
        assert result["shape"] == (16, 40) and result["err"] < 1e-5, result  # against float64, fp32 inputs
        assert result["ops"] == ["tileweave.all_gather_gemm.default", "tileweave.gemm_reduce_scatter.default"], result
