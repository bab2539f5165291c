"""Generation from a Hugging Face checkpoint directory split over TP ranks.

    python examples/hf_generate.py DIR --prompt-ids 1,15043,3186 --world 2       # emulated CPU ranks
    torchrun --nproc-per-node 2 examples/hf_generate.py DIR --prompt-ids 1,15043  # one process per GPU

DIR holds config.json and model.safetensors (or shards with model.safetensors.index.json) of a Llama,
Mistral, Qwen2, Qwen3, Mixtral or Qwen3-MoE model; each rank reads only its slices. Prints the generated
token ids. On the CPU the model runs in float32 (the Triton interpreter; slow on anything but a tiny model).
"""

from __future__ import annotations

import argparse
import os
import sys

if "LOCAL_RANK" not in os.environ:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # emulated ranks: the kernels run in the interpreter

import torch
import torch.distributed as dist

from tileweave.models import from_pretrained
from tileweave.testing.emulated import run_ranks


def generate_rank(rank: int, world: int, directory: str, prompt: list[int], new_tokens: int) -> list[int]:
    """One rank: load its shards, generate greedily; the new token ids."""
    dtype = torch.float32 if not torch.cuda.is_available() else None  # None: the checkpoint's dtype
    model = from_pretrained(directory, group=dist.group.WORLD, dtype=dtype)
    ids = torch.tensor([prompt], device=model.embed.device)
    return model.generate(ids, new_tokens)[0].tolist()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="checkpoint directory")
    p.add_argument("--prompt-ids", required=True, help="comma-separated token ids")
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--world", type=int, default=2, help="emulated ranks on the CPU (default 2)")
    args = p.parse_args(argv)
    prompt = [int(t) for t in args.prompt_ids.split(",")]
    if "LOCAL_RANK" in os.environ:  # under torchrun: this process is one rank
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl")
        tokens = generate_rank(dist.get_rank(), dist.get_world_size(), args.model, prompt, args.new_tokens)
        dist.destroy_process_group()
        if int(os.environ["LOCAL_RANK"]) == 0:
            print(tokens)
        return 0
    print(run_ranks(args.world, generate_rank, args.model, prompt, args.new_tokens)[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
