"""Former home of GEMM+ReduceScatter, kept so that ``tileweave.ops.gemm_reduce_scatter`` imports keep
working: the op lives in ``tileweave.ops.reduce_scatter``, the functional form in
``tileweave.ops.functional``."""

from tileweave.ops.functional import gemm_reduce_scatter
from tileweave.ops.reduce_scatter.blocks import BLOCK_FLAGS, CHUNK_GFLOP, CHUNK_ROWS, PULL_MAX_BLOCKS, blocks_for, \
    chunk_rows_for
from tileweave.ops.reduce_scatter.op import TRANSPORTS, GemmReduceScatter

__all__ = ["BLOCK_FLAGS", "CHUNK_GFLOP", "CHUNK_ROWS", "PULL_MAX_BLOCKS", "TRANSPORTS", "GemmReduceScatter",
           "blocks_for", "cached_op", "chunk_rows_for", "gemm_reduce_scatter"]


def cached_op(group, device) -> GemmReduceScatter:
    """The op shared by every functional call on ``group`` and ``device``."""
    return GemmReduceScatter.shared(group, device)
