"""Train a small stack of tensor-parallel MoE layers for a few steps on a synthetic regression; print the
loss and tokens/s.

    python examples/train_moe.py                       # every GPU if 2 or more, else 2 emulated CPU ranks
    python examples/train_moe.py --policy fallback     # the MoE pair's NCCL + grouped GEMM path

The model is ``layers`` residual blocks ``x + TPMoE(rms_norm(x))`` fed sequence-parallel token shards;
the target is a fixed random teacher map of the input. The replicated parameters (the routers and the
norms) see only their rank's tokens in backward: their gradients are summed over the group before each
optimizer step, so the replicas stay equal. On GPUs: Mixtral-like widths in bf16 (fp32 master weights
under autocast); on the CPU: tiny widths in fp32 (the Triton interpreter is slow).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import torch  # noqa: E402

from tileweave.testing.emulated import run_ranks  # noqa: E402


class MoEStack(torch.nn.Module):
    def __init__(self, layers: int, hidden: int, ffn: int, experts: int, top_k: int, ops, device) -> None:
        super().__init__()
        from tileweave.nn.moe import TPMoE

        self.norms = torch.nn.ModuleList(torch.nn.RMSNorm(hidden, device=device) for _ in range(layers))
        self.moes = torch.nn.ModuleList(TPMoE(hidden, ffn, experts, top_k, ops=ops, device=device)
                                        for _ in range(layers))

    def forward(self, x_shard: torch.Tensor) -> torch.Tensor:
        for norm, moe in zip(self.norms, self.moes):
            x_shard = x_shard + moe(norm(x_shard))
        return x_shard

    @torch.no_grad()
    def sync_replicated_grads(self) -> None:
        import torch.distributed as dist

        for moe in self.moes:
            moe.all_reduce_replicated_grads()
        for norm in self.norms:
            if norm.weight.grad is not None:
                dist.all_reduce(norm.weight.grad)


def _ops(policy: str):
    """The layers' ops: tileweave's functional MoE pair, or op objects of their own under ``policy``."""
    from tileweave.nn.moe_autograd import TILEWEAVE_OPS, tileweave_ops

    return TILEWEAVE_OPS if policy == "auto" else tileweave_ops(policy=policy)


def train(rank: int, world: int, args: argparse.Namespace) -> dict:
    import torch.distributed as dist

    gpu = torch.cuda.is_available()
    device = torch.device(f"cuda:{rank}" if gpu else "cpu")
    if gpu:
        hidden, ffn, experts, top_k, tokens = 4096, 14336 // 4, 8, 2, 8192
    else:
        hidden, ffn, experts, top_k, tokens = args.hidden, 2 * args.hidden, 4, 2, args.tokens
    torch.manual_seed(0)  # the same replicated weights on every rank (each then takes its expert shards)
    model = MoEStack(args.layers, hidden, ffn, experts, top_k, _ops(args.policy), device)
    teacher = torch.randn(hidden, hidden, device=device) / hidden ** 0.5
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    local = tokens // world
    gen = torch.Generator(device=device).manual_seed(1 + rank)
    x = torch.randn(local, hidden, device=device, generator=gen)
    target = torch.tanh(x @ teacher)
    losses, times = [], []
    for step in range(args.steps):
        if gpu:
            torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=gpu):
            out = model(x)
        loss = torch.nn.functional.mse_loss(out.float(), target)
        loss.backward()
        model.sync_replicated_grads()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if gpu:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        # The loss over all tokens: the mean of the ranks' means (equal shards).
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
        if rank == 0:
            print(f"step {step}: loss {losses[-1]:.5f}  {tokens / times[-1]:,.0f} tokens/s", flush=True)
    steady = sorted(times[1:])[len(times[1:]) // 2] if len(times) > 1 else times[0]
    return {"losses": losses, "tokens_per_s": tokens / steady}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", choices=("auto", "fused", "fallback"), default="auto")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--hidden", type=int, default=32, help="CPU runs only (GPUs use Mixtral's width)")
    parser.add_argument("--tokens", type=int, default=32, help="tokens per step over the group, CPU runs only")
    args = parser.parse_args(argv)
    gpus = torch.cuda.is_available() and torch.cuda.device_count() >= 2
    world = torch.cuda.device_count() if gpus else 2
    results = run_ranks(world, train, args, gpus=gpus, heap_bytes=64 << 20)
    losses = results[0]["losses"]
    print(f"{args.policy}: loss {losses[0]:.5f} -> {losses[-1]:.5f}, median {results[0]['tokens_per_s']:,.0f} "
          f"tokens/s over steps 2..{args.steps} ({world} ranks)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
