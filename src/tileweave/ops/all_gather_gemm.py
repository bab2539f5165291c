"""Former home of AllGather+GEMM, kept so that ``tileweave.ops.all_gather_gemm`` imports keep working:
the op lives in ``tileweave.ops.all_gather``, the functional form in ``tileweave.ops.functional``."""

from tileweave.ops.all_gather.op import TRANSPORTS, AllGatherGemm, PendingGather, gathered_like
from tileweave.ops.functional import all_gather_gemm

__all__ = ["TRANSPORTS", "AllGatherGemm", "PendingGather", "all_gather_gemm", "cached_op", "gathered_like"]


def cached_op(group, device) -> AllGatherGemm:
    """The op shared by every functional call on ``group`` and ``device``."""
    return AllGatherGemm.shared(group, device)
