"""tileweave's tensor-parallel styles for PyTorch's ``parallelize_module``: drop-in replacements for
``torch.distributed.tensor.parallel``'s ``ColwiseParallel``, ``RowwiseParallel`` and
``SequenceParallel`` whose linears run on tileweave's fused ops.

    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import parallelize_module
    from tileweave.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    parallelize_module(block, mesh["tp"], {
        "attention_norm": SequenceParallel(),
        "attention.wq": ColwiseParallel(input_layouts=Shard(1)),   # AllGather+GEMM
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),  # GEMM+ReduceScatter
        ...
    })

Parameters become DTensors on the mesh (``Shard(0)`` colwise, ``Shard(1)`` rowwise), so FSDP2
(``fully_shard`` on another mesh dimension) and ``torch.distributed.checkpoint`` see the global tensors.
"""

from tileweave.parallel.styles import ColwiseParallel, RowwiseParallel, SequenceParallel

__all__ = ["ColwiseParallel", "RowwiseParallel", "SequenceParallel"]
