"""``tileweave generate``: tokens from a Hugging Face checkpoint directory, the model split over TP ranks.

    tileweave generate --model DIR --prompt-ids 1,15043,3186 --tp 2          # GPUs, else emulated CPU ranks
    torchrun --nproc-per-node 2 -m tileweave generate --model DIR --prompt-ids 1,15043

DIR holds ``config.json`` and safetensors (a Llama, Mistral, Qwen2, Qwen3, Mixtral or Qwen3-MoE model,
``tileweave.models.from_pretrained``); each rank reads only its slices. With CUDA GPUs one process per
GPU (``--tp`` of them, all by default); without, ``--tp`` emulated CPU ranks in float32 (Triton's
interpreter: only tiny models finish). Prints the new token ids and the prefill and decode speeds;
``--progress`` shows the tokens as they come.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

import torch
import torch.distributed as dist

from tileweave.models import UnsupportedConfig, decoder_config, from_pretrained
from tileweave.models.safetensors import read_json
from tileweave.runtime import settings
from tileweave.testing.emulated import run_ranks


def _ids(text: str) -> list[int]:
    try:
        ids = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids, got {text!r}") from None
    if not ids or min(ids) < 0:
        raise argparse.ArgumentTypeError(f"expected one or more token ids >= 0, got {text!r}")
    return ids


def parse_args(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="tileweave generate",
                                description="Tokens from a Hugging Face checkpoint directory, the model split "
                                            "over TP ranks: one process per GPU, or emulated CPU ranks "
                                            "without GPUs.")
    p.add_argument("--model", required=True, help="checkpoint directory (config.json and safetensors)")
    p.add_argument("--prompt-ids", type=_ids, required=True, help="comma-separated token ids of the prompt")
    p.add_argument("--new-tokens", type=int, default=32, help="tokens to generate at most (default 32)")
    p.add_argument("--tp", type=int, default=0, help="TP ranks (default: every GPU; 2 emulated ranks on the CPU)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop-ids", type=_ids, default=None, help="comma-separated ids that end the generation")
    p.add_argument("--cuda-graph", action="store_true", help="replay the decode step from a CUDA graph (GPUs)")
    p.add_argument("--progress", action="store_true", help="print each new token as it comes")
    args = p.parse_args(argv)
    if args.new_tokens < 1:
        p.error(f"--new-tokens must be >= 1, got {args.new_tokens}")
    if not os.path.isfile(os.path.join(args.model, "config.json")):
        p.error(f"--model {args.model!r} has no config.json")
    try:
        # The config is read again by every rank; refused here, no rank starts for it.
        hf = read_json(os.path.join(args.model, "config.json"))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the ranks' own reading of it warns where it applies
            config = decoder_config(hf if isinstance(hf, dict) else {})
    except (UnsupportedConfig, ValueError, KeyError) as exc:
        p.error(f"--model {args.model!r}: {exc}")
    if max(args.prompt_ids) >= config.vocab:
        p.error(f"--prompt-ids: id {max(args.prompt_ids)} is outside the model's vocabulary of {config.vocab}")
    if len(args.prompt_ids) + args.new_tokens > config.max_seq:
        p.error(f"{len(args.prompt_ids)} prompt ids + --new-tokens {args.new_tokens} exceed the model's "
                f"max_seq={config.max_seq}")
    gpus = torch.cuda.device_count()
    if args.cuda_graph and not gpus:
        p.error("--cuda-graph needs CUDA GPUs")
    args.tp = args.tp or gpus or 2
    if args.tp < 1 or (gpus and args.tp > gpus):
        p.error(f"--tp must be between 1 and the {gpus or 'any number of'} GPUs, got {args.tp}")
    return args


def generate_rank(rank: int, world: int, args: argparse.Namespace) -> dict:
    """One rank: load its slices, generate; the tokens and the times (rank 0 prints the progress)."""
    cuda = torch.cuda.is_available()
    if args.cuda_graph:
        settings.override(settings.GRAPHABLE, "1")  # the decode step's ops must replay in a graph
    start = time.perf_counter()
    model = from_pretrained(args.model, group=dist.group.WORLD, dtype=None if cuda else torch.float32)
    loaded = time.perf_counter()
    stamps = []

    def on_token(i: int, tokens: torch.Tensor) -> None:
        stamps.append(time.perf_counter())  # reading the token (progress) or the clock waits for the GPU
        if args.progress and rank == 0:
            print(f"token {i + 1}/{args.new_tokens}: {tokens.tolist()[0]}", file=sys.stderr, flush=True)
        elif cuda:
            torch.cuda.synchronize()
            stamps[-1] = time.perf_counter()

    ids = torch.tensor([args.prompt_ids], device=model.embed.device)
    began = time.perf_counter()
    tokens = model.generate(ids, args.new_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                            stop_tokens=args.stop_ids or (), cuda_graph=args.cuda_graph, on_token=on_token)
    return {"tokens": tokens[0].tolist(), "load_s": loaded - start, "prefill_s": stamps[0] - began,
            "decode_s": (stamps[-1] - stamps[0]) / max(1, len(stamps) - 1), "steps": len(stamps)}


def report(args: argparse.Namespace, results: list[dict], where: str) -> int:
    first = results[0]
    if any(r["tokens"] != first["tokens"] for r in results):
        print("the ranks generated different tokens: " + "; ".join(str(r["tokens"]) for r in results),
              file=sys.stderr)
        return 1
    prefill = max(r["prefill_s"] for r in results)
    decode = max(r["decode_s"] for r in results)
    print(f"{where}, TP={len(results)}: prompt {len(args.prompt_ids)} tokens, {len(first['tokens'])} new")
    print(f"load {max(r['load_s'] for r in results):.2f} s; prefill {prefill * 1e3:.1f} ms "
          f"({len(args.prompt_ids) / prefill:.1f} tokens/s)"
          + (f"; decode {decode * 1e3:.2f} ms/token ({1 / decode:.1f} tokens/s)" if first["steps"] > 1 else ""))
    print("tokens:", ",".join(map(str, first["tokens"])))
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if "LOCAL_RANK" in os.environ:  # under torchrun: this process is one rank
        local = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
        rank, world = dist.get_rank(), dist.get_world_size()
        try:
            result = generate_rank(rank, world, args)
            everyone = [None] * world
            dist.all_gather_object(everyone, result)
        finally:
            dist.destroy_process_group()
        return report(args, everyone, "GPUs (torchrun)") if rank == 0 else 0
    gpus = torch.cuda.is_available()
    results = run_ranks(args.tp, generate_rank, args, gpus=gpus, timeout_s=3600)
    return report(args, results, "GPUs" if gpus else "emulated ranks (CPU, interpreter)")


if __name__ == "__main__":
    sys.exit(main())
