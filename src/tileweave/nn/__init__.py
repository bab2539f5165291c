"""Tensor-parallel layers on the fused ops."""

from tileweave.nn.block import BlockConfig, TPTransformerBlock
from tileweave.nn.linear import ColumnParallelLinear, RowParallelLinear

__all__ = ["BlockConfig", "ColumnParallelLinear", "RowParallelLinear", "TPTransformerBlock"]
