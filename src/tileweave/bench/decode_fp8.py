"""FP8 rows of the ``decode`` benchmark (``--dtype fp8 --scaling rowwise,blockwise``): the decoder's FP8
inference (``tileweave.nn.fp8_weights``) on the decode shapes, each row's ``dtype`` ``fp8-<scaling>``.

Weights are float8 e4m3 quantized once (``quantize_weight``: rowwise per output row, blockwise per 128
x 128 block); every call quantizes its activations per token (rowwise) or per 1 x 128 block
(blockwise) on the device with tileweave's ``quantize``, in both variants, so that the variants differ
only in the GEMM and the all-reduce:

* ``tileweave``: ``GemmAllReduce(graphable=True)`` with ``scale_a``, ``scale_b``, the residual and the
  RMSNorm fused (``inference.row_parallel_residual_norm``'s call);
* ``torch``: torch's scaled matmul (``torch._scaled_mm`` rowwise, ``torch.nn.functional.scaled_mm``
  with ``BlockWise1x128`` / ``BlockWise128x128`` blockwise; ``tileweave.bench.fp8.torch_scaled_mm``),
  NCCL's all-reduce, the residual and the RMSNorm in torch. Not run on emulated CPU ranks (``--smoke``).

Checks: ``gemm_ar`` rows against float32 of the dequantized operands (the activations quantized by
``tileweave.bench.fp8.quantize_rows``, plain torch, bit for bit the device quantization); ``layer``
rows (one ``TPDecoderLayer(fp8=...)`` decode step; its column GEMMs on tileweave's ``matmul`` in both
variants) against the float32 layer on the dequantized weights with unquantized activations, within
``LAYER_TOL``: a check that the step computes the layer, not of its last bits (the CPU tests hold those).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tileweave.bench import fp8
from tileweave.nn.decoder import rms_norm
from tileweave.nn.fp8_weights import Float8Weight, quantize_weight

SCALINGS = ("rowwise", "blockwise")
LAYER_TOL = 6e-2
"""Per-token e4m3 activations move a layer's outputs by a few percent (3 mantissa bits: a relative
rounding error up to 1/16 per element, averaging out over a row)."""


def label(scaling: str) -> str:
    """The ``dtype`` field of an FP8 row."""
    return fp8.dtype_label(scaling)


def parse_scalings(text: str) -> tuple[str, ...]:
    chosen = tuple(s.strip() for s in text.split(",") if s.strip())
    bad = [s for s in chosen if s not in SCALINGS]
    if bad or not chosen or len(set(chosen)) != len(chosen):
        raise ValueError(f"--scaling expects distinct names from {', '.join(SCALINGS)} (the decoder's FP8 "
                         f"weights); got {text!r}")
    return chosen


def torch_tail(y: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float):
    """The baselines' epilogue in torch: ``(rms_norm(residual + y) * norm_weight, residual + y)``."""
    h = residual + y
    return rms_norm(h, norm_weight, eps), h


def dequantized_rows(x: torch.Tensor, scaling: str) -> torch.Tensor:
    """float32 of ``x [M, K]`` quantized per token (rowwise) or per 1 x 128 block (blockwise)."""
    return fp8.quantize_rows(x, scaling)[2]


def torch_row(scaling: str):
    """The ``torch`` variant's row-parallel call ``(x, weight, residual, norm_weight, eps, group) ->
    (normed, h)`` for ``Float8Weight``s, or ``(None, why)``."""
    mm, note = fp8.torch_scaled_mm(scaling)
    if mm is None:
        return None, note

    def row(x, weight: Float8Weight, residual, norm_weight, eps, group):
        a, b, kw = weight.operands(x)
        sa = kw["scale_a"]
        if scaling == "blockwise":
            sa = fp8.m_major(sa)  # torch takes the 1 x 128 scales M-major
        y = mm(a, b, sa, kw["scale_b"]).to(x.dtype)
        dist.all_reduce(y, group=group)
        return torch_tail(y, residual, norm_weight, eps)

    return row, ""


def quantized_weights(ws: list[torch.Tensor], scaling: str) -> tuple[list[Float8Weight], list[torch.Tensor]]:
    """Each rank's weight slice as a ``Float8Weight`` and its float32 dequantization."""
    qs = [quantize_weight(w, scaling) for w in ws]
    return qs, [q.dequantize(torch.float32) for q in qs]
