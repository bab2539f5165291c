"""The MoE pair of tensor-parallel MoE: layer 0 (AllGather + grouped GEMM) and layer 1 (grouped GEMM
+ top-k reduce + ReduceScatter), over a routing plan built on the device."""

from tileweave.ops.moe.layer0 import MoEAllGatherGemm
from tileweave.ops.moe.layer1 import MoEGemmReduceScatter
from tileweave.ops.moe.paths import choose_path
from tileweave.ops.moe.plan import MoEPlan, build_plan, moe_plan

__all__ = ["MoEAllGatherGemm", "MoEGemmReduceScatter", "MoEPlan", "build_plan", "choose_path",
           "moe_plan"]
