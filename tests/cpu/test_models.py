"""Hugging Face checkpoints through ``tileweave.models.from_pretrained`` on emulated ranks, against
``transformers`` (a test dependency) running the same tiny random model in float64: logits of a
left-padded batch, greedy tokens (with and without a stop token), sampling, the full state dict; and
every config field the model cannot honour refused by name."""

import copy
import re
import warnings
from pathlib import Path

import pytest
import torch

from support import hf_models
from tileweave.models import UnsupportedConfig, decoder_config
from tileweave.testing.emulated import run_ranks

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")


@pytest.mark.parametrize("family, world, shard", [("llama", 2, True), ("mistral", 3, False), ("qwen2", 2, False),
                                                  ("qwen3", 3, True)])
def test_from_pretrained_matches_transformers(tmp_path, family, world, shard):
    # batch 2 x 5: 10 rows, sequence-parallel prefill at W = 2, replicated at W = 3
    model = hf_models.make_model(family, str(tmp_path / "model"), shard=shard)
    ids, mask = hf_models.prompts(2, 5)
    new = 4
    free = hf_models.reference(model, ids, mask, new, None)
    stop = int(free["greedy"][0, 1])  # the second token of the first sequence ends it
    ref = hf_models.reference(model, ids, mask, new, stop)
    real = mask.bool()
    top2 = ref["logits"][real].topk(2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1]).min() > 1e-3, "reference choices too close to a tie for a token test"

    bad = None
    if family == "llama":  # a checkpoint with one tensor of the wrong shape
        bad = tmp_path / "bad"
        bad.mkdir()
        state = {k: v.float().contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
        state["model.layers.0.self_attn.k_proj.weight"] = state["model.layers.0.self_attn.k_proj.weight"][:16]
        safetensors_torch.save_file(state, str(bad / "model.safetensors"))
        (bad / "config.json").write_text((tmp_path / "model" / "config.json").read_text())
    results = run_ranks(world, hf_models.load_check, str(tmp_path / "model"), ids, mask, new, stop,
                        None if bad is None else str(bad))
    for r in results:
        hf_models.check_against_transformers(r, ref, real, family)
        if bad is not None:
            assert r["stopped"] == ref["stopped"].tolist(), (r["stopped"], ref["stopped"])
            assert r["sampled"][0] == r["sampled"][1] == results[0]["sampled"][0]  # seeded: alike everywhere
            assert r["sampled"][0] != r["greedy"]
            assert r["nucleus_of_one"] == r["greedy"]
            assert ("'model.layers.0.self_attn.k_proj.weight' must have shape [32, 64] (from the model config), "
                    "got [16, 64]") in r["bad_shape"], r["bad_shape"]
            assert ("'model.layers.1.mlp.down_proj.weight' must have shape [64, 96] (from the model config), "
                    "got [64, 95]") in r["bad_state"], r["bad_state"]


LLAMA = {"model_type": "llama", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_act": "silu",
         "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
         "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}


def _with(base: dict, **changes) -> dict:
    hf = copy.deepcopy(base)
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(hf.get(key), dict):
            hf[key].update(value)
        else:
            hf[key] = value
    return hf


@pytest.mark.parametrize("changes, field", [
    (dict(model_type="qwen2_moe"), "model_type='qwen2_moe'"),
    (dict(model_type="deepseek_v3"), "model_type='deepseek_v3'"),
    (dict(model_type="gemma2"), "model_type='gemma2'"),
    (dict(num_local_experts=8), "num_local_experts=8"),
    (dict(hidden_act="gelu"), "hidden_act='gelu'"),
    (dict(attention_bias=True), "attention_bias=True"),
    (dict(mlp_bias=True), "mlp_bias=True"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0}), "rope_type='yarn'"),
    (dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0}), "rope_type='dynamic'"),
    (dict(partial_rotary_factor=0.5), "partial_rotary_factor=0.5"),
    (dict(use_sliding_window=True), "use_sliding_window=True"),
    (dict(layer_types=["full_attention", "sliding_attention"]), "layer_types="),
    (dict(quantization_config={"quant_method": "gptq"}), "quantization_config='gptq'"),
    (dict(final_logit_softcapping=30.0), "final_logit_softcapping=30.0"),
])
def test_unsupported_config_fields_are_refused_by_name(changes, field):
    with pytest.raises(UnsupportedConfig, match="config.json: " + field.replace("[", r"\[")):
        decoder_config(_with(LLAMA, **changes))


def test_config_fields_read():
    old_style = _with(LLAMA, rope_parameters=None, rope_theta=500000.0,
                      rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    c = decoder_config(old_style)
    assert c.rope_theta == 500000.0 and c.rope_scaling.factor == 8.0 and c.max_seq == 256
    mistral = _with(LLAMA, model_type="mistral", sliding_window=128)
    with pytest.warns(UserWarning, match="sliding_window=128 caps max_seq at 128 tokens"):
        assert decoder_config(mistral).max_seq == 128  # within the window, sliding-window attention is exact
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a max_seq the caller chose within the window: nothing to say
        assert decoder_config(mistral, max_seq=100).max_seq == 100
    with pytest.raises(UnsupportedConfig, match="sliding_window=128"):
        decoder_config(mistral, max_seq=200)
    with pytest.raises(UnsupportedConfig, match="max_position_embeddings=256"):
        decoder_config(LLAMA, max_seq=300)
    q3 = decoder_config(_with(LLAMA, model_type="qwen3", head_dim=32, num_attention_heads=4))
    assert q3.head_dim == 32 and q3.qk_norm and not q3.qkv_bias
    assert decoder_config(_with(LLAMA, model_type="qwen2")).qkv_bias


def test_the_library_needs_neither_transformers_nor_safetensors():
    src = Path(__file__).resolve().parents[2] / "src" / "tileweave"
    found = [f"{p.relative_to(src)}: {m.group(0)}" for p in src.rglob("*.py")
             for m in re.finditer(r"^\s*(import|from) (transformers|safetensors)\b.*$", p.read_text(), re.M)]
    assert found == []
