"""Tensor-parallel layers on the fused ops."""

from tileweave.nn.linear import ColumnParallelLinear, RowParallelLinear

__all__ = ["ColumnParallelLinear", "RowParallelLinear"]
