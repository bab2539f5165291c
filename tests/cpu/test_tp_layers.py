"""Sequence-parallel TP layers on emulated ranks: outputs and every gradient against the unsharded
MLP in float64, with the gathered input kept or gathered again, and under autocast."""

import pytest

from tileweave.runtime.emulated import ONE_QUEUE_ENV
from support import scenarios
from tileweave.testing.emulated import run_ranks


@pytest.mark.parametrize("world, save_gathered", [(2, True), (4, False)])  # 8 ranks: the fused ops' own tests
def test_mlp_forward_and_every_gradient(world, save_gathered):
    for result in run_ranks(world, scenarios.tp_mlp_check, 48, 32, 64, save_gathered):
        for key in ("y", "dx", "d_up_w", "d_up_b", "d_down_w", "d_down_b"):
            assert result[key] < 1e-5, (key, result)
        assert result["round_trip"], result


@pytest.mark.parametrize("world, save_gathered", [(2, False), (4, True)])
def test_mlp_on_chunked_transports_with_one_hardware_queue(world, save_gathered):
    # Every stream of a rank in one in-order queue, as streams that share a hardware queue on a GPU:
    # the layers' calls (forward, input gradient, the gather alone for the weight gradient, the
    # pulling reduce-scatter at two ranks) must not wait on a peer before issuing what the peer needs.
    env = {ONE_QUEUE_ENV: "1", "TILEWEAVE_EMULATED_TIMEOUT_S": "15",
           "TILEWEAVE_AG_TRANSPORT": "chunked", "TILEWEAVE_RS_TRANSPORT": "chunked"}
    for result in run_ranks(world, scenarios.tp_mlp_check, 48, 32, 64, save_gathered, env=env):
        for key in ("y", "dx", "d_up_w", "d_up_b", "d_down_w", "d_down_b"):
            assert result[key] < 1e-5, (key, result)


def test_mlp_on_the_oneshot_paths():
    # TILEWEAVE_POLICY=oneshot: both ops the layers share take their one-shot paths, the forward's kept
    # gathered input and the backward's one for the weight gradient (a view of the one-shot buffer)
    # included.
    env = {"TILEWEAVE_POLICY": "oneshot"}
    for result in run_ranks(2, scenarios.tp_mlp_check, 48, 32, 64, True, env=env):
        for key in ("y", "dx", "d_up_w", "d_up_b", "d_down_w", "d_down_b"):
            assert result[key] < 1e-5, (key, result)
        assert result["paths"] == "oneshot oneshot", result


def test_mlp_under_autocast_keeps_fp32_parameter_gradients():
    for result in run_ranks(2, scenarios.tp_mlp_check, 48, 32, 64, True, True):
        assert result["grad_dtypes"] == "torch.float32,torch.float32", result
        for key in ("y", "dx", "d_up_w", "d_down_w"):
            assert result[key] < 5e-3, (key, result)


def test_mlp_on_graphable_ops():
    # TILEWEAVE_GRAPHABLE=1: the ops the layers share run the constant-valued flags (forward, backward,
    # and the gather alone that re-gathers the input for the weight gradient).
    for result in run_ranks(2, scenarios.tp_mlp_check, 48, 32, 64, False, env={"TILEWEAVE_GRAPHABLE": "1"}):
        for key in ("y", "dx", "d_up_w", "d_up_b", "d_down_w", "d_down_b"):
            assert result[key] < 1e-5, (key, result)
        assert result["graphable"], result


def test_mlp_on_shared_ops_with_options_from_the_environment():
    # TILEWEAVE_RS_PULL / TILEWEAVE_AG_STREAM_K reach the ops the layers share, and the layers' outputs
    # and gradients stay right with them.
    env = {"TILEWEAVE_RS_PULL": "1", "TILEWEAVE_AG_STREAM_K": "1"}
    for result in run_ranks(2, scenarios.tp_mlp_check, 48, 32, 64, True, env=env):
        for key in ("y", "dx", "d_up_w", "d_up_b", "d_down_w", "d_down_b"):
            assert result[key] < 1e-5, (key, result)
        assert result["shared_options"] == ["pull=True", "stream_k=True"], result
    for result in run_ranks(2, scenarios.tp_mlp_check, 48, 32, 64, True):
        # pulling: the default; the stream-K tail: the heuristic's choice (None)
        assert result["shared_options"] == ["pull=True", "stream_k=None"], result
    for result in run_ranks(2, scenarios.tp_mlp_check, 48, 32, 64, True, env={"TILEWEAVE_RS_PULL": "0"}):
        assert result["shared_options"] == ["pull=False", "stream_k=None"], result


def _load_refusals(rank: int, world: int) -> dict:
    import torch

    from tileweave.nn import ColumnParallelLinear, RowParallelLinear

    out = {}
    for cls in (ColumnParallelLinear, RowParallelLinear):
        layer = cls(8 * world, 4 * world, bias=False)
        good = {"weight": torch.randn(4 * world, 8 * world)}
        cases = {"shape": {"weight": good["weight"][:, 1:]}, "extra": dict(good, bias=torch.zeros(4 * world)),
                 "missing": {}}
        for case, state in cases.items():
            try:
                layer.load_full_state_dict(state)
                out[(cls.__name__, case)] = "no error"
            except (ValueError, KeyError) as e:
                out[(cls.__name__, case)] = f"{type(e).__name__}: {e}"
        layer.load_full_state_dict(good)
        out[(cls.__name__, "round_trip")] = bool(torch.equal(layer.full_state_dict()["weight"], good["weight"]))
    return out


def test_linears_refuse_a_wrong_state_by_name():
    # A weight of the wrong shape, a tensor the layer has no place for (a bias for a bias-free layer)
    # and a missing weight are refused, naming the tensor; a good state round-trips.
    for result in run_ranks(2, _load_refusals):
        for cls in ("ColumnParallelLinear", "RowParallelLinear"):
            assert "'weight' must have shape" in result[(cls, "shape")], result
            assert "ValueError" in result[(cls, "extra")] and "bias" in result[(cls, "extra")], result
            assert "KeyError" in result[(cls, "missing")] and "weight" in result[(cls, "missing")], result
            assert result[(cls, "round_trip")], result
