"""A Hugging Face ``config.json`` as a ``DecoderConfig``, or an error that names the field the TP decoder
cannot honour: nothing is computed approximately.

Families: ``llama`` (Llama 2, 3, 3.1 with ``rope_type: "llama3"``), ``mistral``, ``qwen2`` (QKV bias),
``qwen3`` (QK-norm, explicit ``head_dim``), and the mixtures of experts ``mixtral`` (Mistral's attention,
``num_local_experts``, ``num_experts_per_tok``, weights renormalised) and ``qwen3_moe`` (Qwen3's
attention, ``num_experts``, ``num_experts_per_tok``, ``norm_topk_prob``, ``moe_intermediate_size``; every
layer sparse: ``decoder_sparse_step`` 1 and no ``mlp_only_layers``). Settings that act only in training
(``router_jitter_noise``, ``router_aux_loss_coef``, ``output_router_logits``) are accepted. Refused: other
model types (other mixtures of experts among them), shared experts and other routing schemes,
activations other than SiLU, ``attention_bias`` and ``mlp_bias``, RoPE types other than ``default`` and
``llama3`` and partial rotary embeddings, sliding-window attention that could bite (``use_sliding_window``,
non-full ``layer_types``, a Mistral ``sliding_window`` shorter than the longest sequence asked for),
quantized checkpoints, and logit or embedding scalings these families do not have.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from tileweave.nn.decoder import DecoderConfig, MoEConfig, RopeScaling

MOE_FAMILIES = ("mixtral", "qwen3_moe")
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", *MOE_FAMILIES)
MIXTURES_OF_EXPERTS = ("qwen2_moe", "deepseek_v2", "deepseek_v3", "olmoe", "dbrx")
"""Refused mixtures of experts."""
# Fields of other families that change the math; a config that sets one is not one of ours.
FOREIGN = ("final_logit_softcapping", "attn_logit_softcapping", "logit_scale", "embedding_multiplier",
           "residual_multiplier", "attention_multiplier", "logits_scaling", "query_pre_attn_scalar")
EXPERT_FIELDS = ("num_local_experts", "num_experts", "num_experts_per_tok", "moe_intermediate_size")
"""Fields of a mixture of experts: refused in a dense family's config."""
# Routing schemes and shared experts of other mixtures of experts (Qwen2-MoE, DeepSeek, OLMoE, ...).
FOREIGN_MOE = ("shared_expert_intermediate_size", "n_shared_experts", "num_shared_experts", "moe_layer_freq",
               "first_k_dense_replace", "routed_scaling_factor", "scoring_func", "topk_method", "n_group",
               "topk_group", "n_routed_experts", "moe_topk")
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
    return hf.get("sliding_window") if family in ("mistral", "mixtral") else None


def decoder_config(hf: dict, *, max_seq: int | None = None) -> DecoderConfig:
    """The ``DecoderConfig`` of the parsed ``config.json`` ``hf``. ``max_seq``: the longest sequence a
    KV cache will hold (default: ``max_position_embeddings``, capped, with a warning, by a Mistral
    ``sliding_window``, within which the window never bites). Raises ``UnsupportedConfig`` naming the field it cannot honour."""
    family = hf.get("model_type")
    if family in MIXTURES_OF_EXPERTS:
        raise _refuse("model_type", family, f"the mixtures of experts supported are {', '.join(MOE_FAMILIES)}")
    if family not in FAMILIES:
        raise _refuse("model_type", family, f"the supported families are {', '.join(FAMILIES)}")
    foreign = FOREIGN + (FOREIGN_MOE if family in MOE_FAMILIES else EXPERT_FIELDS)
    for field in foreign:
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
        if window and window < longest:
            warnings.warn(f"config.json's sliding_window={window} caps max_seq at {window} tokens (of "
                          f"max_position_embeddings={longest}): sliding-window attention is not implemented, and "
                          "sequences up to the window are exact. Pass max_seq= (at most the window) to choose.",
                          stacklevel=2)
    elif max_seq > longest:
        raise _refuse("max_position_embeddings", longest, f"max_seq={max_seq} is longer")
    elif window and max_seq > window:
        raise _refuse("sliding_window", window, f"sliding-window attention is not implemented, and max_seq={max_seq} "
                      "is longer than the window (sequences up to sliding_window tokens are exact)")
    heads = int(hf["num_attention_heads"])
    moe, ffn = _experts(hf, family) if family in MOE_FAMILIES else (None, int(hf["intermediate_size"]))
    return DecoderConfig(
        vocab=int(hf["vocab_size"]), hidden=int(hf["hidden_size"]), layers=int(hf["num_hidden_layers"]),
        heads=heads, kv_heads=int(hf.get("num_key_value_heads") or heads), ffn=ffn,
        head_dim=hf.get("head_dim"), rope_theta=theta, rope_scaling=scaling,
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)), max_seq=max_seq, qkv_bias=family == "qwen2",
        qk_norm=family in ("qwen3", "qwen3_moe"), tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        moe=moe)


def _experts(hf: dict, family: str) -> tuple[MoEConfig, int]:
    """``(MoEConfig, expert width)`` of a Mixtral or Qwen3-MoE config."""
    if family == "mixtral":
        experts, ffn = hf.get("num_local_experts", 8), int(hf["intermediate_size"])
        normalize = True
    else:
        # transformers 5 writes num_local_experts for what Qwen's own configs call num_experts
        experts = hf.get("num_experts", hf.get("num_local_experts", 128))
        ffn, normalize = int(hf["moe_intermediate_size"]), bool(hf.get("norm_topk_prob", False))
        if hf.get("decoder_sparse_step", 1) != 1:
            raise _refuse("decoder_sparse_step", hf["decoder_sparse_step"],
                          "every layer is a mixture of experts here (decoder_sparse_step 1)")
        if hf.get("mlp_only_layers"):
            raise _refuse("mlp_only_layers", hf["mlp_only_layers"],
                          "dense MLP layers between mixture-of-experts layers are not implemented")
    top_k = hf.get("num_experts_per_tok", 2)
    if not isinstance(experts, int) or experts < 1:
        raise _refuse("num_experts", experts, "a mixture of experts needs at least one expert")
    if not isinstance(top_k, int) or not 1 <= top_k <= experts:
        raise _refuse("num_experts_per_tok", top_k, f"it must be from 1 to the {experts} experts")
    return MoEConfig(experts=experts, top_k=top_k, normalize_topk=normalize, naming=family), ffn


def checkpoint_dtype(hf: dict) -> torch.dtype | None:
    """The dtype ``config.json`` names (``dtype``, or ``torch_dtype`` in older files), if any."""
    name = hf.get("dtype") or hf.get("torch_dtype")
    return DTYPES.get(str(name).removeprefix("torch.")) if name else None
