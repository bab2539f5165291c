"""Tensor-parallel layers on the fused ops."""

from tileweave.nn.block import BlockConfig, TPTransformerBlock
from tileweave.nn.decoder import (DecoderConfig, DecoderOps, KVCache, MoEConfig, RopeScaling, TPDecoder,
                                  TPDecoderLayer, TPMoEDecoderLayer)
from tileweave.nn.fp8 import Float8Recipe
from tileweave.nn.inference import column_parallel_linear, row_parallel_linear, row_parallel_residual_norm
from tileweave.nn.linear import (ColumnParallelLinear, RowParallelLinear, TPOps, all_gather_linear,
                                 linear_reduce_scatter)
from tileweave.nn.moe import TPMoE
from tileweave.nn.moe_autograd import MoEOps, tileweave_ops

__all__ = ["BlockConfig", "ColumnParallelLinear", "DecoderConfig", "DecoderOps", "Float8Recipe", "KVCache", "MoEConfig",
           "MoEOps",
           "RopeScaling", "RowParallelLinear", "TPDecoder", "TPDecoderLayer", "TPMoE", "TPMoEDecoderLayer", "TPOps",
           "TPTransformerBlock",
           "all_gather_linear", "column_parallel_linear", "linear_reduce_scatter", "row_parallel_linear", "row_parallel_residual_norm", "tileweave_ops"]
