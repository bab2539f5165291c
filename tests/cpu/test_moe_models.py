"""Mixture-of-experts checkpoints (Mixtral, Qwen3-MoE) through ``tileweave.models.from_pretrained`` on
emulated ranks, against ``transformers`` running the same tiny random model in float64: logits of a
left-padded batch (sequence-parallel prefill on the MoE pair at W = 2, replicated at W = 3), greedy
tokens (the decode steps on ``TPMoE.replicated``), the full state dict under the checkpoint's names and
its round trip, shape errors naming the tensor, and every config field the model cannot honour refused
by name."""

import copy

import pytest
import torch

from support import hf_models
from tileweave.models import UnsupportedConfig, decoder_config
from tileweave.testing.emulated import run_ranks

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")


@pytest.mark.parametrize("family, world", [("mixtral", 2), ("qwen3_moe", 3)])
def test_moe_checkpoint_matches_transformers(tmp_path, family, world):
    model = hf_models.make_model(family, str(tmp_path / "model"))
    ids, mask = hf_models.prompts(2, 5)
    ref = hf_models.reference(model, ids, mask, 4, None)
    real = mask.bool()
    top2 = ref["logits"][real].topk(2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1]).min() > 1e-3, "reference choices too close to a tie for a token test"
    bad = None
    if family == "mixtral":  # a checkpoint with one expert tensor of the wrong shape
        bad = tmp_path / "bad"
        bad.mkdir()
        state = {k: v.float().contiguous() for k, v in safetensors_torch.load_file(
            str(tmp_path / "model" / "model.safetensors")).items()}
        state[BAD_TENSOR] = state[BAD_TENSOR][:40].contiguous()
        safetensors_torch.save_file(state, str(bad / "model.safetensors"))
        (bad / "config.json").write_text((tmp_path / "model" / "config.json").read_text())
    results = run_ranks(world, moe_check, str(tmp_path / "model"), ids, mask, None if bad is None else str(bad))
    for r in results:
        hf_models.check_against_transformers(r, ref, real, family)
        if bad is not None:
            assert (f"'{BAD_TENSOR}' must have shape [48, 64] (from the model config), got [40, 64]"
                    in r["bad_checkpoint"]), r
            assert ("'model.layers.1.block_sparse_moe.experts.3.w2.weight' must have shape [64, 48] (from the "
                    "model config), got [64, 47]") in r["bad_state"], r


BAD_TENSOR = "model.layers.0.block_sparse_moe.experts.2.w1.weight"


def moe_check(rank: int, world: int, directory: str, ids, mask, bad_directory: str | None) -> dict:
    """``hf_models.load_check`` (logits, greedy tokens, state dict), then with ``bad_directory`` the
    errors of a checkpoint with one expert tensor of the wrong shape and of a state dict with one."""
    import torch.distributed as dist

    from tileweave.models import from_pretrained

    out = hf_models.load_check(rank, world, directory, ids, mask, 4, 0)
    if bad_directory is None:
        return out
    try:
        from_pretrained(bad_directory, group=dist.group.WORLD, dtype=torch.float32, device="cpu")
    except ValueError as exc:
        out["bad_checkpoint"] = str(exc)
    model = from_pretrained(directory, group=dist.group.WORLD, dtype=torch.float32, device="cpu")
    state = model.full_state_dict()
    name = "model.layers.1.block_sparse_moe.experts.3.w2.weight"
    state[name] = state[name][:, :-1]
    try:
        model.load_full_state_dict(state)
    except ValueError as exc:
        out["bad_state"] = str(exc)
    return out


MIXTRAL = {"model_type": "mixtral", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_act": "silu",
           "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
           "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}, "num_local_experts": 8,
           "num_experts_per_tok": 2, "router_jitter_noise": 0.1, "router_aux_loss_coef": 0.02,
           "output_router_logits": False, "sliding_window": None}
QWEN3_MOE = {"model_type": "qwen3_moe", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96,
             "moe_intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 32, "hidden_act": "silu", "max_position_embeddings": 256,
             "rms_norm_eps": 1e-6, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
             "num_experts": 16, "num_experts_per_tok": 4, "norm_topk_prob": True, "decoder_sparse_step": 1,
             "mlp_only_layers": [], "use_sliding_window": False, "sliding_window": None}


def _with(base: dict, **changes) -> dict:
    hf = copy.deepcopy(base)
    hf.update(changes)
    return hf


def test_moe_config_fields_read():
    m = decoder_config(MIXTRAL)
    assert (m.moe.experts, m.moe.top_k, m.moe.normalize_topk, m.moe.naming, m.ffn) == (8, 2, True, "mixtral", 96)
    assert not m.qk_norm
    assert decoder_config(_with(MIXTRAL, sliding_window=128)).max_seq == 128  # Mistral's attention
    q = decoder_config(QWEN3_MOE)
    assert (q.moe.experts, q.moe.top_k, q.moe.normalize_topk, q.moe.naming, q.ffn) == (16, 4, True, "qwen3_moe", 32)
    assert q.qk_norm and q.head_dim == 32
    # transformers 5 writes Qwen3-MoE's expert count as num_local_experts
    written = _with(QWEN3_MOE, num_local_experts=16, norm_topk_prob=False)
    del written["num_experts"]
    assert decoder_config(written).moe.experts == 16 and not decoder_config(written).moe.normalize_topk


@pytest.mark.parametrize("base, changes, field", [
    (QWEN3_MOE, dict(decoder_sparse_step=2), "decoder_sparse_step=2"),
    (QWEN3_MOE, dict(mlp_only_layers=[0]), r"mlp_only_layers=\[0\]"),
    (QWEN3_MOE, dict(shared_expert_intermediate_size=64), "shared_expert_intermediate_size=64"),
    (QWEN3_MOE, dict(use_sliding_window=True), "use_sliding_window=True"),
    (QWEN3_MOE, dict(num_experts_per_tok=17), "num_experts_per_tok=17"),
    (QWEN3_MOE, dict(num_experts=0), "num_experts=0"),
    (MIXTRAL, dict(n_shared_experts=1), "n_shared_experts=1"),
    (MIXTRAL, dict(routed_scaling_factor=2.5), "routed_scaling_factor=2.5"),
    (MIXTRAL, dict(scoring_func="sigmoid"), "scoring_func='sigmoid'"),
    (MIXTRAL, dict(hidden_act="gelu"), "hidden_act='gelu'"),
    (MIXTRAL, dict(model_type="qwen2_moe"), "model_type='qwen2_moe'"),
    (MIXTRAL, dict(model_type="llama"), "num_local_experts=8"),  # expert fields in a dense family
])
def test_unsupported_moe_config_fields_are_refused_by_name(base, changes, field):
    with pytest.raises(UnsupportedConfig, match="config.json: " + field):
        decoder_config(_with(base, **changes))
