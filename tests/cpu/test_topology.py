"""The GPU backend's judgement of a TP group's topology (a pure function, testable without GPUs): a
group across hosts or without peer access runs on NCCL (a reason, no error); shared GPUs and mixed
models within a host are refused."""

import pytest

from tileweave.runtime.backend import TileweaveError, judge_topology


def _gpu(host, index, model="H200"):
    return (host, index, f"{host}-uuid-{index}", model)


def test_one_host_with_peer_access_fuses():
    assert judge_topology([_gpu("a", 0), _gpu("a", 1)], 0, shares_gpus=False, can_access=lambda peer: True) == ""


def test_a_group_across_hosts_takes_nccl():
    reason = judge_topology([_gpu("a", 0), _gpu("b", 0)], 1, shares_gpus=False, can_access=lambda peer: True)
    assert reason == "the TP group spans 2 hosts (a, b)"


def test_no_peer_access_takes_nccl():
    reason = judge_topology([_gpu("a", 0), _gpu("a", 1)], 0, shares_gpus=False, can_access=lambda peer: peer != 1)
    assert reason == "GPU 0 has no peer access to GPU 1"


def test_shared_gpu_and_mixed_models_are_refused():
    with pytest.raises(TileweaveError, match="use the same GPU"):
        judge_topology([_gpu("a", 0), _gpu("a", 0)], 0, shares_gpus=False, can_access=lambda peer: True)
    assert judge_topology([_gpu("a", 0), _gpu("a", 0)], 0, shares_gpus=True, can_access=lambda peer: True) == ""
    with pytest.raises(TileweaveError, match="mixes GPU models"):
        judge_topology([_gpu("a", 0), _gpu("a", 1, "A100")], 0, shares_gpus=False, can_access=lambda peer: True)
