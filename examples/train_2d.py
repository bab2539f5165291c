"""Train a small Llama with 2-D parallelism: tileweave's TP styles inside a TP group, FSDP2 across groups.

    python examples/train_2d.py                 # 4 emulated CPU ranks: dp 2 x tp 2
    python examples/train_2d.py --tp 4          # on GPUs (one per rank) when 2+ are present: dp = GPUs / tp

The model is plain torch (``tileweave.testing.llama``, torchtitan's module names). The steps a
torchtitan user knows: a 2-D mesh, ``parallelize_module`` with the TP plan on ``mesh["tp"]`` (here with
``tileweave.parallel``'s styles), ``fully_shard`` on ``mesh["dp"]``, an optimizer, a distributed
checkpoint. At the end rank 0 checks the loss against the same steps run unsharded in one process.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import torch  # noqa: E402

from tileweave.testing.emulated import run_ranks  # noqa: E402


def train(rank: int, world: int, args: argparse.Namespace) -> list[float]:
    import torch.distributed.checkpoint as dcp
    import torch.nn.functional as F
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    from tileweave.testing.llama import Llama, LlamaConfig, llama_tp_plan

    gpu = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if gpu else ("cpu", torch.float32)  # the interpreter needs fp32/fp16
    dp = world // args.tp
    mesh = init_device_mesh(device, (dp, args.tp), mesh_dim_names=("dp", "tp"))

    config = LlamaConfig(vocab=256, dim=64, layers=2, heads=8, kv_heads=4, ffn=128)
    torch.manual_seed(0)  # the same initial weights on every rank (and in the check below)
    model = Llama(config)
    reference = copy.deepcopy(model) if rank == 0 else None
    model.to(device=device, dtype=dtype)

    # Tensor parallelism inside each TP group; see llama_tp_plan for the plan dict.
    parallelize_module(model, mesh["tp"], llama_tp_plan(model))
    # Fully sharded data parallelism across the groups: each block, then the rest.
    for layer in model.layers.values():
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    # Each data-parallel rank trains on its own sequences; the ranks of a TP group share theirs.
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, config.vocab, (args.steps, dp * args.batch, args.seq + 1), generator=g)
    dp_rank = mesh["dp"].get_local_rank()
    rows = slice(dp_rank * args.batch, (dp_rank + 1) * args.batch)
    losses = []
    for step in range(args.steps):
        tokens, targets = data[step, rows, :-1].to(device), data[step, rows, 1:].to(device)
        loss = F.cross_entropy(model(tokens).flatten(0, 1).float(), targets.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if rank == 0:
            print(f"step {step}: loss {loss.item():.4f} (dp rank 0)", flush=True)

    # A distributed checkpoint holds whole tensors: it loads at any (dp, tp) layout.
    dcp.save(get_model_state_dict(model), checkpoint_id=args.checkpoint)

    if rank == 0:
        # The same steps in one process, unsharded; FSDP2 averages the dp ranks' gradients, so the
        # reference descends the mean of their losses.
        reference.double()
        ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
        for step in range(args.steps):
            per_rank = [F.cross_entropy(reference(data[step, d * args.batch:(d + 1) * args.batch, :-1]).flatten(0, 1),
                                        data[step, d * args.batch:(d + 1) * args.batch, 1:].flatten())
                        for d in range(dp)]
            (sum(per_rank) / dp).backward()
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)
            print(f"step {step}: reference loss {per_rank[0].item():.4f} (dp rank 0's sequences), "
                  f"difference {abs(per_rank[0].item() - losses[step]):.1e}", flush=True)
    return losses


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2, help="ranks per TP group")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=2, help="sequences per data-parallel rank")
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--checkpoint", default=None, help="where to save the checkpoint (default: a temp dir)")
    args = parser.parse_args()
    gpus = torch.cuda.is_available() and torch.cuda.device_count() >= 2
    world = torch.cuda.device_count() if gpus else 4
    if world % args.tp:
        parser.error(f"--tp {args.tp} must divide the {world} ranks")
    with tempfile.TemporaryDirectory() as scratch:
        args.checkpoint = args.checkpoint or os.path.join(scratch, "checkpoint")
        run_ranks(world, train, args, gpus=gpus, heap_bytes=64 << 20)
        print(f"trained on {world // args.tp} x {args.tp} (dp x tp) ranks; checkpoint written to {args.checkpoint}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
