"""tileweave: tensor-parallel GEMMs with their communication hidden inside.

Public API (shapes per rank; W ranks in the group):

* ``matmul(a, b)`` / ``linear(x, weight)``: the persistent Triton GEMM the fused ops run on.
* ``all_gather_gemm(a_shard [M/W, K], b [K, N_loc], group)`` -> ``[M, N_loc]``; ``AllGatherGemm``.
* ``gemm_reduce_scatter(a [M, K_loc], b [K_loc, N], group)`` -> ``[M/W, N]``; ``GemmReduceScatter``.
* ``gemm_all_reduce(a [M, K_loc], b [K_loc, N], group)`` -> ``[M, N]`` summed over ranks (decode), optionally
  ``(rmsnorm(r + sum), r + sum)``; ``GemmAllReduce``.
* ``moe_plan(topk_ids_shard [T/W, k], num_experts=E, group)`` -> ``MoEPlan``;
  ``moe_all_gather_gemm(x_shard [T/W, H], w0 [E, H, F_loc], plan)`` -> ``[T*k, F_loc]`` (MoE layer 0);
  ``moe_gemm_reduce_scatter(h [T*k, F_loc], w1 [E, F_loc, H], plan, topk_weights_shard)`` -> ``[T/W, H]``
  (MoE layer 1); ``MoEAllGatherGemm``, ``MoEGemmReduceScatter``; ``grouped_gemm`` (their core).
* ``last_path(op)``: which path ("fused", "chunked", "oneshot", "fallback", "local", "triton") the last
  call took.
* ``tileweave.nn``: ``ColumnParallelLinear``, ``RowParallelLinear`` (sequence-parallel, or replicated with
  ``sequence_parallel=False``), ``TPTransformerBlock``, ``TPMoE``, ``TPDecoder`` (inference: prefill
  sequence-parallel, decode on ``gemm_all_reduce``).
* ``tileweave.parallel``: ``ColwiseParallel``, ``RowwiseParallel``, ``SequenceParallel`` for torch's
  ``parallelize_module`` (DTensor parameters, linears on the fused ops; 2-D meshes with FSDP2).
* ``torch.ops.tileweave.*``: the fused ops as custom ops (what ``torch.compile`` sees).

Environment: ``TILEWEAVE_DEBUG=1`` checks every call for expired waits (synchronising);
``TILEWEAVE_MAX_SPIN`` / ``TILEWEAVE_TIMEOUT_S`` bound in-kernel and host waits;
``TILEWEAVE_POLICY``, ``TILEWEAVE_AG_TRANSPORT``, ``TILEWEAVE_RS_TRANSPORT`` override the defaults of
the functional ops (the benchmark uses them); ``TILEWEAVE_CACHE_DIR`` holds autotuned configs.
"""

from tileweave.ops.all_gather.op import AllGatherGemm
from tileweave.ops.all_reduce import GemmAllReduce
from tileweave.ops.common import last_path
from tileweave.ops.functional import (all_gather_gemm, gemm_all_reduce,  # registers torch.ops.tileweave.*
                                      gemm_reduce_scatter, moe_all_gather_gemm, moe_gemm_reduce_scatter)
from tileweave.ops.compute.grouped_gemm import grouped_gemm
from tileweave.ops.compute.matmul import linear, matmul
from tileweave.ops.moe import MoEAllGatherGemm, MoEGemmReduceScatter, MoEPlan, build_plan, moe_plan
from tileweave.ops.reduce_scatter.op import GemmReduceScatter
from tileweave.runtime.backend import CollectiveTimeout, TileweaveError
from tileweave.tune.configs import GemmConfig
from tileweave.tune.grouped import GroupedConfig

__version__ = "0.1.0"

__all__ = [
    "AllGatherGemm", "CollectiveTimeout", "GemmAllReduce", "GemmConfig", "GemmReduceScatter", "GroupedConfig",
    "MoEAllGatherGemm", "MoEGemmReduceScatter", "MoEPlan", "TileweaveError", "all_gather_gemm", "build_plan",
    "gemm_all_reduce", "gemm_reduce_scatter", "grouped_gemm", "last_path", "linear", "matmul",
    "moe_all_gather_gemm", "moe_gemm_reduce_scatter", "moe_plan",
]
