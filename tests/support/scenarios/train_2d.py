"""2-D training on emulated ranks: tileweave's styles on the mesh's tp dimension, FSDP2 on its dp
dimension, against one process training the same Llama unsharded in float64; a distributed checkpoint
saved at one TP size and loaded at another."""

from __future__ import annotations

import copy

import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import parallelize_module

import tileweave
from support.scenarios.styles import _seeded
from tileweave.testing.llama import Llama, LlamaConfig, llama_tp_plan

CONFIG = LlamaConfig(vocab=32, dim=16, layers=2, heads=4, kv_heads=2, ffn=24)
LR = 0.5
BATCH, SEQ = 2, 8
"""Sequences per data-parallel rank, and their length."""


def batch(step: int, dp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens, targets)`` of the whole step, ``[dp * BATCH, SEQ]`` each; dp rank d trains on rows
    ``[d*BATCH, (d+1)*BATCH)``."""
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, CONFIG.vocab, (dp * BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def eval_tokens(dp: int) -> torch.Tensor:
    return batch(99, dp)[0]


def _plain(t: torch.Tensor):
    """A tensor as a numpy array, to return from a rank: torch would pass its storage by a file
    descriptor that dies with the rank."""
    return t.detach().double().numpy().copy()


def _model(tag: str) -> Llama:
    torch.manual_seed(0)
    return _seeded(Llama(CONFIG), tag)


def _sharded(mesh, tag: str) -> Llama:
    model = _model(tag)
    parallelize_module(model, mesh["tp"], llama_tp_plan(model))
    for layer in model.layers.values():
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model


def _loss(model, tokens, targets) -> torch.Tensor:
    return F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())


def train_2d_check(rank: int, world: int, tp: int, steps: int, checkpoint: str) -> dict:
    """``steps`` SGD steps of the Llama on a ``(world / tp, tp)`` mesh; each rank's losses, every
    parameter's whole gradient of every step (rank 0), the logits of ``eval_tokens`` after training
    (this dp rank's rows) and the paths the TP linears took. Saves the model to ``checkpoint``."""
    dp = world // tp
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    model = _sharded(mesh, "train-2d")
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    rows = slice(mesh["dp"].get_local_rank() * BATCH, (mesh["dp"].get_local_rank() + 1) * BATCH)
    losses, grads = [], []
    for step in range(steps):
        tokens, targets = batch(step, dp)
        loss = _loss(model, tokens[rows], targets[rows])
        loss.backward()
        losses.append(loss.item())
        whole = {name: _plain(p.grad.full_tensor()) for name, p in model.named_parameters()}  # collective
        grads.append(whole if rank == 0 else None)
        opt.step()
        opt.zero_grad(set_to_none=True)
    paths = f"{tileweave.last_path('all_gather_gemm')} {tileweave.last_path('gemm_reduce_scatter')}"
    with torch.no_grad():
        logits = model(eval_tokens(dp)[rows])
    dcp.save(get_model_state_dict(model), checkpoint_id=checkpoint)
    return {"losses": losses, "grads": grads, "logits": _plain(logits), "paths": paths}


def load_2d_check(rank: int, world: int, tp: int, checkpoint: str) -> dict:
    """A model built with other weights on a ``(world / tp, tp)`` mesh, then loaded from ``checkpoint``:
    the logits of ``eval_tokens`` (this dp rank's rows) and the whole state dict (rank 0)."""
    dp = world // tp
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    model = _sharded(mesh, "not-the-checkpoint")
    state = get_model_state_dict(model)
    dcp.load(state, checkpoint_id=checkpoint)
    set_model_state_dict(model, state)
    rows = slice(mesh["dp"].get_local_rank() * BATCH, (mesh["dp"].get_local_rank() + 1) * BATCH)
    with torch.no_grad():
        logits = model(eval_tokens(dp)[rows])
    whole = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))  # collective
    return {"logits": _plain(logits), "state": {k: _plain(v) for k, v in whole.items()} if rank == 0 else None}


def reference(dp: int, steps: int) -> dict:
    """The same training in one process, unsharded, float64, on each step's whole batch (the mean of
    the dp ranks' mean losses: what FSDP2's averaged gradients descend): losses, gradients, the
    logits of ``eval_tokens`` after training, the trained state dict."""
    model = copy.deepcopy(_model("train-2d")).double()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, grads = [], []
    for step in range(steps):
        tokens, targets = batch(step, dp)
        per_rank = [_loss(model, tokens[d * BATCH:(d + 1) * BATCH], targets[d * BATCH:(d + 1) * BATCH])
                    for d in range(dp)]
        loss = sum(per_rank) / dp
        loss.backward()
        losses.append([x.item() for x in per_rank])
        grads.append({name: p.grad.clone() for name, p in model.named_parameters()})
        opt.step()
        opt.zero_grad(set_to_none=True)
    with torch.no_grad():
        logits = model(eval_tokens(dp))
    return {"losses": losses, "grads": grads, "logits": logits, "state": model.state_dict()}
