"""Train a stack of TP transformer blocks for a few steps on synthetic activations; print tokens/s.

    python examples/train_block.py                      # every GPU if present, else 2 emulated CPU ranks
    python examples/train_block.py --policy fallback    # the same model on NCCL + cuBLAS (Megatron-style)
    python examples/train_block.py --policy floor       # compute floor: collectives replaced by local copies
    python examples/train_block.py --fp8 rowwise        # FP8 training beside the same model in bf16
    python examples/train_block.py --fp8 tensorwise,rowwise,blockwise --model 70b --ranks 1

On GPUs it uses Llama 3 8B (or 70B) widths in bf16, 2 sequences of 4096 tokens; on the CPU, tiny widths
in fp32 (the interpreter is slow). With ``--fp8`` every recipe trains its own copy of the model, from
the same initial weights on the same data, and each step prints the losses side by side.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import torch  # noqa: E402

from tileweave.testing.emulated import run_ranks  # noqa: E402

WIDTHS = {"8b": dict(hidden=4096, heads=32, kv_heads=8, ffn=14336),
          "70b": dict(hidden=8192, heads=64, kv_heads=8, ffn=28672)}
"""Llama 3's block widths on GPUs."""
RECIPES = ("tensorwise", "rowwise", "blockwise")


def cpu_widths(world: int, recipes: list[str]) -> dict:
    """Tiny widths for the interpreter; blockwise FP8 needs every local feature count a multiple of 128."""
    if "blockwise" in recipes:
        return dict(hidden=128 * world, heads=8 * world, kv_heads=4 * world, ffn=128 * world)
    return dict(hidden=64, heads=4, kv_heads=2, ffn=128)


def train(rank: int, world: int, args: argparse.Namespace) -> dict[str, float]:
    os.environ["TILEWEAVE_POLICY"] = "fused" if args.policy == "floor" else args.policy
    import torch.distributed as dist

    from tileweave.bench.block import floor_ops
    from tileweave.nn import BlockConfig, Float8Recipe, TPTransformerBlock

    # The compute floor: the layers run on local stand-ins that do the same GEMMs and move the same bytes
    # within one GPU (the block's time without communication; its numbers are not a model's).
    ops = floor_ops(rank, world) if args.policy == "floor" else None

    gpu = torch.cuda.is_available() and not args.cpu
    device = f"cuda:{rank}" if gpu else "cpu"
    if gpu:
        config, batch, seq, dtype = BlockConfig(**WIDTHS[args.model]), 2, args.seq or 4096, torch.bfloat16
    else:
        config, batch, seq, dtype = BlockConfig(**cpu_widths(world, args.fp8)), 2, args.seq or 32, torch.float32
    runs = {}  # label -> (blocks, optimizer): the model in `dtype`, then one copy per FP8 recipe
    for name in [None, *args.fp8]:
        recipe = None if name is None else dataclasses.replace(
            getattr(Float8Recipe, name)(), **({"backward_fast_accum": True} if args.fast_accum else {}))
        torch.manual_seed(rank)  # synthetic weights: each rank initialises its own shards, alike in every run
        blocks = torch.nn.ModuleList(TPTransformerBlock(config, device=device, dtype=dtype, ops=ops, fp8=recipe)
                                     for _ in range(args.layers))
        label = str(dtype).removeprefix("torch.").replace("bfloat16", "bf16").replace("float32", "fp32") \
            if name is None else f"fp8-{name}"
        runs[label] = (blocks, torch.optim.AdamW(blocks.parameters(), lr=args.lr))
    tokens = batch * seq
    local = tokens // world
    gen = torch.Generator(device=device).manual_seed(1 + rank)
    x = torch.randn(local, config.hidden, device=device, dtype=dtype, generator=gen)
    target = torch.randn(local, config.hidden, device=device, dtype=dtype, generator=gen)
    times: dict[str, list[float]] = {label: [] for label in runs}
    for step in range(args.steps):
        losses = {}
        for label, (blocks, opt) in runs.items():
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
            times[label].append(time.perf_counter() - start)
            losses[label] = loss.item()
        if rank == 0:
            base, rate = next(iter(losses)), tokens / times[next(iter(times))][-1]
            if len(runs) == 1:
                print(f"step {step}: loss {losses[base]:.4f}  {rate:,.0f} tokens/s", flush=True)
            else:
                others = "  ".join(f"{label} {value:.4f} ({(value / losses[base] - 1) * 100:+.2f}%)"
                                   for label, value in list(losses.items())[1:])
                print(f"step {step}: loss {base} {losses[base]:.4f}  {others}", flush=True)
    dist.barrier()

    def median_rate(seconds: list[float]) -> float:
        steady = sorted(seconds[1:])[len(seconds[1:]) // 2] if len(seconds) > 1 else seconds[0]
        return tokens / steady

    return {label: median_rate(seconds) for label, seconds in times.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", choices=("fused", "fallback", "auto", "floor"), default="fused")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--fp8", default="", help="FP8 recipes to train beside the model, comma-separated: "
                        + ", ".join(RECIPES))
    parser.add_argument("--fast-accum", action="store_true", help="FP8's backward GEMMs accumulate on the tensor "
                        "cores across K steps too (the recipes' forward GEMMs do by default, except blockwise)")
    parser.add_argument("--model", choices=tuple(WIDTHS), default="8b", help="block widths on GPUs")
    parser.add_argument("--seq", type=int, default=0, help="tokens per sequence, 2 sequences (default: 4096 on "
                        "GPUs, 32 on the CPU)")
    parser.add_argument("--ranks", type=int, default=0, help="TP ranks (default: every GPU, or 2 on the CPU)")
    parser.add_argument("--cpu", action="store_true", help="emulated CPU ranks even where GPUs are present")
    args = parser.parse_args()
    args.fp8 = [name for name in args.fp8.split(",") if name]
    for name in args.fp8:
        if name not in RECIPES:
            parser.error(f"--fp8: {name!r} is not one of {', '.join(RECIPES)}")
    if args.fp8 and args.policy == "floor":
        parser.error("--fp8 runs on tileweave's ops: the floor's stand-ins take no float8")
    gpus = torch.cuda.is_available() and not args.cpu
    world = args.ranks or (torch.cuda.device_count() if gpus else 2)
    if gpus and world > torch.cuda.device_count():
        parser.error(f"--ranks {world}: only {torch.cuda.device_count()} GPUs")
    rates = run_ranks(world, train, args, gpus=gpus, heap_bytes=64 << 20)
    base = next(iter(rates[0].values()))
    for label, rate in rates[0].items():
        versus = "" if rate == base else f", {rate / base:.2f}x the first"
        print(f"{args.policy}{'' if len(rates[0]) == 1 else ' ' + label}: median {rate:,.0f} tokens/s over steps "
              f"2..{args.steps} ({world} rank{'s' if world > 1 else ''}{versus})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
