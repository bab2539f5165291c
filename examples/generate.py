"""Greedy generation with a small random-weight Llama-style model split over TP ranks.

Prefills a batch of random prompts (sequence-parallel on the fused all-gather/reduce-scatter GEMMs
where the token count divides the ranks), decodes ``--new-tokens`` tokens per sequence (replicated
activations, each row-parallel GEMM one ``gemm_all_reduce`` with the residual add and RMSNorm fused),
prints prefill and decode tokens/s, and checks that the tokens equal those of the same model run
unsharded on one device (``tileweave.testing.decoder_reference``, float64 on the CPU). Exits 1 if not.

    python examples/generate.py                       # 2 emulated ranks on the CPU (fp32, interpreter)
    python examples/generate.py --gpus                # one process per visible GPU
    torchrun --nproc-per-node 2 examples/generate.py  # under torchrun

Times on the CPU measure the Triton interpreter, not a GPU.
"""

from __future__ import annotations

import argparse
import os
import sys

if "--gpus" not in sys.argv and "LOCAL_RANK" not in os.environ:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # emulated ranks: the kernels run in the interpreter

import torch
import torch.distributed as dist

from tileweave.nn.decoder import DecoderConfig, TPDecoder
from tileweave.testing.decoder_reference import reference_generate
from tileweave.testing.decoder_scenarios import generation_inputs, generation_rank
from tileweave.testing.emulated import run_ranks


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=2, help="emulated ranks on the CPU (default 2)")
    p.add_argument("--gpus", action="store_true", help="one process per visible GPU instead")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=6)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=128)
    p.add_argument("--vocab", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for name in ("world", "batch", "prompt_len", "new_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args


def config_of(args: argparse.Namespace) -> DecoderConfig:
    return DecoderConfig(vocab=args.vocab, hidden=args.hidden, layers=args.layers, heads=args.heads,
                         kv_heads=args.kv_heads, ffn=args.ffn, rope_theta=10000.0,
                         max_seq=args.prompt_len + args.new_tokens)


def rank_args(args: argparse.Namespace) -> tuple:
    """What each rank runs with (``tileweave.testing.decoder_scenarios.generation_rank``)."""
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
