"""Tiny random Hugging Face models of each supported family, written with ``save_pretrained``, and the
per-rank check that loads one with ``tileweave.models.from_pretrained`` (run on emulated ranks by the
tests). ``transformers`` is the reference: it is a test dependency only."""

from __future__ import annotations

import torch
import torch.distributed as dist

# hidden, heads, kv_heads, head_dim (None: hidden / heads), ffn, vocab
FAMILIES = {
    # Llama 3.1: llama3 RoPE scaling, tied embeddings, a sharded checkpoint
    "llama": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
                  tie_word_embeddings=True,
                  rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 8}),
    # Mistral at W = 3: one key/value head per rank
    "mistral": dict(hidden_size=48, num_attention_heads=6, num_key_value_heads=3, intermediate_size=96,
                    head_dim=16, sliding_window=4096),
    # Qwen2: QKV bias; one key/value head for two ranks (replicated)
    "qwen2": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=1, intermediate_size=96),
    # Qwen3: QK-norm, head_dim apart from hidden / heads; one key/value head for three ranks
    "qwen3": dict(hidden_size=64, num_attention_heads=6, num_key_value_heads=1, head_dim=16, intermediate_size=96),
    # Mixtral: 4 experts, top 2, weights renormalised; expert width 48 (24 or 16 per rank)
    "mixtral": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=48,
                    num_local_experts=4, num_experts_per_tok=2),
    # Qwen3-MoE: QK-norm, head_dim 16, 4 experts of width 36, top 2 without renormalising
    "qwen3_moe": dict(hidden_size=64, num_attention_heads=6, num_key_value_heads=3, head_dim=16,
                      intermediate_size=96, moe_intermediate_size=36, num_experts=4, num_experts_per_tok=2,
                      norm_topk_prob=False),
}
VOCAB = 120


def make_model(family: str, directory: str, *, seed: int = 0, shard: bool = False):
    """A random float64 model of ``family`` (``FAMILIES``), saved in float32 to ``directory``; returns it
    (float64, eval mode). Weights are drawn wider than the families' initialisation, so that the logits
    have clear winners."""
    import transformers

    classes = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
               "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
               "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
               "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
               "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
               "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM)}
    config_cls, model_cls = classes[family]
    config = config_cls(vocab_size=VOCAB, num_hidden_layers=2, max_position_embeddings=64, rms_norm_eps=1e-6,
                        eos_token_id=None, bos_token_id=None, pad_token_id=None, **FAMILIES[family])
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif p.dim() >= 2:  # linears [out, in], fused experts [E, out, in]
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
            else:  # biases
                p.copy_(0.1 * torch.randn_like(p))
    model.save_pretrained(directory, max_shard_size="40KB" if shard else "1GB")
    if family in ("mixtral", "qwen3_moe"):
        model.set_experts_implementation("eager")  # the default grouped_mm takes no float64
    return model.double().eval()


def prompts(batch: int, seq: int, *, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask) [batch, seq]``, left-padded: sequence ``b`` has ``b`` padding tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.long)
    for b in range(batch):
        mask[b, :b] = 0
    return ids.masked_fill(mask == 0, 0), mask


