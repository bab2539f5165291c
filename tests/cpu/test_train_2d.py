"""2-D parallelism on emulated ranks: tileweave's styles on the tp dimension and FSDP2 on the dp
dimension of a (2, 2) mesh train a small Llama as one process does unsharded in float64; its
distributed checkpoint, saved at TP 2, loads at TP 1 and gives the same outputs."""

import torch

from support.scenarios import train_2d as T
from support.scenarios.common import rel_err as _rel_err
from tileweave.testing.emulated import run_ranks

STEPS = 2


def rel_err(got, ref) -> float:
    return _rel_err(torch.as_tensor(got), ref)


def test_train_2d_then_load_at_another_tp_size(tmp_path):
    checkpoint = str(tmp_path / "checkpoint")
    results = run_ranks(4, T.train_2d_check, 2, STEPS, checkpoint)
    ref = T.reference(2, STEPS)
    for rank, result in enumerate(results):
        assert result["paths"] == "fused chunked", result["paths"]
        dp_rank = rank // 2
        for step in range(STEPS):
            assert abs(result["losses"][step] - ref["losses"][step][dp_rank]) < 1e-5, (rank, step, result["losses"])
        rows = slice(dp_rank * T.BATCH, (dp_rank + 1) * T.BATCH)
        assert rel_err(result["logits"], ref["logits"][rows]) < 1e-5, rank
    for step in range(STEPS):
        grads = results[0]["grads"][step]
        assert grads.keys() == ref["grads"][step].keys()
        for name, grad in grads.items():
            assert rel_err(grad, ref["grads"][step][name]) < 1e-5, (step, name)

    # The checkpoint of (dp 2, tp 2) loaded on a (dp 2, tp 1) mesh: the trained weights, the same logits.
    loaded = run_ranks(2, T.load_2d_check, 1, checkpoint)
    for dp_rank, result in enumerate(loaded):
        rows = slice(dp_rank * T.BATCH, (dp_rank + 1) * T.BATCH)
        assert rel_err(result["logits"], ref["logits"][rows]) < 1e-5, dp_rank
    state = loaded[0]["state"]
    assert state.keys() == ref["state"].keys()
    for name, value in state.items():
        assert tuple(value.shape) == tuple(ref["state"][name].shape), name      # whole tensors, not TP shards
        assert rel_err(value, ref["state"][name]) < 1e-5, name
