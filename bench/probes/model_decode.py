"""The decode step's latency of a Llama-3-8B-shaped model with random weights at world size 1: ours
(``tileweave.models`` loading the weights by their Hugging Face names, the step replayed from a CUDA
graph) beside ``transformers``' own greedy generation of the same model, and the weight-read floor.

Run by hand on one GPU: ``PYTHONPATH=src python3 bench/probes/model_decode.py OUT [BATCHES] [LAYERS]``
(BATCHES default ``1,8,32``; LAYERS default 32, fewer for a quick look). Writes ``OUT/model_decode.json``
and prints a table. Per batch size:

- ``ours_step_ms``: one decode step replayed from its CUDA graph (``tileweave.nn.generation.DecodeStep``),
  CUDA events around ``STEPS`` steps, the median of ``REPS`` batches; the token fed back is the argmax
  of the last logits, as greedy generation does.
- ``ours_generate_ms`` / ``hf_generate_ms``: per new token of a whole greedy ``generate`` call, from
  the difference between ``NEW`` and 1 new tokens (prefill and, for ours, the graph capture counted in).
  ``transformers`` runs eagerly with its default dynamic cache: a sanity anchor, not a tuned server.
- ``floor_ms``: the bytes a step must read (every weight but the embedding table, and the KV cache
  written so far) at the H200's 4.8 TB/s peak HBM bandwidth (NVIDIA's H200 datasheet).
- ``tokens_agree``: the fraction of greedy tokens that ours and ``transformers`` agree on (bf16 random
  models have near-ties, so a few may differ late in a sequence)."""
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from tileweave.testing.emulated import run_ranks

PROMPT, NEW, STEPS, REPS = 512, 64, 50, 5
HBM_BYTES_PER_S = 4.8e12


def _config(layers: int):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
                       num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                       rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False, dtype="bfloat16")


def _events_ms(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _rank(rank: int, world: int, batches: list[int], layers: int) -> list[dict]:
    os.environ["TILEWEAVE_GRAPHABLE"] = "1"
    from transformers import LlamaForCausalLM

    from tileweave.models import decoder_config
    from tileweave.nn.decoder import TPDecoder
    from tileweave.nn.generation import DecodeStep

    torch.manual_seed(0)
    hf_config = _config(layers)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        hf = LlamaForCausalLM(hf_config).eval()
    torch.set_default_dtype(torch.float32)
    weights = hf.state_dict()
    # The weights by their checkpoint names, read in place of a safetensors file (tileweave.models reads
    # the same names from disk; writing 16 GB here would only cost time).
    config = decoder_config(hf_config.to_dict(), max_seq=PROMPT + STEPS * (REPS + 2) + NEW + 8)
    with torch.device("meta"):
        model = TPDecoder(config, group=dist.group.WORLD, dtype=torch.bfloat16)
    model.to_empty(device="cuda")
    model.load(lambda name, shape, dim=0, start=None, stop=None:
               weights[name].narrow(dim, start or 0, (stop or weights[name].shape[dim]) - (start or 0)))
    weight_bytes = sum(t.numel() * t.element_size() for n, t in weights.items() if "embed_tokens" not in n)
    rows = []
    g = torch.Generator().manual_seed(1)
    for batch in batches:
        ids = torch.randint(0, hf_config.vocab_size, (batch, PROMPT), generator=g).cuda()
        with torch.no_grad():
            cache = model.new_cache(batch, PROMPT + STEPS * (REPS + 2) + 2)
            step = DecodeStep(model, cache, cuda_graph=True)
            tokens = model.prefill(ids, cache, None)[:, -1].argmax(-1)
            for _ in range(2):  # the eager first step, then the capture
                tokens = step(tokens).argmax(-1)

            def steps(tokens=tokens):
                for _ in range(STEPS):
                    tokens = step(tokens).argmax(-1)

            ours_step = _events_ms(steps, REPS) / STEPS
            ours = {}
            hf_out = {}
            for n in (1, NEW):
                ours[n] = _events_ms(lambda: model.generate(ids, n, cuda_graph=True), 3)
                hf_out[n] = _events_ms(lambda: hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                                           attention_mask=torch.ones_like(ids)), 3)
            mine = model.generate(ids, NEW, cuda_graph=True)
            theirs = hf.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                                 attention_mask=torch.ones_like(ids))[:, PROMPT:]
        kv_bytes = 2 * layers * batch * (PROMPT + NEW // 2) * config.kv_heads * config.head_dim * 2
        floor = (weight_bytes + kv_bytes) / HBM_BYTES_PER_S * 1e3
        rows.append({"batch": batch, "layers": layers, "prompt": PROMPT, "ours_step_ms": ours_step,
                     "ours_generate_ms": (ours[NEW] - ours[1]) / (NEW - 1),
                     "hf_generate_ms": (hf_out[NEW] - hf_out[1]) / (NEW - 1), "floor_ms": floor,
                     "tokens_agree": float((mine == theirs).float().mean()),
                     "first_token_agree": float((mine[:, 0] == theirs[:, 0]).float().mean())})
        del cache, step
    return rows


def main() -> None:
    out_dir = sys.argv[1]
    batches = [int(b) for b in sys.argv[2].split(",")] if len(sys.argv) > 2 else [1, 8, 32]
    layers = int(sys.argv[3]) if len(sys.argv) > 3 else 32
    start = time.perf_counter()
    rows = run_ranks(1, _rank, batches, layers, gpus=True, timeout_s=500)[0]
    os.makedirs(out_dir, exist_ok=True)
    meta = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "commit": os.environ.get(
        "TILEWEAVE_GIT_COMMIT"), "wall_s": time.perf_counter() - start}
    with open(os.path.join(out_dir, "model_decode.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print(f"{'batch':>5} {'ours step ms':>12} {'ours gen ms':>11} {'hf gen ms':>9} {'floor ms':>8} "
          f"{'floor/ours':>10} {'hf/ours':>7} {'agree':>6}")
    for r in rows:
        print(f"{r['batch']:5d} {r['ours_step_ms']:12.3f} {r['ours_generate_ms']:11.3f} {r['hf_generate_ms']:9.3f} "
              f"{r['floor_ms']:8.3f} {r['floor_ms'] / r['ours_step_ms']:10.2f} "
              f"{r['hf_generate_ms'] / r['ours_generate_ms']:7.2f} {r['tokens_agree']:6.2f}")


if __name__ == "__main__":
    main()
