"""Hugging Face checkpoints as TP models: ``from_pretrained(directory, group=...)`` returns a
``tileweave.nn.TPDecoder`` with this rank's shards of the checkpoint's weights.

A checkpoint directory holds ``config.json`` and ``model.safetensors`` (or shards listed in
``model.safetensors.index.json``). Each rank reads only the slices it holds (the replicated embedding
and norms whole), through ``tileweave.models.safetensors``; ``transformers`` and ``safetensors`` are not
needed. The config is read by ``tileweave.models.config``, which refuses by name any field the model
cannot honour; every tensor's shape is checked against the config.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from tileweave.models.config import UnsupportedConfig, checkpoint_dtype, decoder_config
from tileweave.models.safetensors import Checkpoint, read_json
from tileweave.nn.checkpoint import shape_error
from tileweave.nn.decoder import DecoderOps, TPDecoder

__all__ = ["Checkpoint", "UnsupportedConfig", "decoder_config", "from_pretrained"]

# Tensors that some checkpoints carry and that the model recomputes (RoPE frequencies of old Llamas).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)



def model_dtype(dtype: torch.dtype | None, hf: dict, device: torch.device) -> torch.dtype:
    """The dtype ``from_pretrained`` builds the model in: ``dtype``, else the config's, else float32. On
    the CPU (Triton's interpreter, whose bfloat16 arithmetic is wrong) a bfloat16 config gives float32,
    and an explicit ``torch.bfloat16`` is refused before anything loads."""
    if dtype is None:
        dtype = checkpoint_dtype(hf) or torch.float32
        return torch.float32 if device.type == "cpu" and dtype == torch.bfloat16 else dtype
    if device.type == "cpu" and dtype == torch.bfloat16:
        raise ValueError("from_pretrained: dtype=torch.bfloat16 on the CPU: the CPU runs the kernels in Triton's "
                         "interpreter, which computes bfloat16 wrongly; use torch.float32 (the default there) "
                         "or torch.float16")
    return dtype

def from_pretrained(path: str | Path, *, group: dist.ProcessGroup | None, dtype: torch.dtype | None = None,
                    device: torch.device | str | None = None, max_seq: int | None = None,
                    ops: DecoderOps | None = None, prefill_sequence_parallel: bool = True,
                    fp8: str | None = None) -> TPDecoder:
    """The TP decoder of the checkpoint directory ``path``, this rank's shards loaded.

    ``group``: the TP group (None: the default group). ``dtype``: the weights' and activations' dtype
    (``model_dtype``: default the config's ``dtype``, else float32; on the CPU float32 or float16). ``device``: default
    the current CUDA device, else the CPU. ``max_seq``: the longest sequence (prompt and generated
    tokens) a KV cache may hold (``decoder_config``). ``ops``, ``prefill_sequence_parallel``: as
    ``TPDecoder``'s. ``fp8``: ``"rowwise"`` or ``"blockwise"`` quantizes the GEMM weights of each layer
    as it is read (FP8 inference, ``tileweave.nn.decoder``), so the high-precision weights are never all
    held at once; the checkpoint itself must be unquantized (bf16, fp16 or fp32). Raises
    ``UnsupportedConfig`` for a config field the model cannot honour,
    ``ValueError`` for a tensor of the wrong shape (naming it, the expected and the actual shape) or one
    the model has no place for, ``KeyError`` for a missing one. Every rank must call it alike.
    """
    directory = Path(path)
    hf = read_json(directory / "config.json")
    if not isinstance(hf, dict):
        raise ValueError(f"{directory / 'config.json'}: not a JSON object of config fields")
    config = decoder_config(hf, max_seq=max_seq)
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    dtype = model_dtype(dtype, hf, torch.device(device))
    checkpoint = Checkpoint(directory)
    owner = f"from_pretrained({str(directory)!r})"
    used: set[str] = set()

    def read(name: str, shape, dim: int = 0, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        if name not in checkpoint:
            raise KeyError(f"{owner}: the checkpoint has no tensor {name!r} (expected shape {list(shape)})")
        if checkpoint.shape(name) != tuple(shape):
            raise shape_error(owner, name, shape, checkpoint.shape(name))
        used.add(name)
        return checkpoint.read(name, dim, start, stop).to(device=device, dtype=dtype)

    with torch.device("meta"):
        model = TPDecoder(config, group=group, ops=ops, prefill_sequence_parallel=prefill_sequence_parallel,
                          dtype=dtype, fp8=fp8)
    model.to_empty(device=device)
    model.load(read)
    extra = [n for n in checkpoint.names if n not in used and not n.endswith(IGNORED_SUFFIXES)
             and not (config.tie_embeddings and n == "lm_head.weight")]
    if extra:
        raise ValueError(f"{owner}: the checkpoint has tensors the model has no place for: {sorted(extra)[:8]}")
    return model
