"""The MoE pair of tensor-parallel MoE: layer 0 (AllGather + grouped GEMM) and layer 1 (grouped GEMM
+ top-k reduce + ReduceScatter) (``op``), over a routing plan built on the device (``plan``); the rule
that picks their path (``rule``)."""

from tileweave.ops.moe.op import MoEAllGatherGemm, MoEGemmReduceScatter
from tileweave.ops.moe.plan import MoEPlan, build_plan, moe_plan
from tileweave.ops.moe.rule import choose_path

__all__ = ["MoEAllGatherGemm", "MoEGemmReduceScatter", "MoEPlan", "build_plan", "choose_path",
           "moe_plan"]
