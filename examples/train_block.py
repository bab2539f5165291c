"""Train a stack of TP transformer blocks for a few steps on synthetic activations; print tokens/s.

    python examples/train_block.py                      # 2 GPUs if present, else 2 emulated CPU ranks
    python examples/train_block.py --policy fallback    # the same model on NCCL + cuBLAS (Megatron-style)
    python examples/train_block.py --policy floor       # compute floor: collectives replaced by local copies

On GPUs it uses Llama 3 8B widths in bf16; on the CPU, tiny widths in fp32 (the interpreter is slow).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import torch  # noqa: E402

from tileweave.testing.emulated import run_ranks  # noqa: E402


def train(rank: int, world: int, args: argparse.Namespace) -> float:
    os.environ["TILEWEAVE_POLICY"] = "fused" if args.policy == "floor" else args.policy
    import torch.distributed as dist

    from tileweave.bench.block import floor_ops
    from tileweave.nn import BlockConfig, TPTransformerBlock

    # The compute floor: the layers run on local stand-ins that do the same GEMMs and move the same bytes
    # within one GPU (the block's time without communication; its numbers are not a model's).
    ops = floor_ops(rank, world) if args.policy == "floor" else None

    gpu = torch.cuda.is_available()
    device = f"cuda:{rank}" if gpu else "cpu"
    if gpu:
        config, batch, seq, dtype = BlockConfig(hidden=4096, heads=32, kv_heads=8, ffn=14336), 2, 4096, torch.bfloat16
    else:
        config, batch, seq, dtype = BlockConfig(hidden=64, heads=4, kv_heads=2, ffn=128), 2, 32, torch.float32
    torch.manual_seed(rank)  # synthetic weights: each rank initialises its own shards
    blocks = torch.nn.ModuleList(TPTransformerBlock(config, device=device, dtype=dtype, ops=ops)
                                 for _ in range(args.layers))
    opt = torch.optim.AdamW(blocks.parameters(), lr=1e-4)
    tokens = batch * seq
    local = tokens // world
    gen = torch.Generator(device=device).manual_seed(1 + rank)
    x = torch.randn(local, config.hidden, device=device, dtype=dtype, generator=gen)
    target = torch.randn(local, config.hidden, device=device, dtype=dtype, generator=gen)
    times = []
    for step in range(args.steps):
        if gpu:
            torch.cuda.synchronize()
        start = time.perf_counter()
        h = x
        for block in blocks:
            h = block(h, batch)
        loss = torch.nn.functional.mse_loss(h.float(), target.float())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if gpu:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        if rank == 0:
            print(f"step {step}: loss {loss.item():.4f}  {tokens / times[-1]:,.0f} tokens/s", flush=True)
    dist.barrier()
    steady = sorted(times[1:])[len(times[1:]) // 2] if len(times) > 1 else times[0]
    return tokens / steady


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", choices=("fused", "fallback", "auto", "floor"), default="fused")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    gpus = torch.cuda.is_available() and torch.cuda.device_count() >= 2
    world = torch.cuda.device_count() if gpus else 2
    rates = run_ranks(world, train, args, gpus=gpus, heap_bytes=64 << 20)
    print(f"{args.policy}: median {rates[0]:,.0f} tokens/s over steps 2..{args.steps} ({world} ranks)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
