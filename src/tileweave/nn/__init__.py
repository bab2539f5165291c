"""Tensor-parallel layers on the fused ops."""

from tileweave.nn.block import BlockConfig, TPTransformerBlock
from tileweave.nn.decoder import DecoderConfig, DecoderOps, KVCache, TPDecoder, TPDecoderLayer
from tileweave.nn.inference import column_parallel_linear, row_parallel_linear, row_parallel_residual_norm
from tileweave.nn.linear import ColumnParallelLinear, RowParallelLinear, TPOps
from tileweave.nn.moe import TPMoE
from tileweave.nn.moe_autograd import MoEOps, tileweave_ops

__all__ = ["BlockConfig", "ColumnParallelLinear", "DecoderConfig", "DecoderOps", "KVCache", "MoEOps",
           "RowParallelLinear", "TPDecoder", "TPDecoderLayer", "TPMoE", "TPOps", "TPTransformerBlock",
           "column_parallel_linear", "row_parallel_linear", "row_parallel_residual_norm", "tileweave_ops"]
