"""tileweave: tensor-parallel GEMMs with their communication hidden inside.

Public API (shapes per rank; W ranks in the group):

* ``matmul(a, b)`` / ``linear(x, weight)``: the persistent Triton GEMM the fused ops run on.
* ``all_gather_gemm(a_shard [M/W, K], b [K, N_loc], group)`` -> ``[M, N_loc]``; ``AllGatherGemm``.
* ``gemm_reduce_scatter(a [M, K_loc], b [K_loc, N], group)`` -> ``[M/W, N]``; ``GemmReduceScatter``.
* ``last_path(op)``: which path ("fused", "chunked", "oneshot", "fallback", "local", "triton") the last
  call took.
* ``tileweave.nn``: ``ColumnParallelLinear``, ``RowParallelLinear``, ``TPTransformerBlock``.
* ``torch.ops.tileweave.*``: the fused ops as custom ops (what ``torch.compile`` sees).

Environment: ``TILEWEAVE_DEBUG=1`` checks every call for expired waits (synchronising);
``TILEWEAVE_MAX_SPIN`` / ``TILEWEAVE_TIMEOUT_S`` bound in-kernel and host waits;
``TILEWEAVE_POLICY``, ``TILEWEAVE_AG_TRANSPORT``, ``TILEWEAVE_RS_TRANSPORT`` override the defaults of
the functional ops (the benchmark uses them); ``TILEWEAVE_CACHE_DIR`` holds autotuned configs.
"""

from tileweave.ops.all_gather.op import AllGatherGemm
from tileweave.ops.common import last_path
from tileweave.ops.functional import all_gather_gemm, gemm_reduce_scatter  # registers torch.ops.tileweave.*
from tileweave.ops.matmul import linear, matmul
from tileweave.ops.reduce_scatter.op import GemmReduceScatter
from tileweave.runtime.backend import CollectiveTimeout, TileweaveError
from tileweave.tune.configs import GemmConfig

__version__ = "0.1.0"

__all__ = [
    "AllGatherGemm", "CollectiveTimeout", "GemmConfig", "GemmReduceScatter", "TileweaveError",
    "all_gather_gemm", "gemm_reduce_scatter", "last_path", "linear", "matmul",
]
