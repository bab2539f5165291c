"""Greedy generation with a small random-weight Llama-style model split over TP ranks.

Prefills a batch of random prompts (sequence-parallel on the fused all-gather/reduce-scatter GEMMs
where the token count divides the ranks), decodes ``--new-tokens`` tokens per sequence (replicated
activations, each row-parallel GEMM one ``gemm_all_reduce`` with the residual add and RMSNorm fused),
prints prefill and decode tokens/s, and checks that the tokens equal those of the same model run
unsharded on one device (``tileweave.testing.decoder_reference``, float64 on the CPU). Exits 1 if not.
Each rank runs ``generation_rank``, which emulated ranks import by name: run this file, or import it
as the module ``generate`` with examples/ on ``sys.path``.

    python examples/generate.py                       # 2 emulated ranks on the CPU (fp32, interpreter)
    python examples/generate.py --gpus                # one process per visible GPU
    torchrun --nproc-per-node 2 examples/generate.py  # under torchrun

Times on the CPU measure the Triton interpreter, not a GPU.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

if "--gpus" not in sys.argv and "LOCAL_RANK" not in os.environ:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # emulated ranks: the kernels run in the interpreter

import torch
import torch.distributed as dist

from tileweave.nn.decoder import DecoderConfig, TPDecoder
from tileweave.testing.decoder_reference import random_state_dict, reference_generate
from tileweave.testing.emulated import run_ranks


def generation_inputs(config: DecoderConfig, batch: int, prompt_len: int, seed: int
                      ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The unsharded fp32 weights and the prompts ``[batch, prompt_len]`` of the generation example,
    the same on every rank."""
    state = random_state_dict(config, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    return state, torch.randint(0, config.vocab, (batch, prompt_len), generator=g)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed_generate(model: TPDecoder, prompt: torch.Tensor, steps: int) -> tuple[torch.Tensor, float, float]:
    """``(tokens [B, steps], prefill seconds, decode seconds)``, starting from a barrier."""
    device = prompt.device
    cache = model.new_cache(prompt.shape[0])
    dist.barrier()
    t0 = time.perf_counter()
    nxt = model.prefill(prompt, cache)[:, -1].argmax(-1)
    _sync(device)
    t1 = time.perf_counter()
    out = [nxt]
    for _ in range(steps - 1):
        nxt = model.decode(nxt, cache).argmax(-1)
        out.append(nxt)
    _sync(device)
    return torch.stack(out, dim=1), t1 - t0, time.perf_counter() - t1


def generation_rank(rank: int, world: int, config: DecoderConfig, batch: int, prompt_len: int,
                    new_tokens: int, seed: int) -> dict:
    """One rank of the generation example: the TP model (fp32) from the unsharded weights, greedy
    generation timed (on a GPU after one untimed run that compiles the kernels); the tokens (lists) and times."""
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    state, prompt = generation_inputs(config, batch, prompt_len, seed)
    model = TPDecoder(config, device=device, dtype=torch.float32)
    model.load_full_state_dict(state)
    prompt = prompt.to(device)
    if device.type == "cuda":
        _timed_generate(model, prompt, new_tokens)
    tokens, prefill_s, decode_s = _timed_generate(model, prompt, new_tokens)
    # plain lists: a tensor would travel to the parent through shared memory its rank has freed
    return {"tokens": tokens.cpu().tolist(), "prefill_s": prefill_s, "decode_s": decode_s}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=2, help="emulated ranks on the CPU (default 2)")
    p.add_argument("--gpus", action="store_true", help="one process per visible GPU instead")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=6)
    p.add_argument("--layers", type=int, default=2)
    # Sizes the TP group divides: by default they follow the group size (W: --world, or the GPUs).
    p.add_argument("--hidden", type=int, default=None, help="default 16 x heads")
    p.add_argument("--heads", type=int, default=None, help="default 4 x W")
    p.add_argument("--kv-heads", type=int, default=None, help="default 2 x W")
    p.add_argument("--ffn", type=int, default=None, help="default 2 x hidden")
    p.add_argument("--vocab", type=int, default=None, help="default 64 x W")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for name in ("world", "batch", "prompt_len", "new_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    w = torch.cuda.device_count() if args.gpus else args.world
    args.heads = args.heads or 4 * w
    args.kv_heads = args.kv_heads or 2 * w
    args.hidden = args.hidden or 16 * args.heads
    args.ffn = args.ffn or 2 * args.hidden
    args.vocab = args.vocab or 64 * w
    return args


def config_of(args: argparse.Namespace) -> DecoderConfig:
    return DecoderConfig(vocab=args.vocab, hidden=args.hidden, layers=args.layers, heads=args.heads,
                         kv_heads=args.kv_heads, ffn=args.ffn, rope_theta=10000.0,
                         max_seq=args.prompt_len + args.new_tokens)


def rank_args(args: argparse.Namespace) -> tuple:
    """What each rank runs with (``generation_rank``)."""
    return config_of(args), args.batch, args.prompt_len, args.new_tokens, args.seed


def report(args: argparse.Namespace, results: list[dict], world: int, where: str) -> int:
    """Print the speeds and the check; 0 if every rank's tokens equal the unsharded reference's."""
    state, prompt = generation_inputs(config_of(args), args.batch, args.prompt_len, args.seed)
    want = reference_generate(state, config_of(args), prompt, args.new_tokens)
    prefill_s = max(r["prefill_s"] for r in results)
    decode_s = max(r["decode_s"] for r in results)
    b = args.batch
    print(f"{where}, TP={world}: batch {b}, prompt {args.prompt_len}, {args.new_tokens} new tokens")
    print(f"prefill: {b * args.prompt_len / prefill_s:.1f} tokens/s ({prefill_s * 1e3:.1f} ms)")
    if args.new_tokens > 1:
        steps = args.new_tokens - 1
        print(f"decode:  {b * steps / decode_s:.1f} tokens/s ({decode_s / steps * 1e3:.2f} ms/step)")
    bad = [r for r, res in enumerate(results) if res["tokens"] != want.tolist()]
    if bad:
        print(f"MISMATCH on ranks {bad}:\n  tp:        {results[bad[0]]['tokens']}\n"
              f"  reference: {want.tolist()}")
        return 1
    print(f"tokens match the unsharded reference: {want.tolist()}")
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if "LOCAL_RANK" in os.environ:  # under torchrun: this process is one rank
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl")
        world, rank = dist.get_world_size(), dist.get_rank()
        result = generation_rank(rank, world, *rank_args(args))
        gathered = [None] * world
        dist.all_gather_object(gathered, result)
        dist.destroy_process_group()
        return report(args, gathered, world, "GPUs (torchrun)") if rank == 0 else 0
    if args.gpus:
        world = torch.cuda.device_count()
        if world < 1:
            print("--gpus: no CUDA GPU visible", file=sys.stderr)
            return 2
        return report(args, run_ranks(world, generation_rank, *rank_args(args), gpus=True), world, "GPUs")
    return report(args, run_ranks(args.world, generation_rank, *rank_args(args)), args.world, "emulated ranks (CPU, interpreter)")


if __name__ == "__main__":
    sys.exit(main())