def reference(model, ids: torch.Tensor, mask: torch.Tensor, new_tokens: int, stop: int | None) -> dict:
    """transformers' float64 logits of the padded batch (positions counted from each first real token,
    as its ``generate`` counts them), its greedy tokens, and with ``stop`` as the end token."""
    positions = (mask.cumsum(1) - 1).clamp_min(0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        kw = dict(attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        greedy = model.generate(ids, eos_token_id=None, **kw)[:, ids.shape[1]:]
        stopped = model.generate(ids, eos_token_id=stop, **kw)[:, ids.shape[1]:] if stop is not None else None
    return {"logits": logits, "greedy": greedy, "stopped": stopped}


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    got, ref = got.double(), ref.double()
    if not torch.isfinite(got).all():
        return float("inf")
    return ((got - ref).norm() / ref.norm()).item()


def load_check(rank: int, world: int, directory: str, ids, mask, new_tokens: int, stop: int,
               bad_directory: str | None = None) -> dict:
    """``from_pretrained`` on this rank: logits of the padded batch and greedy tokens (plain lists), the
    full state dict against the checkpoint's tensors (read by the ``safetensors`` package) and again
    after ``load_full_state_dict`` of it. With ``bad_directory`` (a checkpoint with a wrong shape) also:
    greedy with ``stop`` as a stop token, two seeded sampled runs and a nucleus so small it is greedy,
    and the shape errors."""
    from safetensors import safe_open
    import glob

    from tileweave.models import from_pretrained

    model = from_pretrained(directory, group=dist.group.WORLD, dtype=torch.float32, device="cpu")
    out = {"logits": model(ids, attention_mask=mask).tolist()}
    out["greedy"] = model.generate(ids, new_tokens, attention_mask=mask).tolist()
    if bad_directory is not None:
        out["stopped"] = model.generate(ids, new_tokens, attention_mask=mask, stop_tokens=[stop],
                                        pad_token_id=0).tolist()
        sample = dict(attention_mask=mask, temperature=0.8, top_p=0.9, seed=7)
        out["sampled"] = [model.generate(ids, new_tokens, **sample).tolist() for _ in range(2)]
        out["nucleus_of_one"] = model.generate(ids, new_tokens, attention_mask=mask, temperature=1.0,
                                               top_p=1e-6).tolist()

    saved = {}
    for path in glob.glob(f"{directory}/*.safetensors"):
        with safe_open(path, "pt") as f:
            saved.update({name: f.get_tensor(name) for name in f.keys()})
    full = model.full_state_dict()
    out["state_names"] = sorted(full) == sorted(saved)
    out["state_equal"] = all(torch.equal(full[n], saved[n]) for n in saved if n in full)
    model.load_full_state_dict(full)
    again = model.full_state_dict()
    out["round_trip"] = all(torch.equal(again[n], full[n]) for n in full)
    out["logits_after_round_trip"] = _rel_err(model(ids, attention_mask=mask), torch.tensor(out["logits"]))
    if bad_directory is not None:
        try:
            from_pretrained(bad_directory, group=dist.group.WORLD, dtype=torch.float32, device="cpu")
        except ValueError as exc:
            out["bad_shape"] = str(exc)
        bad = dict(full)
        name = "model.layers.1.mlp.down_proj.weight"
        bad[name] = bad[name][:, 1:]
        try:
            model.load_full_state_dict(bad)
        except ValueError as exc:
            out["bad_state"] = str(exc)
    return out


def write_checkpoint(state: dict[str, torch.Tensor], config: dict, directory: str) -> None:
    """``state`` (float32) as ``directory/model.safetensors`` and ``config`` as ``config.json``, written
    here in the format's few lines, so that GPU machines without ``safetensors`` can run the check."""
    import json
    import os
    import struct

    os.makedirs(directory, exist_ok=True)
    header, blobs, offset = {}, [], 0
    for name, t in state.items():
        raw = t.detach().float().contiguous().cpu().numpy().tobytes()
        header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header).encode()
    with open(os.path.join(directory, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)


def _generate_three_ways(directory: str, state: dict, dims, steps: int, seed: int) -> dict:
    """The checkpoint in ``directory`` loaded with ``from_pretrained`` in float32 on this rank's GPU:
    greedy tokens of a left-padded batch with the decode step eager, replayed from a CUDA graph, and
    replayed again; and the float64 reference's tokens of each sequence unpadded."""
    from tileweave.models import from_pretrained
    from tileweave.testing.decoder_reference import reference_generate

    model = from_pretrained(directory, group=dist.group.WORLD, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, dims.vocab, (3, 9), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    mask[2, :5] = 0
    want = [reference_generate(state, dims, ids[b:b + 1, int((mask[b] == 0).sum()):], steps)[0].tolist()
            for b in range(ids.shape[0])]
    cuda = ids.cuda(), mask.cuda()
    eager = model.generate(cuda[0], steps, attention_mask=cuda[1]).cpu().tolist()
    graphed = model.generate(cuda[0], steps, attention_mask=cuda[1], cuda_graph=True).cpu().tolist()
    again = model.generate(cuda[0], steps, attention_mask=cuda[1], cuda_graph=True).cpu().tolist()
    return {"eager": eager, "graphed": graphed, "again": again, "want": want}


def graph_check(rank: int, world: int, directory: str, steps: int) -> dict:
    """On GPUs: a random Llama written as a checkpoint (by rank 0), loaded with ``from_pretrained`` in
    float32; greedy tokens of a left-padded batch with the decode step eager and replayed from a CUDA
    graph, and the float64 reference's tokens of each sequence unpadded
    (``tileweave.testing.decoder_reference``, which shares no code with the decoder)."""
    import os

    os.environ["TILEWEAVE_GRAPHABLE"] = "1"  # read by the shared ops when the model first calls them
    from tileweave.nn.decoder import DecoderConfig
    from tileweave.testing.decoder_reference import random_state_dict

    dims = DecoderConfig(vocab=64 * world, hidden=128, layers=2, heads=4 * world, kv_heads=world, ffn=96 * world,
                         rope_theta=10000.0, norm_eps=1e-5)
    state = random_state_dict(dims, seed=3)
    if rank == 0:
        write_checkpoint(state, {"model_type": "llama", "vocab_size": dims.vocab, "hidden_size": dims.hidden,
                                 "intermediate_size": dims.ffn, "num_hidden_layers": dims.layers,
                                 "num_attention_heads": dims.heads, "num_key_value_heads": dims.kv_heads,
                                 "max_position_embeddings": 64, "rms_norm_eps": dims.norm_eps,
                                 "rope_theta": dims.rope_theta, "tie_word_embeddings": False}, directory)
    dist.barrier()
    return _generate_three_ways(directory, state, dims, steps, 4)


def moe_graph_check(rank: int, world: int, directory: str, steps: int) -> dict:
    """``graph_check`` for a mixture of experts: a random Mixtral written as a checkpoint (by rank 0),
    loaded with ``from_pretrained`` in float32; greedy tokens of a left-padded batch with the decode step
    (``TPMoE.replicated``) eager and replayed from a CUDA graph, and the float64 reference's tokens
    (``tileweave.testing.decoder_reference`` with Mixtral's experts)."""
    import os

    os.environ["TILEWEAVE_GRAPHABLE"] = "1"  # read by the shared ops when the model first calls them
    from tileweave.nn.decoder import DecoderConfig, MoEConfig
    from tileweave.testing.decoder_reference import random_state_dict

    moe = MoEConfig(experts=4, top_k=2)
    dims = DecoderConfig(vocab=64 * world, hidden=128, layers=2, heads=4 * world, kv_heads=world, ffn=64 * world,
                         rope_theta=10000.0, norm_eps=1e-5, moe=moe)
    state = random_state_dict(dims, seed=5)
    if rank == 0:
        write_checkpoint(state, {"model_type": "mixtral", "vocab_size": dims.vocab, "hidden_size": dims.hidden,
                                 "intermediate_size": dims.ffn, "num_hidden_layers": dims.layers,
                                 "num_attention_heads": dims.heads, "num_key_value_heads": dims.kv_heads,
                                 "num_local_experts": moe.experts, "num_experts_per_tok": moe.top_k,
                                 "max_position_embeddings": 64, "rms_norm_eps": dims.norm_eps,
                                 "rope_theta": dims.rope_theta, "tie_word_embeddings": False}, directory)
    dist.barrier()
    return _generate_three_ways(directory, state, dims, steps, 6)


def check_against_transformers(r: dict, ref: dict, real, family: str) -> None:
    """Assert what every checkpoint test asserts of one rank's result ``r`` against transformers'
    ``ref``: logits within 1e-5 on the real tokens (``real``, a mask), greedy tokens equal, and the full
    state dict's names, values and round trip."""
    logits = torch.tensor(r["logits"], dtype=torch.float64)
    err = ((logits - ref["logits"])[real].norm() / ref["logits"][real].norm()).item()
    assert err < 1e-5, (family, err)
    assert r["greedy"] == ref["greedy"].tolist(), (r["greedy"], ref["greedy"])
    assert r["state_names"] and r["state_equal"] and r["round_trip"], r
    assert r["logits_after_round_trip"] == 0.0
