"""GEMM + AllReduce for decode (``op``: shapes, semantics, paths; ``rule``: which path a shape takes)."""

from tileweave.ops.all_reduce.op import GemmAllReduce
from tileweave.ops.all_reduce.rule import choose_path

__all__ = ["GemmAllReduce", "choose_path"]
