"""A Hugging Face ``config.json`` as a ``DecoderConfig``, or an error that names the field the TP decoder
cannot honour: nothing is computed approximately.

Families: ``llama`` (Llama 2, 3, 3.1 with ``rope_type: "llama3"``), ``mistral``, ``qwen2`` (QKV bias),
``qwen3`` (QK-norm, explicit ``head_dim``). Refused: other model types (mixtures of experts among them),
activations other than SiLU, ``attention_bias`` and ``mlp_bias``, RoPE types other than ``default`` and
``llama3`` and partial rotary embeddings, sliding-window attention that could bite (``use_sliding_window``,
non-full ``layer_types``, a Mistral ``sliding_window`` shorter than the longest sequence asked for),
quantized checkpoints, and logit or embedding scalings these families do not have.
"""

from __future__ import annotations

from typing import Any

import torch

from tileweave.nn.decoder import DecoderConfig, RopeScaling

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
MIXTURES_OF_EXPERTS = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3", "olmoe", "dbrx")
# Fields of other families that change the math; a config that sets one is not one of ours.
FOREIGN = ("final_logit_softcapping", "attn_logit_softcapping", "logit_scale", "embedding_multiplier",
           "residual_multiplier", "attention_multiplier", "logits_scaling", "query_pre_attn_scalar",
           "num_local_experts", "num_experts")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class UnsupportedConfig(ValueError):
    """A config field that the TP decoder cannot honour (the message names it)."""


def _refuse(field: str, value: Any, why: str) -> UnsupportedConfig:
    return UnsupportedConfig(f"config.json: {field}={value!r} is not supported: {why}")


def _rope(hf: dict) -> tuple[float, RopeScaling | None]:
    """``(rope_theta, scaling)`` from ``rope_parameters`` (transformers 5) or ``rope_theta`` and
    ``rope_scaling`` (older)."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    for where in (hf, params):
        if where.get("partial_rotary_factor", 1.0) != 1.0:
            raise _refuse("partial_rotary_factor", where["partial_rotary_factor"], "RoPE turns whole heads only")
    if kind == "default":
        return theta, None
    if kind == "llama3":
        return theta, RopeScaling(factor=float(params["factor"]), low_freq_factor=float(params["low_freq_factor"]),
                                  high_freq_factor=float(params["high_freq_factor"]),
                                  original_max_position=int(params["original_max_position_embeddings"]))
    raise _refuse("rope_type", kind, "the RoPE types are 'default' and 'llama3'")


def _window(hf: dict, family: str) -> int | None:
    """The sliding window that applies, or None."""
    if hf.get("use_sliding_window"):
        raise _refuse("use_sliding_window", True, "sliding-window attention is not implemented")
    kinds = set(hf.get("layer_types") or ["full_attention"])
    if kinds != {"full_attention"}:
        raise _refuse("layer_types", sorted(kinds), "only full attention is implemented")
    return hf.get("sliding_window") if family == "mistral" else None


def decoder_config(hf: dict, *, max_seq: int | None = None) -> DecoderConfig:
    """The ``DecoderConfig`` of the parsed ``config.json`` ``hf``. ``max_seq``: the longest sequence a
    KV cache will hold (default: ``max_position_embeddings``, capped by a Mistral ``sliding_window``,
    within which the window never bites). Raises ``UnsupportedConfig`` naming the field it cannot honour."""
    family = hf.get("model_type")
    if family in MIXTURES_OF_EXPERTS:
        raise _refuse("model_type", family, "mixtures of experts are not supported yet")
    if family not in FAMILIES:
        raise _refuse("model_type", family, f"the supported families are {', '.join(FAMILIES)}")
    for field in FOREIGN:
        if hf.get(field) is not None:
            raise _refuse(field, hf[field], f"a {family} model has no such field")
    if hf.get("quantization_config"):
        raise _refuse("quantization_config", hf["quantization_config"].get("quant_method", "?"),
                      "quantized weights are not supported")
    if hf.get("hidden_act", "silu") != "silu":
        raise _refuse("hidden_act", hf["hidden_act"], "the MLP is SwiGLU (silu)")
    for field in ("attention_bias", "mlp_bias"):
        if hf.get(field):
            raise _refuse(field, True, "the projections have no bias (Qwen2's fixed QKV bias aside)")
    theta, scaling = _rope(hf)
    window = _window(hf, family)
    longest = int(hf.get("max_position_embeddings", 2048))
    if max_seq is None:
        max_seq = min(longest, window) if window else longest
    elif max_seq > longest:
        raise _refuse("max_position_embeddings", longest, f"max_seq={max_seq} is longer")
    elif window and max_seq > window:
        raise _refuse("sliding_window", window, f"sliding-window attention is not implemented, and max_seq={max_seq} "
                      "is longer than the window (sequences up to sliding_window tokens are exact)")
    heads = int(hf["num_attention_heads"])
    return DecoderConfig(
        vocab=int(hf["vocab_size"]), hidden=int(hf["hidden_size"]), layers=int(hf["num_hidden_layers"]),
        heads=heads, kv_heads=int(hf.get("num_key_value_heads") or heads), ffn=int(hf["intermediate_size"]),
        head_dim=hf.get("head_dim"), rope_theta=theta, rope_scaling=scaling,
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)), max_seq=max_seq, qkv_bias=family == "qwen2",
        qk_norm=family == "qwen3", tie_embeddings=bool(hf.get("tie_word_embeddings", False)))


def checkpoint_dtype(hf: dict) -> torch.dtype | None:
    """The dtype ``config.json`` names (``dtype``, or ``torch_dtype`` in older files), if any."""
    name = hf.get("dtype") or hf.get("torch_dtype")
    return DTYPES.get(str(name).removeprefix("torch.")) if name else None
